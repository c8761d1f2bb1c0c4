//! Reading request bodies: the size limit (413), the read deadline (408), JSON syntax (400) and
//! field types (400 naming the field by its path, e.g. `messages[1].content`), all OpenAI-style.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::error::Category;

use crate::connections::BodyReadTimeout;
use crate::error::ApiError;

/// Parses a JSON body into `T`, or says what is wrong with it and where.
pub fn parse_json<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<T, ApiError> {
    let bytes = match body {
        Ok(b) => b,
        Err(rejection) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => {
            return Err(ApiError::body_too_large(limit))
        }
        Err(rejection) => {
            if let Some(timeout) = body_timeout_in(&rejection) {
                return Err(ApiError::body_timeout(timeout.0));
            }
            return Err(ApiError::invalid_request(format!(
                "could not read the request body: {}",
                rejection.body_text()
            )));
        }
    };
    match bytes.iter().find(|b| !b.is_ascii_whitespace()) {
        None => {
            return Err(ApiError::invalid_request(
                "the request body is empty; send a JSON object",
            ))
        }
        // serde would read a struct from a JSON array too; the API takes objects only.
        Some(b'[') => {
            return Err(ApiError::invalid_request(
                "the request body must be a JSON object, not an array",
            ))
        }
        Some(_) => {}
    }
    let mut de = serde_json::Deserializer::from_slice(&bytes);
    let value: T = match serde_path_to_error::deserialize(&mut de) {
        Ok(v) => v,
        Err(e) => return Err(describe(e)),
    };
    de.end()
        .map_err(|e| ApiError::invalid_request(format!("invalid JSON: {e}")))?;
    Ok(value)
}

/// The connection's body deadline, when that is why the body could not be read.
fn body_timeout_in(rejection: &BytesRejection) -> Option<&BodyReadTimeout> {
    std::iter::successors(Some(rejection as &dyn std::error::Error), |e| e.source())
        .find_map(|e| e.downcast_ref::<BodyReadTimeout>())
}

fn describe(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let inner = e.inner();
    if matches!(inner.classify(), Category::Syntax | Category::Eof | Category::Io) {
        return ApiError::invalid_request(format!("invalid JSON: {inner}"));
    }
    let message = without_position(&inner.to_string());
    let path = e.path().to_string();
    let parent = if path == "." { None } else { Some(path) };
    if let Some(field) = message
        .strip_prefix("missing field `")
        .and_then(|rest| rest.strip_suffix('`'))
    {
        let param = match &parent {
            Some(p) => format!("{p}.{field}"),
            None => field.to_string(),
        };
        return ApiError::invalid_field(param.clone(), format!("`{param}` is required"));
    }
    match parent {
        Some(param) => {
            let what = untagged_expectation(&message).map(str::to_string).unwrap_or(message);
            ApiError::invalid_field(param.clone(), format!("`{param}`: {what}"))
        }
        None => ApiError::invalid_request(format!(
            "the request body must be a JSON object of the API's shape: {message}"
        )),
    }
}

/// serde's "did not match any variant of untagged enum X" says nothing useful; say what fits.
fn untagged_expectation(message: &str) -> Option<&'static str> {
    let name = message.strip_prefix("data did not match any variant of untagged enum ")?;
    Some(match name.trim() {
        "StopField" => "must be a string or a list of strings",
        "MessageContent" => "must be a string or a list of content parts like {\"type\": \"text\", \"text\": \"...\"}",
        "InputContent" => {
            "must be a string or a list of content parts like {\"type\": \"input_text\", \"text\": \"...\"}"
        }
        "PromptInput" => "must be a string, a list of strings, a list of token ids or a list of lists of token ids",
        _ => "has the wrong type",
    })
}

/// serde_json ends its messages with " at line L column C", which means nothing to a client.
fn without_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(i) if message[i..].contains(" column ") => message[..i].to_string(),
        _ => message.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{ChatCompletionRequest, CompletionRequest};

    fn parse<T: DeserializeOwned>(s: &str) -> Result<T, ApiError> {
        parse_json(Ok(Bytes::from(s.to_string())), 1000)
    }

    #[test]
    fn syntax_errors_are_invalid_json() {
        let e = parse::<ChatCompletionRequest>("{\"messages\": [").unwrap_err();
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert!(e.message.starts_with("invalid JSON"), "{}", e.message);
        let e = parse::<ChatCompletionRequest>("").unwrap_err();
        assert!(e.message.contains("empty"));
    }

    #[test]
    fn type_errors_name_the_field() {
        let e = parse::<ChatCompletionRequest>(r#"{"messages": [], "temperature": "hot"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        assert!(!e.message.contains("line 1"), "{}", e.message);
        let e = parse::<ChatCompletionRequest>(r#"{"messages": [{"role": "user", "content": 5}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        assert!(e.message.contains("string or a list of content parts"), "{}", e.message);
        let e = parse::<ChatCompletionRequest>(r#"{"messages": [{"content": "hi"}]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let e = parse::<ChatCompletionRequest>(r#"{"model": "x"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        let e = parse::<CompletionRequest>(r#"{"prompt": [1, -2]}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        let e = parse::<ChatCompletionRequest>("[1]").unwrap_err();
        assert_eq!(e.param, None);
        assert!(e.message.contains("JSON object"));
    }

    #[test]
    fn trailing_garbage_is_refused() {
        let e = parse::<CompletionRequest>(r#"{"prompt": "a"} x"#).unwrap_err();
        assert!(e.message.starts_with("invalid JSON"));
    }
}
