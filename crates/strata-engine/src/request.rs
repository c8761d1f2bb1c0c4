//! What callers send to the engine and what they get back: one request, its stream of outputs,
//! and the errors that refuse it. The HTTP server and the CLI speak only these types.

use crate::constraint::OutputConstraint;
use crate::sampler::SamplingParams;

/// One generation request, already tokenized.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Strings that end generation when they appear in the output text (not included in it).
    pub stop: Vec<String>,
    /// Token ids that end generation (not included in the output).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// `Some(k)`: report each generated token's log-probability and the `k` most likely
    /// alternatives (k may be 0).
    pub logprobs: Option<usize>,
    /// A grammar the output must match (structured output, forced tool calls).
    pub constraint: Option<OutputConstraint>,
    /// May draft and verify several tokens a step when the engine speculates (the API's
    /// `"speculative": false` opts out; the output is the same either way).
    pub speculative: bool,
}

impl GenerationRequest {
    /// A greedy request for `max_tokens` tokens with no stop strings.
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        GenerationRequest {
            prompt,
            sampling: SamplingParams::default(),
            max_tokens,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: None,
            constraint: None,
            speculative: true,
        }
    }
}

/// Most alternatives a request may ask for per token (OpenAI allows 20).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token, a stop token id or a stop string.
    Stop,
    /// `max_tokens` or the model length was reached.
    Length,
    /// The caller went away or the engine shut down.
    Abort,
}

impl FinishReason {
    /// The OpenAI spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// Log-probability of one generated token and its most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// `(token, logprob)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_prompt_tokens: usize,
}

/// One message on a request's stream.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestOutput {
    /// New tokens and the text they complete. `text` may be empty while a multi-byte
    /// character or a possible stop string is held back.
    Delta {
        tokens: Vec<u32>,
        text: String,
        logprobs: Vec<TokenLogprob>,
    },
    /// The last message of a stream that ended normally (or was aborted by the engine).
    Finished {
        reason: FinishReason,
        /// The stop string that ended it, if one did.
        stop_string: Option<String>,
        usage: Usage,
    },
    /// The engine failed while running this request; the stream ends here.
    Failed(String),
    /// The devices can no longer run the model (a GPU was lost or a collective hung); the
    /// stream ends here and the engine refuses every later request. Holds the executor's reason.
    Unavailable(String),
}

/// Why the engine refused a request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the request queue is full (at most {max} requests may wait, --max-queue); retry later")]
    QueueFull { max: usize },
    /// One call asked for more generations than the queue can ever hold: retrying cannot help.
    #[error("this request asks for {requests} generations (prompts x n) but at most {max_queue} may wait at once (--max-queue); send fewer prompts or a smaller n")]
    MoreThanQueue { requests: usize, max_queue: usize },
    #[error("this model's maximum context length is {max_model_len} tokens, but the prompt has {prompt} tokens")]
    PromptTooLong { prompt: usize, max_model_len: usize },
    #[error("{0}")]
    Invalid(String),
    #[error("the engine is not running: {0}")]
    EngineDead(String),
}
