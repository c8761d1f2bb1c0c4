//! What browsers and OpenAI clients send, against the real default model: CORS preflights and
//! headers (`--allowed-origins`), `system_fingerprint`, OpenAI's limits on temperature and
//! max tokens, `logit_bias` and `response_format` checks, and llama.cpp's `/tokenize` shape.

mod common;

use common::{assert_error, chunks, engine_config, server_config, stream, TestServer, MODEL};
use reqwest::header::HeaderMap;
use reqwest::Method;
use serde_json::{json, Value};
use strata_server::{AllowedOrigins, ServerConfig};

const PAGE: &str = "http://localhost:5173";
const KEY: &str = "browser-key";

fn chat(extra: Value) -> Value {
    let mut body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

fn allow_origin(h: &HeaderMap) -> Option<&str> {
    h.get("access-control-allow-origin").map(|v| v.to_str().unwrap())
}

fn varies_on_origin(h: &HeaderMap) -> bool {
    h.get_all("vary")
        .iter()
        .any(|v| v.to_str().unwrap().to_ascii_lowercase().contains("origin"))
}

async fn preflight(s: &TestServer, path: &str, origin: &str) -> reqwest::Response {
    s.client
        .request(Method::OPTIONS, s.url(path))
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization,content-type,x-stainless-os",
        )
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cors_preflights_come_before_auth_and_every_answer_to_the_origin_is_marked() {
    let s = TestServer::start(
        engine_config(),
        ServerConfig {
            api_key: Some(KEY.into()),
            allowed_origins: AllowedOrigins::parse(&[PAGE]).unwrap(),
            ..server_config()
        },
    )
    .await;
    // A browser's preflight: 204 with what it may send, though it carries no API key.
    for path in ["/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize"] {
        let r = preflight(&s, path, PAGE).await;
        assert_eq!(r.status().as_u16(), 204, "{path}");
        let h = r.headers();
        assert_eq!(allow_origin(h), Some(PAGE));
        assert!(varies_on_origin(h));
        assert!(h["access-control-allow-methods"].to_str().unwrap().contains("POST"));
        let allowed = h["access-control-allow-headers"].to_str().unwrap();
        for name in ["authorization", "content-type", "x-stainless-os"] {
            assert!(allowed.contains(name), "{allowed}");
        }
        assert_eq!(h["access-control-max-age"], "7200");
    }
    // Another origin's preflight: 403, OpenAI-shaped, nothing that lets its page read on.
    let r = preflight(&s, "/v1/chat/completions", "http://evil.example").await;
    assert_eq!(allow_origin(r.headers()), None);
    let status = r.status().as_u16();
    let e: Value = r.json().await.unwrap();
    assert_error(status, &e, 403, None);
    assert_eq!(e["error"]["code"], "origin_not_allowed");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("--allowed-origins"),
        "{e}"
    );
    // The real requests: errors, answers and streams all carry the header for the page.
    let post = |body: Value, key: Option<&str>, origin: &str| {
        let mut r = s
            .client
            .post(s.url("/v1/chat/completions"))
            .header("origin", origin)
            .json(&body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        r.send()
    };
    let r = post(chat(json!({})), None, PAGE).await.unwrap();
    assert_eq!(r.status().as_u16(), 401);
    assert_eq!(allow_origin(r.headers()), Some(PAGE), "a 401 is readable by the page");
    let r = post(chat(json!({"temperature": 5})), Some(KEY), PAGE).await.unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_eq!(allow_origin(r.headers()), Some(PAGE));
    let r = post(chat(json!({})), Some(KEY), PAGE).await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(allow_origin(r.headers()), Some(PAGE));
    assert!(varies_on_origin(r.headers()));
    let r = post(chat(json!({"stream": true})), Some(KEY), PAGE).await.unwrap();
    assert_eq!(r.headers()["content-type"], "text/event-stream");
    assert_eq!(
        allow_origin(r.headers()),
        Some(PAGE),
        "an SSE stream is readable by the page"
    );
    assert!(r.text().await.unwrap().contains("[DONE]"));
    let r = s
        .client
        .get(s.url("/health"))
        .header("origin", PAGE)
        .send()
        .await
        .unwrap();
    assert_eq!(allow_origin(r.headers()), Some(PAGE));
    // Another origin's request is served (it is not a browser's business) but not marked.
    let r = post(chat(json!({})), Some(KEY), "http://evil.example").await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(allow_origin(r.headers()), None);
    assert!(varies_on_origin(r.headers()));
    // An OPTIONS that is no preflight (no Origin) is an ordinary request: it needs the key.
    let r = s
        .client
        .request(Method::OPTIONS, s.url("/v1/models"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn system_fingerprint_is_on_every_answer_and_chunk_and_cors_is_off_by_default() {
    let s = TestServer::default().await;
    let want = strata_server::system_fingerprint(MODEL, &engine_config());
    assert!(
        want.starts_with("fp_") && want.len() == 13 && want[3..].chars().all(|c| c.is_ascii_hexdigit()),
        "{want}"
    );
    let (status, r) = s.post("/v1/chat/completions", &chat(json!({}))).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["system_fingerprint"], want);
    let (status, r) = s
        .post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 2}))
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["system_fingerprint"], want);
    let events = stream(
        &s,
        "/v1/chat/completions",
        &chat(json!({"stream": true, "stream_options": {"include_usage": true}})),
    )
    .await
    .all()
    .await;
    let chat_chunks = chunks(&events);
    assert!(chat_chunks.len() >= 3);
    assert!(
        chat_chunks.iter().all(|c| c["system_fingerprint"] == want),
        "{chat_chunks:?}"
    );
    let body = json!({"prompt": "Hi", "max_tokens": 2, "stream": true});
    let completion_chunks = chunks(&stream(&s, "/v1/completions", &body).await.all().await);
    assert!(!completion_chunks.is_empty());
    assert!(completion_chunks.iter().all(|c| c["system_fingerprint"] == want));
    // Another model name or precision is another fingerprint.
    assert_ne!(strata_server::system_fingerprint("other", &engine_config()), want);
    // Without --allowed-origins: no CORS headers, and a preflight is told how to allow it.
    let r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .header("origin", PAGE)
        .json(&chat(json!({})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(allow_origin(r.headers()), None);
    assert!(!varies_on_origin(r.headers()));
    let r = preflight(&s, "/v1/chat/completions", PAGE).await;
    assert_eq!(r.status().as_u16(), 403);
    assert_eq!(allow_origin(r.headers()), None);
    let e: Value = r.json().await.unwrap();
    assert!(e["error"]["message"].as_str().unwrap().contains(PAGE), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn temperature_and_max_tokens_are_held_to_openais_limits() {
    let s = TestServer::default().await;
    let c = "/v1/chat/completions";
    for t in [2.01, 5.0, -0.1] {
        let (status, e) = s.post(c, &chat(json!({"temperature": t}))).await;
        assert_error(status, &e, 400, Some("temperature"));
        let (status, e) = s
            .post("/v1/completions", &json!({"prompt": "x", "temperature": t}))
            .await;
        assert_error(status, &e, 400, Some("temperature"));
    }
    let (status, r) = s.post(c, &chat(json!({"temperature": 2}))).await;
    assert_eq!(status, 200, "{r}");
    // Prompt + max tokens over --max-model-len (1024): 400 with the numbers, not a clamp.
    let (status, t) = s
        .post("/tokenize", &json!({"messages": [{"role": "user", "content": "Hi"}]}))
        .await;
    assert_eq!(status, 200, "{t}");
    let prompt_tokens = t["count"].as_u64().unwrap();
    for field in ["max_tokens", "max_completion_tokens"] {
        let room = 1024 - prompt_tokens;
        let (status, e) = s.post(c, &chat(json!({field: room + 1}))).await;
        assert_error(status, &e, 400, Some(field));
        assert_eq!(e["error"]["code"], "context_length_exceeded");
        let message = e["error"]["message"].as_str().unwrap();
        for number in [1024, prompt_tokens, room + 1, 1025] {
            assert!(message.contains(&number.to_string()), "{number}: {message}");
        }
    }
    let ids: Vec<u32> = (0..1000).map(|i| 100 + i).collect();
    let (status, e) = s
        .post("/v1/completions", &json!({"prompt": ids, "max_tokens": 25}))
        .await;
    assert_error(status, &e, 400, Some("max_tokens"));
    assert!(e["error"]["message"].as_str().unwrap().contains("1025 tokens"), "{e}");
    let (status, r) = s
        .post(
            "/v1/completions",
            &json!({"prompt": ids, "max_tokens": 24, "ignore_eos": true}),
        )
        .await;
    assert_eq!(status, 200, "exactly what fits is accepted: {r}");
    assert_eq!(r["usage"]["completion_tokens"], 24);
    // Without max_tokens, the default (16 for completions) shrinks to what fits.
    let ids: Vec<u32> = (0..1020).map(|i| 100 + i).collect();
    let (status, r) = s
        .post("/v1/completions", &json!({"prompt": ids, "ignore_eos": true}))
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["completion_tokens"], 4);
    assert_eq!(r["choices"][0]["finish_reason"], "length");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_takes_llama_cpp_content() {
    let s = TestServer::default().await;
    let text = "Hello, world";
    let (status, plain) = s
        .post("/tokenize", &json!({"prompt": text, "add_special_tokens": false}))
        .await;
    assert_eq!(status, 200, "{plain}");
    let (status, content) = s.post("/tokenize", &json!({"content": text})).await;
    assert_eq!(status, 200, "{content}");
    assert_eq!(content["tokens"], plain["tokens"], "llama.cpp adds no BOS unless asked");
    assert_eq!(content["count"], plain["count"]);
    assert_eq!(content["max_model_len"], 1024);
    let (_, with_bos) = s.post("/tokenize", &json!({"prompt": text})).await;
    let (status, asked) = s
        .post("/tokenize", &json!({"content": text, "add_special": true}))
        .await;
    assert_eq!(status, 200, "{asked}");
    assert_eq!(asked["tokens"], with_bos["tokens"]);
    let (status, e) = s.post("/tokenize", &json!({"content": text, "prompt": text})).await;
    assert_error(status, &e, 400, Some("prompt"));
    let (status, e) = s
        .post("/tokenize", &json!({"content": text, "with_pieces": true}))
        .await;
    assert_error(status, &e, 400, Some("with_pieces"));
    let (status, e) = s.post("/tokenize", &json!({"content": 5})).await;
    assert_error(status, &e, 400, Some("content"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_and_response_format_are_checked() {
    let s = TestServer::default().await;
    let c = "/v1/chat/completions";
    let vocab = s.engine.tokenizer().vocab_size();
    let schema = json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]});
    let accepted = [
        json!({"logit_bias": {"0": -100, "17": 100, "42": 2.5}}),
        json!({"logit_bias": {(vocab - 1).to_string(): -1}}),
        json!({"logit_bias": {}}),
        json!({"logit_bias": null, "response_format": null}),
        json!({"response_format": {"type": "text"}}),
        json!({"response_format": {"type": "json_object"}}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "city_answer-1", "schema": schema, "strict": true}}}),
        json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "description": "d", "schema": {}}}}),
    ];
    for extra in accepted {
        let (status, r) = s.post(c, &chat(extra.clone())).await;
        assert_eq!(status, 200, "{extra}: {r}");
        let body = json!({"prompt": "Hi", "max_tokens": 2, "logit_bias": extra.get("logit_bias"),
            "response_format": extra.get("response_format")});
        let (status, r) = s.post("/v1/completions", &body).await;
        assert_eq!(status, 200, "{extra}: {r}");
    }
    let too_many: serde_json::Map<String, Value> = (0..1025).map(|i| (i.to_string(), json!(1))).collect();
    let named = "response_format.json_schema.name";
    let refused: Vec<(Value, &str)> = vec![
        (json!({"logit_bias": {vocab.to_string(): 1}}), "logit_bias"),
        (json!({"logit_bias": {"-1": 1}}), "logit_bias"),
        (json!({"logit_bias": {"hello": 1}}), "logit_bias"),
        (json!({"logit_bias": {"5": 101}}), "logit_bias"),
        (json!({"logit_bias": {"5": -100.5}}), "logit_bias"),
        (json!({"logit_bias": too_many}), "logit_bias"),
        (json!({"logit_bias": [1, 2]}), "logit_bias"),
        (json!({"response_format": "json"}), "response_format"),
        (json!({"response_format": {}}), "response_format.type"),
        (json!({"response_format": {"type": "sound"}}), "response_format.type"),
        (
            json!({"response_format": {"type": "json_schema"}}),
            "response_format.json_schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}),
            named,
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": schema}}}),
            named,
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x".repeat(65), "schema": schema}}}),
            named,
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": "yes"}}}),
            "response_format.json_schema.strict",
        ),
        // Schemas llguidance cannot compile: 400 with its reason.
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}}),
            "response_format.json_schema.schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/$defs/missing"}}}}),
            "response_format.json_schema.schema",
        ),
    ];
    for (extra, param) in refused {
        let (status, e) = s.post(c, &chat(extra.clone())).await;
        assert_error(status, &e, 400, Some(param));
        let mut body = json!({"prompt": "Hi", "max_tokens": 2});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let (status, e) = s.post("/v1/completions", &body).await;
        assert_error(status, &e, 400, Some(param));
    }
    let (_, e) = s
        .post(
            c,
            &chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}})),
        )
        .await;
    assert!(
        e["error"]["message"].as_str().unwrap().contains("strin"),
        "llguidance's reason: {e}"
    );
}
