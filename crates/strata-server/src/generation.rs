//! Running a checked request on the engine: submitting its choices, collecting them for a JSON
//! reply, or merging their outputs into one SSE stream; latency metrics are recorded on the way.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::http::{header, HeaderValue};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use strata_engine::{EngineHandle, FinishReason, RequestOutput, RequestStream, TokenLogprob, Usage};
use strata_model::tokenizer::Tokenizer;

use crate::error::ApiError;
use crate::metrics::GenerationTimer;
use crate::params::{random_u64, GenerationPlan};
use crate::protocol::{ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob, UsageInfo};
use crate::AppState;

/// One submitted choice.
pub struct Submitted {
    /// The choice's index in the response (`prompt_index * n + i`).
    pub index: usize,
    pub stream: RequestStream,
}

/// Submits `plan.n` requests for every prompt, all or none: a refused request leaves nothing
/// queued or reserved behind it.
fn submit(
    state: &AppState,
    prompts: &[Vec<u32>],
    plan: &GenerationPlan,
    prompt_param: &str,
) -> Result<Vec<Submitted>, ApiError> {
    let requests = prompts.iter().flat_map(|prompt| plan.requests(prompt)).collect();
    let streams = state
        .engine
        .submit_all(requests)
        .map_err(|e| ApiError::from_submit(e, prompt_param))?;
    // Choice `p * n + i` is the i-th of prompt p: the order they were built in.
    Ok(streams
        .into_iter()
        .enumerate()
        .map(|(index, stream)| Submitted { index, stream })
        .collect())
}

/// Everything one choice produced.
#[derive(Debug, Clone)]
pub struct ChoiceResult {
    pub index: usize,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: FinishReason,
    pub stop_string: Option<String>,
    pub usage: Usage,
}

async fn collect_one(state: Arc<AppState>, mut s: Submitted, arrival: Instant) -> Result<ChoiceResult, ApiError> {
    let mut timer = GenerationTimer::new(Arc::clone(&state.metrics), arrival);
    let mut text = String::new();
    let mut logprobs = Vec::new();
    while let Some(out) = s.stream.next().await {
        match out {
            RequestOutput::Delta {
                tokens,
                text: t,
                logprobs: lp,
            } => {
                timer.tokens(tokens.len());
                text.push_str(&t);
                logprobs.extend(lp);
            }
            RequestOutput::Finished {
                reason,
                stop_string,
                usage,
            } => {
                timer.finished(reason);
                if reason == FinishReason::Abort {
                    return Err(ApiError::engine_unavailable(
                        "the server is shutting down and aborted this request",
                    ));
                }
                return Ok(ChoiceResult {
                    index: s.index,
                    text,
                    logprobs,
                    finish: reason,
                    stop_string,
                    usage,
                });
            }
            RequestOutput::Failed(why) => return Err(ApiError::engine_failed(&why)),
            RequestOutput::Unavailable(why) => return Err(ApiError::engine_unavailable(&why)),
        }
    }
    Err(ApiError::engine_failed(
        "the request's output stream ended without a result",
    ))
}

/// Waits for every choice; the first failure fails the request (the others are then aborted).
async fn collect_all(
    state: &Arc<AppState>,
    submitted: Vec<Submitted>,
    arrival: Instant,
) -> Result<Vec<ChoiceResult>, ApiError> {
    let futures = submitted
        .into_iter()
        .map(|s| collect_one(Arc::clone(state), s, arrival));
    let mut results = futures_util::future::try_join_all(futures).await?;
    results.sort_by_key(|c| c.index);
    Ok(results)
}

/// Usage of a whole response: each prompt's tokens counted once however many choices it has.
pub fn total_usage(usages: impl IntoIterator<Item = (usize, Usage)>, n: usize) -> UsageInfo {
    let mut total = UsageInfo::default();
    for (index, u) in usages {
        if index % n.max(1) == 0 {
            total.prompt_tokens += u.prompt_tokens;
            total.prompt_tokens_details.cached_tokens += u.cached_prompt_tokens;
        }
        total.completion_tokens += u.completion_tokens;
    }
    total.total_tokens = total.prompt_tokens + total.completion_tokens;
    total
}

/// A token's text as a client sees it, and its raw bytes.
fn token_piece(tokenizer: &Tokenizer, id: u32) -> (String, Vec<u8>) {
    let bytes = tokenizer.token_to_piece(id).map(<[u8]>::to_vec).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Chat-style log-probabilities.
pub fn chat_logprobs(tokenizer: &Tokenizer, lps: &[TokenLogprob]) -> ChatLogprobs {
    ChatLogprobs {
        content: lps
            .iter()
            .map(|lp| {
                let (token, bytes) = token_piece(tokenizer, lp.token);
                ChatTokenLogprob {
                    token,
                    logprob: lp.logprob,
                    bytes,
                    top_logprobs: lp
                        .top
                        .iter()
                        .map(|&(id, logprob)| {
                            let (token, bytes) = token_piece(tokenizer, id);
                            TopLogprob { token, logprob, bytes }
                        })
                        .collect(),
                }
            })
            .collect(),
    }
}

/// Completions-style log-probabilities; `offset` is the character offset of the first token.
pub fn completion_logprobs(tokenizer: &Tokenizer, lps: &[TokenLogprob], mut offset: usize) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for lp in lps {
        let (token, _) = token_piece(tokenizer, lp.token);
        out.text_offset.push(offset);
        offset += token.chars().count();
        out.tokens.push(token);
        out.token_logprobs.push(lp.logprob);
        out.top_logprobs.push(
            lp.top
                .iter()
                .map(|&(id, logprob)| (token_piece(tokenizer, id).0, logprob))
                .collect(),
        );
    }
    out
}

/// What every response and stream chunk of one request repeats.
pub struct ResponseMeta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub system_fingerprint: String,
    pub engine: EngineHandle,
    /// Whether the client asked for log-probabilities.
    pub logprobs: bool,
    /// Whether the client asked for the usage chunk (`stream_options.include_usage`).
    pub include_usage: bool,
}

impl ResponseMeta {
    pub fn new(state: &AppState, id_prefix: &str, plan: &GenerationPlan) -> Self {
        ResponseMeta {
            id: format!("{id_prefix}-{:016x}", random_u64()),
            created: unix_now(),
            model: state.config.served_model_name.clone(),
            system_fingerprint: state.system_fingerprint.clone(),
            engine: state.engine.clone(),
            logprobs: plan.template.logprobs.is_some(),
            include_usage: plan.include_usage,
        }
    }

    /// The `usage` field of a stream chunk: absent unless asked for, then null but on the last.
    pub fn chunk_usage(&self, usage: Option<UsageInfo>) -> Option<Option<UsageInfo>> {
        self.include_usage.then_some(usage)
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// How one endpoint writes its stream chunks (chat and completions differ).
pub trait ChunkFormat: Send + Sync + 'static {
    fn meta(&self) -> &ResponseMeta;
    /// Sent for each choice before any token (chat: the assistant role).
    fn opening(&self, index: usize) -> Option<String>;
    /// New text (possibly empty when only log-probabilities are new); `offset` is the number
    /// of characters the choice had before.
    fn delta(&self, index: usize, text: String, logprobs: &[TokenLogprob], offset: usize) -> String;
    /// The chunks for new text: [`Self::delta`]'s one, unless the format holds text back or
    /// splits it (chat tool calls).
    fn deltas(&self, index: usize, text: String, logprobs: &[TokenLogprob], offset: usize) -> Vec<String> {
        vec![self.delta(index, text, logprobs, offset)]
    }
    /// The choice's last chunk.
    fn finish(&self, index: usize, reason: FinishReason, stop_string: Option<String>) -> String;
    /// The choice's last chunks: [`Self::finish`]'s one, after any text the format held back.
    fn finishing(&self, index: usize, reason: FinishReason, stop_string: Option<String>) -> Vec<String> {
        vec![self.finish(index, reason, stop_string)]
    }
    /// The usage chunk (`stream_options.include_usage`).
    fn usage(&self, usage: UsageInfo) -> String;
}

/// Submits a checked request and answers it: an SSE stream written by `stream_format`, or the
/// JSON `reply` built from every choice once all are done.
#[allow(clippy::too_many_arguments)]
pub async fn respond<F: ChunkFormat>(
    state: Arc<AppState>,
    prompts: &[Vec<u32>],
    plan: &GenerationPlan,
    prompt_param: &str,
    meta: ResponseMeta,
    arrival: Instant,
    stream_format: impl FnOnce(ResponseMeta) -> F,
    reply: impl FnOnce(ResponseMeta, Vec<ChoiceResult>, UsageInfo) -> Response,
) -> Result<Response, ApiError> {
    let submitted = submit(&state, prompts, plan, prompt_param)?;
    if plan.stream {
        return Ok(sse_response(state, stream_format(meta), submitted, plan.n, arrival));
    }
    let results = collect_all(&state, submitted, arrival).await?;
    let usage = total_usage(results.iter().map(|r| (r.index, r.usage)), plan.n);
    Ok(reply(meta, results, usage))
}

struct ChoiceState {
    timer: GenerationTimer,
    chars: usize,
}

/// The merged outputs of a request's choices, turned into SSE `data:` payloads.
struct ChunkStream<F: ChunkFormat> {
    format: F,
    merged: SelectAll<BoxStream<'static, (usize, RequestOutput)>>,
    choices: Vec<ChoiceState>,
    usages: Vec<(usize, Usage)>,
    n: usize,
    pending: VecDeque<String>,
    done: bool,
}

fn choice_outputs(s: Submitted) -> BoxStream<'static, (usize, RequestOutput)> {
    let index = s.index;
    stream::unfold(Some(s.stream), move |rs| async move {
        let mut rs = rs?;
        let out = rs.next().await?;
        let last = !matches!(out, RequestOutput::Delta { .. });
        Some(((index, out), if last { None } else { Some(rs) }))
    })
    .boxed()
}

impl<F: ChunkFormat> ChunkStream<F> {
    async fn next_payload(&mut self) -> Option<String> {
        loop {
            if let Some(p) = self.pending.pop_front() {
                return Some(p);
            }
            if self.done {
                return None;
            }
            match self.merged.next().await {
                Some((index, out)) => self.on_output(index, out),
                None => {
                    if self.format.meta().include_usage {
                        let usage = total_usage(self.usages.drain(..), self.n);
                        self.pending.push_back(self.format.usage(usage));
                    }
                    self.pending.push_back("[DONE]".into());
                    self.done = true;
                }
            }
        }
    }

    fn on_output(&mut self, index: usize, out: RequestOutput) {
        let Some(choice) = self.choices.get_mut(index) else {
            return;
        };
        match out {
            RequestOutput::Delta { tokens, text, logprobs } => {
                choice.timer.tokens(tokens.len());
                let logprobs = if self.format.meta().logprobs {
                    logprobs
                } else {
                    Vec::new()
                };
                if text.is_empty() && logprobs.is_empty() {
                    return;
                }
                let offset = choice.chars;
                choice.chars += text.chars().count();
                self.pending.extend(self.format.deltas(index, text, &logprobs, offset));
            }
            RequestOutput::Finished {
                reason,
                stop_string,
                usage,
            } => {
                choice.timer.finished(reason);
                self.usages.push((index, usage));
                self.pending.extend(self.format.finishing(index, reason, stop_string));
            }
            RequestOutput::Failed(why) => self.end_with(ApiError::engine_failed(&why)),
            RequestOutput::Unavailable(why) => self.end_with(ApiError::engine_unavailable(&why)),
        }
    }

    /// Ends the whole stream with an error event and `[DONE]`.
    fn end_with(&mut self, error: ApiError) {
        let body = error.body();
        self.pending
            .push_back(serde_json::to_string(&body).unwrap_or_else(|_| "{}".into()));
        self.pending.push_back("[DONE]".into());
        // Dropping the other choices' streams aborts them.
        self.merged = SelectAll::new();
        self.done = true;
    }
}

/// The SSE response for a streamed request: chunks as they come, keep-alive comments while
/// nothing does (e.g. queued), `[DONE]` at the end, and headers that stop proxies buffering.
fn sse_response<F: ChunkFormat>(
    state: Arc<AppState>,
    format: F,
    submitted: Vec<Submitted>,
    n: usize,
    arrival: Instant,
) -> Response {
    let total = submitted.len();
    let mut pending = VecDeque::new();
    let mut indexes: Vec<usize> = submitted.iter().map(|s| s.index).collect();
    indexes.sort_unstable();
    for &i in &indexes {
        if let Some(p) = format.opening(i) {
            pending.push_back(p);
        }
    }
    let keep_alive = state.config.sse_keep_alive;
    let chunks = ChunkStream {
        choices: (0..total)
            .map(|_| ChoiceState {
                timer: GenerationTimer::new(Arc::clone(&state.metrics), arrival),
                chars: 0,
            })
            .collect(),
        merged: stream::select_all(submitted.into_iter().map(choice_outputs)),
        format,
        usages: Vec::with_capacity(total),
        n,
        pending,
        done: false,
    };
    let events = stream::unfold(chunks, |mut chunks| async move {
        let payload = chunks.next_payload().await?;
        Some((Ok::<Event, Infallible>(Event::default().data(payload)), chunks))
    });
    let mut response = Sse::new(events)
        .keep_alive(KeepAlive::new().interval(keep_alive).text("keep-alive"))
        .into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/event-stream"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_tokens_count_once_per_prompt() {
        let u = |p, c| Usage {
            prompt_tokens: p,
            completion_tokens: c,
            cached_prompt_tokens: 0,
        };
        // Two prompts (10 and 20 tokens), n = 2.
        let total = total_usage([(0, u(10, 3)), (1, u(10, 4)), (2, u(20, 5)), (3, u(20, 6))], 2);
        assert_eq!(total.prompt_tokens, 30);
        assert_eq!(total.completion_tokens, 18);
        assert_eq!(total.total_tokens, 48);
    }
}
