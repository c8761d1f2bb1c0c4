//! `POST /v1/completions`: prompts as a string, strings, token ids or lists of token ids; n
//! choices per prompt; a JSON reply or an SSE stream of `text_completion` chunks.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use strata_engine::{FinishReason, SubmitError, TokenLogprob};

use crate::body::parse_json;
use crate::error::{ApiError, GenerationErrors, RequestErrors};
use crate::generation::{completion_logprobs, respond, ChoiceResult, ChunkFormat, ResponseMeta};
use crate::params::{plan, GenerationPlan};
use crate::prompt::{prompt_error, PromptContext};
use crate::protocol::{CompletionChoice, CompletionRequest, CompletionResponse, PromptInput, UsageInfo};
use crate::AppState;

/// OpenAI's default `max_tokens` for completions.
pub const DEFAULT_COMPLETION_MAX_TOKENS: usize = 16;

/// Creates a completion.
#[utoipa::path(
    post,
    path = "/v1/completions",
    tag = "openai",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion; with `stream: true` a `text/event-stream` of `data: <CompletionResponse>` chunks ending with `data: [DONE]`",
            content((CompletionResponse = "application/json"), (CompletionResponse = "text/event-stream"))),
        RequestErrors,
        GenerationErrors,
    ),
    security(("bearer" = []))
)]
pub async fn completions(State(state): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
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
    let req: CompletionRequest = parse_json(body, state.config.max_request_body_bytes)?;
    state.check_model(req.model.as_deref())?;
    let (prompts, plan) = prepare(&req, &state.prompt_context())?;
    if let Some(user) = &req.user {
        tracing::debug!(user, prompts = prompts.len(), "completion");
    }
    let meta = ResponseMeta::new(&state, "cmpl", &plan);
    respond(
        Arc::clone(&state),
        &prompts,
        &plan,
        "prompt",
        meta,
        arrival,
        CompletionChunks,
        reply,
    )
    .await
}

/// Checks a completion request and builds its prompts' ids: everything short of submitting it.
pub fn prepare(req: &CompletionRequest, ctx: &PromptContext) -> Result<(Vec<Vec<u32>>, GenerationPlan), ApiError> {
    if req.echo == Some(true) {
        return Err(ApiError::invalid_field("echo", "`echo: true` is not supported"));
    }
    if req.suffix.is_some() {
        return Err(ApiError::invalid_field("suffix", "`suffix` is not supported"));
    }
    if let Some(best_of) = req.best_of {
        if best_of != 1 && Some(best_of) != req.n {
            return Err(ApiError::invalid_field(
                "best_of",
                "`best_of` other than 1 (or `n`) is not supported",
            ));
        }
    }
    let max_tokens = req.max_tokens.map(|v| (v, "max_tokens"));
    let logprobs = req.logprobs.map(|k| (k, "logprobs"));
    let fields = req.generation_fields(max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, logprobs);
    let plan = plan(&fields, ctx.tokenizer.vocab_size(), ctx.grammar)?;
    Ok((prompt_ids(&req.prompt, &plan, ctx)?, plan))
}

/// The prompts of a request as token ids. What cannot fit is refused before any text is
/// tokenized or any id list copied: more prompts x `n` than the queue holds, a text longer than
/// the context can hold, an id list of `max_model_len` ids or more, or too long to leave room for
/// the `max_tokens` asked for.
fn prompt_ids(prompt: &PromptInput, plan: &GenerationPlan, ctx: &PromptContext) -> Result<Vec<Vec<u32>>, ApiError> {
    let n = plan.n;
    let fits = |ids: usize| {
        ctx.limit.check_ids(ids, "prompt")?;
        plan.check_room(ids, ctx.limit.max_model_len, "prompt")
    };
    let count = match prompt {
        PromptInput::Text(_) | PromptInput::Tokens(_) => 1,
        PromptInput::Texts(ts) => ts.len(),
        PromptInput::TokenLists(lists) => lists.len(),
    };
    if count == 0 {
        return Err(ApiError::invalid_field("prompt", "`prompt` must not be an empty list"));
    }
    let requests = count.saturating_mul(n);
    if requests > ctx.max_queue {
        let refusal = SubmitError::MoreThanQueue {
            requests,
            max_queue: ctx.max_queue,
        };
        return Err(ApiError::from_submit(refusal, "prompt"));
    }
    // Each prompt is refused as soon as it is known not to fit: the rest are never tokenized.
    let encode = |text: &String| {
        let ids = ctx
            .limit
            .text_ids(ctx.tokenizer, text, true)
            .map_err(|e| prompt_error(e, "prompt"))?;
        fits(ids.len()).map(|()| ids)
    };
    let ids = |list: &Vec<u32>| fits(list.len()).map(|()| list.clone());
    let prompts = match prompt {
        PromptInput::Text(t) => vec![encode(t)?],
        PromptInput::Texts(ts) => ts.iter().map(encode).collect::<Result<_, _>>()?,
        PromptInput::Tokens(list) => vec![ids(list)?],
        PromptInput::TokenLists(lists) => lists.iter().map(ids).collect::<Result<_, _>>()?,
    };
    if let Some(i) = prompts.iter().position(Vec::is_empty) {
        return Err(ApiError::invalid_field(
            "prompt",
            format!("`prompt` number {i} has no tokens"),
        ));
    }
    Ok(prompts)
}

/// The JSON answer of a non-streamed completion.
fn reply(meta: ResponseMeta, results: Vec<ChoiceResult>, usage: UsageInfo) -> Response {
    let tokenizer = meta.engine.tokenizer();
    let choices = results
        .into_iter()
        .map(|r| CompletionChoice {
            index: r.index,
            logprobs: meta.logprobs.then(|| completion_logprobs(tokenizer, &r.logprobs, 0)),
            text: r.text,
            finish_reason: Some(r.finish.as_str().into()),
            stop_reason: r.stop_string,
        })
        .collect();
    Json(CompletionResponse {
        id: meta.id.clone(),
        object: "text_completion".into(),
        created: meta.created,
        model: meta.model.clone(),
        system_fingerprint: meta.system_fingerprint.clone(),
        choices,
        usage: Some(Some(usage)),
    })
    .into_response()
}

/// Writes streamed `text_completion` chunks.
struct CompletionChunks(ResponseMeta);

impl CompletionChunks {
    fn chunk(&self, choice: Option<CompletionChoice>, usage: Option<UsageInfo>) -> String {
        let meta = &self.0;
        let chunk = CompletionResponse {
            id: meta.id.clone(),
            object: "text_completion".into(),
            created: meta.created,
            model: meta.model.clone(),
            system_fingerprint: meta.system_fingerprint.clone(),
            choices: choice.into_iter().collect(),
            usage: meta.chunk_usage(usage),
        };
        serde_json::to_string(&chunk).unwrap_or_else(|_| "{}".into())
    }
}

impl ChunkFormat for CompletionChunks {
    fn meta(&self) -> &ResponseMeta {
        &self.0
    }

    fn opening(&self, _index: usize) -> Option<String> {
        None
    }

    fn delta(&self, index: usize, text: String, logprobs: &[TokenLogprob], offset: usize) -> String {
        let logprobs = self
            .0
            .logprobs
            .then(|| completion_logprobs(self.0.engine.tokenizer(), logprobs, offset));
        let choice = CompletionChoice {
            index,
            text,
            logprobs,
            finish_reason: None,
            stop_reason: None,
        };
        self.chunk(Some(choice), None)
    }

    fn finish(&self, index: usize, reason: FinishReason, stop_string: Option<String>) -> String {
        let choice = CompletionChoice {
            index,
            text: String::new(),
            logprobs: None,
            finish_reason: Some(reason.as_str().into()),
            stop_reason: stop_string,
        };
        self.chunk(Some(choice), None)
    }

    fn usage(&self, usage: UsageInfo) -> String {
        self.chunk(None, Some(usage))
    }
}
