//! API errors in OpenAI's JSON shape (`{"error": {"message", "type", "param", "code"}}`) with
//! the HTTP status each failure deserves; every handler returns these instead of panicking.

use std::time::Duration;

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use strata_engine::SubmitError;
use utoipa::ToSchema;

/// The body of every error response.
#[derive(Debug, Clone, Serialize, serde::Deserialize, ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorDetail,
}

/// What went wrong, OpenAI style.
#[derive(Debug, Clone, Serialize, serde::Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// A sentence a person can act on.
    pub message: String,
    /// `invalid_request_error`, `authentication_error`, `permission_error`, `not_found_error`,
    /// `rate_limit_error`, `server_error` or `service_unavailable`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, when there is one (e.g. `messages[0].content`).
    pub param: Option<String>,
    /// A machine-readable code for some errors (e.g. `context_length_exceeded`).
    pub code: Option<String>,
}

/// The errors a request with a JSON body can get (for the OpenAPI document).
#[derive(utoipa::IntoResponses)]
pub enum RequestErrors {
    /// Invalid JSON, a field of the wrong type or value (`param` names it), or a prompt longer
    /// than --max-model-len (code `context_length_exceeded`, with both numbers).
    #[response(status = 400)]
    BadRequest(ErrorResponse),
    /// Missing or wrong API key (code `invalid_api_key`).
    #[response(status = 401)]
    Unauthorized(ErrorResponse),
    /// The `model` is not the served one (code `model_not_found`).
    #[response(status = 404)]
    UnknownModel(ErrorResponse),
    /// The body did not arrive within --body-read-timeout.
    #[response(status = 408)]
    BodyTimeout(ErrorResponse),
    /// The body is larger than --max-request-body-bytes.
    #[response(status = 413)]
    TooLarge(ErrorResponse),
    /// The body is not declared as JSON (`Content-Type: application/json`).
    #[response(status = 415)]
    NotJson(ErrorResponse),
}

/// The further errors of a generation request (for the OpenAPI document).
#[derive(utoipa::IntoResponses)]
pub enum GenerationErrors {
    /// The request queue is full (--max-queue); retry later.
    #[response(status = 429)]
    QueueFull(ErrorResponse),
    /// The engine failed while generating.
    #[response(status = 500)]
    EngineFailed(ErrorResponse),
    /// The engine is not running (its devices can no longer run the model, or it stopped), or
    /// the server is shutting down.
    #[response(status = 503)]
    Unavailable(ErrorResponse),
}

/// An error the API returns: an HTTP status plus OpenAI's error object.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// 400 about one request field.
    pub fn invalid_field(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.into()),
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 400 about the request as a whole.
    pub fn invalid_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400: the prompt cannot fit in --max-model-len.
    pub fn context_length_exceeded(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError {
            code: Some("context_length_exceeded"),
            ..Self::invalid_field(param, message)
        }
    }

    /// 401: missing or wrong API key.
    pub fn unauthorized() -> Self {
        ApiError {
            code: Some("invalid_api_key"),
            ..Self::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing or incorrect API key; send it as `Authorization: Bearer <key>`",
            )
        }
    }

    /// 403: a browser's CORS preflight from an origin not in `--allowed-origins`.
    pub fn origin_not_allowed(origin: &str) -> Self {
        ApiError {
            code: Some("origin_not_allowed"),
            ..Self::new(
                StatusCode::FORBIDDEN,
                "permission_error",
                format!(
                    "cross-origin requests from `{origin}` are not allowed; start the server with \
                     --allowed-origins {origin} (or * for any origin)"
                ),
            )
        }
    }

    /// 404: the request names a model this server does not serve.
    pub fn unknown_model(asked: &str, served: &str) -> Self {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..Self::new(
                StatusCode::NOT_FOUND,
                "not_found_error",
                format!("the model `{asked}` does not exist; this server serves `{served}`"),
            )
        }
    }

    /// 404 for a path the API does not have.
    pub fn unknown_route(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!("no route for {method} {path}; see /openapi.json for the API"),
        )
    }

    /// 405 for a known path with the wrong method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{path} does not accept {method}; see /openapi.json for the API"),
        )
    }

    /// 413: the body is over `--max-request-body-bytes`.
    pub fn body_too_large(limit: usize) -> Self {
        ApiError {
            code: Some("request_too_large"),
            ..Self::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body is larger than the server's limit of {limit} bytes"),
            )
        }
    }

    /// 415: a POST whose body is not declared as JSON (a form or text/plain body is what a web
    /// page can send cross-origin without a CORS preflight).
    pub fn not_json(content_type: Option<&str>) -> Self {
        let got = match content_type {
            Some(t) => format!("`{t}`"),
            None => "none".to_string(),
        };
        ApiError {
            code: Some("unsupported_media_type"),
            ..Self::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                format!("the request body must be JSON sent with `Content-Type: application/json` (got {got})"),
            )
        }
    }

    /// 408: the request body did not arrive in time (`--body-read-timeout`).
    pub fn body_timeout(timeout: Duration) -> Self {
        ApiError {
            code: Some("request_timeout"),
            ..Self::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {:.1} s (--body-read-timeout)",
                    timeout.as_secs_f64()
                ),
            )
        }
    }

    /// 503 for a connection over `--max-connections`.
    pub fn too_many_connections(max: usize) -> Self {
        ApiError {
            code: Some("too_many_connections"),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                format!("the server has its maximum of {max} connections open (--max-connections); retry later"),
            )
        }
    }

    /// 503 while the engine is not running (also once its devices were lost: `why` says how).
    pub fn engine_unavailable(why: &str) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!("the engine is not running: {why}"),
        )
    }

    /// 500: the engine failed while running the request.
    pub fn engine_failed(why: &str) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            format!("the engine failed while generating: {why}"),
        )
    }

    /// A refusal from the engine; `prompt_param` names the field holding the prompt.
    pub fn from_submit(err: SubmitError, prompt_param: &str) -> Self {
        match err {
            SubmitError::QueueFull { .. } => ApiError {
                code: Some("queue_full"),
                ..Self::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", err.to_string())
            },
            SubmitError::PromptTooLong { .. } => Self::context_length_exceeded(prompt_param, err.to_string()),
            SubmitError::MoreThanQueue { .. } => Self::invalid_field(prompt_param, err.to_string()),
            SubmitError::Invalid(message) => {
                let param = field_named_in(&message);
                ApiError {
                    param,
                    ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
                }
            }
            SubmitError::EngineDead(why) => Self::engine_unavailable(&why),
        }
    }

    pub fn body(&self) -> ErrorResponse {
        ErrorResponse {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind.to_string(),
                param: self.param.clone(),
                code: self.code.map(str::to_string),
            },
        }
    }
}

/// The engine's validation messages start with the field they are about ("top_p must be ...").
fn field_named_in(message: &str) -> Option<String> {
    const FIELDS: &[&str] = &[
        "prompt",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "top_logprobs",
        "max_tokens",
        "seed",
    ];
    let first = message.split_whitespace().next()?;
    FIELDS.iter().find(|f| **f == first).map(|f| f.to_string())
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        if self.status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        if matches!(self.status, StatusCode::PAYLOAD_TOO_LARGE | StatusCode::REQUEST_TIMEOUT) {
            // The rest of the body was never read, so the connection cannot carry another
            // request: say so, or a client reusing it gets a reset instead of its next answer.
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_413_or_408_closes_the_connection() {
        let r = ApiError::body_too_large(10).into_response();
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(r.headers()[header::CONNECTION], "close");
        let r = ApiError::body_timeout(Duration::from_secs(3)).into_response();
        assert_eq!(r.status(), StatusCode::REQUEST_TIMEOUT);
        assert_eq!(r.headers()[header::CONNECTION], "close");
        let r = ApiError::invalid_request("bad").into_response();
        assert!(r.headers().get(header::CONNECTION).is_none());
    }

    #[test]
    fn a_401_names_the_bearer_scheme() {
        let r = ApiError::unauthorized().into_response();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(r.headers()[header::WWW_AUTHENTICATE], "Bearer");
        let r = ApiError::not_json(Some("text/plain")).into_response();
        assert!(r.headers().get(header::WWW_AUTHENTICATE).is_none());
    }

    #[test]
    fn engine_messages_name_their_field() {
        let e = ApiError::from_submit(SubmitError::Invalid("top_p must be in (0, 1], got 2".into()), "prompt");
        assert_eq!(e.param.as_deref(), Some("top_p"));
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        let e = ApiError::from_submit(SubmitError::Invalid("the prompt is empty".into()), "prompt");
        assert_eq!(e.param, None);
    }

    #[test]
    fn refusals_map_to_statuses() {
        let full = ApiError::from_submit(SubmitError::QueueFull { max: 3 }, "prompt");
        assert_eq!(full.status, StatusCode::TOO_MANY_REQUESTS);
        let long = ApiError::from_submit(
            SubmitError::PromptTooLong {
                prompt: 2000,
                max_model_len: 1024,
            },
            "messages",
        );
        assert_eq!(long.status, StatusCode::BAD_REQUEST);
        assert!(long.message.contains("2000") && long.message.contains("1024"));
        assert_eq!(long.param.as_deref(), Some("messages"));
        let dead = ApiError::from_submit(SubmitError::EngineDead("gone".into()), "prompt");
        assert_eq!(dead.status, StatusCode::SERVICE_UNAVAILABLE);
    }
}
