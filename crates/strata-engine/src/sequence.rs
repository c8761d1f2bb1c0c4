//! The state of one request inside the engine: its tokens, KV block table, sampler, text decoder
//! and stop checks. The scheduler moves sequences between waiting and running; the engine loop feeds them tokens.

use std::time::Instant;

use strata_model::tokenizer::{IncrementalDecoder, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use crate::block_manager::BlockTable;
use crate::constraint::SequenceConstraint;
use crate::outbox::Outbox;
use crate::request::{FinishReason, GenerationRequest, RequestOutput, TokenLogprob, Usage};
use crate::sampler::Sampler;

/// Identifies a request for its whole life.
pub type SequenceId = u64;

/// One request being served.
pub struct Sequence {
    pub id: SequenceId,
    pub request: GenerationRequest,
    /// Generated tokens so far.
    pub output: Vec<u32>,
    /// Leading tokens (of prompt + output) whose KV is in the cache.
    pub num_computed: usize,
    /// Blocks holding this sequence's KV; empty while waiting.
    pub table: BlockTable,
    pub sampler: Sampler,
    /// Prompt tokens that came from the prefix cache at first admission.
    pub cached_prompt_tokens: usize,
    pub arrival: Instant,
    /// Times this sequence was preempted (its KV dropped, to be recomputed).
    pub preemptions: usize,
    /// Whether the scheduler has admitted it at least once (it left the request queue).
    pub admitted: bool,
    /// The grammar its output must match, if any.
    pub constraint: Option<SequenceConstraint>,
    /// Draft tokens proposed to follow its tokens, verified in its next step
    /// ([`crate::scheduler::ScheduledChunk::drafts`] of them).
    pub draft: Vec<u32>,
    /// Most draft tokens to propose next: after a rejection one more than were accepted, after
    /// a draft taken whole one more than it had; a sequence whose drafts keep failing verifies
    /// one draft token a step, not a whole draft.
    pub draft_limit: usize,
    text: TextTracker,
    /// The caller's stream; messages reach it through the [`Outbox`].
    tx: UnboundedSender<RequestOutput>,
    /// Token ids that end generation: stop ids, plus the model's end-of-generation ids unless ignored.
    stop_ids: Vec<u32>,
}

/// What happened to a sequence after it got a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    Running,
    Finished(FinishReason),
    /// The caller's end of the stream is gone: abort.
    Disconnected,
}

impl Sequence {
    pub fn new(
        id: SequenceId,
        request: GenerationRequest,
        tokenizer: &Tokenizer,
        tx: UnboundedSender<RequestOutput>,
    ) -> Sequence {
        let mut stop_ids = request.stop_token_ids.clone();
        if !request.ignore_eos {
            stop_ids.extend_from_slice(tokenizer.eog_ids());
        }
        Sequence {
            id,
            sampler: Sampler::new(request.sampling.clone()),
            text: TextTracker::new(tokenizer, &request.prompt, request.stop.clone()),
            output: Vec::new(),
            num_computed: 0,
            table: BlockTable::default(),
            cached_prompt_tokens: 0,
            arrival: Instant::now(),
            preemptions: 0,
            admitted: false,
            constraint: None,
            draft: Vec::new(),
            draft_limit: usize::MAX,
            tx,
            stop_ids,
            request,
        }
    }

    /// Prompt and generated tokens.
    pub fn num_tokens(&self) -> usize {
        self.request.prompt.len() + self.output.len()
    }

    /// Whether `more` generated tokens from now the sequence ends by length: its max_tokens, or
    /// `max_model_len` tokens in all. The one rule for ending by length (`more` 0: now).
    pub fn ends_by_length(&self, more: usize, max_model_len: usize) -> bool {
        self.output.len() + more >= self.request.max_tokens || self.num_tokens() + more >= max_model_len
    }

    /// Token at position `pos` of prompt + output.
    pub fn token(&self, pos: usize) -> u32 {
        let p = self.request.prompt.len();
        if pos < p {
            self.request.prompt[pos]
        } else {
            self.output[pos - p]
        }
    }

    /// Tokens `range` of prompt + output.
    pub fn tokens(&self, range: std::ops::Range<usize>) -> Vec<u32> {
        range.map(|p| self.token(p)).collect()
    }

    /// Whether it may draft tokens: the request allows it and no grammar constrains it (a
    /// grammar's mask is computed for one token at a time).
    pub fn speculates(&self) -> bool {
        self.request.speculative && self.constraint.is_none()
    }

    /// Draft tokens it can use in its next step, at most: the tokens it may still generate,
    /// less the one every step yields, and the positions left under `max_model_len`.
    pub fn draft_room(&self, max_model_len: usize) -> usize {
        let generate = self.request.max_tokens.saturating_sub(self.output.len() + 1);
        generate.min(max_model_len.saturating_sub(self.num_tokens()))
    }

    /// Tokens still to run through the model before the next sample (1 in decode).
    pub fn to_compute(&self) -> usize {
        self.num_tokens() - self.num_computed
    }

    /// Whether the caller stopped listening.
    pub fn is_disconnected(&self) -> bool {
        self.tx.is_closed()
    }

    /// Records a sampled token: stop checks, text, a delta posted for the stream, and the end by
    /// length (max_tokens, or `max_model_len` tokens in all).
    pub fn push_token(
        &mut self,
        token: u32,
        logprob: Option<TokenLogprob>,
        max_model_len: usize,
        outbox: &mut Outbox,
    ) -> Progress {
        if self.stop_ids.contains(&token) {
            return self.finish(FinishReason::Stop, None, outbox);
        }
        self.output.push(token);
        let (text, stop) = self.text.push(token);
        let delta = RequestOutput::Delta {
            tokens: vec![token],
            text,
            logprobs: logprob.into_iter().collect(),
        };
        if self.is_disconnected() {
            return Progress::Disconnected;
        }
        outbox.post(&self.tx, delta);
        if let Some(s) = stop {
            return self.finish(FinishReason::Stop, Some(s), outbox);
        }
        if self.ends_by_length(0, max_model_len) {
            return self.finish(FinishReason::Length, None, outbox);
        }
        Progress::Running
    }

    /// Flushes held-back text and posts the final message.
    pub fn finish(&mut self, reason: FinishReason, stop_string: Option<String>, outbox: &mut Outbox) -> Progress {
        if stop_string.is_none() {
            let rest = self.text.flush();
            if !rest.is_empty() {
                outbox.post(
                    &self.tx,
                    RequestOutput::Delta {
                        tokens: vec![],
                        text: rest,
                        logprobs: vec![],
                    },
                );
            }
        }
        let usage = Usage {
            prompt_tokens: self.request.prompt.len(),
            completion_tokens: self.output.len(),
            cached_prompt_tokens: self.cached_prompt_tokens,
        };
        outbox.post(
            &self.tx,
            RequestOutput::Finished {
                reason,
                stop_string,
                usage,
            },
        );
        Progress::Finished(reason)
    }

    /// Ends the stream with an engine error.
    pub fn fail(&self, message: &str, outbox: &mut Outbox) {
        outbox.post(&self.tx, RequestOutput::Failed(message.to_string()));
    }

    /// Ends the stream because the devices can no longer run the model.
    pub fn unavailable(&self, why: &str, outbox: &mut Outbox) {
        outbox.post(&self.tx, RequestOutput::Unavailable(why.to_string()));
    }
}

/// Output text of one sequence: incremental decoding, and stop strings found across token
/// boundaries. Text that could be the start of a stop string is held back until it cannot.
struct TextTracker {
    decoder: IncrementalDecoder,
    stops: Vec<String>,
    /// Decoded text not yet sent (kept while it may begin a stop string).
    pending: String,
    /// Longest stop string, in bytes.
    max_stop: usize,
}

impl TextTracker {
    fn new(tokenizer: &Tokenizer, prompt: &[u32], stops: Vec<String>) -> TextTracker {
        let stops: Vec<String> = stops.into_iter().filter(|s| !s.is_empty()).collect();
        TextTracker {
            decoder: IncrementalDecoder::new(tokenizer, prompt),
            max_stop: stops.iter().map(String::len).max().unwrap_or(0),
            stops,
            pending: String::new(),
        }
    }

    /// Adds a token; returns the text that is safe to send and the stop string if one matched
    /// (then the text is everything before it).
    fn push(&mut self, token: u32) -> (String, Option<String>) {
        if let Some(t) = self.decoder.push(token) {
            self.pending.push_str(&t);
        }
        if self.stops.is_empty() {
            return (std::mem::take(&mut self.pending), None);
        }
        let hit = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, s)) = hit {
            let s = s.clone();
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return (text, Some(s));
        }
        // Keep the longest tail that is a prefix of some stop string.
        let keep = (1..self.max_stop.min(self.pending.len() + 1))
            .rev()
            .find(|&n| {
                let cut = self.pending.len() - n;
                self.pending.is_char_boundary(cut) && self.stops.iter().any(|s| s.starts_with(&self.pending[cut..]))
            })
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let text = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (text, None)
    }

    /// Everything still held back (the sequence ended without a stop string).
    fn flush(&mut self) -> String {
        if let Some(t) = self.decoder.finish() {
            self.pending.push_str(&t);
        }
        std::mem::take(&mut self.pending)
    }
}
