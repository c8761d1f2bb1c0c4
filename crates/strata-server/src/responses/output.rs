//! Turning what the chat path answered (its reply, or its stream chunks) into a response's
//! output items and stream events: one builder serves the JSON reply and the stream alike.

use serde::Deserialize;

use super::types::{
    IncompleteDetails, InputTokensDetails, OutputItem, OutputText, OutputTokensDetails, ResponseError, ResponseObject,
    ResponseUsage, StreamEvent,
};
use crate::error::ErrorDetail;
use crate::params::random_u64;
use crate::protocol::UsageInfo;

/// The parts of a non-streamed chat reply a response is made of (chat's wire shape).
#[derive(Debug, Deserialize)]
pub struct ChatReply {
    pub choices: Vec<ChatReplyChoice>,
    pub usage: UsageInfo,
}

#[derive(Debug, Deserialize)]
pub struct ChatReplyChoice {
    pub message: ChatReplyMessage,
    pub finish_reason: String,
}

#[derive(Debug, Deserialize)]
pub struct ChatReplyMessage {
    pub content: Option<String>,
    pub tool_calls: Option<Vec<ChatToolCall>>,
}

/// A tool call of a chat reply, or a piece of one in a stream chunk (`index` says which).
#[derive(Debug, Default, Deserialize)]
pub struct ChatToolCall {
    pub index: Option<usize>,
    pub id: Option<String>,
    pub function: Option<ChatFunctionCall>,
}

#[derive(Debug, Default, Deserialize)]
pub struct ChatFunctionCall {
    pub name: Option<String>,
    pub arguments: Option<String>,
}

/// One `data:` object of a chat stream: a chunk, or the error that ended it.
#[derive(Debug, Deserialize)]
pub struct ChatStreamData {
    pub error: Option<ErrorDetail>,
    #[serde(default)]
    pub choices: Vec<ChatChunkChoice>,
    pub usage: Option<UsageInfo>,
}

#[derive(Debug, Deserialize)]
pub struct ChatChunkChoice {
    pub delta: ChatChunkDelta,
    pub finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatChunkDelta {
    pub content: Option<String>,
    pub tool_calls: Option<Vec<ChatToolCall>>,
}

/// The output items of one response as they are generated, and the events that tell of them.
pub struct OutputBuilder {
    /// The response as it is before any output: settings echoed, `in_progress`.
    template: ResponseObject,
    items: Vec<OutputItem>,
    /// The output index of the message item while it is open.
    message: Option<usize>,
    /// The output index of each tool call, by its chat `index`.
    calls: Vec<(usize, usize)>,
    /// The status the items and the response end with, once known.
    status: Option<&'static str>,
    usage: Option<ResponseUsage>,
    /// Whether the last event (completed, incomplete or failed) has been made.
    ended: bool,
}

const CONTENT_INDEX: usize = 0;

impl OutputBuilder {
    pub fn new(template: ResponseObject) -> Self {
        OutputBuilder {
            template,
            items: Vec::new(),
            message: None,
            calls: Vec::new(),
            status: None,
            usage: None,
            ended: false,
        }
    }

    /// Whether the stream's last event has been made.
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// The events that open a stream.
    pub fn opening(&self) -> Vec<StreamEvent> {
        vec![
            StreamEvent::Created {
                response: self.template.clone(),
            },
            StreamEvent::InProgress {
                response: self.template.clone(),
            },
        ]
    }

    /// The output of a whole chat reply.
    pub fn reply(mut self, reply: ChatReply) -> Result<ResponseObject, String> {
        let Some(choice) = reply.choices.into_iter().next() else {
            return Err("the chat path answered with no choice".into());
        };
        if let Some(text) = choice.message.content.filter(|t| !t.is_empty()) {
            self.text(text);
        }
        for (index, call) in choice.message.tool_calls.into_iter().flatten().enumerate() {
            self.tool_call(ChatToolCall {
                index: Some(index),
                ..call
            });
        }
        self.finish(&choice.finish_reason);
        self.usage(reply.usage);
        Ok(self.response())
    }

    /// The events of one chat stream chunk.
    pub fn chunk(&mut self, data: ChatStreamData) -> Vec<StreamEvent> {
        if let Some(error) = data.error {
            return self.failed(&error);
        }
        let mut events = Vec::new();
        for choice in data.choices {
            if let Some(text) = choice.delta.content.filter(|t| !t.is_empty()) {
                events.extend(self.text(text));
            }
            for call in choice.delta.tool_calls.into_iter().flatten() {
                events.extend(self.tool_call(call));
            }
            if let Some(reason) = choice.finish_reason {
                if reason == "abort" {
                    return self.failed(&ErrorDetail {
                        message: "the server is shutting down and aborted this response".into(),
                        kind: "service_unavailable".into(),
                        param: None,
                        code: None,
                    });
                }
                events.extend(self.finish(&reason));
            }
        }
        if let Some(usage) = data.usage {
            self.usage(usage);
        }
        events
    }

    /// The last event of a stream whose chat stream ended: `response.completed` or
    /// `response.incomplete`, a failure if the chat stream ended without a finish, or nothing
    /// if the stream has already ended.
    pub fn closing(&mut self) -> Vec<StreamEvent> {
        if self.ended {
            return Vec::new();
        }
        if self.status.is_none() {
            return self.failed(&ErrorDetail {
                message: "generation ended without finishing the response".into(),
                kind: "server_error".into(),
                param: None,
                code: None,
            });
        }
        self.ended = true;
        let response = self.response();
        vec![if response.status == "incomplete" {
            StreamEvent::Incomplete { response }
        } else {
            StreamEvent::Completed { response }
        }]
    }

    /// New text: opens the message item first if it is not open.
    fn text(&mut self, delta: String) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        let index = match self.message {
            Some(index) => index,
            None => {
                let index = self.items.len();
                let item_id = format!("msg_{:016x}", random_u64());
                let opened = |content| OutputItem::Message {
                    id: item_id.clone(),
                    status: "in_progress".into(),
                    role: "assistant".into(),
                    content,
                };
                self.items.push(opened(vec![OutputText::new(String::new())]));
                self.message = Some(index);
                events.push(StreamEvent::OutputItemAdded {
                    output_index: index,
                    item: opened(Vec::new()),
                });
                events.push(StreamEvent::ContentPartAdded {
                    item_id,
                    output_index: index,
                    content_index: CONTENT_INDEX,
                    part: OutputText::new(String::new()),
                });
                index
            }
        };
        if let Some(OutputItem::Message { id, content, .. }) = self.items.get_mut(index) {
            if let (Some(part), false) = (content.first_mut(), delta.is_empty()) {
                part.text.push_str(&delta);
                events.push(StreamEvent::OutputTextDelta {
                    item_id: id.clone(),
                    output_index: index,
                    content_index: CONTENT_INDEX,
                    delta,
                    logprobs: Vec::new(),
                });
            }
        }
        events
    }

    /// A tool call or a piece of one: the first piece of a call opens its item.
    fn tool_call(&mut self, call: ChatToolCall) -> Vec<StreamEvent> {
        let mut events = Vec::new();
        let chat_index = call.index.unwrap_or(0);
        let function = call.function.unwrap_or_default();
        let output_index = match self.calls.iter().find(|(c, _)| *c == chat_index) {
            Some(&(_, output_index)) => output_index,
            None => {
                let output_index = self.items.len();
                let item = OutputItem::FunctionCall {
                    id: format!("fc_{:016x}", random_u64()),
                    call_id: call.id.unwrap_or_else(|| format!("call_{:016x}", random_u64())),
                    name: function.name.clone().unwrap_or_default(),
                    arguments: String::new(),
                    status: "in_progress".into(),
                };
                self.items.push(item.clone());
                self.calls.push((chat_index, output_index));
                events.push(StreamEvent::OutputItemAdded { output_index, item });
                output_index
            }
        };
        let delta = function.arguments.unwrap_or_default();
        if let Some(OutputItem::FunctionCall { id, arguments, .. }) = self.items.get_mut(output_index) {
            if !delta.is_empty() {
                arguments.push_str(&delta);
                events.push(StreamEvent::FunctionCallArgumentsDelta {
                    item_id: id.clone(),
                    output_index,
                    delta,
                });
            }
        }
        events
    }

    /// Closes every open item with the status `finish_reason` gives; a response with no item
    /// gets an empty message.
    fn finish(&mut self, finish_reason: &str) -> Vec<StreamEvent> {
        let status = if finish_reason == "length" {
            "incomplete"
        } else {
            "completed"
        };
        self.status = Some(status);
        let mut events = Vec::new();
        if self.items.is_empty() {
            events.extend(self.text(String::new()));
        }
        for (output_index, item) in self.items.iter_mut().enumerate() {
            match item {
                OutputItem::Message {
                    id,
                    status: item_status,
                    content,
                    ..
                } if item_status == "in_progress" => {
                    *item_status = status.into();
                    let part = content
                        .first()
                        .cloned()
                        .unwrap_or_else(|| OutputText::new(String::new()));
                    events.push(StreamEvent::OutputTextDone {
                        item_id: id.clone(),
                        output_index,
                        content_index: CONTENT_INDEX,
                        text: part.text.clone(),
                        logprobs: Vec::new(),
                    });
                    events.push(StreamEvent::ContentPartDone {
                        item_id: id.clone(),
                        output_index,
                        content_index: CONTENT_INDEX,
                        part,
                    });
                }
                OutputItem::FunctionCall {
                    id,
                    name,
                    arguments,
                    status: item_status,
                    ..
                } if item_status == "in_progress" => {
                    *item_status = status.into();
                    events.push(StreamEvent::FunctionCallArgumentsDone {
                        item_id: id.clone(),
                        output_index,
                        name: name.clone(),
                        arguments: arguments.clone(),
                    });
                }
                _ => continue,
            }
            events.push(StreamEvent::OutputItemDone {
                output_index,
                item: item.clone(),
            });
        }
        self.message = None;
        events
    }

    fn usage(&mut self, usage: UsageInfo) {
        self.usage = Some(ResponseUsage {
            input_tokens: usage.prompt_tokens,
            input_tokens_details: InputTokensDetails {
                cached_tokens: usage.prompt_tokens_details.cached_tokens,
            },
            output_tokens: usage.completion_tokens,
            output_tokens_details: OutputTokensDetails { reasoning_tokens: 0 },
            total_tokens: usage.total_tokens,
        });
    }

    /// The response with its output so far.
    fn response(&self) -> ResponseObject {
        let status = self.status.unwrap_or("in_progress");
        ResponseObject {
            status: status.into(),
            incomplete_details: (status == "incomplete").then(|| IncompleteDetails {
                reason: "max_output_tokens".into(),
            }),
            output: self.items.clone(),
            usage: self.usage,
            ..self.template.clone()
        }
    }

    /// The events that end a stream whose generation failed: `error`, then `response.failed`.
    pub fn failed(&mut self, error: &ErrorDetail) -> Vec<StreamEvent> {
        self.ended = true;
        let response = ResponseObject {
            status: "failed".into(),
            error: Some(ResponseError {
                code: "server_error".into(),
                message: error.message.clone(),
            }),
            ..self.response()
        };
        vec![StreamEvent::error(error), StreamEvent::Failed { response }]
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::responses::types::{TextConfig, TextFormat};

    fn template() -> ResponseObject {
        ResponseObject {
            id: "resp_1".into(),
            object: "response".into(),
            created_at: 1,
            status: "in_progress".into(),
            error: None,
            incomplete_details: None,
            model: "m".into(),
            output: Vec::new(),
            usage: None,
            instructions: None,
            max_output_tokens: None,
            temperature: 1.0,
            top_p: 1.0,
            parallel_tool_calls: true,
            tool_choice: json!("auto"),
            tools: Vec::new(),
            text: TextConfig {
                format: Some(TextFormat::Text),
                verbosity: None,
            },
            metadata: Default::default(),
            user: None,
            store: false,
        }
    }

    fn events_of(builder: &mut OutputBuilder, chunks: &[Value]) -> Vec<Value> {
        let mut events = Vec::new();
        for chunk in chunks {
            let data: ChatStreamData = serde_json::from_value(chunk.clone()).unwrap();
            events.extend(builder.chunk(data));
        }
        events.extend(builder.closing());
        events.iter().map(|e| serde_json::to_value(e).unwrap()).collect()
    }

    #[test]
    fn streamed_tool_calls_become_function_call_items() {
        let mut builder = OutputBuilder::new(template());
        let events = events_of(
            &mut builder,
            &[
                json!({"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}),
                json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                    "function": {"name": "weather", "arguments": ""}}]}, "finish_reason": null}]}),
                json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{\"city\":"}}]},
                    "finish_reason": null}]}),
                json!({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "\"Oslo\"}"}}]},
                    "finish_reason": null}]}),
                json!({"choices": [{"delta": {"tool_calls": [{"index": 1, "id": "call_b",
                    "function": {"name": "time", "arguments": "{}"}}]}, "finish_reason": null}]}),
                json!({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]}),
                json!({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                    "prompt_tokens_details": {"cached_tokens": 2}}}),
            ],
        );
        let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            types,
            [
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_eq!(events[5]["arguments"], "{\"city\":\"Oslo\"}");
        assert_eq!(events[5]["name"], "weather");
        let response = &events[9]["response"];
        assert_eq!(response["status"], "completed");
        assert_eq!(response["output"][0]["type"], "function_call");
        assert_eq!(response["output"][0]["call_id"], "call_a");
        assert_eq!(response["output"][0]["status"], "completed");
        assert_eq!(response["output"][1]["call_id"], "call_b");
        assert_eq!(events[3]["output_index"], 1);
        assert_eq!(response["usage"]["input_tokens"], 5);
        assert_eq!(response["usage"]["input_tokens_details"]["cached_tokens"], 2);
        assert_eq!(response["usage"]["total_tokens"], 12);
    }

    /// The response of a chat reply with `content` and one call.
    fn reply_of(content: Value) -> ResponseObject {
        let reply: ChatReply = serde_json::from_value(json!({
            "choices": [{"message": {"role": "assistant", "content": content, "tool_calls": [
                {"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": "{}"}}]},
                "finish_reason": "tool_calls"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": 0}},
        }))
        .unwrap();
        OutputBuilder::new(template()).reply(reply).unwrap()
    }

    #[test]
    fn a_reply_with_text_and_calls_has_a_message_then_the_calls() {
        let response = reply_of(json!("Checking."));
        let output = serde_json::to_value(&response.output).unwrap();
        assert_eq!(output[0]["type"], "message");
        assert_eq!(output[0]["content"][0]["text"], "Checking.");
        assert_eq!(output[1]["type"], "function_call");
        assert_eq!(output[1]["name"], "weather");
        assert!(output[1]["id"].as_str().unwrap().starts_with("fc_"));
        assert_eq!(response.status, "completed");

        // Calls only, content null: no message item.
        let response = reply_of(Value::Null);
        assert_eq!(response.output.len(), 1);
        assert!(matches!(response.output[0], OutputItem::FunctionCall { .. }));
    }

    #[test]
    fn an_empty_answer_is_an_empty_message_and_abort_fails_the_stream() {
        let mut builder = OutputBuilder::new(template());
        let events = events_of(
            &mut builder,
            &[json!({"choices": [{"delta": {}, "finish_reason": "stop"}]})],
        );
        let types: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
        assert_eq!(
            types,
            [
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert_eq!(events[4]["item"]["content"][0]["text"], "");

        let mut builder = OutputBuilder::new(template());
        let events = events_of(
            &mut builder,
            &[
                json!({"choices": [{"delta": {"content": "Once"}, "finish_reason": null}]}),
                json!({"choices": [{"delta": {}, "finish_reason": "abort"}]}),
            ],
        );
        let n = events.len();
        assert_eq!(events.iter().filter(|e| e["type"] == "error").count(), 1);
        assert_eq!(events[n - 2]["type"], "error");
        assert_eq!(events[n - 1]["type"], "response.failed");
        assert_eq!(events[n - 1]["response"]["output"][0]["content"][0]["text"], "Once");
        assert!(builder.ended());
    }
}
