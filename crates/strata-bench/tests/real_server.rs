//! `strata bench` against the real server: an in-process `strata serve` on the default model,
//! a short closed-loop run with one request the server must refuse, and the report checked.

mod common;

use std::collections::BTreeSet;

use strata_bench::{run_bench, InputSource, LoadShape};
use strata_engine::{EngineConfig, EngineHandle};
use strata_model::loader::{default_model_path, load_model};
use strata_server::ServerConfig;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_run_against_strata_serve_counts_everything_and_the_refused_request() {
    let path = default_model_path();
    assert!(path.exists(), "{} is missing: run `make fetch` first", path.display());
    let model = tokio::task::spawn_blocking(move || load_model(&path, &|_, _| {}).expect("default model loads"))
        .await
        .expect("load task");
    let engine_config = EngineConfig {
        threads: 1,
        kv_cache_memory: 64 << 20,
        max_model_len: Some(256),
        ..Default::default()
    };
    let engine = EngineHandle::start(model, engine_config).expect("engine starts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("address"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(strata_server::serve(
        listener,
        engine.clone(),
        ServerConfig {
            served_model_name: "smol".into(),
            ..Default::default()
        },
        async move {
            let _ = stopped.await;
        },
    ));

    // Seven ordinary prompts and one longer than --max-model-len (the injected failure).
    let dir = common::temp_dir("real-server");
    let file = dir.join("prompts.jsonl");
    let mut lines: Vec<String> = (0..7)
        .map(|i| format!("{{\"prompt\": \"Tell me fact number {i} about the sea.\"}}"))
        .collect();
    lines.insert(3, format!("{{\"prompt\": \"{}\"}}", "far away ".repeat(400)));
    std::fs::write(&file, lines.join("\n")).expect("write prompts");

    let mut cfg = common::small_config(base.clone());
    cfg.input = InputSource::PromptFile { path: file };
    cfg.load = LoadShape::ClosedLoop { users: 4 };
    cfg.num_requests = Some(8);
    cfg.warmup = 0;
    cfg.output_len = Some(6);
    cfg.stream = true;
    cfg.ignore_eos = true;
    cfg.timeout_s = 300.0;
    let report = run_bench(&cfg).await.expect("the bench runs");

    assert_eq!(report.model, "smol", "the model name came from GET /v1/models");
    assert_eq!(report.requests.sent, 8);
    assert_eq!(report.requests.completed, 7);
    assert_eq!(report.requests.failed, 1);
    assert_eq!(report.errors.http_status.get(&400), Some(&1), "{:?}", report.errors);
    assert!((report.error_rate - 1.0 / 8.0).abs() < 1e-9);
    assert_eq!(
        report.output_tokens.total,
        7 * 6,
        "ignore_eos: every completed request gives 6 tokens"
    );
    assert_eq!(report.output_tokens.counted_by.get("server_usage"), Some(&7));
    let ttft = report.ttft_ms.as_ref().expect("a streamed run has TTFT");
    assert!(ttft.p50 > 0.0 && ttft.p95 >= ttft.p50 && ttft.p99 >= ttft.p95);
    assert!(report.output_token_throughput > 0.0 && report.total_token_throughput > report.output_token_throughput);

    // The JSON has every figure the table and the compare mode read.
    let json = serde_json::to_value(&report).expect("report serializes");
    let keys: BTreeSet<&str> = json.as_object().expect("object").keys().map(|k| k.as_str()).collect();
    for k in [
        "label",
        "base_url",
        "model",
        "endpoint",
        "stream",
        "concurrency",
        "request_rate",
        "duration_s",
        "requests",
        "error_rate",
        "errors",
        "ttft_ms",
        "itl_ms",
        "tpot_ms",
        "e2e_ms",
        "request_throughput",
        "output_token_throughput",
        "total_token_throughput",
        "input_tokens",
        "output_tokens",
        "config",
    ] {
        assert!(keys.contains(k), "report JSON lacks {k}");
    }

    // The server is clean afterwards: nothing running, every KV block back.
    assert!(engine.wait_idle(std::time::Duration::from_secs(10)));
    assert_eq!(engine.stats().kv_blocks_used, 0);
    let _ = stop.send(());
    server.await.expect("server task").expect("server stops cleanly");
}
