//! The JSON types of `/v1/responses` as OpenAI spells them: the request with its input items,
//! text format and function tools, the response object, and the stream's events.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

use crate::error::ErrorDetail;

/// `POST /v1/responses`: the stateless subset of OpenAI's Responses API, served by the chat
/// path. Unknown fields are ignored, except the chat request's sampling extras (`top_k`,
/// `min_p`, `seed`, `stop`, `stop_token_ids`, `presence_penalty`, `frequency_penalty`,
/// `repetition_penalty`, `ignore_eos`, `speculative`, `logit_bias`), which are passed to it as they are.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct ResponsesRequest {
    /// The served model name; absent means that model.
    pub model: Option<String>,
    pub input: ResponsesInput,
    /// A system message put before the input.
    pub instructions: Option<String>,
    /// Most tokens to generate (default: up to `--max-model-len`); reaching it makes the
    /// response `incomplete`.
    pub max_output_tokens: Option<u64>,
    /// Sampling temperature in [0, 100] (default 1; 0 is greedy).
    pub temperature: Option<f64>,
    /// Nucleus sampling mass in (0, 1].
    pub top_p: Option<f64>,
    /// Answer with a `text/event-stream` of response events.
    pub stream: Option<bool>,
    /// The output's format: plain text, any JSON object, or JSON matching a schema.
    pub text: Option<TextConfig>,
    /// Functions the model may call.
    pub tools: Option<Vec<ResponsesTool>>,
    /// `none`, `auto`, `required` or `{"type": "function", "name": ...}`.
    #[schema(value_type = Object)]
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Echoed in the response: at most 16 pairs, keys of at most 64 characters, values of at
    /// most 512.
    pub metadata: Option<BTreeMap<String, String>>,
    /// Accepted and logged at debug level.
    pub user: Option<String>,
    /// Only `false`: strata keeps no responses.
    pub store: Option<bool>,
    /// Refused: strata keeps no responses to continue from; send the whole conversation as `input`.
    pub previous_response_id: Option<String>,
    /// Refused: strata keeps no conversations.
    #[schema(value_type = Object)]
    pub conversation: Option<Value>,
    /// Only `false`: a background response would have to be stored to be polled.
    pub background: Option<bool>,
    /// Every other field; only the chat request's sampling extras are used.
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// `input`: a string (one user message) or a list of items.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(untagged)]
pub enum ResponsesInput {
    Text(String),
    Items(Vec<InputItem>),
}

// By hand rather than `untagged`, so that an error inside an item names it (`input[2].role`).
impl<'de> Deserialize<'de> for ResponsesInput {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct InputVisitor;

        impl<'de> Visitor<'de> for InputVisitor {
            type Value = ResponsesInput;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string or a list of input items like {\"role\": \"user\", \"content\": \"...\"}")
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(ResponsesInput::Text(v.to_string()))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(ResponsesInput::Items(items))
            }
        }

        deserializer.deserialize_any(InputVisitor)
    }
}

/// One input item: a message (`type` `message` or absent, with `role` and `content`), a
/// `function_call` the model made earlier, or the `function_call_output` answering it.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct InputItem {
    /// `message` (the default), `function_call` or `function_call_output`.
    #[serde(rename = "type")]
    pub kind: Option<String>,
    /// A message's `user`, `system`, `developer` or `assistant`.
    pub role: Option<String>,
    /// A message's text, or its `input_text` / `output_text` parts.
    pub content: Option<InputContent>,
    /// A function call's id, which its output repeats.
    pub call_id: Option<String>,
    /// A function call's function.
    pub name: Option<String>,
    /// A function call's arguments, as a JSON text.
    pub arguments: Option<String>,
    /// A function call output's result.
    pub output: Option<InputContent>,
}

/// Text, or a list of text parts.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum InputContent {
    Text(String),
    Parts(Vec<InputPart>),
}

/// One content part; only text parts are supported.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
pub struct InputPart {
    /// `input_text` or `output_text`.
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// `text`: the output's format.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema)]
pub struct TextConfig {
    /// Absent means `{"type": "text"}`.
    pub format: Option<TextFormat>,
    /// Accepted and echoed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verbosity: Option<String>,
}

/// `text.format`; unlike chat's `response_format`, a schema's fields sit in it directly.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum TextFormat {
    Text,
    JsonObject,
    JsonSchema {
        name: String,
        #[schema(value_type = Object)]
        schema: Value,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        description: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strict: Option<bool>,
    },
}

/// A tool, in the Responses shape (its fields flat, not under `function`).
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponsesTool {
    Function {
        name: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        description: Option<String>,
        /// The arguments' JSON schema.
        #[serde(default)]
        #[schema(value_type = Object)]
        parameters: Option<Value>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strict: Option<bool>,
    },
}

/// A response: the request's settings echoed, the output items and the token counts.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ResponseObject {
    pub id: String,
    /// Always `response`.
    pub object: String,
    pub created_at: u64,
    /// `in_progress` (stream events before the end), `completed`, `incomplete` (the output
    /// reached `max_output_tokens`) or `failed` (a stream that failed after it started).
    pub status: String,
    pub error: Option<ResponseError>,
    pub incomplete_details: Option<IncompleteDetails>,
    pub model: String,
    pub output: Vec<OutputItem>,
    /// Null until the response is done.
    pub usage: Option<ResponseUsage>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u64>,
    pub temperature: f64,
    pub top_p: f64,
    pub parallel_tool_calls: bool,
    #[schema(value_type = Object)]
    pub tool_choice: Value,
    pub tools: Vec<ResponsesTool>,
    pub text: TextConfig,
    pub metadata: BTreeMap<String, String>,
    pub user: Option<String>,
    /// Always `false`.
    pub store: bool,
}

/// Why a response failed.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ResponseError {
    /// `server_error`.
    pub code: String,
    pub message: String,
}

/// Why a response is incomplete.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct IncompleteDetails {
    /// `max_output_tokens`.
    pub reason: String,
}

/// One output item.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    /// The assistant's text.
    Message {
        id: String,
        /// `in_progress`, `completed` or `incomplete`.
        status: String,
        /// Always `assistant`.
        role: String,
        content: Vec<OutputText>,
    },
    /// A call the client should make, answering with a `function_call_output` item.
    FunctionCall {
        id: String,
        call_id: String,
        name: String,
        /// The arguments as a JSON text.
        arguments: String,
        status: String,
    },
}

/// The text of a message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OutputText {
    /// Always `output_text`.
    #[serde(rename = "type")]
    pub kind: String,
    pub text: String,
    /// Always empty.
    #[schema(value_type = Vec<Object>)]
    pub annotations: Vec<Value>,
}

impl OutputText {
    pub fn new(text: String) -> Self {
        OutputText {
            kind: "output_text".into(),
            text,
            annotations: Vec::new(),
        }
    }
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ResponseUsage {
    pub input_tokens: usize,
    pub input_tokens_details: InputTokensDetails,
    pub output_tokens: usize,
    pub output_tokens_details: OutputTokensDetails,
    pub total_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct InputTokensDetails {
    /// Input tokens whose KV came from the prefix cache.
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct OutputTokensDetails {
    /// Always 0.
    pub reasoning_tokens: usize,
}

/// One SSE event of a streamed response; its `event:` line repeats `type`.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ResponseStreamEvent {
    /// 0 for the first event of a response, one more for each next one.
    pub sequence_number: u64,
    #[serde(flatten)]
    pub event: StreamEvent,
}

/// What a stream event says, tagged by `type`.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(tag = "type")]
pub enum StreamEvent {
    #[serde(rename = "response.created")]
    Created { response: ResponseObject },
    #[serde(rename = "response.in_progress")]
    InProgress { response: ResponseObject },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded { output_index: usize, item: OutputItem },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: OutputText,
    },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        item_id: String,
        output_index: usize,
        content_index: usize,
        delta: String,
        /// Always empty.
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        text: String,
        /// Always empty.
        #[schema(value_type = Vec<Object>)]
        logprobs: Vec<Value>,
    },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        item_id: String,
        output_index: usize,
        content_index: usize,
        part: OutputText,
    },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        item_id: String,
        output_index: usize,
        delta: String,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        item_id: String,
        output_index: usize,
        name: String,
        arguments: String,
    },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone { output_index: usize, item: OutputItem },
    /// The last event of a response that ended normally.
    #[serde(rename = "response.completed")]
    Completed { response: ResponseObject },
    /// The last event of a response that reached `max_output_tokens`.
    #[serde(rename = "response.incomplete")]
    Incomplete { response: ResponseObject },
    /// Generation failed after the stream started; `response.failed` follows.
    #[serde(rename = "error")]
    Error {
        code: Option<String>,
        message: String,
        param: Option<String>,
    },
    /// The last event of a response whose generation failed.
    #[serde(rename = "response.failed")]
    Failed { response: ResponseObject },
}

impl StreamEvent {
    /// The `error` event of an error the chat path reported.
    pub fn error(detail: &ErrorDetail) -> Self {
        StreamEvent::Error {
            code: detail.code.clone(),
            message: detail.message.clone(),
            param: detail.param.clone(),
        }
    }
}
