//! Tool calling over HTTP: checks of `tools`/`tool_choice`, tool history, calls read out of
//! scripted model output (JSON and streamed deltas), and calls forced by the grammar.

mod common;

use std::collections::VecDeque;

use common::{assert_error, default_model, engine_config, server_config, stream, TestServer, MODEL};
use serde_json::{json, Value};
use strata_engine::{cpu_executor, EngineHandle};
use strata_model::{CpuExecutor, Executor, KvLayout, Logits, LogitsWanted, ModelConfig, ModelError, SeqChunk};

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
    ])
}

fn chat_with_tools(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": weather_tools(), "temperature": 0});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tool_requests_get_400_naming_the_field() {
    let s = TestServer::default().await;
    for (extra, param) in [
        (json!({"tools": "get_weather"}), "tools"),
        (json!({"tools": [{"type": "function"}]}), "tools[0].function"),
        (
            json!({"tools": [{"type": "function", "function": {"description": "no name"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}),
            "tools[0].function.parameters",
        ),
        (json!({"tool_choice": "maybe"}), "tool_choice"),
        (json!({"tool_choice": 3}), "tool_choice"),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}}),
            "tool_choice.function.name",
        ),
        (json!({"tools": null, "tool_choice": "required"}), "tool_choice"),
        (json!({"parallel_tool_calls": "yes"}), "parallel_tool_calls"),
    ] {
        let body = chat_with_tools(extra);
        let (status, e) = s.post("/v1/chat/completions", &body).await;
        assert_error(status, &e, 400, Some(param));
    }
    let call = json!({"id": "call_1", "type": "function", "function": {"name": "get_time"}});
    let body = json!({"messages": [{"role": "user", "content": "time?"},
        {"role": "assistant", "content": null, "tool_calls": [call]}]});
    let (status, e) = s.post("/v1/chat/completions", &body).await;
    assert_error(status, &e, 400, Some("messages[1].tool_calls[0].function.arguments"));
    let body = json!({"messages": [{"role": "tool", "tool_call_id": "call_1"}]});
    let (status, e) = s.post("/v1/chat/completions", &body).await;
    assert_error(status, &e, 400, Some("messages[0].content"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_with_calls_and_results_is_answered() {
    let s = TestServer::default().await;
    let messages = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}
    ]);
    let body = chat_with_tools(json!({"messages": messages, "max_tokens": 4}));
    let (status, r) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"][0]["message"]["role"], "assistant");
    // The tools and the history are in the prompt: far more tokens than the question alone.
    let (_, alone) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 1}),
        )
        .await;
    let with = r["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(with > alone["usage"]["prompt_tokens"].as_u64().unwrap() + 100, "{r}");
}

/// What the scripted model says: some text, then two calls in the Hermes form, then EOS.
const SCRIPT: &str = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call><|im_end|>";

/// An executor that answers every prompt with the same tokens, whatever the prompt.
struct Scripted {
    cpu: CpuExecutor,
    script: Vec<u32>,
    eos: u32,
    /// Answers to batches submitted and not yet collected.
    answers: VecDeque<Logits>,
}

impl Executor for Scripted {
    fn config(&self) -> &ModelConfig {
        self.cpu.config()
    }

    fn submit(&mut self, batch: Vec<SeqChunk>, _tokens_from: Option<Vec<usize>>) -> Result<(), ModelError> {
        let vocab = self.cpu.config().vocab_size;
        let mut logits = Logits {
            rows: Vec::new(),
            vocab,
            data: Vec::new(),
            argmax: Vec::new(),
        };
        for (i, chunk) in batch.iter().enumerate() {
            if matches!(chunk.logits, LogitsWanted::None) {
                continue;
            }
            let generated = chunk.end_pos().saturating_sub(chunk.prompt_len);
            let next = self.script.get(generated).copied().unwrap_or(self.eos);
            let mut row = vec![0.0f32; vocab];
            row[next as usize] = 50.0;
            logits.rows.push((i, chunk.end_pos() - 1));
            logits.data.extend(row);
        }
        self.answers.push_back(logits);
        Ok(())
    }

    fn collect(&mut self) -> Result<Logits, ModelError> {
        self.answers
            .pop_front()
            .ok_or_else(|| ModelError::BadBatch("collect without a submitted batch".into()))
    }

    fn kv_layout(&self) -> KvLayout {
        self.cpu.kv_layout()
    }

    fn device(&self) -> String {
        "a script".into()
    }
}

async fn scripted_server() -> TestServer {
    let model = default_model().await;
    let config = engine_config();
    let script = model.tokenizer.encode(SCRIPT, false, true).expect("script tokenizes");
    let eos = model.tokenizer.eos_id().expect("the model has EOS");
    let cpu = cpu_executor(model.transformer, &config).expect("the cache fits");
    let executor = Box::new(Scripted {
        cpu,
        script,
        eos,
        answers: VecDeque::new(),
    });
    let engine =
        EngineHandle::start_with(executor, model.tokenizer, model.chat_template, config).expect("engine starts");
    TestServer::serve(engine, server_config()).await
}

/// (name, arguments) of a message's calls, checking each call's id and type.
fn calls(message: &Value) -> Vec<(String, String)> {
    message["tool_calls"]
        .as_array()
        .map(|calls| {
            calls
                .iter()
                .map(|c| {
                    assert!(c["id"].as_str().unwrap().starts_with("call_"), "{c}");
                    assert_eq!(c["type"], "function");
                    let f = &c["function"];
                    (
                        f["name"].as_str().unwrap().to_string(),
                        f["arguments"].as_str().unwrap().to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The (content, calls, finish reasons, chunks) of a streamed chat completion.
async fn streamed(s: &TestServer, body: &Value) -> (String, Vec<(String, String)>, Vec<String>, Vec<Value>) {
    let chunks: Vec<Value> = stream(s, "/v1/chat/completions", body)
        .await
        .all()
        .await
        .iter()
        .filter_map(|e| e.json())
        .collect();
    let mut content = String::new();
    let mut calls: Vec<(String, String)> = Vec::new();
    let mut finishes = Vec::new();
    for chunk in &chunks {
        let choice = &chunk["choices"][0];
        if let Some(t) = choice["delta"]["content"].as_str() {
            content.push_str(t);
        }
        for call in choice["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let index = call["index"].as_u64().unwrap() as usize;
            let arguments = call["function"]["arguments"].as_str().unwrap();
            if index == calls.len() {
                // A call's first chunk names it and starts its arguments empty.
                assert!(call["id"].as_str().unwrap().starts_with("call_"), "{call}");
                assert_eq!(call["type"], "function");
                assert_eq!(arguments, "", "{call}");
                calls.push((call["function"]["name"].as_str().unwrap().to_string(), String::new()));
            } else {
                assert!(
                    call.get("id").is_none() && call["function"].get("name").is_none(),
                    "{call}"
                );
                calls[index].1.push_str(arguments);
            }
        }
        if let Some(f) = choice["finish_reason"].as_str() {
            finishes.push(f.to_string());
        }
    }
    (content, calls, finishes, chunks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_in_the_output_come_back_as_tool_calls() {
    let s = scripted_server().await;
    let expected = vec![
        ("get_weather".to_string(), "{\"city\": \"Paris\"}".to_string()),
        ("get_time".to_string(), "{}".to_string()),
    ];
    let (status, r) = s.post("/v1/chat/completions", &chat_with_tools(json!({}))).await;
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["message"]["content"], "Let me check.");
    assert_eq!(calls(&choice["message"]), expected);
    assert_eq!(choice["finish_reason"], "tool_calls");

    let (content, streamed_calls, finishes, chunks) = streamed(&s, &chat_with_tools(json!({"stream": true}))).await;
    assert_eq!(content, "Let me check.");
    assert_eq!(streamed_calls, expected);
    assert_eq!(finishes, vec!["tool_calls"]);
    // The arguments came in several pieces, and no chunk carried a piece of a marker as content.
    let tool_chunks = chunks
        .iter()
        .filter(|c| c["choices"][0]["delta"].get("tool_calls").is_some())
        .count();
    assert!(tool_chunks >= 6, "{tool_chunks} tool-call chunks");
    assert!(chunks
        .iter()
        .all(|c| !c["choices"][0]["delta"]["content"].as_str().unwrap_or("").contains('<')));

    // One call only when parallel calls are off.
    let (_, one) = s
        .post(
            "/v1/chat/completions",
            &chat_with_tools(json!({"parallel_tool_calls": false})),
        )
        .await;
    assert_eq!(calls(&one["choices"][0]["message"]), expected[..1].to_vec());
    let (_, one_streamed, _, _) = streamed(
        &s,
        &chat_with_tools(json!({"parallel_tool_calls": false, "stream": true})),
    )
    .await;
    assert_eq!(one_streamed, expected[..1].to_vec());

    // Without tools, or with `tool_choice: "none"`, the same output is plain content.
    for body in [
        json!({"messages": [{"role": "user", "content": "Weather in Paris?"}]}),
        chat_with_tools(json!({"tool_choice": "none"})),
    ] {
        let (status, r) = s.post("/v1/chat/completions", &body).await;
        assert_eq!(status, 200, "{r}");
        let message = &r["choices"][0]["message"];
        assert!(message.get("tool_calls").is_none(), "{r}");
        assert!(message["content"]
            .as_str()
            .unwrap()
            .starts_with("Let me check.\n<tool_call>\n{"));
        assert_eq!(r["choices"][0]["finish_reason"], "stop");
    }
}

/// Checks `arguments` against the weather schema: a JSON object with a string `city`.
fn assert_weather_arguments(arguments: &str) {
    let parsed: Value = serde_json::from_str(arguments).unwrap_or_else(|e| panic!("{arguments}: {e}"));
    let object = parsed
        .as_object()
        .unwrap_or_else(|| panic!("{arguments} is not an object"));
    assert!(object["city"].is_string(), "{arguments}");
    assert!(object.keys().all(|k| k == "city"), "{arguments}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_tool_choice_makes_the_real_model_call_with_valid_arguments() {
    let s = TestServer::default().await;
    let body = chat_with_tools(json!({"tool_choice": "required", "max_tokens": 64}));
    let (status, r) = s.post("/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{r}");
    let choice = &r["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{r}");
    let made = calls(&choice["message"]);
    assert!(!made.is_empty(), "{r}");
    for (name, arguments) in &made {
        match name.as_str() {
            "get_weather" => assert_weather_arguments(arguments),
            "get_time" => assert_eq!(arguments, "{}"),
            other => panic!("called {other}"),
        }
    }
    // A named function is the one called; streamed, the same greedy call arrives in pieces.
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "parallel_tool_calls": false, "max_tokens": 64});
    let (status, r) = s.post("/v1/chat/completions", &chat_with_tools(named.clone())).await;
    assert_eq!(status, 200, "{r}");
    let made = calls(&r["choices"][0]["message"]);
    assert_eq!(made.len(), 1, "{r}");
    assert_eq!(made[0].0, "get_weather");
    assert_weather_arguments(&made[0].1);
    let mut stream_body = chat_with_tools(named);
    stream_body["stream"] = json!(true);
    let (content, streamed_calls, finishes, _) = streamed(&s, &stream_body).await;
    assert_eq!(content, "");
    assert_eq!(streamed_calls, made);
    assert_eq!(finishes, vec!["tool_calls"]);
}
