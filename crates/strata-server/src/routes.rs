//! The small endpoints: `/v1/models`, `/health`, `/metrics`, `/tokenize`, `/detokenize`,
//! `/openapi.json`, and the OpenAI-shaped replies for unknown routes and methods.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::body::parse_json;
use crate::error::{ApiError, ErrorResponse, RequestErrors};
use crate::prompt::{chat_messages, prompt_error};
use crate::protocol::{
    DetokenizeRequest, DetokenizeResponse, HealthResponse, ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
};
use crate::AppState;

fn model_card(state: &AppState) -> ModelCard {
    ModelCard {
        id: state.config.served_model_name.clone(),
        object: "model".into(),
        created: state.created,
        owned_by: "strata".into(),
        max_model_len: state.engine.max_model_len(),
    }
}

/// Lists the served model.
#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, body = ModelList), (status = 401, body = ErrorResponse)),
    security(("bearer" = [])))]
pub async fn list_models(State(state): State<Arc<AppState>>) -> Json<ModelList> {
    Json(ModelList {
        object: "list".into(),
        data: vec![model_card(&state)],
    })
}

/// Describes one model.
#[utoipa::path(get, path = "/v1/models/{model}", tag = "openai",
    params(("model" = String, Path, description = "The served model name")),
    responses((status = 200, body = ModelCard), (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse)),
    security(("bearer" = [])))]
pub async fn get_model(
    State(state): State<Arc<AppState>>,
    Path(model): Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    state.check_model(Some(&model))?;
    Ok(Json(model_card(&state)))
}

/// 200 while the engine runs, 503 with the reason once it has stopped (e.g. its GPUs were lost).
/// Needs no API key.
#[utoipa::path(get, path = "/health", tag = "operations",
    responses((status = 200, body = HealthResponse), (status = 503, body = ErrorResponse)))]
pub async fn health(State(state): State<Arc<AppState>>) -> Result<Json<HealthResponse>, ApiError> {
    match state.engine.death() {
        None => Ok(Json(HealthResponse { status: "ok".into() })),
        Some(why) => Err(ApiError::engine_unavailable(&why)),
    }
}

/// Prometheus metrics (`strata_*`). Needs no API key.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text exposition format", content_type = "text/plain", body = String)))]
pub async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    let text = state
        .metrics
        .render(&state.engine.stats(), &state.engine.capacity(), state.engine.is_alive());
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        text,
    )
        .into_response()
}

/// Token ids of a prompt (BOS as the model asks), of llama.cpp's `content` (no BOS unless
/// `add_special`), or of messages rendered by the chat template; more than --max-model-len of
/// them get 400 (`context_length_exceeded`), as on the other endpoints.
#[utoipa::path(post, path = "/tokenize", tag = "strata",
    request_body = TokenizeRequest,
    responses((status = 200, body = TokenizeResponse), RequestErrors),
    security(("bearer" = [])))]
pub async fn tokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let req: TokenizeRequest = parse_json(body, state.config.max_request_body_bytes)?;
    state.check_model(req.model.as_deref())?;
    let ctx = state.prompt_context();
    if req.with_pieces == Some(true) {
        return Err(ApiError::invalid_field(
            "with_pieces",
            "`with_pieces: true` is not supported; token texts come from /detokenize",
        ));
    }
    let add_special = req.add_special_tokens.or(req.add_special);
    let (tokens, field) = match (&req.prompt, &req.content, &req.messages) {
        (Some(text), None, None) | (None, Some(text), None) => {
            // llama.cpp adds no BOS to `content` unless asked.
            let (field, default_special) = if req.prompt.is_some() {
                ("prompt", true)
            } else {
                ("content", false)
            };
            let ids = ctx
                .limit
                .text_ids(ctx.tokenizer, text, add_special.unwrap_or(default_special));
            (ids.map_err(|e| prompt_error(e, field))?, field)
        }
        (None, None, Some(messages)) => {
            let messages = chat_messages(messages, "messages")?;
            let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
            let ids = ctx
                .limit
                .chat_ids(ctx.tokenizer, ctx.template, &messages, add_generation_prompt);
            (ids.map_err(|e| prompt_error(e, "messages"))?, "messages")
        }
        _ => {
            return Err(ApiError::invalid_field(
                "prompt",
                "give exactly one of `prompt` or `content` (a string) and `messages` (a chat)",
            ))
        }
    };
    // Counting asks for no room to generate: exactly --max-model-len ids still fit.
    if tokens.len() > ctx.limit.max_model_len {
        return Err(ctx.limit.too_long(tokens.len(), field));
    }
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: state.engine.max_model_len(),
        tokens,
    }))
}

/// The text of token ids (special tokens included).
#[utoipa::path(post, path = "/detokenize", tag = "strata",
    request_body = DetokenizeRequest,
    responses((status = 200, body = DetokenizeResponse), RequestErrors),
    security(("bearer" = [])))]
pub async fn detokenize(
    State(state): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let req: DetokenizeRequest = parse_json(body, state.config.max_request_body_bytes)?;
    state.check_model(req.model.as_deref())?;
    let tokenizer = state.engine.tokenizer();
    let vocab = tokenizer.vocab_size();
    if let Some(i) = req.tokens.iter().position(|&t| t as usize >= vocab) {
        return Err(ApiError::invalid_field(
            format!("tokens[{i}]"),
            format!("token id {} is outside the vocabulary of {vocab}", req.tokens[i]),
        ));
    }
    let prompt = tokenizer
        .decode(&req.tokens, false)
        .map_err(|e| ApiError::invalid_field("tokens", e.to_string()))?;
    Ok(Json(DetokenizeResponse { prompt }))
}

/// This document.
#[utoipa::path(get, path = "/openapi.json", tag = "operations",
    responses((status = 200, description = "The OpenAPI 3.1 document of this API", content_type = "application/json", body = Object)))]
pub async fn openapi_json() -> Response {
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        crate::openapi::document_json(),
    )
        .into_response()
}

/// Any path the API does not have.
pub async fn unknown_route(method: Method, uri: Uri) -> ApiError {
    ApiError::unknown_route(method.as_str(), uri.path())
}

/// A known path asked with a method it does not take.
pub async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    ApiError::method_not_allowed(method.as_str(), uri.path())
}
