//! `/v1/responses` against the real default model: answers equal to the chat path's for the
//! same conversation, the response object's shape, `incomplete` at `max_output_tokens`, the
//! stream's events in order with their sequence numbers, and every refusal OpenAI-shaped.

mod common;

use std::time::Duration;

use common::{assert_error, engine_config, server_config, server_losing_gpus, stream, TestServer, LOST_GPU, MODEL};
use serde_json::{json, Value};
use strata_engine::EngineConfig;
use strata_server::ServerConfig;

const RESPONSES: &str = "/v1/responses";

/// A Responses request: `input` plus the extra fields.
fn request(input: Value, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "input": input});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

/// The text of a response's message items.
fn output_text(response: &Value) -> String {
    let mut text = String::new();
    for item in response["output"].as_array().expect("output is a list") {
        if item["type"] == "message" {
            for part in item["content"].as_array().expect("content is a list") {
                text.push_str(part["text"].as_str().expect("text"));
            }
        }
    }
    text
}

/// Asks the chat path the same conversation; returns (its text, its usage).
async fn chat_answer(s: &TestServer, messages: Value, extra: Value) -> (String, Value) {
    let mut body = json!({"model": MODEL, "messages": messages, "temperature": 0});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    let (status, r) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    let text = r["choices"][0]["message"]["content"]
        .as_str()
        .expect("content")
        .to_string();
    (text, r["usage"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn responses_answer_as_chat_does_for_the_same_conversation() {
    let s = TestServer::default().await;
    let (status, r) = s
        .post(
            RESPONSES,
            &request(
                json!("Say something."),
                json!({"max_output_tokens": 8, "temperature": 0, "metadata": {"run": "7"}}),
            ),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert!(r["id"].as_str().is_some_and(|id| id.starts_with("resp_")), "{r}");
    assert_eq!(r["object"], "response");
    assert!(r["created_at"].is_u64());
    assert_eq!(r["model"], MODEL);
    assert!(r["error"].is_null());
    assert_eq!(r["store"], false);
    assert_eq!(r["tools"], json!([]));
    assert_eq!(r["tool_choice"], "auto");
    assert_eq!(r["parallel_tool_calls"], true);
    assert_eq!(r["text"], json!({"format": {"type": "text"}}));
    assert_eq!(r["metadata"], json!({"run": "7"}));
    assert_eq!(r["temperature"], 0.0);
    assert_eq!(r["max_output_tokens"], 8);
    let output = r["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{r}");
    let message = &output[0];
    assert_eq!(message["type"], "message");
    assert_eq!(message["role"], "assistant");
    assert!(message["id"].as_str().is_some_and(|id| id.starts_with("msg_")), "{r}");
    assert_eq!(message["content"][0]["type"], "output_text");
    assert_eq!(message["content"][0]["annotations"], json!([]));
    let (text, usage) = chat_answer(
        &s,
        json!([{"role": "user", "content": "Say something."}]),
        json!({"max_tokens": 8}),
    )
    .await;
    assert_eq!(output_text(&r), text);
    assert_eq!(r["usage"]["input_tokens"], usage["prompt_tokens"]);
    assert_eq!(r["usage"]["output_tokens"], usage["completion_tokens"]);
    assert_eq!(r["usage"]["total_tokens"], usage["total_tokens"]);
    assert!(r["usage"]["input_tokens_details"]["cached_tokens"].is_u64());
    assert_eq!(r["usage"]["output_tokens_details"]["reasoning_tokens"], 0);

    // Message items in every spelling, after the instructions: the chat path's system message.
    let items = json!([
        {"role": "user", "content": [{"type": "input_text", "text": "Hello."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": "Name a colour."},
    ]);
    let (status, r) = s
        .post(
            RESPONSES,
            &request(
                items,
                json!({"instructions": "Answer in one word.", "max_output_tokens": 6, "temperature": 0}),
            ),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["instructions"], "Answer in one word.");
    let (text, usage) = chat_answer(
        &s,
        json!([
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": "Hello."},
            {"role": "assistant", "content": "Hi!"},
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a colour."},
        ]),
        json!({"max_tokens": 6}),
    )
    .await;
    assert_eq!(output_text(&r), text);
    assert_eq!(r["usage"]["input_tokens"], usage["prompt_tokens"], "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_output_tokens_makes_the_response_incomplete() {
    let s = TestServer::default().await;
    // The chat path's sampling extras pass through: ignore_eos makes it run to the limit.
    let (status, r) = s
        .post(
            RESPONSES,
            &request(
                json!("Tell me a story."),
                json!({"max_output_tokens": 3, "ignore_eos": true}),
            ),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["status"], "incomplete");
    assert_eq!(r["incomplete_details"], json!({"reason": "max_output_tokens"}));
    assert_eq!(r["usage"]["output_tokens"], 3);
    assert_eq!(r["output"][0]["status"], "incomplete");

    // A stop string ends it before the limit: completed.
    let (status, r) = s
        .post(
            RESPONSES,
            &request(
                json!("Tell me a story."),
                json!({"max_output_tokens": 64, "temperature": 0, "stop": [" "]}),
            ),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["status"], "completed", "{r}");
    assert!(r["incomplete_details"].is_null());
    assert_eq!(r["output"][0]["status"], "completed");
    assert!(!output_text(&r).contains(' '), "{r}");
}

/// The event types of a stream, checking on the way that each `event:` line names its data's
/// type and the sequence numbers count from 0.
fn event_types(events: &[common::SseEvent]) -> Vec<String> {
    let mut types = Vec::new();
    for (i, e) in events.iter().filter(|e| e.data.is_some()).enumerate() {
        let data: Value = serde_json::from_str(e.data.as_deref().unwrap()).expect("every event is JSON");
        assert_eq!(data["sequence_number"], i, "{data}");
        assert_eq!(e.event.as_deref(), data["type"].as_str(), "{data}");
        types.push(data["type"].as_str().unwrap().to_string());
    }
    types
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_response_sends_the_events_in_order() {
    let s = TestServer::default().await;
    let body = request(
        json!([{"role": "user", "content": "Say something."}]),
        json!({"max_output_tokens": 8, "temperature": 0, "ignore_eos": true}),
    );
    let (_, whole) = s.post(RESPONSES, &body).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = stream(&s, RESPONSES, &streamed).await.all().await;
    let types = event_types(&events);
    let data = common::chunks(&events);
    assert!(events.iter().all(|e| e.data.as_deref() != Some("[DONE]")));
    let deltas = types.iter().filter(|t| *t == "response.output_text.delta").count();
    assert!(deltas >= 4, "tokens arrive as separate deltas: {types:?}");
    let mut want = vec![
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ];
    want.extend(std::iter::repeat_n("response.output_text.delta", deltas));
    want.extend([
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]);
    assert_eq!(types, want);

    let id = data[0]["response"]["id"].as_str().unwrap();
    assert_eq!(data[0]["response"]["status"], "in_progress");
    assert_eq!(data[0]["response"]["output"], json!([]));
    let item_id = data[2]["item"]["id"].as_str().unwrap();
    let mut text = String::new();
    for d in &data[2..data.len() - 1] {
        assert_eq!(d["output_index"], 0, "{d}");
        if d.get("item_id").is_some() {
            assert_eq!(d["item_id"], item_id, "{d}");
            assert_eq!(d["content_index"], 0, "{d}");
        }
        if d["type"] == "response.output_text.delta" {
            text.push_str(d["delta"].as_str().unwrap());
        }
    }
    assert_eq!(text, output_text(&whole));
    let done = &data[data.len() - 4];
    assert_eq!(done["text"], text.as_str());
    let last = &data[data.len() - 1]["response"];
    assert_eq!(last["id"], id);
    assert_eq!(last["status"], "incomplete");
    assert_eq!(output_text(last), text);
    assert_eq!(last["output"][0]["id"], item_id);
    for field in ["input_tokens", "output_tokens", "total_tokens"] {
        assert_eq!(last["usage"][field], whole["usage"][field]);
    }
    assert_eq!(data[data.len() - 2]["item"], last["output"][0]);

    // One that stops before the limit ends with response.completed.
    let mut stops = streamed.clone();
    stops["stop"] = json!([" "]);
    stops["max_output_tokens"] = json!(64);
    let events = stream(&s, RESPONSES, &stops).await.all().await;
    let types = event_types(&events);
    assert_eq!(
        types.last().map(String::as_str),
        Some("response.completed"),
        "{types:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_stream_hears_keep_alives_and_a_dropped_one_frees_its_blocks() {
    let s = TestServer::start(
        EngineConfig {
            max_num_seqs: 1,
            ..engine_config()
        },
        ServerConfig {
            sse_keep_alive: Duration::from_millis(50),
            ..server_config()
        },
    )
    .await;
    let long = json!({"max_output_tokens": 500, "ignore_eos": true, "stream": true});
    // A runs; B waits in the queue behind it.
    let mut a = stream(&s, RESPONSES, &request(json!("Tell me a long story."), long.clone())).await;
    while !a
        .next()
        .await
        .unwrap()
        .data
        .is_some_and(|d| d.contains("output_text.delta"))
    {}
    let mut b = stream(&s, RESPONSES, &request(json!("Tell me another."), long)).await;
    // B opens at once, then hears keep-alive comments while it waits.
    let mut opened = Vec::new();
    let mut keep_alives = 0;
    while keep_alives < 2 {
        match b.next().await.expect("B's stream goes on").event {
            Some(name) => opened.push(name),
            None => keep_alives += 1,
        }
    }
    assert_eq!(opened, ["response.created", "response.in_progress"]);
    // A goes away: B runs; then B goes away too, and every block is free again.
    drop(a);
    while !b
        .next()
        .await
        .unwrap()
        .data
        .is_some_and(|d| d.contains("output_text.delta"))
    {}
    drop(b);
    assert!(
        s.wait_blocks_free(Duration::from_secs(10)).await,
        "dropped streams free their blocks"
    );
    let (_, metrics) = s.get("/metrics").await;
    assert!(
        metrics.contains("strata_request_finished_total{finish_reason=\"abort\"} 2"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_that_fails_ends_with_error_then_response_failed() {
    let s = server_losing_gpus().await;
    let body = request(
        json!("Tell me a story."),
        json!({"max_output_tokens": 8, "ignore_eos": true, "stream": true}),
    );
    let events = stream(&s, RESPONSES, &body).await.all().await;
    let types = event_types(&events);
    let n = types.len();
    assert_eq!(types[n - 2..], ["error", "response.failed"], "{types:?}");
    let data = common::chunks(&events);
    let error = &data[n - 2];
    assert!(error["message"].as_str().unwrap().contains(LOST_GPU), "{error}");
    let failed = &data[n - 1]["response"];
    assert_eq!(failed["status"], "failed");
    assert_eq!(failed["error"]["code"], "server_error");
    assert!(failed["error"]["message"].as_str().unwrap().contains(LOST_GPU));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_state_and_malformed_requests_get_openai_errors() {
    let s = TestServer::default().await;
    let cases: Vec<(Value, &str)> = vec![
        (request(json!("hi"), json!({"store": true})), "store"),
        (
            request(json!("hi"), json!({"previous_response_id": "resp_1"})),
            "previous_response_id",
        ),
        (request(json!("hi"), json!({"conversation": "conv_1"})), "conversation"),
        (request(json!("hi"), json!({"background": true})), "background"),
        (json!({"model": MODEL}), "input"),
        (request(json!(5), json!({})), "input"),
        (request(json!({"role": "user"}), json!({})), "input"),
        (request(json!([]), json!({})), "input"),
        (
            request(json!([{"role": "robot", "content": "x"}]), json!({})),
            "input[0].role",
        ),
        (request(json!([{"content": "x"}]), json!({})), "input[0].role"),
        (request(json!([{"role": "user"}]), json!({})), "input[0].content"),
        (
            request(json!([{"role": "user", "content": 5}]), json!({})),
            "input[0].content",
        ),
        (
            request(
                json!([{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_image"}]}]),
                json!({}),
            ),
            "input[1].content[0].type",
        ),
        (
            request(
                json!([{"role": "user", "content": [{"type": "input_text"}]}]),
                json!({}),
            ),
            "input[0].content[0].text",
        ),
        (
            request(
                json!([{"type": "function_call", "name": "f", "arguments": "{}"}]),
                json!({}),
            ),
            "input[0].call_id",
        ),
        (
            request(json!([{"type": "function_call_output", "call_id": "c"}]), json!({})),
            "input[0].output",
        ),
        (request(json!([{"type": "reasoning"}]), json!({})), "input[0].type"),
        // Errors the chat path finds are named as the Responses request names the field.
        (
            request(json!("hi"), json!({"max_output_tokens": 0})),
            "max_output_tokens",
        ),
        (request(json!("hi"), json!({"temperature": -1})), "temperature"),
        (request(json!("hi"), json!({"top_p": 0})), "top_p"),
        (
            request(json!("hi"), json!({"text": {"format": {"type": "xml"}}})),
            "text.format.type",
        ),
        (
            request(json!("hi"), json!({"text": {"format": {"type": "json_schema"}}})),
            "text.format.name",
        ),
        (
            request(json!("hi"), json!({"tools": [{"type": "web_search"}]})),
            "tools[0].type",
        ),
        (request(json!("hi"), json!({"tool_choice": "sometimes"})), "tool_choice"),
        (
            request(json!("hi"), json!({"tool_choice": {"type": "function"}})),
            "tool_choice.name",
        ),
        (request(json!("hi"), json!({"metadata": {"a": 1}})), "metadata.a"),
        (
            request(json!("hi"), json!({"metadata": {"k": "v".repeat(513)}})),
            "metadata.k",
        ),
        (
            request(
                json!("hi"),
                json!({"metadata": (0..17).map(|i| (format!("k{i}"), json!("v"))).collect::<serde_json::Map<_, _>>()}),
            ),
            "metadata",
        ),
    ];
    for (body, param) in cases {
        let (status, e) = s.post(RESPONSES, &body).await;
        assert_error(status, &e, 400, Some(param));
    }
    let (status, e) = s
        .post(RESPONSES, &request(json!("hi"), json!({"max_output_tokens": 0})))
        .await;
    assert_error(status, &e, 400, Some("max_output_tokens"));
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("`max_output_tokens`"), "{message}");
    let (_, e) = s
        .post(RESPONSES, &request(json!([{"role": "user", "content": 5}]), json!({})))
        .await;
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("input_text"), "{message}");
    let (status, e) = s
        .post(RESPONSES, &request(json!("hi"), json!({"model": "gpt-4o"})))
        .await;
    assert_error(status, &e, 404, Some("model"));
    // store: false is what strata does anyway.
    let (status, r) = s
        .post(
            RESPONSES,
            &request(json!("hi"), json!({"store": false, "max_output_tokens": 1})),
        )
        .await;
    assert_eq!(status, 200, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_format_holds_the_output_to_json_and_its_errors_name_text_format() {
    let s = TestServer::default().await;
    let schema = json!({"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
        "required": ["colour"], "additionalProperties": false});
    let format = json!({"format": {"type": "json_schema", "name": "colour", "schema": schema, "strict": true}});
    let body = request(
        json!("What colour is the sky?"),
        json!({"text": format, "max_output_tokens": 64, "temperature": 0}),
    );
    let (status, r) = s.post(RESPONSES, &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["text"], format);
    let answer: Value = serde_json::from_str(&output_text(&r)).expect("the output is JSON");
    assert!(
        ["red", "green", "blue"].contains(&answer["colour"].as_str().unwrap_or_default()),
        "{answer}"
    );
    // Streamed, the deltas make the same JSON.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = stream(&s, RESPONSES, &streamed).await.all().await;
    let text: String = common::chunks(&events)
        .iter()
        .filter(|d| d["type"] == "response.output_text.delta")
        .map(|d| d["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, output_text(&r));

    let (status, r) = s
        .post(
            RESPONSES,
            &request(
                json!("Give me a JSON object."),
                json!({"text": {"format": {"type": "json_object"}}, "max_output_tokens": 6, "temperature": 0}),
            ),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    // Held to a JSON object from its first token (this model's objects run past a few tokens).
    let text = output_text(&r);
    assert!(text.trim_start().starts_with('{'), "{r}");

    // The chat path's checks of the format, named as the Responses request names the field.
    for (format, param) in [
        (
            json!({"type": "json_schema", "name": "x", "schema": {"type": "strin"}}),
            "text.format.schema",
        ),
        (
            json!({"type": "json_schema", "name": "has space", "schema": {}}),
            "text.format.name",
        ),
    ] {
        let body = request(json!("hi"), json!({"text": {"format": format}}));
        let (status, e) = s.post(RESPONSES, &body).await;
        assert_error(status, &e, 400, Some(param));
        let message = e["error"]["message"].as_str().unwrap();
        assert!(!message.contains("response_format"), "{message}");
    }
}

/// The weather tool in the Responses shape: its fields flat, not under `function`.
fn weather_tool() -> Value {
    json!({"type": "function", "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn function_tools_give_function_call_items_and_take_their_outputs() {
    let s = TestServer::default().await;
    let body = request(
        json!("Weather in Paris?"),
        json!({"tools": [weather_tool()], "tool_choice": {"type": "function", "name": "get_weather"},
            "parallel_tool_calls": false, "max_output_tokens": 64, "temperature": 0}),
    );
    let (status, r) = s.post(RESPONSES, &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["status"], "completed", "{r}");
    assert_eq!(r["tools"], json!([weather_tool()]));
    assert_eq!(r["parallel_tool_calls"], false);
    let output = r["output"].as_array().unwrap();
    assert_eq!(output.len(), 1, "{r}");
    let call = &output[0];
    assert_eq!(call["type"], "function_call");
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["status"], "completed");
    assert!(call["id"].as_str().unwrap().starts_with("fc_"), "{call}");
    assert!(call["call_id"].as_str().unwrap().starts_with("call_"), "{call}");
    let arguments: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).expect("arguments are JSON");
    assert!(arguments["city"].is_string(), "{arguments}");

    // Streamed: the item, its arguments in pieces, then done.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = stream(&s, RESPONSES, &streamed).await.all().await;
    let types = event_types(&events);
    let deltas = types
        .iter()
        .filter(|t| *t == "response.function_call_arguments.delta")
        .count();
    let mut want = vec!["response.created", "response.in_progress", "response.output_item.added"];
    want.extend(std::iter::repeat_n("response.function_call_arguments.delta", deltas));
    want.extend([
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]);
    assert_eq!(types, want);
    assert!(deltas >= 2, "the arguments arrive in pieces: {types:?}");
    let data = common::chunks(&events);
    let pieces: String = data
        .iter()
        .filter(|d| d["type"] == "response.function_call_arguments.delta")
        .map(|d| d["delta"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(pieces, call["arguments"].as_str().unwrap());
    assert_eq!(data[data.len() - 3]["arguments"], call["arguments"]);
    assert_eq!(data[data.len() - 1]["response"]["output"][0]["name"], "get_weather");

    // The call and its output as input items are the chat path's assistant tool call and tool
    // message: the same prompt and the same answer.
    let history = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C and sunny"},
    ]);
    let (status, r) = s
        .post(
            RESPONSES,
            &request(
                history,
                json!({"tools": [weather_tool()], "max_output_tokens": 8, "temperature": 0}),
            ),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    let chat_tool = json!({"type": "function", "function": {"name": "get_weather",
        "description": "The weather in a city", "parameters": weather_tool()["parameters"]}});
    let (text, usage) = chat_answer(
        &s,
        json!([
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
        ]),
        json!({"tools": [chat_tool], "max_tokens": 8}),
    )
    .await;
    assert_eq!(r["usage"]["input_tokens"], usage["prompt_tokens"], "{r}");
    assert_eq!(output_text(&r), text);

    // The chat path's tool checks, named as the Responses request names the fields.
    for (extra, param) in [
        (json!({"tools": [{"type": "function", "name": "a b"}]}), "tools[0].name"),
        (
            json!({"tools": [weather_tool()], "tool_choice": {"type": "function", "name": "get_stock"}}),
            "tool_choice.name",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": [weather_tool()], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}),
            "tool_choice",
        ),
    ] {
        let (status, e) = s.post(RESPONSES, &request(json!("hi"), extra)).await;
        assert_error(status, &e, 400, Some(param));
        let message = e["error"]["message"].as_str().unwrap();
        assert!(
            !message.contains("response_format") && !message.contains(".function"),
            "{message}"
        );
    }
}
