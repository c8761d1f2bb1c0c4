//! strata-server: the OpenAI-compatible HTTP API over a running engine (chat, completions, SSE,
//! models, tokenize, health, metrics, OpenAPI), with API-key auth and graceful shutdown.

pub mod body;
pub mod chat;
pub mod completions;
pub mod connections;
pub mod cors;
pub mod error;
pub mod generation;
pub mod metrics;
pub mod openapi;
pub mod params;
pub mod prompt;
pub mod protocol;
pub mod response_format;
pub mod responses;
pub mod routes;
pub mod tool_calls;

use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE};
use axum::http::Method;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use axum::Router;
use strata_engine::{EngineConfig, EngineHandle};
use subtle::ConstantTimeEq;

use connections::{serve_connections, ConnectionLimits};
pub use cors::AllowedOrigins;
pub use error::{ApiError, ErrorDetail, ErrorResponse};
pub use metrics::Metrics;
use prompt::{PromptContext, PromptLimit};
use response_format::GrammarCheck;

/// How the server behaves (the engine has its own config).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model name clients send and see (`--served-model-name`).
    pub served_model_name: String,
    /// Required as `Authorization: Bearer <key>` when set (`--api-key`, `STRATA_API_KEY`).
    pub api_key: Option<String>,
    /// Larger request bodies get 413.
    pub max_request_body_bytes: usize,
    /// Interval of `: keep-alive` comments on an SSE stream that has nothing to send.
    pub sse_keep_alive: Duration,
    /// After SIGTERM/SIGINT, how long in-flight requests may finish before they are aborted.
    pub shutdown_timeout: Duration,
    /// Read deadlines and the connection cap.
    pub connections: ConnectionLimits,
    /// Origins whose web pages may call the API (`--allowed-origins`); none: no CORS headers.
    pub allowed_origins: AllowedOrigins,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            served_model_name: "default".into(),
            api_key: None,
            max_request_body_bytes: 32 << 20,
            sse_keep_alive: Duration::from_secs(10),
            shutdown_timeout: Duration::from_secs(30),
            connections: ConnectionLimits {
                header_read_timeout: Duration::from_secs(10),
                body_read_timeout: Duration::from_secs(30),
                keep_alive_timeout: Duration::from_secs(75),
                max_connections: connections::DEFAULT_MAX_CONNECTIONS,
            },
            allowed_origins: AllowedOrigins::default(),
        }
    }
}

/// What every handler sees.
pub struct AppState {
    pub engine: EngineHandle,
    pub config: ServerConfig,
    pub metrics: Arc<Metrics>,
    /// Unix time the server started (the model's `created`).
    pub created: u64,
    /// Prompt texts longer than this cannot fit in --max-model-len.
    pub prompt_limit: PromptLimit,
    /// `system_fingerprint` of every completion and stream chunk.
    pub system_fingerprint: String,
    /// Checks requests' `response_format` against the served vocabulary.
    pub grammar: GrammarCheck,
}

impl AppState {
    pub fn new(engine: EngineHandle, config: ServerConfig) -> Self {
        AppState {
            prompt_limit: PromptLimit::new(engine.tokenizer(), engine.max_model_len()),
            system_fingerprint: system_fingerprint(&config.served_model_name, engine.config()),
            grammar: GrammarCheck::new(&engine),
            engine,
            config,
            metrics: Arc::new(Metrics::default()),
            created: generation::unix_now(),
        }
    }

    /// The tokenizer, chat template and limits that requests' prompts are built with.
    pub fn prompt_context(&self) -> PromptContext<'_> {
        PromptContext {
            tokenizer: self.engine.tokenizer(),
            template: self.engine.chat_template(),
            limit: self.prompt_limit,
            max_queue: self.engine.config().max_queue,
            grammar: &self.grammar,
        }
    }

    /// A request naming another model gets 404; one naming none gets the served model.
    pub fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != self.config.served_model_name => {
                Err(ApiError::unknown_model(m, &self.config.served_model_name))
            }
            _ => Ok(()),
        }
    }
}

/// OpenAI's `system_fingerprint`: `fp_` and 10 hex digits naming this build of the server, the
/// served model and the engine settings that change its numbers (KV and activation precision).
pub fn system_fingerprint(served_model_name: &str, engine: &EngineConfig) -> String {
    // `DefaultHasher::new()` has fixed keys: the same value in every run of one build.
    let mut h = std::hash::DefaultHasher::new();
    (
        env!("CARGO_PKG_VERSION"),
        served_model_name,
        format!("{:?} {:?}", engine.kv_cache_dtype, engine.activation_precision),
    )
        .hash(&mut h);
    format!("fp_{:010x}", h.finish() >> 24)
}

/// Paths that need no API key.
const OPEN_PATHS: &[&str] = &["/health", "/metrics", "/openapi.json"];

/// Every route the server has: (path, handlers). The OpenAPI document must list exactly these.
pub fn routes() -> Vec<(&'static str, MethodRouter<Arc<AppState>>)> {
    vec![
        ("/v1/chat/completions", post(chat::chat_completions)),
        ("/v1/completions", post(completions::completions)),
        ("/v1/responses", post(responses::create_response)),
        ("/v1/models", get(routes::list_models)),
        ("/v1/models/{model}", get(routes::get_model)),
        ("/health", get(routes::health)),
        ("/metrics", get(routes::metrics)),
        ("/tokenize", post(routes::tokenize)),
        ("/detokenize", post(routes::detokenize)),
        ("/openapi.json", get(routes::openapi_json)),
    ]
}

/// The whole HTTP application.
pub fn router(state: Arc<AppState>) -> Router {
    let mut app = Router::new();
    for (path, handlers) in routes() {
        app = app.route(path, handlers.fallback(routes::wrong_method));
    }
    app.fallback(routes::unknown_route)
        .layer(middleware::from_fn(require_json_body))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), require_api_key))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), cors::cors))
        .layer(middleware::from_fn_with_state(Arc::clone(&state), count_requests))
        .layer(DefaultBodyLimit::max(state.config.max_request_body_bytes))
        .with_state(state)
}

/// Refuses requests without the right `Authorization: Bearer` key (compared in constant time).
async fn require_api_key(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let Some(key) = &state.config.api_key else {
        return next.run(request).await;
    };
    if OPEN_PATHS.contains(&request.uri().path()) {
        return next.run(request).await;
    }
    let given = request
        .headers()
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, token)| token.trim());
    match given {
        Some(token) if bool::from(token.as_bytes().ct_eq(key.as_bytes())) => next.run(request).await,
        _ => ApiError::unauthorized().into_response(),
    }
}

/// Refuses (415) a POST to an API route whose body is not declared as JSON: browsers send
/// `text/plain` and form bodies cross-origin without asking, JSON only after a CORS preflight.
async fn require_json_body(request: Request, next: Next) -> Response {
    let routed = request.extensions().get::<MatchedPath>().is_some();
    if request.method() != Method::POST || !routed {
        return next.run(request).await;
    }
    let content_type = request
        .headers()
        .get(CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("(not text)"));
    if content_type.is_some_and(is_json_media_type) {
        return next.run(request).await;
    }
    ApiError::not_json(content_type).into_response()
}

/// `application/json` or `application/<anything>+json`, parameters (`; charset=utf-8`) allowed.
fn is_json_media_type(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    match essence.strip_prefix("application/") {
        Some(sub) => sub == "json" || (sub.ends_with("+json") && sub.len() > "+json".len()),
        None => false,
    }
}

/// Counts every response by route and status for `/metrics`.
async fn count_requests(State(state): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|p| p.as_str().to_string())
        .unwrap_or_else(|| "unmatched".into());
    let response = next.run(request).await;
    state.metrics.count_request(&route, response.status().as_u16());
    response
}

/// Why serving stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("the server task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Serves on `listener` until `shutdown` resolves; then stops accepting, lets in-flight requests
/// finish for `config.shutdown_timeout`, aborts what is left, stops the engine and returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: EngineHandle,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let timeout = config.shutdown_timeout;
    let limits = config.connections;
    let state = Arc::new(AppState::new(engine.clone(), config));
    let (signalled_tx, mut signalled_rx) = tokio::sync::watch::channel(false);
    let server = serve_connections(listener, router(state), limits, async move {
        shutdown.await;
        let _ = signalled_tx.send(true);
    });
    let mut server = tokio::spawn(server);
    let outcome = tokio::select! {
        result = &mut server => Some(result),
        _ = signalled_rx.wait_for(|s| *s) => None,
    };
    let result = match outcome {
        Some(result) => result,
        None => {
            tracing::info!("shutting down: no new connections; in-flight requests get {timeout:?} to finish");
            match tokio::time::timeout(timeout, &mut server).await {
                Ok(result) => result,
                Err(_) => {
                    tracing::warn!("shutdown timeout passed: aborting the requests still running");
                    let stopping = engine.clone();
                    tokio::task::spawn_blocking(move || stopping.shutdown()).await?;
                    match tokio::time::timeout(Duration::from_secs(5), &mut server).await {
                        Ok(result) => result,
                        Err(_) => {
                            server.abort();
                            Ok(())
                        }
                    }
                }
            }
        }
    };
    let stopping = engine.clone();
    tokio::task::spawn_blocking(move || stopping.shutdown()).await?;
    result?;
    Ok(())
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => tracing::info!("SIGINT received"),
        _ = terminate => tracing::info!("SIGTERM received"),
    }
}

#[cfg(test)]
mod tests {
    use super::is_json_media_type;

    #[test]
    fn json_media_types() {
        for t in [
            "application/json",
            "application/json; charset=utf-8",
            " Application/JSON ;charset=UTF-8",
            "application/vnd.api+json",
            "application/merge-patch+json",
        ] {
            assert!(is_json_media_type(t), "{t}");
        }
        for t in [
            "text/plain",
            "text/json",
            "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x",
            "application/jsonp",
            "application/+json",
            "application/json-seq",
            "",
            "json",
        ] {
            assert!(!is_json_media_type(t), "{t}");
        }
    }
}
