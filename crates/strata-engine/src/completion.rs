//! Reading one request's stream to its end from synchronous code (the CLI, benchmarks, tests):
//! the generated tokens and text, why it stopped, usage, and when the first and last tokens came.

use std::time::{Duration, Instant};

use crate::engine::RequestStream;
use crate::request::{FinishReason, RequestOutput, TokenLogprob, Usage};

/// Everything one request produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub finish: FinishReason,
    pub stop_string: Option<String>,
    pub usage: Usage,
    /// From the call until the first generated token arrived (prefill and queueing).
    pub time_to_first_token: Duration,
    /// From the first generated token to the last.
    pub decode_time: Duration,
}

impl Completion {
    /// Prompt tokens per second of time to first token.
    pub fn prompt_tps(&self) -> f64 {
        self.usage.prompt_tokens as f64 / self.time_to_first_token.as_secs_f64().max(1e-9)
    }

    /// Generated tokens per second after the first (each needs one decode step).
    pub fn decode_tps(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Reads `stream` to its end, handing each piece of text to `on_text` as it arrives. Fails with
/// the engine's message if the request failed or the devices became unavailable.
pub fn complete(mut stream: RequestStream, on_text: &mut dyn FnMut(&str)) -> Result<Completion, String> {
    let start = Instant::now();
    let (mut first, mut last) = (None, start);
    let (mut tokens, mut text, mut logprobs) = (Vec::new(), String::new(), Vec::new());
    while let Some(out) = stream.blocking_next() {
        match out {
            RequestOutput::Delta {
                tokens: t,
                text: piece,
                logprobs: lp,
            } => {
                if !t.is_empty() {
                    last = Instant::now();
                    first.get_or_insert(last);
                }
                tokens.extend(t);
                logprobs.extend(lp);
                if !piece.is_empty() {
                    on_text(&piece);
                    text.push_str(&piece);
                }
            }
            RequestOutput::Finished {
                reason,
                stop_string,
                usage,
            } => {
                // No token at all (the first one ended generation): the end is the first token.
                let first = first.unwrap_or_else(Instant::now);
                let last = last.max(first);
                return Ok(Completion {
                    tokens,
                    text,
                    logprobs,
                    finish: reason,
                    stop_string,
                    usage,
                    time_to_first_token: first - start,
                    decode_time: last - first,
                });
            }
            RequestOutput::Failed(e) | RequestOutput::Unavailable(e) => return Err(e),
        }
    }
    Err("the engine stopped before the request finished".into())
}
