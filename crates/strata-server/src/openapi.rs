//! The OpenAPI document served at `/openapi.json`, derived from the handlers' annotations and
//! the very types that parse requests and write responses, so it cannot drift from the code.

use std::sync::OnceLock;

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::{chat, completions, responses, routes};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "strata",
        description = "OpenAI-compatible API of the strata inference server. Endpoints under /v1 and /tokenize, /detokenize need `Authorization: Bearer <key>` when the server runs with --api-key; /health, /metrics and /openapi.json are open. Unknown request fields are ignored."
    ),
    paths(
        chat::chat_completions,
        completions::completions,
        responses::create_response,
        routes::list_models,
        routes::get_model,
        routes::health,
        routes::metrics,
        routes::tokenize,
        routes::detokenize,
        routes::openapi_json,
    ),
    modifiers(&BearerKey),
    tags(
        (name = "openai", description = "The OpenAI API subset strata serves"),
        (name = "strata", description = "Extras in vLLM's spelling"),
        (name = "operations", description = "Health, metrics and this document"),
    )
)]
pub struct ApiDoc;

struct BearerKey;

impl Modify for BearerKey {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document as JSON, built once.
pub fn document_json() -> String {
    static DOC: OnceLock<String> = OnceLock::new();
    DOC.get_or_init(|| {
        ApiDoc::openapi()
            .to_pretty_json()
            .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    })
    .clone()
}

/// The paths the document describes.
pub fn documented_paths() -> Vec<String> {
    ApiDoc::openapi().paths.paths.keys().cloned().collect()
}
