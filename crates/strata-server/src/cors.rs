//! Cross-origin requests from browsers (`--allowed-origins`): preflights answered before auth,
//! and `Access-Control-Allow-Origin` on every response to an allowed origin, errors included.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{
    ACCESS_CONTROL_ALLOW_HEADERS, ACCESS_CONTROL_ALLOW_METHODS, ACCESS_CONTROL_ALLOW_ORIGIN, ACCESS_CONTROL_MAX_AGE,
    ACCESS_CONTROL_REQUEST_HEADERS, ACCESS_CONTROL_REQUEST_METHOD, ORIGIN, VARY,
};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::error::ApiError;
use crate::AppState;

/// The methods the API takes.
const ALLOW_METHODS: &str = "GET, POST, OPTIONS";
/// Headers a browser may always send: the API key and the JSON body's type.
const ALWAYS_ALLOWED_HEADERS: [&str; 2] = ["authorization", "content-type"];
/// Seconds a browser may reuse a preflight's answer (Chromium caps it at 7200).
pub const PREFLIGHT_MAX_AGE_SECS: u32 = 7200;

/// The origins whose web pages may call the API (`--allowed-origins`); none by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedOrigins {
    /// `*`: any origin.
    any: bool,
    /// Lower-cased `scheme://host[:port]`.
    origins: Vec<String>,
}

impl AllowedOrigins {
    /// Any origin at all (`*`).
    pub fn any() -> Self {
        AllowedOrigins {
            any: true,
            origins: Vec::new(),
        }
    }

    /// From the flag's values: each a comma-separated list (or vLLM's JSON list like
    /// `["http://localhost:5173"]`) of origins `scheme://host[:port]`, or `*` for any.
    pub fn parse<S: AsRef<str>>(values: &[S]) -> Result<Self, String> {
        let mut allowed = AllowedOrigins::default();
        for value in values {
            let value = value.as_ref().trim();
            let items: Vec<String> = if value.starts_with('[') {
                serde_json::from_str(value)
                    .map_err(|e| format!("{value:?} is not a JSON list of origin strings: {e}"))?
            } else {
                value.split(',').map(str::to_string).collect()
            };
            for item in items {
                let item = item.trim();
                if item == "*" {
                    allowed.any = true;
                } else if !item.is_empty() {
                    let origin = checked_origin(item)?;
                    if !allowed.origins.contains(&origin) {
                        allowed.origins.push(origin);
                    }
                }
            }
        }
        Ok(allowed)
    }

    /// Whether no origin is allowed (no CORS headers are ever sent).
    pub fn is_empty(&self) -> bool {
        !self.any && self.origins.is_empty()
    }

    /// Whether a page of `origin` may call the API.
    pub fn allows(&self, origin: &str) -> bool {
        self.any || self.origins.iter().any(|o| o.eq_ignore_ascii_case(origin))
    }
}

impl std::fmt::Display for AllowedOrigins {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.any {
            return f.write_str("*");
        }
        f.write_str(&self.origins.join(", "))
    }
}

/// An origin as browsers send it: `scheme://host[:port]`, nothing after (a trailing slash or
/// a path would never match, so it is refused with the fix).
fn checked_origin(item: &str) -> Result<String, String> {
    let fix = "write origins as scheme://host[:port], e.g. http://localhost:5173, or * for any";
    let Some((scheme, rest)) = item.split_once("://") else {
        return Err(format!("{item:?} is not an origin: {fix}"));
    };
    let scheme_ok = !scheme.is_empty() && scheme.chars().all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c));
    let host_ok = !rest.is_empty() && rest.chars().all(|c| c.is_ascii_alphanumeric() || "-.:[]_".contains(c));
    if !scheme_ok || !host_ok {
        let why = if rest.contains('/') {
            "has a path or trailing slash, which a browser's Origin never has"
        } else {
            "is not an origin"
        };
        return Err(format!("{item:?} {why}: {fix}"));
    }
    Ok(item.to_ascii_lowercase())
}

/// A CORS preflight: `OPTIONS` with `Origin` and `Access-Control-Request-Method`.
fn is_preflight(request: &Request) -> bool {
    request.method() == Method::OPTIONS
        && request.headers().contains_key(ORIGIN)
        && request.headers().contains_key(ACCESS_CONTROL_REQUEST_METHOD)
}

/// The headers a preflight allows: those the browser asked for, plus authorization and
/// content-type.
fn allowed_headers(request_headers: &HeaderMap) -> String {
    let mut names: Vec<String> = ALWAYS_ALLOWED_HEADERS.iter().map(|h| h.to_string()).collect();
    let asked = request_headers
        .get_all(ACCESS_CONTROL_REQUEST_HEADERS)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .filter(|name| !name.is_empty());
    for name in asked {
        if !names.contains(&name) {
            names.push(name);
        }
    }
    names.join(", ")
}

/// Answers preflights (204 for an allowed origin, 403 otherwise) before the API key is checked,
/// and marks every other response to an allowed origin as readable by its page.
pub async fn cors(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let allowed = &state.config.allowed_origins;
    let origin = request.headers().get(ORIGIN).cloned();
    let origin_allowed = origin
        .as_ref()
        .and_then(|o| o.to_str().ok())
        .is_some_and(|o| allowed.allows(o));
    if is_preflight(&request) {
        let Some(origin) = origin.filter(|_| origin_allowed) else {
            let asked = request
                .headers()
                .get(ORIGIN)
                .map(|o| o.to_str().unwrap_or("(not text)"));
            return ApiError::origin_not_allowed(asked.unwrap_or_default()).into_response();
        };
        let mut response = StatusCode::NO_CONTENT.into_response();
        let headers = response.headers_mut();
        headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        headers.insert(ACCESS_CONTROL_ALLOW_METHODS, HeaderValue::from_static(ALLOW_METHODS));
        if let Ok(names) = HeaderValue::from_str(&allowed_headers(request.headers())) {
            headers.insert(ACCESS_CONTROL_ALLOW_HEADERS, names);
        }
        headers.insert(ACCESS_CONTROL_MAX_AGE, HeaderValue::from(PREFLIGHT_MAX_AGE_SECS));
        headers.insert(
            VARY,
            HeaderValue::from_static("origin, access-control-request-method, access-control-request-headers"),
        );
        return response;
    }
    let mut response = next.run(request).await;
    if allowed.is_empty() {
        return response;
    }
    let headers = response.headers_mut();
    // Whether the answer carries the header depends on the Origin: caches must know.
    headers.append(VARY, HeaderValue::from_static("origin"));
    if let Some(origin) = origin.filter(|_| origin_allowed) {
        headers.insert(ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_parse_from_lists_json_and_star() {
        let a = AllowedOrigins::parse(&["http://localhost:5173,https://App.example.com", "http://[::1]:3000"]).unwrap();
        assert!(a.allows("http://localhost:5173"));
        assert!(a.allows("https://app.example.com"));
        assert!(a.allows("HTTP://[::1]:3000"));
        assert!(!a.allows("http://localhost:5174"));
        assert!(!a.allows("null"));
        let json = AllowedOrigins::parse(&[r#"["http://localhost:5173"]"#]).unwrap();
        assert!(json.allows("http://localhost:5173") && !json.allows("http://evil.example"));
        let any = AllowedOrigins::parse(&["*"]).unwrap();
        assert!(any.allows("http://anything.example") && any.allows("null"));
        assert_eq!(any, AllowedOrigins::any());
        assert!(AllowedOrigins::parse::<&str>(&[]).unwrap().is_empty());
        assert!(AllowedOrigins::parse(&[""]).unwrap().is_empty());
    }

    #[test]
    fn origins_that_never_match_are_refused_with_the_fix() {
        for bad in [
            "http://localhost:5173/",
            "localhost:5173",
            "http://x.example/app",
            "://x",
            "http://",
            "[1",
        ] {
            let e = AllowedOrigins::parse(&[bad]).unwrap_err();
            assert!(
                e.contains("scheme://host[:port]") || e.contains("JSON list"),
                "{bad}: {e}"
            );
        }
        let e = AllowedOrigins::parse(&["http://localhost:5173/"]).unwrap_err();
        assert!(e.contains("trailing slash"), "{e}");
    }

    #[test]
    fn preflights_allow_what_was_asked_plus_auth_and_json() {
        let mut h = HeaderMap::new();
        assert_eq!(allowed_headers(&h), "authorization, content-type");
        h.insert(
            ACCESS_CONTROL_REQUEST_HEADERS,
            HeaderValue::from_static("Authorization, X-Stainless-OS,x-stainless-lang"),
        );
        assert_eq!(
            allowed_headers(&h),
            "authorization, content-type, x-stainless-os, x-stainless-lang"
        );
    }
}
