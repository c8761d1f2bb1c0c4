//! The report of a run against the mock: every JSON field present, request counts that add up, token sources named.
//! Owns the happy-path checks of `run_bench`, streamed and not, chat and completions, with and without usage.

mod common;

use std::collections::BTreeMap;

use serde_json::Value;
use strata_bench::mock::{MockConfig, MockServer};
use strata_bench::{run_bench, BenchResults, CountSource, Endpoint, InputSource};

const REPORT_FIELDS: &[&str] = &[
    "label",
    "base_url",
    "model",
    "endpoint",
    "stream",
    "concurrency",
    "request_rate",
    "started_unix_s",
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
    "prompt_lengths_counted_by",
    "speculative_decoding",
    "server_preemptions",
    "notes",
    "config",
    "client",
];

/// The object's keys at `path`, sorted (serde_json keeps them in the order written).
fn keys(value: &Value, path: &str) -> Vec<String> {
    let mut keys: Vec<String> = value
        .pointer(path)
        .and_then(Value::as_object)
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default();
    keys.sort();
    keys
}

#[tokio::test]
async fn json_report_has_every_field_and_counts_add_up() {
    let mock = MockServer::start(MockConfig::default()).await.unwrap();
    let mut cfg = common::small_config(mock.base_url());
    cfg.warmup = 3;
    let report = run_bench(&cfg).await.unwrap();

    assert_eq!(report.model, "mock-model");
    let c = &report.requests;
    assert_eq!((c.sent, c.completed, c.failed, c.warmup_sent), (20, 20, 0, 3));
    assert_eq!(c.completed + c.failed, c.sent);
    assert_eq!(mock.completion_requests(), 23, "warm-up is sent but not counted");
    assert_eq!(report.output_tokens.total, 20 * 5);
    assert_eq!(report.input_tokens.total, 20 * 12);
    assert_eq!(
        report.output_tokens.counted_by,
        BTreeMap::from([("server_usage".to_string(), 20)])
    );
    assert_eq!(report.prompt_lengths_counted_by, CountSource::Words);
    assert!(report.notes.iter().any(|n| n.contains("approximate")));
    assert_eq!(report.ttft_ms.as_ref().unwrap().count, 20);
    assert_eq!(report.itl_ms.as_ref().unwrap().count, 20 * 4);
    assert_eq!(report.tpot_ms.as_ref().unwrap().count, 20);
    assert_eq!(report.error_rate, 0.0);

    let dir = common::temp_dir("fields");
    let path = dir.join("r.json");
    BenchResults::new(vec![report]).write(&path).unwrap();
    let json: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let run = &json["runs"][0];
    for field in REPORT_FIELDS {
        assert!(run.get(field).is_some(), "missing field {field}");
    }
    assert_eq!(
        keys(run, "").len(),
        REPORT_FIELDS.len(),
        "a new field needs adding to REPORT_FIELDS"
    );
    for latency in ["ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"] {
        assert_eq!(
            keys(run, &format!("/{latency}")),
            ["count", "max", "mean", "min", "p50", "p90", "p95", "p99"],
            "{latency}"
        );
    }
    for key in ["sent", "completed", "failed", "warmup_sent", "warmup_failed"] {
        assert!(run["requests"].get(key).is_some(), "requests.{key}");
    }
    for key in [
        "total",
        "http_status",
        "timeout",
        "connect",
        "disconnect",
        "malformed_stream",
        "stream_error_event",
        "first_message",
    ] {
        assert!(run["errors"].get(key).is_some(), "errors.{key}");
    }
    for key in [
        "base_url",
        "endpoint",
        "load",
        "num_requests",
        "warmup",
        "input",
        "seed",
        "timeout_s",
    ] {
        assert!(run["config"].get(key).is_some(), "config.{key}");
    }
    assert!(run["config"].get("api_key").is_none());
    assert_eq!(BenchResults::read(&path).unwrap().runs[0].requests.sent, 20);
}

#[tokio::test]
async fn completions_without_stream_report_latency_but_no_ttft() {
    let mock = MockServer::start(MockConfig::default()).await.unwrap();
    let mut cfg = common::small_config(mock.base_url());
    cfg.endpoint = Endpoint::Completions;
    cfg.stream = false;
    let report = run_bench(&cfg).await.unwrap();
    assert_eq!(report.requests.completed, 20);
    assert!(report.ttft_ms.is_none() && report.itl_ms.is_none());
    assert_eq!(report.e2e_ms.unwrap().count, 20);
    assert_eq!(report.output_tokens.total, 100);
}

#[tokio::test]
async fn without_usage_tokens_are_counted_by_the_server_tokenizer_or_chunks() {
    let mock = common::mock_without_usage(true).await;
    let report = run_bench(&common::small_config(mock.base_url())).await.unwrap();
    assert_eq!(report.prompt_lengths_counted_by, CountSource::ServerTokenize);
    assert_eq!(
        report.output_tokens.counted_by,
        BTreeMap::from([("server_tokenize".to_string(), 20)])
    );
    assert_eq!(report.input_tokens.total, 20 * 12);
    assert_eq!(report.output_tokens.total, 20 * 5);

    let no_tokenize = common::mock_without_usage(false).await;
    let report = run_bench(&common::small_config(no_tokenize.base_url())).await.unwrap();
    assert_eq!(
        report.output_tokens.counted_by,
        BTreeMap::from([("stream_chunks".to_string(), 20)])
    );
    assert_eq!(report.output_tokens.total, 20 * 5);
}

#[tokio::test]
async fn a_local_tokenizer_counts_prompts() {
    let dir = common::temp_dir("tokenizer");
    let words = ["[UNK]", "the", "of", "and", "a"];
    let vocab: serde_json::Map<String, Value> = words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), Value::from(i)))
        .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tokenizer.to_string()).unwrap();
    let mock = common::mock_without_usage(false).await;
    let mut cfg = common::small_config(mock.base_url());
    cfg.tokenizer = Some(path);
    let report = run_bench(&cfg).await.unwrap();
    assert_eq!(report.prompt_lengths_counted_by, CountSource::Tokenizer);
    assert_eq!(report.input_tokens.total, 20 * 12);
    assert_eq!(
        report.output_tokens.counted_by,
        BTreeMap::from([("tokenizer".to_string(), 20)])
    );
}

#[tokio::test]
async fn a_sharegpt_dataset_sets_prompts_and_output_lengths() {
    let dir = common::temp_dir("dataset");
    let path = dir.join("sharegpt.json");
    std::fs::write(
        &path,
        r#"[{"conversations":[{"from":"human","value":"one two three"},{"from":"gpt","value":"a b"}]},
            {"conversations":[{"from":"human","value":"four five"},{"from":"gpt","value":"c d e f"}]}]"#,
    )
    .unwrap();
    let mock = MockServer::start(MockConfig::default()).await.unwrap();
    let mut cfg = common::small_config(mock.base_url());
    cfg.input = InputSource::Dataset { path };
    cfg.output_len = None;
    cfg.num_requests = Some(4);
    let report = run_bench(&cfg).await.unwrap();
    assert_eq!(report.requests.completed, 4);
    assert_eq!(report.input_tokens.total, 2 * (3 + 2));
    assert_eq!(report.output_tokens.total, 2 * (2 + 4));
}
