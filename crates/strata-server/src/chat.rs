//! `POST /v1/chat/completions`: messages through the chat template, n choices, a JSON reply or
//! an SSE stream of `chat.completion.chunk` objects exactly as OpenAI sends them.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use strata_engine::{FinishReason, TokenLogprob};

use crate::body::parse_json;
use crate::error::{ApiError, GenerationErrors, RequestErrors};
use crate::generation::{chat_logprobs, respond, ChoiceResult, ChunkFormat, ResponseMeta};
use crate::params::{plan, GenerationPlan};
use crate::prompt::{chat_messages, prompt_error, PromptContext};
use crate::protocol::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatLogprobs, ChatMessageOut, UsageInfo,
};
use crate::AppState;

/// Creates a chat completion.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "openai",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion; with `stream: true` a `text/event-stream` of `data: <ChatCompletionChunk>` events (the first of each choice carries the role, the last its `finish_reason`, then the usage chunk when asked for) ending with `data: [DONE]`, and `: keep-alive` comments while nothing is generated",
            content((ChatCompletionResponse = "application/json"), (ChatCompletionChunk = "text/event-stream"))),
        RequestErrors,
        GenerationErrors,
    ),
    security(("bearer" = []))
)]
pub async fn chat_completions(State(state): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    let arrival = Instant::now();
    match run(state, body, arrival).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(
    state: Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    arrival: Instant,
) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_json(body, state.config.max_request_body_bytes)?;
    state.check_model(req.model.as_deref())?;
    let (prompt, plan) = prepare(&req, &state.prompt_context())?;
    if let Some(user) = &req.user {
        tracing::debug!(user, prompt_tokens = prompt.len(), "chat completion");
    }
    let meta = ResponseMeta::new(&state, "chatcmpl", &plan);
    respond(
        Arc::clone(&state),
        &[prompt],
        &plan,
        "messages",
        meta,
        arrival,
        ChatChunks,
        reply,
    )
    .await
}

/// Checks a chat request and builds its prompt ids: everything short of submitting it.
pub fn prepare(req: &ChatCompletionRequest, ctx: &PromptContext) -> Result<(Vec<u32>, GenerationPlan), ApiError> {
    let messages = chat_messages(&req.messages, "messages")?;
    let wants_logprobs = req.logprobs.unwrap_or(false);
    if req.top_logprobs.is_some() && !wants_logprobs {
        return Err(ApiError::invalid_field(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        ));
    }
    let max_tokens = req
        .max_completion_tokens
        .map(|v| (v, "max_completion_tokens"))
        .or(req.max_tokens.map(|v| (v, "max_tokens")));
    let logprobs = wants_logprobs.then(|| (req.top_logprobs.unwrap_or(0), "top_logprobs"));
    let fields = req.generation_fields(max_tokens, ctx.limit.max_model_len, logprobs);
    let plan = plan(&fields, ctx.tokenizer.vocab_size(), ctx.grammar)?;
    let prompt = ctx
        .limit
        .chat_ids(ctx.tokenizer, ctx.template, &messages, true)
        .map_err(|e| prompt_error(e, "messages"))?;
    ctx.limit.check_ids(prompt.len(), "messages")?;
    plan.check_room(prompt.len(), ctx.limit.max_model_len, "messages")?;
    Ok((prompt, plan))
}

/// The JSON answer of a non-streamed chat completion.
fn reply(meta: ResponseMeta, results: Vec<ChoiceResult>, usage: UsageInfo) -> Response {
    let tokenizer = meta.engine.tokenizer();
    let choices = results
        .into_iter()
        .map(|r| ChatChoice {
            index: r.index,
            message: ChatMessageOut {
                role: "assistant".into(),
                content: r.text,
            },
            logprobs: meta.logprobs.then(|| chat_logprobs(tokenizer, &r.logprobs)),
            finish_reason: r.finish.as_str().into(),
            stop_reason: r.stop_string,
        })
        .collect();
    Json(ChatCompletionResponse {
        id: meta.id.clone(),
        object: "chat.completion".into(),
        created: meta.created,
        model: meta.model.clone(),
        system_fingerprint: meta.system_fingerprint.clone(),
        choices,
        usage,
    })
    .into_response()
}

/// Writes `chat.completion.chunk` objects.
struct ChatChunks(ResponseMeta);

impl ChatChunks {
    fn chunk(
        &self,
        index: Option<usize>,
        delta: ChatDelta,
        finish: Option<(FinishReason, Option<String>)>,
        logprobs: Option<ChatLogprobs>,
        usage: Option<UsageInfo>,
    ) -> String {
        let meta = &self.0;
        let (finish_reason, stop_reason) = match finish {
            Some((reason, stop)) => (Some(reason.as_str().to_string()), stop),
            None => (None, None),
        };
        let chunk = ChatCompletionChunk {
            id: meta.id.clone(),
            object: "chat.completion.chunk".into(),
            created: meta.created,
            model: meta.model.clone(),
            system_fingerprint: meta.system_fingerprint.clone(),
            choices: index
                .map(|index| ChatChunkChoice {
                    index,
                    delta,
                    logprobs,
                    finish_reason,
                    stop_reason,
                })
                .into_iter()
                .collect(),
            usage: meta.chunk_usage(usage),
        };
        serde_json::to_string(&chunk).unwrap_or_else(|_| "{}".into())
    }
}

impl ChunkFormat for ChatChunks {
    fn meta(&self) -> &ResponseMeta {
        &self.0
    }

    fn opening(&self, index: usize) -> Option<String> {
        let delta = ChatDelta {
            role: Some("assistant".into()),
            content: Some(String::new()),
        };
        Some(self.chunk(Some(index), delta, None, None, None))
    }

    fn delta(&self, index: usize, text: String, logprobs: &[TokenLogprob], _offset: usize) -> String {
        let delta = ChatDelta {
            role: None,
            content: Some(text),
        };
        let logprobs = self
            .0
            .logprobs
            .then(|| chat_logprobs(self.0.engine.tokenizer(), logprobs));
        self.chunk(Some(index), delta, None, logprobs, None)
    }

    fn finish(&self, index: usize, reason: FinishReason, stop_string: Option<String>) -> String {
        self.chunk(
            Some(index),
            ChatDelta::default(),
            Some((reason, stop_string)),
            None,
            None,
        )
    }

    fn usage(&self, usage: UsageInfo) -> String {
        self.chunk(None, ChatDelta::default(), None, None, Some(usage))
    }
}
