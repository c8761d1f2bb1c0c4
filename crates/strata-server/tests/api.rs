//! The HTTP API against the real default model: every endpoint, the JSON shapes, n > 1, seeds,
//! logprobs, stop strings, every error OpenAI-shaped, auth, metrics and the OpenAPI document.

mod common;

use std::time::Duration;

use common::{assert_error, server_config, server_losing_gpus, stream, TestServer, LOST_GPU, MODEL};
use serde_json::{json, Value};
use strata_engine::EngineConfig;
use strata_server::prompt::{PromptError, PromptLimit};
use strata_server::ServerConfig;

fn chat(content: &str, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": content}]});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

fn completion(prompt: Value, extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "prompt": prompt});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_openapi_match_the_routes() {
    let s = TestServer::default().await;
    let (status, body) = s.get("/v1/models").await;
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(models["object"], "list");
    assert_eq!(models["data"][0]["id"], MODEL);
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["max_model_len"], 1024);
    let (status, body) = s.get(&format!("/v1/models/{MODEL}")).await;
    assert_eq!(status, 200, "{body}");
    let (status, body) = s.get("/v1/models/gpt-4").await;
    assert_error(status, &serde_json::from_str(&body).unwrap(), 404, Some("model"));
    let (status, body) = s.get("/health").await;
    assert_eq!((status, body.as_str()), (200, r#"{"status":"ok"}"#));

    // The document lists exactly the routes the server has, and each one answers.
    let (status, body) = s.get("/openapi.json").await;
    assert_eq!(status, 200);
    let doc: Value = serde_json::from_str(&body).unwrap();
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let mut documented: Vec<String> = doc["paths"].as_object().unwrap().keys().cloned().collect();
    let mut served: Vec<String> = strata_server::routes()
        .into_iter()
        .map(|(p, _)| p.to_string())
        .collect();
    documented.sort();
    served.sort();
    assert_eq!(documented, served);
    for (path, ops) in doc["paths"].as_object().unwrap() {
        let url = s.url(&path.replace("{model}", MODEL));
        for method in ops.as_object().unwrap().keys() {
            let request = match method.as_str() {
                "get" => s.client.get(&url),
                "post" => s.client.post(&url).body("{}"),
                other => panic!("unexpected method {other}"),
            };
            let r = request.send().await.unwrap();
            let status = r.status().as_u16();
            let text = r.text().await.unwrap();
            assert!(status != 404 && status != 405, "{method} {path}: {status} {text}");
        }
    }
    // The request schema is the parsing type's: every field the chat request accepts is documented.
    let chat_schema = &doc["components"]["schemas"]["ChatCompletionRequest"]["properties"];
    for field in [
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "logprobs",
        "top_logprobs",
        "ignore_eos",
        "stream",
        "stream_options",
        "user",
    ] {
        assert!(chat_schema.get(field).is_some(), "{field} missing from the document");
    }
    let chat_op = &doc["paths"]["/v1/chat/completions"]["post"]["responses"];
    for code in ["200", "400", "401", "404", "413", "429", "500", "503"] {
        assert!(chat_op.get(code).is_some(), "chat response {code} undocumented");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completion_json_shape_seeds_n_and_logprobs() {
    let s = TestServer::default().await;
    let (status, r) = s
        .post(
            "/v1/chat/completions",
            &chat("Name a colour.", json!({"max_tokens": 6, "temperature": 0})),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "chat.completion");
    assert_eq!(r["model"], MODEL);
    assert!(r["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &r["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["message"]["role"], "assistant");
    assert!(!choice["message"]["content"].as_str().unwrap().is_empty());
    assert!(["stop", "length"].contains(&choice["finish_reason"].as_str().unwrap()));
    // Usage agrees with /tokenize of the same messages.
    let (_, tok) = s
        .post(
            "/tokenize",
            &json!({"messages": [{"role": "user", "content": "Name a colour."}]}),
        )
        .await;
    let u = &r["usage"];
    assert_eq!(u["prompt_tokens"], tok["count"]);
    assert!(u["completion_tokens"].as_u64().unwrap() <= 6);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    // Content as a list of text parts and the newer max_completion_tokens give the same answer.
    let parts = json!({"model": MODEL, "max_completion_tokens": 6, "temperature": 0,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Name a "}, {"type": "text", "text": "colour."}]}]});
    let (status, r2) = s.post("/v1/chat/completions", &parts).await;
    assert_eq!(status, 200, "{r2}");
    assert_eq!(r2["choices"][0]["message"], choice["message"]);

    // Seeds: n choices sample with seed + i, so the same seed repeats them exactly.
    let sampled = chat(
        "Tell me a word.",
        json!({"max_tokens": 5, "temperature": 1.0, "top_p": 0.95, "top_k": 40, "min_p": 0.01,
            "presence_penalty": 0.5, "frequency_penalty": 0.2, "repetition_penalty": 1.1,
            "seed": 1234, "n": 3, "user": "tester", "ignore_eos": true}),
    );
    let (status, a) = s.post("/v1/chat/completions", &sampled).await;
    assert_eq!(status, 200, "{a}");
    let (_, b) = s.post("/v1/chat/completions", &sampled).await;
    let texts = |r: &Value| -> Vec<String> {
        r["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["message"]["content"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(texts(&a), texts(&b));
    let indexes: Vec<u64> = a["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["index"].as_u64().unwrap())
        .collect();
    assert_eq!(indexes, vec![0, 1, 2]);
    assert_eq!(a["usage"]["completion_tokens"], 15, "ignore_eos: 3 x 5 tokens");
    // The prompt is counted once however many choices it has.
    let (_, one) = s
        .post(
            "/v1/chat/completions",
            &chat("Tell me a word.", json!({"max_tokens": 1})),
        )
        .await;
    assert_eq!(a["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);

    // Log-probabilities: one entry per token, each with top_logprobs alternatives.
    let (status, lp) = s
        .post(
            "/v1/chat/completions",
            &chat(
                "Hi",
                json!({"max_tokens": 4, "temperature": 0, "logprobs": true, "top_logprobs": 3, "ignore_eos": true}),
            ),
        )
        .await;
    assert_eq!(status, 200, "{lp}");
    let content = lp["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    for t in content {
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
        assert!(t["token"].is_string() && t["bytes"].is_array());
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], t["token"]);
    }
    let joined: String = content.iter().map(|t| t["token"].as_str().unwrap()).collect();
    assert_eq!(joined, lp["choices"][0]["message"]["content"].as_str().unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_take_every_prompt_form() {
    let s = TestServer::default().await;
    let greedy = json!({"max_tokens": 5, "temperature": 0, "ignore_eos": true});
    let (status, r) = s
        .post(
            "/v1/completions",
            &completion(json!("The capital of France is"), greedy.clone()),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["object"], "text_completion");
    assert!(r["id"].as_str().unwrap().starts_with("cmpl-"));
    let text = r["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(r["choices"][0]["finish_reason"], "length");
    assert_eq!(r["usage"]["completion_tokens"], 5);

    // The same prompt as token ids gives the same text.
    let (_, tok) = s
        .post("/tokenize", &json!({"prompt": "The capital of France is"}))
        .await;
    let ids = tok["tokens"].clone();
    assert_eq!(tok["count"], r["usage"]["prompt_tokens"]);
    let (status, r2) = s
        .post("/v1/completions", &completion(ids.clone(), greedy.clone()))
        .await;
    assert_eq!(status, 200, "{r2}");
    assert_eq!(r2["choices"][0]["text"], text.as_str());

    // Lists: two prompts x n = 2 are four choices, indexed prompt * n + i.
    let mut two = greedy.clone();
    two["n"] = json!(2);
    let (status, r3) = s
        .post(
            "/v1/completions",
            &completion(json!(["The capital of France is", "One, two, three,"]), two.clone()),
        )
        .await;
    assert_eq!(status, 200, "{r3}");
    let choices = r3["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    assert_eq!(choices[0]["text"], text.as_str());
    assert_eq!(choices[1]["text"], text.as_str(), "greedy choices agree");
    let (status, r4) = s
        .post(
            "/v1/completions",
            &completion(json!([ids.clone(), ids.clone()]), greedy.clone()),
        )
        .await;
    assert_eq!(status, 200, "{r4}");
    assert_eq!(r4["choices"][1]["text"], text.as_str());
    assert_eq!(
        r4["usage"]["prompt_tokens"].as_u64().unwrap(),
        2 * tok["count"].as_u64().unwrap()
    );

    // A stop string taken from the greedy text ends it there, left out of the text.
    let word = text.split_whitespace().nth(1).unwrap_or(text.trim()).to_string();
    let mut stop = greedy.clone();
    stop["stop"] = json!([word.clone()]);
    let (status, r5) = s
        .post("/v1/completions", &completion(json!("The capital of France is"), stop))
        .await;
    assert_eq!(status, 200, "{r5}");
    assert_eq!(r5["choices"][0]["finish_reason"], "stop");
    assert_eq!(r5["choices"][0]["stop_reason"], word.as_str());
    let stopped = r5["choices"][0]["text"].as_str().unwrap();
    assert!(
        text.starts_with(stopped) && !stopped.contains(&word),
        "{stopped:?} vs {text:?}"
    );

    // Legacy logprobs: tokens, token_logprobs, top_logprobs maps, text offsets.
    let mut lp = greedy.clone();
    lp["logprobs"] = json!(2);
    let (status, r6) = s.post("/v1/completions", &completion(json!("Hello"), lp)).await;
    assert_eq!(status, 200, "{r6}");
    let l = &r6["choices"][0]["logprobs"];
    assert_eq!(l["tokens"].as_array().unwrap().len(), 5);
    assert_eq!(l["token_logprobs"].as_array().unwrap().len(), 5);
    assert_eq!(l["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert_eq!(l["text_offset"][0], 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_round_trip() {
    let s = TestServer::default().await;
    let text = "Hello, wörld! <|im_start|>";
    let (status, t) = s
        .post("/tokenize", &json!({"prompt": text, "add_special_tokens": false}))
        .await;
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["max_model_len"], 1024);
    assert_eq!(
        t["count"].as_u64().unwrap() as usize,
        t["tokens"].as_array().unwrap().len()
    );
    let (status, d) = s.post("/detokenize", &json!({"tokens": t["tokens"]})).await;
    assert_eq!(status, 200, "{d}");
    assert_eq!(d["prompt"], text);
    let (status, m) = s
        .post(
            "/tokenize",
            &json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}),
        )
        .await;
    assert_eq!(status, 200, "{m}");
    let (_, rendered) = s.post("/detokenize", &json!({"tokens": m["tokens"]})).await;
    let rendered = rendered["prompt"].as_str().unwrap();
    assert!(rendered.contains("Be brief.") && rendered.contains("Hi"), "{rendered}");
    let (status, e) = s.post("/detokenize", &json!({"tokens": [1, 99999999]})).await;
    assert_error(status, &e, 400, Some("tokens[1]"));
    let (status, e) = s.post("/tokenize", &json!({})).await;
    assert_error(status, &e, 400, Some("prompt"));
    let (status, e) = s.post("/tokenize", &json!({"prompt": "x", "model": "other"})).await;
    assert_error(status, &e, 404, Some("model"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_request_gets_an_openai_error() {
    let s = TestServer::start(
        common::engine_config(),
        ServerConfig {
            max_request_body_bytes: 1 << 20,
            ..server_config()
        },
    )
    .await;
    let c = "/v1/chat/completions";
    let ok_messages = json!([{"role": "user", "content": "hi"}]);
    // Invalid JSON, empty bodies, arrays.
    for raw in ["{\"messages\": [", "", "   ", "[1, 2]", "nul", "{} {}", "\u{0}\u{1}"] {
        let (status, e) = s.post_raw(c, raw.to_string()).await;
        assert_error(status, &e, 400, None);
    }
    // Wrong types and values name the field.
    let cases: Vec<(Value, &str)> = vec![
        (json!({"model": MODEL}), "messages"),
        (json!({"messages": "hi"}), "messages"),
        (json!({"messages": []}), "messages"),
        (json!({"messages": [{"role": "user"}]}), "messages[0].content"),
        (json!({"messages": [{"content": "x"}]}), "messages[0].role"),
        (
            json!({"messages": [{"role": "robot", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": [{"role": "user", "content": 7}]}),
            "messages[0].content",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages[0].content[0].type",
        ),
        (json!({"messages": ok_messages, "temperature": "hot"}), "temperature"),
        (json!({"messages": ok_messages, "temperature": -1}), "temperature"),
        (json!({"messages": ok_messages, "top_p": 1.5}), "top_p"),
        (json!({"messages": ok_messages, "top_k": -3}), "top_k"),
        (json!({"messages": ok_messages, "min_p": 3}), "min_p"),
        (
            json!({"messages": ok_messages, "presence_penalty": 9}),
            "presence_penalty",
        ),
        (
            json!({"messages": ok_messages, "frequency_penalty": -9}),
            "frequency_penalty",
        ),
        (
            json!({"messages": ok_messages, "repetition_penalty": 0}),
            "repetition_penalty",
        ),
        (
            json!({"messages": ok_messages, "repetition_penalty": 18446744073709551616.0}),
            "repetition_penalty",
        ),
        (json!({"messages": ok_messages, "temperature": 1000}), "temperature"),
        (json!({"messages": ok_messages, "stop": vec!["x"; 17]}), "stop"),
        (
            json!({"messages": ok_messages, "stop": ["a", "b".repeat(600)]}),
            "stop[1]",
        ),
        (
            json!({"messages": ok_messages, "stop_token_ids": vec![1; 2000]}),
            "stop_token_ids",
        ),
        (json!({"messages": ok_messages, "max_tokens": 0}), "max_tokens"),
        (json!({"messages": ok_messages, "max_tokens": -5}), "max_tokens"),
        (json!({"messages": ok_messages, "max_tokens": 1e10}), "max_tokens"),
        (
            json!({"messages": ok_messages, "max_completion_tokens": "many"}),
            "max_completion_tokens",
        ),
        (json!({"messages": ok_messages, "n": 0}), "n"),
        (json!({"messages": ok_messages, "n": 1000}), "n"),
        (json!({"messages": ok_messages, "stop": 5}), "stop"),
        (json!({"messages": ok_messages, "stop": ["a", ""]}), "stop[1]"),
        (json!({"messages": ok_messages, "seed": "lucky"}), "seed"),
        (json!({"messages": ok_messages, "logprobs": 3}), "logprobs"),
        (json!({"messages": ok_messages, "top_logprobs": 2}), "top_logprobs"),
        (
            json!({"messages": ok_messages, "logprobs": true, "top_logprobs": 50}),
            "top_logprobs",
        ),
        (json!({"messages": ok_messages, "stream": "yes"}), "stream"),
        (
            json!({"messages": ok_messages, "stream_options": {"include_usage": true}}),
            "stream_options",
        ),
        (json!({"messages": ok_messages, "ignore_eos": 1}), "ignore_eos"),
        (json!({"messages": ok_messages, "user": 5}), "user"),
    ];
    for (body, param) in cases {
        let (status, e) = s.post(c, &body).await;
        assert_error(status, &e, 400, Some(param));
    }
    let completion_cases: Vec<(Value, &str)> = vec![
        (json!({}), "prompt"),
        (json!({"prompt": 5}), "prompt"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": [[]]}), "prompt"),
        (json!({"prompt": [1, -2]}), "prompt"),
        (json!({"prompt": [1, 99999999]}), "prompt"),
        (json!({"prompt": "x", "logprobs": 50}), "logprobs"),
        (json!({"prompt": "x", "echo": true}), "echo"),
        (json!({"prompt": "x", "suffix": "y"}), "suffix"),
        (json!({"prompt": "x", "best_of": 3}), "best_of"),
    ];
    for (body, param) in completion_cases {
        let (status, e) = s.post("/v1/completions", &body).await;
        assert_error(status, &e, 400, Some(param));
    }
    // A prompt longer than --max-model-len: 400 with both numbers.
    let long: Vec<u32> = (0..2000).map(|i| 100 + i % 1000).collect();
    let (status, e) = s.post("/v1/completions", &json!({"prompt": long})).await;
    assert_error(status, &e, 400, Some("prompt"));
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(message.contains("1024") && message.contains("2000"), "{message}");
    let (status, e) = s
        .post(
            c,
            &json!({"messages": [{"role": "user", "content": "word ".repeat(1500)}]}),
        )
        .await;
    assert_error(status, &e, 400, Some("messages"));
    assert_eq!(e["error"]["code"], "context_length_exceeded");
    // Unknown model: 404.
    let (status, e) = s.post(c, &json!({"model": "gpt-4o", "messages": ok_messages})).await;
    assert_error(status, &e, 404, Some("model"));
    assert_eq!(e["error"]["code"], "model_not_found");
    // Body too large: 413.
    let big = format!(r#"{{"prompt": "{}"}}"#, "a".repeat(2 << 20));
    let (status, e) = s.post_raw("/v1/completions", big).await;
    assert_error(status, &e, 413, None);
    // Unknown route and wrong method.
    let r = s.client.get(s.url("/v2/nothing")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
    assert!(r.json::<Value>().await.unwrap()["error"]["message"].is_string());
    let r = s.client.get(s.url("/v1/chat/completions")).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 405);
    assert!(r.json::<Value>().await.unwrap()["error"]["message"].is_string());
    // Junk never takes the server down.
    let nested = "[".repeat(10_000);
    let junk = [
        nested.as_str(),
        r#"{"messages": [{"role": "user", "content": "\ud800"}]}"#,
        r#"{"messages": null}"#,
        r#"{"prompt": "x", "max_tokens": 18446744073709551616}"#,
        r#"{"prompt": "x", "temperature": 1e400}"#,
    ];
    for raw in junk {
        let (status, e) = s.post_raw("/v1/completions", raw.to_string()).await;
        assert_error(status, &e, 400, None);
    }
    let (status, _) = s.get("/health").await;
    assert_eq!(status, 200);
    // A temperature too small to divide by is greedy, as in vLLM.
    let (status, r) = s
        .post(
            c,
            &json!({"messages": ok_messages, "max_tokens": 2, "temperature": 1e-9}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    // Unknown fields are ignored, nulls mean "not given".
    let (status, r) = s
        .post(
            c,
            &json!({"messages": ok_messages, "max_tokens": 2, "tools": [], "stop": null, "n": null, "response_format": {"type": "text"}}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_is_required_except_for_health_and_metrics() {
    let s = TestServer::start(
        common::engine_config(),
        ServerConfig {
            api_key: Some("sekret-key".into()),
            ..server_config()
        },
    )
    .await;
    let body = json!({"prompt": "Hi", "max_tokens": 2});
    let send = |auth: Option<&'static str>| {
        let mut r = s.client.post(s.url("/v1/completions")).json(&body);
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        r.send()
    };
    for auth in [
        None,
        Some("Bearer wrong-key"),
        Some("Bearer sekret-ke"),
        Some("Basic sekret-key"),
        Some("sekret-key"),
    ] {
        let r = send(auth).await.unwrap();
        let status = r.status().as_u16();
        assert_eq!(r.headers()["www-authenticate"], "Bearer");
        let e: Value = r.json().await.unwrap();
        assert_error(status, &e, 401, None);
        assert_eq!(e["error"]["code"], "invalid_api_key");
    }
    let r = send(Some("Bearer sekret-key")).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let r = send(Some("bearer sekret-key")).await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "the scheme is case-insensitive");
    let (status, _) = s.get("/v1/models").await;
    assert_eq!(status, 401);
    let (status, e) = s.post("/tokenize", &json!({"prompt": "x"})).await;
    assert_error(status, &e, 401, None);
    for open in ["/health", "/metrics", "/openapi.json"] {
        assert_eq!(s.get(open).await.0, 200, "{open}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_requests_latencies_and_engine_state() {
    let s = TestServer::default().await;
    let (status, _) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "One, two,", "max_tokens": 4, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200);
    let (status, _) = s.post("/v1/completions", &json!({"prompt": 3})).await;
    assert_eq!(status, 400);
    // Engine gauges are as of its last step, published just after the reply went out.
    assert!(s.wait_blocks_free(Duration::from_secs(5)).await);
    let r = s.client.get(s.url("/metrics")).send().await.unwrap();
    assert!(r.headers()["content-type"].to_str().unwrap().starts_with("text/plain"));
    let text = r.text().await.unwrap();
    let value = |line_start: &str| -> f64 {
        text.lines()
            .find(|l| l.starts_with(line_start))
            .unwrap_or_else(|| panic!("{line_start} missing from\n{text}"))
            .rsplit(' ')
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(
        value("strata_http_requests_total{route=\"/v1/completions\",status=\"200\"}"),
        1.0
    );
    assert_eq!(
        value("strata_http_requests_total{route=\"/v1/completions\",status=\"400\"}"),
        1.0
    );
    assert_eq!(value("strata_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(value("strata_inter_token_latency_seconds_count"), 3.0);
    assert_eq!(value("strata_e2e_request_latency_seconds_count"), 1.0);
    assert_eq!(value("strata_request_finished_total{finish_reason=\"length\"}"), 1.0);
    assert!(value("strata_prompt_tokens_total") >= 3.0);
    assert_eq!(value("strata_generation_tokens_total"), 4.0);
    assert_eq!(value("strata_num_requests_running"), 0.0);
    assert_eq!(value("strata_num_requests_waiting"), 0.0);
    assert_eq!(value("strata_kv_blocks_used"), 0.0);
    assert_eq!(value("strata_kv_blocks_free"), value("strata_kv_blocks_total"));
    assert!(value("strata_prefix_cache_hit_rate") >= 0.0);
    assert_eq!(value("strata_engine_alive"), 1.0);
    for family in [
        "strata_time_to_first_token_seconds",
        "strata_inter_token_latency_seconds",
        "strata_e2e_request_latency_seconds",
    ] {
        assert!(text.contains(&format!("# TYPE {family} histogram")));
        assert!(text.contains(&format!("{family}_bucket{{le=\"+Inf\"}}")));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_engine_gives_503_and_unhealthy() {
    let s = TestServer::default().await;
    let engine = s.engine.clone();
    tokio::task::spawn_blocking(move || engine.shutdown()).await.unwrap();
    let (status, body) = s.get("/health").await;
    assert_error(status, &serde_json::from_str(&body).unwrap(), 503, None);
    let (status, e) = s
        .post("/v1/chat/completions", &chat("hi", json!({"max_tokens": 2})))
        .await;
    assert_error(status, &e, 503, None);
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "hi", "stream": true}))
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 503);
    let (_, metrics) = s.get("/metrics").await;
    assert!(metrics.contains("strata_engine_alive 0"));
}

/// A 503 `service_unavailable` error that gives the executor's reason.
fn assert_unavailable(status: u16, body: &Value) {
    assert_error(status, body, 503, None);
    assert_eq!(body["error"]["type"], "service_unavailable", "{body}");
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains(LOST_GPU), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_gpu_gives_503_with_the_reason_and_unhealthy() {
    let s = server_losing_gpus().await;
    let (status, body) = s
        .post(
            "/v1/completions",
            &completion(json!("Once upon a time"), json!({"max_tokens": 8, "ignore_eos": true})),
        )
        .await;
    assert_unavailable(status, &body);
    let (status, body) = s.get("/health").await;
    assert_unavailable(status, &serde_json::from_str(&body).unwrap());
    // Later requests are refused at once, with the same reason.
    let (status, body) = s
        .post("/v1/chat/completions", &chat("hi", json!({"max_tokens": 2})))
        .await;
    assert_unavailable(status, &body);
    let (_, metrics) = s.get("/metrics").await;
    assert!(metrics.contains("strata_engine_alive 0"));

    // A stream that is running when the GPUs go ends with the error event, then [DONE].
    let s = server_losing_gpus().await;
    let events = stream(
        &s,
        "/v1/chat/completions",
        &chat(
            "Tell me a story",
            json!({"max_tokens": 8, "ignore_eos": true, "stream": true}),
        ),
    )
    .await
    .all()
    .await;
    let data: Vec<&str> = events.iter().filter_map(|e| e.data.as_deref()).collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{data:?}");
    let error: Value = serde_json::from_str(data[data.len() - 2]).expect("the error event is JSON");
    assert_unavailable(503, &error);
    let (status, body) = s.get("/health").await;
    assert_unavailable(status, &serde_json::from_str(&body).unwrap());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prompts_that_cannot_fit_are_refused_before_tokenizing() {
    let s = TestServer::default().await;
    let tokenizer = s.engine.tokenizer();
    let limit = PromptLimit::new(tokenizer, 1024);
    // No text has fewer tokens than its bytes over the longest token's.
    for text in [
        "Hello, world!",
        "     \n\n\t  x",
        "こんにちは世界",
        "============",
        "<|im_start|>user",
    ] {
        let ids = limit.text_ids(tokenizer, text, false).expect("fits");
        assert!(ids.len() * limit.max_token_bytes >= text.len(), "{text:?}: {ids:?}");
    }
    // One byte more than that bound is refused by its length: the tokenizer never sees it.
    let over = "a".repeat(limit.max_text_bytes() + 1);
    match limit.text_ids(tokenizer, &over, true) {
        Err(PromptError::TooLong { bytes, .. }) => assert_eq!(bytes, over.len()),
        other => panic!("not refused by length: {:?}", other.map(|ids| ids.len())),
    }
    let fitting = "a".repeat(limit.max_text_bytes());
    assert!(limit.check_text(&fitting).is_ok());

    // Over HTTP: 2 MB of text (a million tokens) gets the context-length 400 that names bytes.
    let big = "a ".repeat(1 << 20);
    let refused_by_length = |status: u16, e: &Value, param: &str| {
        assert_error(status, e, 400, Some(param));
        assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
        let message = e["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("1024 tokens") && message.contains("bytes of text"),
            "{message}"
        );
    };
    let (status, e) = s.post("/v1/chat/completions", &chat(&big, json!({}))).await;
    refused_by_length(status, &e, "messages");
    let (status, e) = s.post("/v1/completions", &completion(json!(big), json!({}))).await;
    refused_by_length(status, &e, "prompt");
    let (status, e) = s
        .post("/v1/completions", &completion(json!(["Hi", big]), json!({})))
        .await;
    refused_by_length(status, &e, "prompt");
    let (status, e) = s.post("/tokenize", &json!({"prompt": big})).await;
    refused_by_length(status, &e, "prompt");
    let (status, e) = s
        .post("/tokenize", &json!({"messages": [{"role": "user", "content": big}]}))
        .await;
    refused_by_length(status, &e, "messages");
    // Token ids: a list of max_model_len ids or more, refused with both numbers.
    let (status, e) = s
        .post(
            "/v1/completions",
            &completion(json!([[1, 2], vec![7; 5000]]), json!({})),
        )
        .await;
    assert_error(status, &e, 400, Some("prompt"));
    assert!(e["error"]["message"].as_str().unwrap().contains("5000 tokens"), "{e}");
    // /tokenize refuses what it counts beyond --max-model-len, like the other endpoints.
    let (status, e) = s.post("/tokenize", &json!({"prompt": "word ".repeat(1500)})).await;
    assert_error(status, &e, 400, Some("prompt"));
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    let (status, t) = s.post("/tokenize", &json!({"prompt": "word ".repeat(500)})).await;
    assert_eq!(status, 200, "{t}");
    let (status, _) = s.get("/health").await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn post_bodies_must_be_declared_as_json() {
    let s = TestServer::default().await;
    let body = json!({"prompt": "Hi"}).to_string();
    let send = |path: &'static str, content_type: Option<&'static str>| {
        let mut r = s.client.post(s.url(path)).body(body.clone());
        if let Some(t) = content_type {
            r = r.header("content-type", t);
        }
        r.send()
    };
    for (path, content_type) in [
        ("/v1/completions", Some("text/plain")),
        ("/v1/completions", Some("application/x-www-form-urlencoded")),
        ("/v1/completions", None),
        ("/v1/chat/completions", Some("multipart/form-data; boundary=x")),
        ("/tokenize", Some("text/plain;charset=UTF-8")),
        ("/detokenize", Some("application/jsonx")),
        ("/tokenize", Some("application/+json")),
    ] {
        let r = send(path, content_type).await.unwrap();
        let status = r.status().as_u16();
        let e: Value = r.json().await.unwrap();
        assert_error(status, &e, 415, None);
        assert_eq!(e["error"]["code"], "unsupported_media_type", "{path} {content_type:?}");
    }
    for content_type in [
        "application/json",
        "Application/JSON; charset=utf-8",
        "application/vnd.api+json",
    ] {
        let r = send("/tokenize", Some(content_type)).await.unwrap();
        assert_eq!(r.status().as_u16(), 200, "{content_type}");
    }
    // Unknown routes stay 404 whatever the body.
    let r = send("/v1/nothing", Some("text/plain")).await.unwrap();
    assert_eq!(r.status().as_u16(), 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_speculating_server_answers_as_without_and_counts_drafts_on_metrics() {
    let config = EngineConfig {
        speculative_ngram: Some(strata_engine::NgramSpeculation::parse("3:1:4").unwrap()),
        ..common::engine_config()
    };
    let s = TestServer::start(config, common::server_config()).await;
    assert_answers_as_without_and_counts_drafts(s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_drafting_with_a_model_answers_as_without_and_counts_drafts_on_metrics() {
    let config = EngineConfig {
        speculative_model: Some(strata_engine::DraftModelSpeculation::new(4)),
        ..common::engine_config()
    };
    let (target, draft) = (common::default_model().await, common::default_model().await);
    let engine = strata_engine::EngineHandle::start_with_draft_model(target, Some(draft), config).unwrap();
    let s = TestServer::serve(engine, common::server_config()).await;
    assert_answers_as_without_and_counts_drafts(s).await;
}

/// A request opted out of speculation and the same one drafting get the same text, and only
/// the second one's drafts show on /metrics.
async fn assert_answers_as_without_and_counts_drafts(s: TestServer) {
    let body = |speculative: bool| {
        json!({"prompt": "Red, green, blue. Red, green, blue. Red, green, blue. Red,", "max_tokens": 24,
               "ignore_eos": true, "temperature": 0, "speculative": speculative})
    };
    let (status, plain) = s.post("/v1/completions", &body(false)).await;
    assert_eq!(status, 200, "{plain}");
    let (_, metrics) = s.get("/metrics").await;
    assert!(
        metrics.contains("strata_spec_decode_num_draft_tokens_total 0\n"),
        "opted out: {metrics}"
    );
    let (status, drafted) = s.post("/v1/completions", &body(true)).await;
    assert_eq!(status, 200, "{drafted}");
    assert_eq!(plain["choices"][0]["text"], drafted["choices"][0]["text"]);
    assert_eq!(drafted["usage"]["completion_tokens"], 24);
    assert!(s.wait_blocks_free(Duration::from_secs(5)).await);
    let (_, metrics) = s.get("/metrics").await;
    let value = |name: &str| -> f64 {
        let line = metrics
            .lines()
            .find(|l| l.starts_with(name))
            .unwrap_or_else(|| panic!("{name} missing"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert!(
        value("strata_spec_decode_num_accepted_tokens_total ") > 0.0,
        "{metrics}"
    );
    assert!(value("strata_spec_decode_acceptance_rate ") > 0.0);
    assert!(value("strata_spec_decode_num_draft_tokens_per_pos{position=\"0\"}") > 0.0);
}
