//! `POST /v1/chat/completions`: messages (and tools) through the chat template, n choices, a JSON
//! reply or an SSE stream of `chat.completion.chunk` objects exactly as OpenAI sends them.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::body::parse_json;
use crate::error::{ApiError, GenerationErrors, RequestErrors};
use crate::generation::{chat_logprobs, respond, ChoiceResult, ChunkFormat, ResponseMeta};
use crate::params::{plan, GenerationPlan};
use crate::prompt::{chat_messages, prompt_error, PromptContext};
use crate::protocol::{
    ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, ChatDelta,
    ChatLogprobs, ChatMessageIn, ChatMessageOut, ChatTool, FunctionCall, FunctionCallDelta, ToolCall, ToolCallDelta,
    ToolChoice, UsageInfo,
};
use crate::tool_calls::{call_grammar, CallableFunction, ParsedOutput, ToolCallParser, ToolEvent, ToolFormat};
use crate::AppState;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};
use strata_engine::{FinishReason, OutputConstraint, TokenLogprob};
use strata_model::chat_template::{python_json, ChatTemplate};

/// Creates a chat completion.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    tag = "openai",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion; with `stream: true` a `text/event-stream` of `data: <ChatCompletionChunk>` events (the first of each choice carries the role, tool calls come as `tool_calls` deltas, the last carries its `finish_reason`, then the usage chunk when asked for) ending with `data: [DONE]`, and `: keep-alive` comments while nothing is generated",
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
    let PreparedChat { prompt, plan, tools } = prepare_chat(&req, &state.prompt_context())?;
    if let Some(user) = &req.user {
        tracing::debug!(user, prompt_tokens = prompt.len(), "chat completion");
    }
    let meta = ResponseMeta::new(&state, "chatcmpl", &plan);
    let stream_tools = tools.clone();
    respond(
        Arc::clone(&state),
        &[prompt],
        &plan,
        "messages",
        meta,
        arrival,
        move |meta| ChatChunks::new(meta, stream_tools),
        move |meta, results, usage| reply(meta, results, usage, &tools),
    )
    .await
}

/// A checked chat request: its prompt, its generation and how to read its output for tool calls.
#[derive(Debug, Clone)]
pub struct PreparedChat {
    pub prompt: Vec<u32>,
    pub plan: GenerationPlan,
    pub tools: ToolPlan,
}

/// Checks a chat request and builds its prompt ids: everything short of submitting it.
pub fn prepare(req: &ChatCompletionRequest, ctx: &PromptContext) -> Result<(Vec<u32>, GenerationPlan), ApiError> {
    prepare_chat(req, ctx).map(|p| (p.prompt, p.plan))
}

/// [`prepare`], keeping the tool plan that reads calls out of the output.
pub fn prepare_chat(req: &ChatCompletionRequest, ctx: &PromptContext) -> Result<PreparedChat, ApiError> {
    let tools = plan_tools(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
        ctx,
    )?;
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
    let mut plan = plan(&fields, ctx.tokenizer.vocab_size(), ctx.grammar)?;
    if let Some(constraint) = &tools.constraint {
        if plan.template.constraint.is_some() {
            return Err(ApiError::invalid_field(
                "tool_choice",
                "a forced `tool_choice` cannot be combined with `response_format`",
            ));
        }
        plan.template.constraint = Some(constraint.clone());
    }
    let (messages, extra) = template_input(&req.messages, "messages", &tools, ctx.template)?;
    let prompt = ctx
        .limit
        .chat_ids_with(ctx.tokenizer, ctx.template, &messages, true, &extra)
        .map_err(|e| prompt_error(e, "messages"))?;
    ctx.limit.check_ids(prompt.len(), "messages")?;
    plan.check_room(prompt.len(), ctx.limit.max_model_len, "messages")?;
    Ok(PreparedChat { prompt, plan, tools })
}

/// Most tools one request may declare (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// What a chat request's `tools`, `tool_choice` and `parallel_tool_calls` ask for.
#[derive(Debug, Clone)]
pub struct ToolPlan {
    /// The tools shown to the model and read out of its output (none with `tool_choice: "none"`).
    pub tools: Vec<ChatTool>,
    /// How the model writes calls.
    pub format: ToolFormat,
    /// Whether one answer may hold several calls.
    pub parallel: bool,
    /// The grammar that forces calls (`tool_choice` `required` or a named function).
    pub constraint: Option<OutputConstraint>,
}

impl ToolPlan {
    /// No tools: output is all content.
    pub fn none() -> ToolPlan {
        ToolPlan {
            tools: Vec::new(),
            format: ToolFormat::Hermes,
            parallel: true,
            constraint: None,
        }
    }

    fn parser(&self, streaming: bool) -> Option<ToolCallParser> {
        if self.tools.is_empty() {
            return None;
        }
        let names = self.tools.iter().map(|t| t.function.name.clone()).collect();
        Some(ToolCallParser::new(self.format, names, self.parallel, streaming))
    }

    /// A parser for a streamed output, or `None` when calls are not read.
    pub fn stream_parser(&self) -> Option<ToolCallParser> {
        self.parser(true)
    }

    /// Splits a finished output into its content and its calls.
    pub fn parse(&self, text: &str) -> ParsedOutput {
        match self.parser(false) {
            Some(p) => p.parse(text),
            None => ParsedOutput {
                content: Some(text.to_string()),
                calls: Vec::new(),
            },
        }
    }
}

/// OpenAI's rule for function names: 1 to 64 letters, digits, `_` or `-`.
fn valid_function_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Checks `tools`, `tool_choice` and `parallel_tool_calls`, and works out how the model is shown
/// the tools, how its calls are read and (for forced calls) the grammar its output must match,
/// checked to compile against the vocabulary.
pub fn plan_tools(
    tools: Option<&[ChatTool]>,
    choice: Option<&ToolChoice>,
    parallel: Option<bool>,
    ctx: &PromptContext,
) -> Result<ToolPlan, ApiError> {
    let tools = tools.unwrap_or_default();
    if tools.len() > MAX_TOOLS {
        return Err(ApiError::invalid_field(
            "tools",
            format!("`tools` may hold at most {MAX_TOOLS} tools, got {}", tools.len()),
        ));
    }
    for (i, tool) in tools.iter().enumerate() {
        if tool.kind != "function" {
            return Err(ApiError::invalid_field(
                format!("tools[{i}].type"),
                format!("`tools[{i}].type` is `{}`; only `function` is supported", tool.kind),
            ));
        }
        let name = &tool.function.name;
        let param = format!("tools[{i}].function.name");
        if !valid_function_name(name) {
            return Err(ApiError::invalid_field(
                param.clone(),
                format!("`{param}` must be 1 to 64 letters, digits, `_` or `-`, got `{name}`"),
            ));
        }
        if tools[..i].iter().any(|t| &t.function.name == name) {
            return Err(ApiError::invalid_field(
                param.clone(),
                format!("`{param}`: two tools are named `{name}`"),
            ));
        }
        if let Some(p) = &tool.function.parameters {
            if !p.is_object() {
                let param = format!("tools[{i}].function.parameters");
                return Err(ApiError::invalid_field(
                    param.clone(),
                    format!("`{param}` must be a JSON schema object"),
                ));
            }
        }
    }
    if choice.is_some() && tools.is_empty() {
        return Err(ApiError::invalid_field(
            "tool_choice",
            "`tool_choice` is only allowed when `tools` are given",
        ));
    }
    let forced: Option<Vec<&ChatTool>> = match choice {
        None => None,
        Some(ToolChoice::Mode(mode)) => match mode.as_str() {
            "none" => return Ok(ToolPlan::none()),
            "auto" => None,
            "required" => Some(tools.iter().collect()),
            other => {
                return Err(ApiError::invalid_field(
                    "tool_choice",
                    format!(
                        "`tool_choice` is `{other}`; use `none`, `auto`, `required` or \
                         {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                    ),
                ))
            }
        },
        Some(ToolChoice::Function(named)) => {
            if named.kind != "function" {
                return Err(ApiError::invalid_field(
                    "tool_choice.type",
                    format!("`tool_choice.type` is `{}`; only `function` is supported", named.kind),
                ));
            }
            let name = &named.function.name;
            match tools.iter().find(|t| &t.function.name == name) {
                Some(t) => Some(vec![t]),
                None => {
                    return Err(ApiError::invalid_field(
                        "tool_choice.function.name",
                        format!("`tool_choice.function.name` is `{name}`, which is not one of `tools`"),
                    ))
                }
            }
        }
    };
    let parallel = parallel.unwrap_or(true);
    // The built-in rendering (for templates that do not render tools) asks for Hermes calls.
    let format = if ctx.template.renders_tools() {
        ToolFormat::from_template(ctx.template.source())
    } else {
        ToolFormat::Hermes
    };
    let grammar = |callable: &[&ChatTool]| {
        let functions: Vec<CallableFunction> = callable
            .iter()
            .map(|t| CallableFunction {
                name: &t.function.name,
                parameters: t.function.parameters.as_ref(),
            })
            .collect();
        OutputConstraint::Lark(call_grammar(format, &functions, parallel, ctx.tokenizer))
    };
    let constraint = match forced {
        None => None,
        Some(callable) => {
            let constraint = grammar(&callable);
            if let Err(refused) = ctx.grammar.check(&constraint, "tool_choice") {
                // Name the function whose schema cannot be compiled, when one alone cannot.
                for (i, tool) in tools.iter().enumerate() {
                    if callable.iter().any(|c| c.function.name == tool.function.name) {
                        ctx.grammar
                            .check(&grammar(&[tool]), &format!("tools[{i}].function.parameters"))?;
                    }
                }
                return Err(refused);
            }
            Some(constraint)
        }
    };
    Ok(ToolPlan {
        tools: tools.to_vec(),
        format,
        parallel,
        constraint,
    })
}

/// The built-in description of tools, for templates that do not render them (Qwen2.5's words).
fn tools_system_block(tools: &[ChatTool]) -> String {
    let mut block = String::from(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
         You are provided with function signatures within <tools></tools> XML tags:\n<tools>",
    );
    for tool in tools {
        block.push('\n');
        block.push_str(&python_json(tool));
    }
    block.push_str(
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments \
         within <tool_call></tool_call> XML tags:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    block
}

/// A call's arguments as the template sees them: the parsed object (as vLLM and transformers
/// pass them), or the text when it is not JSON.
fn arguments_value(call: &ToolCall) -> Value {
    serde_json::from_str(&call.function.arguments).unwrap_or_else(|_| Value::from(call.function.arguments.clone()))
}

/// The messages and extra variables a chat template renders: tools and tool history through the
/// template when it handles them, else in the built-in Hermes form (a `# Tools` system block,
/// `<tool_call>` blocks in assistant turns, `<tool_response>` blocks in a user turn).
pub fn template_input(
    messages: &[ChatMessageIn],
    field: &str,
    tools: &ToolPlan,
    template: &ChatTemplate,
) -> Result<(Vec<Value>, Map<String, Value>), ApiError> {
    let texts = chat_messages(messages, field)?;
    let native_calls = template.renders_tool_calls();
    let mut out: Vec<Value> = Vec::with_capacity(messages.len() + 1);
    let mut previous_was_tool = false;
    for (i, (m, text)) in messages.iter().zip(&texts).enumerate() {
        let calls = match text.role.as_str() {
            "assistant" => m.tool_calls.as_deref().unwrap_or_default(),
            _ => &[],
        };
        for (j, call) in calls.iter().enumerate() {
            if call.function.name.is_empty() {
                let param = format!("{field}[{i}].tool_calls[{j}].function.name");
                return Err(ApiError::invalid_field(
                    param.clone(),
                    format!("`{param}` must not be empty"),
                ));
            }
        }
        let is_tool = text.role == "tool";
        let message = match (is_tool, native_calls) {
            (true, true) => {
                let mut message = json!({"role": "tool", "content": text.content});
                if let Some(id) = &m.tool_call_id {
                    message["tool_call_id"] = Value::from(id.clone());
                }
                if let Some(name) = &m.name {
                    message["name"] = Value::from(name.clone());
                }
                message
            }
            (true, false) => {
                let response = format!("<tool_response>\n{}\n</tool_response>", text.content);
                // Consecutive tool results share one user turn.
                if previous_was_tool {
                    if let Some(Value::String(content)) = out.last_mut().and_then(|m| m.get_mut("content")) {
                        content.push('\n');
                        content.push_str(&response);
                        continue;
                    }
                }
                json!({"role": "user", "content": response})
            }
            (false, _) if calls.is_empty() => json!({"role": text.role, "content": text.content}),
            (false, true) => {
                let calls: Vec<Value> = calls
                    .iter()
                    .map(|c| {
                        json!({"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": arguments_value(c)}})
                    })
                    .collect();
                json!({"role": "assistant", "content": text.content, "tool_calls": calls})
            }
            (false, false) => {
                let blocks: Vec<String> = calls
                    .iter()
                    .map(|c| {
                        let call = json!({"name": c.function.name, "arguments": arguments_value(c)});
                        format!("<tool_call>\n{}\n</tool_call>", python_json(&call))
                    })
                    .collect();
                let mut content = text.content.clone();
                if !content.is_empty() {
                    content.push('\n');
                }
                content.push_str(&blocks.join("\n"));
                json!({"role": "assistant", "content": content})
            }
        };
        previous_was_tool = is_tool && !native_calls;
        out.push(message);
    }
    let mut extra = Map::new();
    if !tools.tools.is_empty() {
        if template.renders_tools() {
            let listed = tools.tools.iter().map(|t| serde_json::to_value(t).unwrap_or_default());
            extra.insert("tools".into(), Value::Array(listed.collect()));
        } else {
            let block = tools_system_block(&tools.tools);
            match out.first_mut() {
                Some(first) if first["role"] == "system" => {
                    let system = first["content"].as_str().unwrap_or_default();
                    first["content"] = Value::from(format!("{system}\n\n{block}"));
                }
                _ => out.insert(0, json!({"role": "system", "content": block})),
            }
        }
    }
    Ok((out, extra))
}

/// `finish_reason` of a choice: `tool_calls` when it stopped after making calls.
fn finish_reason(reason: FinishReason, calls: usize) -> &'static str {
    match reason {
        FinishReason::Stop if calls > 0 => "tool_calls",
        other => other.as_str(),
    }
}

/// Parsed calls in the response's shape.
fn response_calls(parsed: ParsedOutput) -> (Option<String>, Vec<ToolCall>) {
    let calls = parsed
        .calls
        .into_iter()
        .map(|c| ToolCall {
            id: c.id,
            kind: "function".into(),
            function: FunctionCall {
                name: c.name,
                arguments: c.arguments,
            },
        })
        .collect();
    (parsed.content, calls)
}

/// The JSON answer of a non-streamed chat completion.
fn reply(meta: ResponseMeta, results: Vec<ChoiceResult>, usage: UsageInfo, tools: &ToolPlan) -> Response {
    let tokenizer = meta.engine.tokenizer();
    let choices = results
        .into_iter()
        .map(|r| {
            let (content, tool_calls) = response_calls(tools.parse(&r.text));
            ChatChoice {
                index: r.index,
                finish_reason: finish_reason(r.finish, tool_calls.len()).into(),
                message: ChatMessageOut {
                    role: "assistant".into(),
                    content,
                    tool_calls,
                },
                logprobs: meta.logprobs.then(|| chat_logprobs(tokenizer, &r.logprobs)),
                stop_reason: r.stop_string,
            }
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

/// Writes `chat.completion.chunk` objects; with tools, each choice's text goes through its own
/// tool-call parser and comes out as content and `tool_calls` deltas.
struct ChatChunks {
    meta: ResponseMeta,
    tools: ToolPlan,
    parsers: Mutex<HashMap<usize, ToolCallParser>>,
}

impl ChatChunks {
    fn new(meta: ResponseMeta, tools: ToolPlan) -> Self {
        ChatChunks {
            meta,
            tools,
            parsers: Mutex::new(HashMap::new()),
        }
    }

    fn chunk(
        &self,
        index: Option<usize>,
        delta: ChatDelta,
        finish: Option<(&str, Option<String>)>,
        logprobs: Option<ChatLogprobs>,
        usage: Option<UsageInfo>,
    ) -> String {
        let meta = &self.meta;
        let (finish_reason, stop_reason) = match finish {
            Some((reason, stop)) => (Some(reason.to_string()), stop),
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

    /// Runs `f` on choice `index`'s parser; `None` when the request reads no calls.
    fn with_parser<T>(&self, index: usize, f: impl FnOnce(&mut ToolCallParser) -> T) -> Option<T> {
        let mut parsers = self.parsers.lock().unwrap_or_else(|e| e.into_inner());
        let parser = match parsers.entry(index) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => e.insert(self.tools.stream_parser()?),
        };
        Some(f(parser))
    }
}

/// A parser event as a stream delta.
fn event_delta(event: ToolEvent) -> ChatDelta {
    let call = |index, id: Option<String>, name: Option<String>, arguments: String| ChatDelta {
        tool_calls: Some(vec![ToolCallDelta {
            index,
            kind: id.as_ref().map(|_| "function".to_string()),
            id,
            function: FunctionCallDelta {
                name,
                arguments: Some(arguments),
            },
        }]),
        ..ChatDelta::default()
    };
    match event {
        ToolEvent::Content(text) => ChatDelta {
            content: Some(text),
            ..ChatDelta::default()
        },
        ToolEvent::CallStart { index, id, name } => call(index, Some(id), Some(name), String::new()),
        ToolEvent::Arguments { index, text } => call(index, None, None, text),
    }
}

impl ChunkFormat for ChatChunks {
    fn meta(&self) -> &ResponseMeta {
        &self.meta
    }

    fn opening(&self, index: usize) -> Option<String> {
        let delta = ChatDelta {
            role: Some("assistant".into()),
            content: Some(String::new()),
            ..ChatDelta::default()
        };
        Some(self.chunk(Some(index), delta, None, None, None))
    }

    fn delta(&self, index: usize, text: String, logprobs: &[TokenLogprob], _offset: usize) -> String {
        let delta = ChatDelta {
            content: Some(text),
            ..ChatDelta::default()
        };
        let logprobs = self
            .meta
            .logprobs
            .then(|| chat_logprobs(self.meta.engine.tokenizer(), logprobs));
        self.chunk(Some(index), delta, None, logprobs, None)
    }

    fn deltas(&self, index: usize, text: String, logprobs: &[TokenLogprob], offset: usize) -> Vec<String> {
        let Some(events) = self.with_parser(index, |p| p.push(&text)) else {
            return vec![self.delta(index, text, logprobs, offset)];
        };
        let mut logprobs =
            (self.meta.logprobs && !logprobs.is_empty()).then(|| chat_logprobs(self.meta.engine.tokenizer(), logprobs));
        let mut chunks: Vec<String> = events
            .into_iter()
            .map(|e| self.chunk(Some(index), event_delta(e), None, logprobs.take(), None))
            .collect();
        // Held-back text still has its log-probabilities sent.
        if let Some(lp) = logprobs {
            chunks.push(self.chunk(Some(index), ChatDelta::default(), None, Some(lp), None));
        }
        chunks
    }

    fn finish(&self, index: usize, reason: FinishReason, stop_string: Option<String>) -> String {
        self.chunk(
            Some(index),
            ChatDelta::default(),
            Some((reason.as_str(), stop_string)),
            None,
            None,
        )
    }

    fn finishing(&self, index: usize, reason: FinishReason, stop_string: Option<String>) -> Vec<String> {
        let Some((events, calls)) = self.with_parser(index, |p| (p.finish(), p.calls())) else {
            return vec![self.finish(index, reason, stop_string)];
        };
        let mut chunks: Vec<String> = events
            .into_iter()
            .map(|e| self.chunk(Some(index), event_delta(e), None, None, None))
            .collect();
        let finish = Some((finish_reason(reason, calls), stop_string));
        chunks.push(self.chunk(Some(index), ChatDelta::default(), finish, None, None));
        chunks
    }

    fn usage(&self, usage: UsageInfo) -> String {
        self.chunk(None, ChatDelta::default(), None, None, Some(usage))
    }
}

#[cfg(test)]
mod tests {
    use std::sync::OnceLock;

    use strata_model::loader::{default_model_path, load_text};
    use strata_model::tokenizer::Tokenizer;

    use super::*;
    use crate::prompt::PromptLimit;
    use crate::response_format::GrammarCheck;

    /// A representative Qwen2.5 template: tools in the system turn, `<tool_call>` blocks in
    /// assistant turns, tool results as `<tool_response>` blocks in a user turn.
    const QWEN_STYLE: &str = r#"{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
{{- "\n\n# Tools\n\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nReturn each call within <tool_call></tool_call> XML tags.<|im_end|>\n" }}
{%- elif messages[0]['role'] == 'system' %}
{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "assistant" and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == "assistant" %}
{{- '<|im_start|>assistant' }}{%- if message.content %}{{- '\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\n<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}{{- tool_call.arguments | tojson }}{{- '}\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\n' }}
{%- elif message.role == "tool" %}
{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"#;

    fn model_text() -> &'static (Tokenizer, ChatTemplate) {
        static TEXT: OnceLock<(Tokenizer, ChatTemplate)> = OnceLock::new();
        TEXT.get_or_init(|| load_text(&default_model_path()).expect("default model (run `make fetch`)"))
    }

    fn request(body: Value) -> ChatCompletionRequest {
        serde_json::from_value(body).expect("request parses")
    }

    fn weather_tools() -> Value {
        json!([
            {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time"}}
        ])
    }

    fn plan_for(req: &ChatCompletionRequest, template: &ChatTemplate) -> Result<ToolPlan, ApiError> {
        static GRAMMAR: OnceLock<GrammarCheck> = OnceLock::new();
        let tokenizer = &model_text().0;
        let ctx = PromptContext {
            tokenizer,
            template,
            limit: PromptLimit::NONE,
            max_queue: 1,
            grammar: GRAMMAR.get_or_init(|| GrammarCheck::for_tokenizer(tokenizer)),
        };
        plan_tools(
            req.tools.as_deref(),
            req.tool_choice.as_ref(),
            req.parallel_tool_calls,
            &ctx,
        )
    }

    /// A conversation with a call, its two results and a system message.
    fn history() -> Value {
        json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris and the time?"},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "noon"}
        ])
    }

    fn rendered(req: &ChatCompletionRequest, template: &ChatTemplate) -> String {
        let plan = plan_for(req, template).expect("tools plan");
        let (messages, extra) = template_input(&req.messages, "messages", &plan, template).expect("messages");
        template.render_with(&messages, true, &extra).expect("renders")
    }

    #[test]
    fn bad_tool_requests_name_the_field() {
        let chatml = ChatTemplate::chatml("", "");
        let tool = |name: &str| json!({"type": "function", "function": {"name": name}});
        let too_many: Vec<Value> = (0..=MAX_TOOLS).map(|i| tool(&format!("f{i}"))).collect();
        for (extra, param) in [
            (
                json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
                "tools[0].type",
            ),
            (json!({"tools": [tool("get weather")]}), "tools[0].function.name"),
            (json!({"tools": [tool("")]}), "tools[0].function.name"),
            (json!({"tools": [tool(&"a".repeat(65))]}), "tools[0].function.name"),
            (json!({"tools": [tool("f"), tool("f")]}), "tools[1].function.name"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
                "tools[0].function.parameters",
            ),
            (json!({"tools": too_many}), "tools"),
            (json!({"tools": [tool("f")], "tool_choice": "sometimes"}), "tool_choice"),
            (
                json!({"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                "tool_choice.function.name",
            ),
            (
                json!({"tools": [tool("f")], "tool_choice": {"type": "tool", "function": {"name": "f"}}}),
                "tool_choice.type",
            ),
            (json!({"tool_choice": "auto"}), "tool_choice"),
            // A schema the grammar compiler cannot use, when calls are forced.
            (
                json!({"tools": [tool("f"), {"type": "function", "function": {"name": "g",
                    "parameters": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}],
                    "tool_choice": "required"}),
                "tools[1].function.parameters",
            ),
        ] {
            let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            let e = plan_for(&request(body.clone()), &chatml).expect_err(&body.to_string());
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
            assert!(e.message.contains(param), "{}", e.message);
        }
        // An assistant call without a name.
        let req = request(json!({"messages": [{"role": "assistant", "content": null,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "", "arguments": "{}"}}]}]}));
        let e = template_input(&req.messages, "messages", &ToolPlan::none(), &chatml).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].tool_calls[0].function.name"));
    }

    #[test]
    fn tool_choice_decides_what_is_shown_read_and_forced() {
        let chatml = ChatTemplate::chatml("", "");
        let with = |extra: Value| {
            let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "tools": weather_tools()});
            body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
            plan_for(&request(body), &chatml).expect("valid")
        };
        let none = with(json!({"tool_choice": "none"}));
        assert!(none.tools.is_empty() && none.constraint.is_none());
        assert_eq!(
            none.parse("<tool_call>{}</tool_call>").content.as_deref(),
            Some("<tool_call>{}</tool_call>")
        );
        for auto in [with(json!({})), with(json!({"tool_choice": "auto"}))] {
            assert_eq!(auto.tools.len(), 2);
            assert!(auto.constraint.is_none() && auto.parallel);
            assert_eq!(auto.format, ToolFormat::Hermes);
        }
        let grammar = |plan: ToolPlan| match plan.constraint {
            Some(OutputConstraint::Lark(g)) => g,
            other => panic!("{other:?}"),
        };
        let required = grammar(with(json!({"tool_choice": "required"})));
        assert!(
            required.contains("get_weather") && required.contains("get_time"),
            "{required}"
        );
        assert!(required.contains("call (\"\\n\" call)*"), "{required}");
        let named = grammar(with(
            json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "parallel_tool_calls": false}),
        ));
        assert!(named.contains("get_time") && !named.contains("get_weather"), "{named}");
        assert!(named.starts_with("start: call\n"), "{named}");
        // A template that writes Mistral calls gets a Mistral grammar.
        let mistral = ChatTemplate::new("{{ tools }}{{ '[TOOL_CALLS]' }}", "", "").unwrap();
        let req = request(
            json!({"messages": [{"role": "user", "content": "hi"}], "tools": weather_tools(),
            "tool_choice": "required"}),
        );
        let plan = plan_for(&req, &mistral).unwrap();
        assert_eq!(plan.format, ToolFormat::Mistral);
        assert!(grammar(plan).contains("[TOOL_CALLS]"));
    }

    #[test]
    fn a_template_that_renders_tools_gets_them_and_the_history() {
        let qwen = ChatTemplate::new(QWEN_STYLE, "", "<|im_end|>").unwrap();
        assert!(qwen.renders_tools() && qwen.renders_tool_calls());
        let req = request(json!({"messages": history(), "tools": weather_tools()}));
        let text = rendered(&req, &qwen);
        let expected = concat!(
            "<|im_start|>system\nBe brief.\n\n# Tools\n\n<tools>\n",
            r#"{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}"#,
            "\n",
            r#"{"type": "function", "function": {"name": "get_time"}}"#,
            "\n</tools>\n\nReturn each call within <tool_call></tool_call> XML tags.<|im_end|>\n",
            "<|im_start|>user\nWeather in Paris and the time?<|im_end|>\n",
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
            "\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n"
        );
        assert_eq!(text, expected);
    }

    #[test]
    fn a_template_without_tools_gets_the_built_in_hermes_form() {
        let (_, smol) = model_text();
        assert!(!smol.renders_tools() && !smol.renders_tool_calls());
        let req = request(json!({"messages": history(), "tools": weather_tools()}));
        let text = rendered(&req, smol);
        let tools_block = tools_system_block(req.tools.as_deref().unwrap());
        assert!(
            text.starts_with(&format!("<|im_start|>system\nBe brief.\n\n{tools_block}<|im_end|>\n")),
            "{text}"
        );
        assert!(tools_block.contains(r#"<tools>
{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
{"type": "function", "function": {"name": "get_time"}}
</tools>"#));
        assert!(tools_block
            .contains("<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"));
        assert!(text.ends_with(concat!(
            "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n",
            "<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><|im_end|>\n",
            "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nnoon\n</tool_response><|im_end|>\n",
            "<|im_start|>assistant\n"
        )), "{text}");
        // Without a system message the tools block is one; without tools nothing changes.
        let req = request(json!({"messages": [{"role": "user", "content": "hi"}], "tools": weather_tools()}));
        assert!(rendered(&req, smol).starts_with(&format!(
            "<|im_start|>system\n{tools_block}<|im_end|>\n<|im_start|>user\nhi"
        )));
        let plain = request(json!({"messages": [{"role": "user", "content": "hi"}]}));
        let messages = chat_messages(&plain.messages, "messages").unwrap();
        assert_eq!(rendered(&plain, smol), smol.render(&messages, true).unwrap());
    }
}
