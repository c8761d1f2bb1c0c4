//! Streaming against the real default model: the SSE shape OpenAI clients parse, keep-alives
//! while queued, 429 on a full queue (a refused request reserving nothing), disconnects freeing
//! KV blocks, 64 concurrent streams, and graceful shutdown (finish in time, or abort after
//! --shutdown-timeout).

mod common;

use std::time::{Duration, Instant};

use common::{engine_config, server_config, stream, SseReader, TestServer, MODEL};
use serde_json::{json, Value};
use strata_engine::EngineConfig;
use strata_server::ServerConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_has_openai_shape() {
    let s = TestServer::default().await;
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let (_, whole) = s.post("/v1/chat/completions", &body).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = stream(&s, "/v1/chat/completions", &streamed).await.all().await;
    assert_eq!(events.last().and_then(|e| e.data.as_deref()), Some("[DONE]"));
    let chunks = common::chunks(&events);
    let id = chunks[0]["id"].as_str().unwrap();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert_eq!(c["model"], MODEL);
        assert!(c["created"].is_u64());
    }
    // First: the role. Then content deltas. Then the finish. Then usage with no choices.
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(chunks[0]["usage"].is_null());
    let (last, body_chunks) = chunks.split_last().unwrap();
    assert_eq!(last["choices"].as_array().unwrap().len(), 0);
    assert_eq!(last["usage"]["completion_tokens"], 8);
    for field in ["prompt_tokens", "completion_tokens", "total_tokens"] {
        assert_eq!(last["usage"][field], whole["usage"][field]);
    }
    let finish = &body_chunks[body_chunks.len() - 1]["choices"][0];
    assert_eq!(finish["finish_reason"], "length");
    assert_eq!(finish["delta"], json!({}));
    let mut text = String::new();
    for c in &body_chunks[1..body_chunks.len() - 1] {
        let choice = &c["choices"][0];
        assert!(choice["finish_reason"].is_null());
        assert!(choice["delta"].get("role").is_none());
        assert!(c["usage"].is_null(), "usage is null until the last chunk");
        text.push_str(choice["delta"]["content"].as_str().unwrap());
    }
    assert_eq!(text, whole["choices"][0]["message"]["content"].as_str().unwrap());
    assert!(body_chunks.len() >= 4, "tokens arrive as separate chunks");

    // Without include_usage there is no usage field at all; n = 2 interleaves two choices.
    let mut two = body.clone();
    two["stream"] = json!(true);
    two["n"] = json!(2);
    two["max_tokens"] = json!(3);
    let events = stream(&s, "/v1/chat/completions", &two).await.all().await;
    let chunks = common::chunks(&events);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
    for index in 0..2 {
        let mine: Vec<&Value> = chunks.iter().filter(|c| c["choices"][0]["index"] == index).collect();
        assert_eq!(mine[0]["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(mine.last().unwrap()["choices"][0]["finish_reason"], "length");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_stream_and_logprobs() {
    let s = TestServer::default().await;
    let body = json!({"model": MODEL, "prompt": "The sky is", "max_tokens": 5, "temperature": 0,
        "ignore_eos": true, "logprobs": 1});
    let (_, whole) = s.post("/v1/completions", &body).await;
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let events = stream(&s, "/v1/completions", &streamed).await.all().await;
    assert_eq!(events.last().and_then(|e| e.data.as_deref()), Some("[DONE]"));
    let chunks = common::chunks(&events);
    let mut text = String::new();
    let mut tokens = 0;
    for c in &chunks {
        assert_eq!(c["object"], "text_completion");
        if let Some(choice) = c["choices"].get(0) {
            text.push_str(choice["text"].as_str().unwrap());
            if let Some(t) = choice["logprobs"]["tokens"].as_array() {
                tokens += t.len();
            }
        }
    }
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
    assert_eq!(tokens, 5);
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_queue_gets_429_and_queued_streams_get_keep_alives() {
    let s = TestServer::start(
        EngineConfig {
            max_num_seqs: 1,
            max_queue: 1,
            ..engine_config()
        },
        ServerConfig {
            sse_keep_alive: Duration::from_millis(50),
            ..server_config()
        },
    )
    .await;
    let long =
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": true, "stream": true});
    // A runs (admitted as soon as its first token arrives) ...
    let mut a = stream(&s, "/v1/completions", &long).await;
    while a.next().await.unwrap().data.is_none() {}
    // ... B waits in the queue, C finds the queue full.
    let mut b = stream(&s, "/v1/completions", &long).await;
    let (status, e) = s
        .post("/v1/completions", &json!({"prompt": "hi", "max_tokens": 1}))
        .await;
    common::assert_error(status, &e, 429, None);
    assert_eq!(e["error"]["code"], "queue_full");
    let r = s
        .client
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "hi", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 429);
    assert_eq!(r.headers()["retry-after"], "1");
    // B hears keep-alive comments before its first token.
    let mut keep_alives = 0;
    loop {
        let e = b.next().await.expect("B's stream goes on");
        if e.comment.is_some() {
            keep_alives += 1;
        } else {
            break;
        }
    }
    assert!(keep_alives >= 2, "{keep_alives} keep-alives while queued");
    drop(a);
    drop(b);
    assert!(s.wait_blocks_free(Duration::from_secs(20)).await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnects_abort_and_free_kv_blocks() {
    let s = TestServer::default().await;
    assert!(s.wait_blocks_free(Duration::from_secs(5)).await);
    let baseline = s.engine.stats().kv_blocks_free();
    // A streaming client that goes away after two chunks.
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 500, "ignore_eos": true, "stream": true});
    let mut r = stream(&s, "/v1/chat/completions", &body).await;
    r.next().await.unwrap();
    r.next().await.unwrap();
    r.next().await.unwrap();
    // Stats are published after each step: the sequence holds blocks by the next one.
    let holds = Instant::now() + Duration::from_secs(5);
    while s.engine.stats().kv_blocks_used == 0 && Instant::now() < holds {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(s.engine.stats().kv_blocks_used > 0);
    let started = Instant::now();
    drop(r);
    assert!(
        s.wait_blocks_free(Duration::from_secs(10)).await,
        "stream abort frees its blocks"
    );
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "aborted well before 500 tokens"
    );
    assert_eq!(s.engine.stats().kv_blocks_free(), baseline);
    // A non-streaming client that times out.
    let started = Instant::now();
    let timed_out = s
        .client
        .post(s.url("/v1/completions"))
        .json(&json!({"prompt": "Count to a thousand:", "max_tokens": 500, "ignore_eos": true}))
        .timeout(Duration::from_millis(400))
        .send()
        .await;
    assert!(timed_out.is_err());
    assert!(
        s.wait_blocks_free(Duration::from_secs(10)).await,
        "dropped request frees its blocks"
    );
    assert!(started.elapsed() < Duration::from_secs(4));
    assert_eq!(s.engine.stats().kv_blocks_free(), baseline);
    let (_, metrics) = s.get("/metrics").await;
    assert!(
        metrics.contains("strata_request_finished_total{finish_reason=\"abort\"} 2"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_concurrent_streams_finish_without_leaks() {
    let s = TestServer::start(
        EngineConfig {
            kv_cache_memory: 128 << 20,
            max_num_seqs: 64,
            ..engine_config()
        },
        server_config(),
    )
    .await;
    let mut tasks = Vec::new();
    for i in 0..64 {
        let client = s.client.clone();
        let url = s.url("/v1/completions");
        tasks.push(tokio::spawn(async move {
            let body = json!({"model": MODEL, "prompt": format!("{i} plus {i} is"), "max_tokens": 4,
                "ignore_eos": true, "stream": true, "temperature": 0.7, "seed": i});
            let r = client.post(url).json(&body).send().await.map_err(|e| e.to_string())?;
            if r.status().as_u16() != 200 {
                return Err(format!("status {}", r.status()));
            }
            let events = SseReader::new(r).all().await;
            let done = events.last().and_then(|e| e.data.as_deref()) == Some("[DONE]");
            let finished = common::chunks(&events)
                .iter()
                .any(|c| c["choices"][0]["finish_reason"] == "length");
            if done && finished {
                Ok(())
            } else {
                Err(format!("incomplete stream: {events:?}"))
            }
        }));
    }
    let mut errors = Vec::new();
    for t in tasks {
        if let Err(e) = t.await.unwrap() {
            errors.push(e);
        }
    }
    assert!(errors.is_empty(), "{} errors: {errors:?}", errors.len());
    assert!(s.wait_blocks_free(Duration::from_secs(10)).await, "no KV blocks leaked");
    let stats = s.engine.stats();
    assert_eq!(stats.kv_blocks_free(), stats.kv_blocks_total);
    assert_eq!(stats.generation_tokens_total, 64 * 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_in_flight_requests_then_refuses_connections() {
    let mut s = TestServer::default().await;
    let body =
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": true, "stream": true});
    let mut r = stream(&s, "/v1/completions", &body).await;
    r.next().await.unwrap();
    s.signal_stop();
    let events = r.all().await;
    assert_eq!(events.last().and_then(|e| e.data.as_deref()), Some("[DONE]"));
    assert!(common::chunks(&events)
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "length"));
    s.wait_stopped().await.expect("serve returns Ok");
    assert!(
        s.client.get(s.url("/health")).send().await.is_err(),
        "no longer accepting"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_aborts_what_outlives_the_timeout() {
    let mut s = TestServer::start(
        engine_config(),
        ServerConfig {
            shutdown_timeout: Duration::from_millis(300),
            ..server_config()
        },
    )
    .await;
    let body =
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 900, "ignore_eos": true, "stream": true});
    let mut r = stream(&s, "/v1/completions", &body).await;
    r.next().await.unwrap();
    let started = Instant::now();
    s.signal_stop();
    let events = r.all().await;
    assert!(common::chunks(&events)
        .iter()
        .any(|c| c["choices"][0]["finish_reason"] == "abort"));
    assert_eq!(events.last().and_then(|e| e.data.as_deref()), Some("[DONE]"));
    s.wait_stopped().await.expect("serve returns Ok");
    assert!(started.elapsed() < Duration::from_secs(5), "{:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_request_leaves_no_queue_slot_behind() {
    let s = TestServer::start(
        EngineConfig {
            max_num_seqs: 1,
            max_queue: 4,
            ..engine_config()
        },
        server_config(),
    )
    .await;
    let long = |prompt: Value| json!({"model": MODEL, "prompt": prompt, "max_tokens": 200, "ignore_eos": true, "stream": true});
    // A runs; nothing else can be admitted while it does.
    let mut a = stream(&s, "/v1/completions", &long(json!("Once upon a time"))).await;
    while a.next().await.unwrap().data.is_none() {}
    // More prompts x n than the queue can ever hold: refused whole, before any is queued.
    for (prompt, n) in [
        (json!(vec!["Hi"; 10_000]), 1),
        (json!(vec!["Hi"; 5]), 1),
        (json!(["Hi", "Ho"]), 3),
    ] {
        let (status, e) = s
            .post("/v1/completions", &json!({"prompt": prompt, "max_tokens": 1, "n": n}))
            .await;
        common::assert_error(status, &e, 400, Some("prompt"));
        assert!(e["error"]["message"].as_str().unwrap().contains("--max-queue"), "{e}");
    }
    // B waits (1 of 4); a request for 4 more does not fit now: 429, and it reserves nothing ...
    let b = stream(&s, "/v1/completions", &long(json!("Hello"))).await;
    let (status, e) = s
        .post(
            "/v1/completions",
            &json!({"prompt": ["a", "b", "c", "d"], "max_tokens": 1}),
        )
        .await;
    common::assert_error(status, &e, 429, None);
    // ... so three single requests still fit, and the queue is then full.
    let mut waiting = Vec::new();
    for _ in 0..3 {
        waiting.push(stream(&s, "/v1/completions", &long(json!("Hi"))).await);
    }
    let (status, e) = s
        .post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 1}))
        .await;
    common::assert_error(status, &e, 429, None);
    // Once the queue drains, a request for exactly its size is taken whole.
    drop(waiting);
    drop(b);
    drop(a);
    assert!(s.wait_blocks_free(Duration::from_secs(20)).await);
    let (status, r) = s
        .post(
            "/v1/completions",
            &json!({"prompt": ["a", "b", "c", "d"], "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["choices"].as_array().unwrap().len(), 4);
}
