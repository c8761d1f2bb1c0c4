//! The JSON types of the API, as OpenAI (and vLLM for its extras) spell them: request bodies,
//! responses, stream chunks. Their serde shape is the wire format and their schema the OpenAPI doc.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::params::GenerationFields;

/// `stop`: one string or a list of strings.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
pub struct StreamOptions {
    /// Send one more chunk before `[DONE]` with `usage` and an empty `choices`.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// A message's content: a string or a list of parts (only `text` parts are supported).
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a message's content.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ContentPart {
    /// Must be `text`.
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// One message of a chat request.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
pub struct ChatMessageIn {
    /// `system`, `developer` (treated as `system`), `user`, `assistant` or `tool`.
    pub role: String,
    /// May be null or absent only for an assistant message.
    #[serde(default)]
    pub content: Option<MessageContent>,
    /// Accepted and ignored (passed to the template on `tool` messages).
    #[serde(default)]
    pub name: Option<String>,
    /// The calls an assistant message made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// On a `tool` message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// A tool the model may call.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ChatTool {
    /// Must be `function`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDefinition,
}

/// A function the model may call.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct FunctionDefinition {
    /// 1 to 64 letters, digits, `_` or `-`.
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The JSON schema of the arguments object (absent: no arguments).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub parameters: Option<serde_json::Value>,
    /// Accepted; forced calls (`tool_choice` `required` or a function) always match the schema.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `tool_choice`: `none`, `auto` (the default with tools), `required`, or one function.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ToolChoice {
    Mode(String),
    Function(NamedToolChoice),
}

/// `tool_choice` naming the function to call.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct NamedToolChoice {
    /// Must be `function`.
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionName,
}

/// A function named by `tool_choice`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct FunctionName {
    pub name: String,
}

/// A call the assistant made.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, ToSchema)]
pub struct ToolCall {
    #[serde(default)]
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

/// The function a call names and its arguments.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments object as JSON text.
    pub arguments: String,
}

/// Defines a request type with its own fields plus the generation fields chat and completion
/// requests share, and `generation_fields()` to hand those to [`crate::params::plan`].
macro_rules! generation_request {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$field_meta:meta])* pub $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
        pub struct $name {
            /// The served model name (`--served-model-name`); absent means that model.
            pub model: Option<String>,
            $($(#[$field_meta])* pub $field: $ty,)*
            /// Sampling temperature in [0, 2] (default 1; 0, or below 1e-5, is greedy).
            pub temperature: Option<f64>,
            /// Nucleus sampling mass in (0, 1].
            pub top_p: Option<f64>,
            /// Keep the k most likely tokens; 0 or -1: no limit.
            pub top_k: Option<i64>,
            /// Drop tokens less likely than this fraction of the most likely one.
            pub min_p: Option<f64>,
            /// Choices to generate (per prompt), 1..=128.
            pub n: Option<u64>,
            /// Strings that end generation (not included in the output): at most 16, of at most
            /// 512 bytes each.
            pub stop: Option<StopField>,
            /// Token ids that end generation, at most 1024 (vLLM extra).
            pub stop_token_ids: Option<Vec<u32>>,
            /// Choice `i` samples with `seed + i`.
            pub seed: Option<i64>,
            /// In [-2, 2]: penalize tokens already generated, once.
            pub presence_penalty: Option<f64>,
            /// In [-2, 2]: penalize tokens already generated, per occurrence.
            pub frequency_penalty: Option<f64>,
            /// In [0.01, 10], 1 = off: penalize tokens of the prompt and output (vLLM extra).
            pub repetition_penalty: Option<f64>,
            /// Keep generating past end-of-generation tokens.
            pub ignore_eos: Option<bool>,
            /// `false`: never draft tokens for this request when the server speculates
            /// (`--speculative-ngram`, `--speculative-model`); the output is the same either way (default true).
            pub speculative: Option<bool>,
            /// Answer with a `text/event-stream` of chunks.
            pub stream: Option<bool>,
            pub stream_options: Option<StreamOptions>,
            /// Accepted and logged at debug level.
            pub user: Option<String>,
            /// Token id (a decimal string) -> bias in [-100, 100] added to its logit; at most 1024.
            pub logit_bias: Option<std::collections::BTreeMap<String, f64>>,
            /// `{"type": "text"}` (the default), `{"type": "json_object"}`, or
            /// `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}`.
            #[schema(value_type = Option<Object>)]
            pub response_format: Option<serde_json::Value>,
        }

        impl $name {
            /// The shared fields plus the ones each request spells its own way.
            pub fn generation_fields(
                &self,
                max_tokens: Option<(u64, &'static str)>,
                default_max_tokens: usize,
                logprobs: Option<(u64, &'static str)>,
            ) -> GenerationFields<'_> {
                GenerationFields {
                    max_tokens,
                    default_max_tokens,
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: self.top_k,
                    min_p: self.min_p,
                    n: self.n,
                    stop: self.stop.as_ref(),
                    stop_token_ids: self.stop_token_ids.as_deref(),
                    seed: self.seed,
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    repetition_penalty: self.repetition_penalty,
                    logprobs,
                    ignore_eos: self.ignore_eos,
                    speculative: self.speculative,
                    stream: self.stream,
                    stream_options: self.stream_options.as_ref(),
                    logit_bias: self.logit_bias.as_ref(),
                    response_format: self.response_format.as_ref(),
                }
            }
        }
    };
}

generation_request! {
    /// `POST /v1/chat/completions`. Unknown fields are ignored.
    #[derive(Default)]
    pub struct ChatCompletionRequest {
        pub messages: Vec<ChatMessageIn>,
        /// Most tokens to generate (default: up to `--max-model-len`).
        pub max_tokens: Option<u64>,
        /// OpenAI's newer name for `max_tokens`; wins when both are given.
        pub max_completion_tokens: Option<u64>,
        /// Return the log-probability of each generated token.
        pub logprobs: Option<bool>,
        /// Alternatives per token (0..=20); needs `logprobs: true`.
        pub top_logprobs: Option<u64>,
        /// Functions the model may call (at most 128).
        pub tools: Option<Vec<ChatTool>>,
        pub tool_choice: Option<ToolChoice>,
        /// Whether one answer may hold several calls (default true).
        pub parallel_tool_calls: Option<bool>,
    }
}

/// `prompt`: a string, a list of strings, a list of token ids or a list of such lists.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

generation_request! {
    /// `POST /v1/completions`. Unknown fields are ignored.
    pub struct CompletionRequest {
        pub prompt: PromptInput,
        /// Most tokens to generate (default 16, as OpenAI).
        pub max_tokens: Option<u64>,
        /// Alternatives per token (0..=20): returns log-probabilities when set.
        pub logprobs: Option<u64>,
        /// Only `false` is supported.
        pub echo: Option<bool>,
        /// Only absent or null is supported.
        pub suffix: Option<String>,
        /// Only 1 (or equal to `n`) is supported.
        pub best_of: Option<u64>,
    }
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct UsageInfo {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// Where the prompt tokens came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

/// The assistant's reply.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatMessageOut {
    pub role: String,
    /// Null when the reply is only tool calls.
    pub content: Option<String>,
    /// The calls the model made (absent when none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
}

/// One alternative token and its log-probability.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

/// A generated token with its log-probability and the most likely alternatives.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

/// `choices[].logprobs` of a chat response.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

/// One choice of a chat completion.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    /// `stop`, `length`, `tool_calls` or `abort` (the server shut down).
    pub finish_reason: String,
    /// The stop string that ended the choice, if one did (vLLM extra).
    pub stop_reason: Option<String>,
}

/// Response of a non-streaming chat completion.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionResponse {
    pub id: String,
    /// Always `chat.completion`.
    pub object: String,
    pub created: u64,
    pub model: String,
    /// Names the server build, model and numeric settings that produced the output.
    pub system_fingerprint: String,
    pub choices: Vec<ChatChoice>,
    pub usage: UsageInfo,
}

/// The new part of a streamed chat message.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct ChatDelta {
    /// `assistant`, in the first chunk of each choice only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// A piece of a streamed tool call: the first of a call has its `id`, `type` and name, the
/// later ones more of its arguments.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ToolCallDelta {
    pub index: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCallDelta,
}

/// The new part of a streamed call's function.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct FunctionCallDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// One choice inside a stream chunk.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatChunkChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    /// Null until the choice's last chunk.
    pub finish_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
}

/// One SSE `data:` object of a streamed chat completion.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    /// Always `chat.completion.chunk`.
    pub object: String,
    pub created: u64,
    pub model: String,
    /// Names the server build, model and numeric settings that produced the output.
    pub system_fingerprint: String,
    pub choices: Vec<ChatChunkChoice>,
    /// With `stream_options.include_usage`: null on every chunk but the last, which has the
    /// usage and no choices. Absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageInfo>>,
}

/// `choices[].logprobs` of a completion, in the legacy completions shape.
#[derive(Debug, Clone, Default, Serialize, Deserialize, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// For each token, its alternatives as `{token text: logprob}`.
    pub top_logprobs: Vec<std::collections::BTreeMap<String, f32>>,
    /// Character offset of each token in the choice's text.
    pub text_offset: Vec<usize>,
}

/// One choice of a completion (also the shape of a streamed completion's choices).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CompletionChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    /// Null in stream chunks before the choice's last.
    pub finish_reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_reason: Option<String>,
}

/// Response of `/v1/completions`; each streamed chunk has the same shape.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CompletionResponse {
    pub id: String,
    /// Always `text_completion`.
    pub object: String,
    pub created: u64,
    pub model: String,
    /// Names the server build, model and numeric settings that produced the output.
    pub system_fingerprint: String,
    pub choices: Vec<CompletionChoice>,
    /// Always present when not streaming; in a stream, as for chat chunks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<UsageInfo>>,
}

/// One model this server serves.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    /// Always `model`.
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// Longest prompt + output, in tokens.
    pub max_model_len: usize,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ModelList {
    /// Always `list`.
    pub object: String,
    pub data: Vec<ModelCard>,
}

/// `POST /tokenize`: a `prompt`, llama.cpp's `content`, or `messages` rendered by the chat
/// template.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    /// llama.cpp's name for a plain prompt; BOS only with `add_special: true`, as llama.cpp.
    #[serde(default)]
    pub content: Option<String>,
    /// Add BOS as the model asks (plain prompts; default true for `prompt`, false for `content`).
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// llama.cpp's name for `add_special_tokens`.
    #[serde(default)]
    pub add_special: Option<bool>,
    /// llama.cpp's token-and-piece answer; only `false` is supported.
    #[serde(default)]
    pub with_pieces: Option<bool>,
    #[serde(default)]
    pub messages: Option<Vec<ChatMessageIn>>,
    /// With `messages`: end with the assistant's turn opener (default true).
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
}

/// Response of `/tokenize`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct TokenizeResponse {
    pub count: usize,
    pub max_model_len: usize,
    pub tokens: Vec<u32>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct DetokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

/// Response of `/detokenize`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DetokenizeResponse {
    pub prompt: String,
}

/// Response of `/health`.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct HealthResponse {
    /// `ok`.
    pub status: String,
}
