//! `POST /v1/responses`: OpenAI's Responses API without stored state, served by the chat path:
//! the request becomes a chat request, and chat's reply or stream becomes a response.

mod output;
mod stream;
pub mod types;

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::{to_bytes, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::header::CONTENT_LENGTH;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Map, Value};

use crate::body::parse_json;
use crate::chat::chat_completions;
use crate::error::{ApiError, ErrorResponse, GenerationErrors, RequestErrors};
use crate::generation::unix_now;
use crate::params::random_u64;
use crate::AppState;
use output::{ChatReply, OutputBuilder};
use types::{
    InputContent, InputItem, ResponseObject, ResponseStreamEvent, ResponsesInput, ResponsesRequest, ResponsesTool,
    TextConfig, TextFormat,
};

/// The chat request's fields beyond OpenAI's that a Responses request may carry too.
const CHAT_EXTRAS: &[&str] = &[
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "speculative",
    "logit_bias",
];

/// Creates a response. Nothing is stored: `store: true`, `previous_response_id`,
/// `conversation` and `background: true` are refused.
#[utoipa::path(
    post,
    path = "/v1/responses",
    tag = "openai",
    request_body = ResponsesRequest,
    responses(
        (status = 200, description = "The response; with `stream: true` a `text/event-stream` of events, each an `event: <type>` line and `data: <ResponseStreamEvent>`: `response.created`, `response.in_progress`, then for each output item `response.output_item.added`, its text (`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`) or its call's arguments (`response.function_call_arguments.delta`..., `.done`), `response.output_item.done`; last `response.completed` or `response.incomplete`, or `error` then `response.failed` if generation failed",
            content((ResponseObject = "application/json"), (ResponseStreamEvent = "text/event-stream"))),
        RequestErrors,
        GenerationErrors,
    ),
    security(("bearer" = []))
)]
pub async fn create_response(State(state): State<Arc<AppState>>, body: Result<Bytes, BytesRejection>) -> Response {
    match run(state, body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn run(state: Arc<AppState>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let req: ResponsesRequest = parse_json(body, state.config.max_request_body_bytes)?;
    let chat_body = chat_body(&req)?;
    let builder = OutputBuilder::new(response_template(&req, &state.config.served_model_name));
    let chat = chat_completions(State(Arc::clone(&state)), Ok(chat_body)).await;
    if !chat.status().is_success() {
        return Ok(renamed_error(chat).await);
    }
    if req.stream.unwrap_or(false) {
        return Ok(stream::sse_response(chat, builder, state.config.sse_keep_alive));
    }
    let reply = to_bytes(chat.into_body(), usize::MAX)
        .await
        .map_err(|e| ApiError::engine_failed(&format!("could not read the chat reply: {e}")))?;
    let reply: ChatReply = serde_json::from_slice(&reply)
        .map_err(|e| ApiError::engine_failed(&format!("could not read the chat reply: {e}")))?;
    let response = builder.reply(reply).map_err(|e| ApiError::engine_failed(&e))?;
    Ok(Json(response).into_response())
}

/// The body of the chat request that generates what `req` asks for, or why `req` is refused.
pub fn chat_body(req: &ResponsesRequest) -> Result<Bytes, ApiError> {
    refuse_stored_state(req)?;
    check_metadata(req.metadata.as_ref())?;
    let body = serde_json::to_vec(&chat_request(req)?)
        .map_err(|e| ApiError::engine_failed(&format!("could not write the chat request: {e}")))?;
    Ok(Bytes::from(body))
}

/// strata keeps no responses or conversations: what needs one is refused, saying what to do.
fn refuse_stored_state(req: &ResponsesRequest) -> Result<(), ApiError> {
    let refusal = if req.store == Some(true) {
        Some((
            "store",
            "strata keeps no responses: send `store: false` or leave it out",
        ))
    } else if req.previous_response_id.is_some() {
        Some((
            "previous_response_id",
            "strata keeps no responses to continue from: send the whole conversation as `input` items instead",
        ))
    } else if req.conversation.as_ref().is_some_and(|c| !c.is_null()) {
        Some((
            "conversation",
            "strata keeps no conversations: send the whole conversation as `input` items instead",
        ))
    } else if req.background == Some(true) {
        Some((
            "background",
            "strata keeps no responses to poll: leave `background` out and wait for the answer, or stream it",
        ))
    } else {
        None
    };
    match refusal {
        Some((param, message)) => Err(ApiError::invalid_field(param, message)),
        None => Ok(()),
    }
}

/// Most `metadata` pairs, and characters in a key and in a value, as OpenAI allows.
pub const MAX_METADATA_PAIRS: usize = 16;
pub const MAX_METADATA_KEY_CHARS: usize = 64;
pub const MAX_METADATA_VALUE_CHARS: usize = 512;

/// `metadata` within OpenAI's limits (it is echoed in the response object).
fn check_metadata(metadata: Option<&BTreeMap<String, String>>) -> Result<(), ApiError> {
    let Some(metadata) = metadata else {
        return Ok(());
    };
    if metadata.len() > MAX_METADATA_PAIRS {
        return Err(ApiError::invalid_field(
            "metadata",
            format!(
                "`metadata` may hold at most {MAX_METADATA_PAIRS} pairs, got {}",
                metadata.len()
            ),
        ));
    }
    for (key, value) in metadata {
        if key.chars().count() > MAX_METADATA_KEY_CHARS || value.chars().count() > MAX_METADATA_VALUE_CHARS {
            return Err(ApiError::invalid_field(
                format!("metadata.{key}"),
                format!(
                    "`metadata` keys may have at most {MAX_METADATA_KEY_CHARS} characters and values at most \
                     {MAX_METADATA_VALUE_CHARS}"
                ),
            ));
        }
    }
    Ok(())
}

/// The chat request that generates what `req` asks for.
fn chat_request(req: &ResponsesRequest) -> Result<Value, ApiError> {
    let mut chat: Map<String, Value> = req
        .extra
        .iter()
        .filter(|(key, _)| CHAT_EXTRAS.contains(&key.as_str()))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    let mut messages = Vec::new();
    if let Some(instructions) = &req.instructions {
        messages.push(json!({"role": "system", "content": instructions}));
    }
    match &req.input {
        ResponsesInput::Text(text) => messages.push(json!({"role": "user", "content": text})),
        ResponsesInput::Items(items) => {
            for (i, item) in items.iter().enumerate() {
                add_item(&mut messages, item, &format!("input[{i}]"))?;
            }
        }
    }
    chat.insert("messages".into(), Value::Array(messages));
    let mut set = |key: &str, value: Option<Value>| {
        if let Some(value) = value {
            chat.insert(key.into(), value);
        }
    };
    set("model", req.model.clone().map(Value::from));
    set("max_completion_tokens", req.max_output_tokens.map(Value::from));
    set("temperature", req.temperature.map(Value::from));
    set("top_p", req.top_p.map(Value::from));
    set("user", req.user.clone().map(Value::from));
    set("parallel_tool_calls", req.parallel_tool_calls.map(Value::from));
    let stream = req.stream.unwrap_or(false);
    set("stream", Some(Value::from(stream)));
    // The usage chunk is what `response.completed` takes its usage from.
    set("stream_options", stream.then(|| json!({"include_usage": true})));
    set(
        "response_format",
        req.text.as_ref().and_then(|t| t.format.as_ref()).map(response_format),
    );
    set(
        "tools",
        req.tools
            .as_ref()
            .map(|tools| tools.iter().map(chat_tool).collect::<Vec<_>>().into()),
    );
    set(
        "tool_choice",
        req.tool_choice.as_ref().map(chat_tool_choice).transpose()?,
    );
    Ok(Value::Object(chat))
}

/// Adds one input item to the chat messages: a message as it is, a function call to the
/// assistant message before it (calls in a row are one message), a call's output as a `tool`
/// message.
fn add_item(messages: &mut Vec<Value>, item: &InputItem, at: &str) -> Result<(), ApiError> {
    match item.kind.as_deref().unwrap_or("message") {
        "message" => {
            let role = required(item.role.as_ref(), at, "role", "message")?;
            if !["user", "system", "developer", "assistant"].contains(&role.as_str()) {
                return Err(ApiError::invalid_field(
                    format!("{at}.role"),
                    format!("`{at}.role` is `{role}`; supported roles are user, system, developer and assistant"),
                ));
            }
            let content = required(item.content.as_ref(), at, "content", "message")?;
            messages.push(json!({"role": role, "content": text_of(content, &format!("{at}.content"))?}));
        }
        "function_call" => {
            let call = json!({
                "id": required(item.call_id.as_ref(), at, "call_id", "function_call")?,
                "type": "function",
                "function": {
                    "name": required(item.name.as_ref(), at, "name", "function_call")?,
                    "arguments": required(item.arguments.as_ref(), at, "arguments", "function_call")?,
                },
            });
            let previous = messages
                .last_mut()
                .filter(|m| m["role"] == "assistant")
                .and_then(Value::as_object_mut);
            match previous {
                Some(assistant) => match assistant.get_mut("tool_calls").and_then(Value::as_array_mut) {
                    Some(calls) => calls.push(call),
                    None => {
                        assistant.insert("tool_calls".into(), json!([call]));
                    }
                },
                None => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        "function_call_output" => {
            let call_id = required(item.call_id.as_ref(), at, "call_id", "function_call_output")?;
            let output = required(item.output.as_ref(), at, "output", "function_call_output")?;
            let output = text_of(output, &format!("{at}.output"))?;
            messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
        }
        other => {
            return Err(ApiError::invalid_field(
                format!("{at}.type"),
                format!(
                    "`{at}.type` is `{other}`; supported items are message, function_call and function_call_output"
                ),
            ))
        }
    }
    Ok(())
}

/// The field `field` of the `kind` item at `at`, which must be there.
fn required<'a, T>(value: Option<&'a T>, at: &str, field: &str, kind: &str) -> Result<&'a T, ApiError> {
    value.ok_or_else(|| {
        ApiError::invalid_field(
            format!("{at}.{field}"),
            format!("`{at}.{field}` is required in a {kind} item"),
        )
    })
}

/// The text of a content (its text parts joined).
fn text_of(content: &InputContent, at: &str) -> Result<String, ApiError> {
    let parts = match content {
        InputContent::Text(text) => return Ok(text.clone()),
        InputContent::Parts(parts) => parts,
    };
    let mut text = String::new();
    for (j, part) in parts.iter().enumerate() {
        let param = format!("{at}[{j}]");
        if part.kind != "input_text" && part.kind != "output_text" {
            return Err(ApiError::invalid_field(
                format!("{param}.type"),
                format!(
                    "`{param}.type` is `{}`; only `input_text` and `output_text` parts are supported",
                    part.kind
                ),
            ));
        }
        match &part.text {
            Some(t) => text.push_str(t),
            None => {
                return Err(ApiError::invalid_field(
                    format!("{param}.text"),
                    format!("`{param}.text` is required in a text part"),
                ))
            }
        }
    }
    Ok(text)
}

/// `text.format` as chat's `response_format` (whose schema sits under `json_schema`).
fn response_format(format: &TextFormat) -> Value {
    match format {
        TextFormat::Text => json!({"type": "text"}),
        TextFormat::JsonObject => json!({"type": "json_object"}),
        TextFormat::JsonSchema {
            name,
            schema,
            description,
            strict,
        } => {
            let mut json_schema = json!({"name": name, "schema": schema});
            if let Some(description) = description {
                json_schema["description"] = json!(description);
            }
            if let Some(strict) = strict {
                json_schema["strict"] = json!(strict);
            }
            json!({"type": "json_schema", "json_schema": json_schema})
        }
    }
}

/// A Responses tool as a chat tool (whose fields sit under `function`).
fn chat_tool(tool: &ResponsesTool) -> Value {
    let ResponsesTool::Function {
        name,
        description,
        parameters,
        strict,
    } = tool;
    let mut function = json!({"name": name});
    if let Some(description) = description {
        function["description"] = json!(description);
    }
    if let Some(parameters) = parameters {
        function["parameters"] = parameters.clone();
    }
    if let Some(strict) = strict {
        function["strict"] = json!(strict);
    }
    json!({"type": "function", "function": function})
}

/// `tool_choice` as chat spells it: the same modes, a function named under `function`.
fn chat_tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(mode) if ["none", "auto", "required"].contains(&mode.as_str()) => Ok(choice.clone()),
        Value::Object(o) if o.get("type") == Some(&json!("function")) => match o.get("name") {
            Some(Value::String(name)) => Ok(json!({"type": "function", "function": {"name": name}})),
            _ => Err(ApiError::invalid_field(
                "tool_choice.name",
                "`tool_choice.name` must name the function to call",
            )),
        },
        _ => Err(ApiError::invalid_field(
            "tool_choice",
            "`tool_choice` must be `none`, `auto`, `required` or {\"type\": \"function\", \"name\": ...}",
        )),
    }
}

/// The response `req` gets before any output: its settings echoed, status `in_progress`.
fn response_template(req: &ResponsesRequest, served_model: &str) -> ResponseObject {
    ResponseObject {
        id: format!("resp_{:016x}{:016x}", random_u64(), random_u64()),
        object: "response".into(),
        created_at: unix_now(),
        status: "in_progress".into(),
        error: None,
        incomplete_details: None,
        model: served_model.to_string(),
        output: Vec::new(),
        usage: None,
        instructions: req.instructions.clone(),
        max_output_tokens: req.max_output_tokens,
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        tool_choice: req.tool_choice.clone().unwrap_or_else(|| json!("auto")),
        tools: req.tools.clone().unwrap_or_default(),
        text: TextConfig {
            format: Some(
                req.text
                    .as_ref()
                    .and_then(|t| t.format.clone())
                    .unwrap_or(TextFormat::Text),
            ),
            verbosity: req.text.as_ref().and_then(|t| t.verbosity.clone()),
        },
        metadata: req.metadata.clone().unwrap_or_default(),
        user: req.user.clone(),
        store: false,
    }
}

/// The chat path's error, its `param` named as in the Responses request.
async fn renamed_error(chat: Response) -> Response {
    let (mut parts, body) = chat.into_parts();
    let Ok(bytes) = to_bytes(body, usize::MAX).await else {
        return ApiError::engine_failed("could not read the chat path's error").into_response();
    };
    let Ok(mut error) = serde_json::from_slice::<ErrorResponse>(&bytes) else {
        return Response::from_parts(parts, bytes.into());
    };
    error.error.param = error.error.param.as_deref().map(responses_param);
    error.error.message = responses_message(&error.error.message);
    parts.headers.remove(CONTENT_LENGTH);
    (parts, Json(error)).into_response()
}

/// A chat error message with the fields it names in backticks named as in Responses.
fn responses_message(message: &str) -> String {
    message
        .split('`')
        .enumerate()
        .map(|(i, part)| {
            if i % 2 == 1 {
                responses_param(part)
            } else {
                part.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join("`")
}

/// The Responses name of a chat request field.
fn responses_param(chat_param: &str) -> String {
    if chat_param == "messages" || chat_param.starts_with("messages[") {
        return "input".into();
    }
    let renames = [
        ("max_completion_tokens", "max_output_tokens"),
        ("response_format.json_schema", "text.format"),
        ("response_format", "text.format"),
        ("tool_choice.function", "tool_choice"),
    ];
    for (chat, responses) in renames {
        if let Some(rest) = chat_param.strip_prefix(chat) {
            if rest.is_empty() || rest.starts_with(['.', '[']) {
                return format!("{responses}{rest}");
            }
        }
    }
    // `tools[i].function.x` is `tools[i].x`.
    if let Some((tool, rest)) = chat_param.split_once("].function") {
        if tool.starts_with("tools[") {
            return format!("{tool}]{rest}");
        }
    }
    chat_param.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: Value) -> ResponsesRequest {
        parse_json(Ok(Bytes::from(body.to_string())), 1 << 20).expect("parses")
    }

    #[test]
    fn instructions_come_first_and_function_calls_join_the_assistant_turn() {
        let req = parse(json!({
            "instructions": "Be brief.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text", "text": "Oslo?"}]},
                {"type": "message", "role": "assistant", "content": "Checking."},
                {"type": "function_call", "call_id": "a", "name": "weather", "arguments": "{\"city\":\"Oslo\"}"},
                {"type": "function_call", "call_id": "b", "name": "time", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "a", "output": "rain"},
                {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": "noon"}]},
                {"type": "function_call", "call_id": "c", "name": "time", "arguments": "{}"},
            ],
            "top_k": 5,
            "n": 3,
        }));
        let chat = chat_request(&req).unwrap();
        let call = |id: &str, name: &str, arguments: &str| json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}});
        assert_eq!(
            chat["messages"],
            json!([
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": "Checking.", "tool_calls": [
                    call("a", "weather", "{\"city\":\"Oslo\"}"), call("b", "time", "{}")]},
                {"role": "tool", "tool_call_id": "a", "content": "rain"},
                {"role": "tool", "tool_call_id": "b", "content": "noon"},
                {"role": "assistant", "content": null, "tool_calls": [call("c", "time", "{}")]},
            ])
        );
        // The chat path's sampling extras pass; its other fields (here `n`) do not.
        assert_eq!(chat["top_k"], 5);
        assert!(chat.get("n").is_none());
        assert_eq!(chat["stream"], false);
        assert!(chat.get("stream_options").is_none());
    }

    #[test]
    fn text_format_tools_and_tool_choice_take_the_chat_shapes() {
        let req = parse(json!({
            "input": "hi",
            "stream": true,
            "max_output_tokens": 9,
            "text": {"format": {"type": "json_schema", "name": "city", "strict": true,
                "schema": {"type": "object", "properties": {"name": {"type": "string"}}}}},
            "tools": [{"type": "function", "name": "weather", "description": "Weather now",
                "parameters": {"type": "object"}, "strict": false}],
            "tool_choice": {"type": "function", "name": "weather"},
        }));
        let chat = chat_request(&req).unwrap();
        assert_eq!(
            chat["response_format"],
            json!({"type": "json_schema", "json_schema": {"name": "city", "strict": true,
                "schema": {"type": "object", "properties": {"name": {"type": "string"}}}}})
        );
        assert_eq!(
            chat["tools"],
            json!([{"type": "function", "function": {"name": "weather", "description": "Weather now",
                "parameters": {"type": "object"}, "strict": false}}])
        );
        assert_eq!(
            chat["tool_choice"],
            json!({"type": "function", "function": {"name": "weather"}})
        );
        assert_eq!(chat["max_completion_tokens"], 9);
        assert_eq!(chat["stream_options"], json!({"include_usage": true}));
        let json_object = parse(json!({"input": "hi", "text": {"format": {"type": "json_object"}}}));
        assert_eq!(
            chat_request(&json_object).unwrap()["response_format"],
            json!({"type": "json_object"})
        );
        // The response echoes the request's own shapes.
        let template = response_template(&req, "m");
        let echoed = serde_json::to_value(&template).unwrap();
        assert_eq!(echoed["tools"][0]["name"], "weather");
        assert_eq!(echoed["text"]["format"]["name"], "city");
        assert_eq!(echoed["tool_choice"], json!({"type": "function", "name": "weather"}));
        let bare = parse(json!({"input": "hi", "tools": [{"type": "function", "name": "f"}]}));
        assert_eq!(
            serde_json::to_value(response_template(&bare, "m")).unwrap()["tools"],
            json!([{"type": "function", "name": "f", "parameters": null}])
        );
    }

    #[test]
    fn chat_params_are_named_as_responses_names_them() {
        for (chat, responses) in [
            ("messages", "input"),
            ("messages[2].content", "input"),
            ("max_completion_tokens", "max_output_tokens"),
            ("response_format", "text.format"),
            ("response_format.json_schema.schema", "text.format.schema"),
            ("response_format.type", "text.format.type"),
            ("tools[1].function.parameters", "tools[1].parameters"),
            ("tools[1].function", "tools[1]"),
            ("tool_choice.function.name", "tool_choice.name"),
            ("temperature", "temperature"),
            ("max_completion_tokens_x", "max_completion_tokens_x"),
        ] {
            assert_eq!(responses_param(chat), responses, "{chat}");
        }
        assert_eq!(
            responses_message("a forced `tool_choice` cannot be combined with `response_format`"),
            "a forced `tool_choice` cannot be combined with `text.format`"
        );
        assert_eq!(
            responses_message("`max_completion_tokens` must be at least 1, not `0`"),
            "`max_output_tokens` must be at least 1, not `0`"
        );
    }

    #[test]
    fn the_document_describes_the_request_the_response_and_the_events() {
        let doc: Value = serde_json::from_str(&crate::openapi::document_json()).unwrap();
        let schemas = &doc["components"]["schemas"];
        let request = &schemas["ResponsesRequest"]["properties"];
        for field in [
            "input",
            "instructions",
            "max_output_tokens",
            "text",
            "tools",
            "tool_choice",
            "store",
        ] {
            assert!(request.get(field).is_some(), "{field} undocumented");
        }
        assert!(request.get("extra").is_none());
        for field in ["id", "status", "output", "usage", "incomplete_details"] {
            assert!(schemas["ResponseObject"]["properties"].get(field).is_some(), "{field}");
        }
        let event = schemas["ResponseStreamEvent"].to_string();
        assert!(
            event.contains("sequence_number") && event.contains("StreamEvent"),
            "{event}"
        );
    }
}
