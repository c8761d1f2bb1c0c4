//! Shared helpers of the strata-bench integration tests: configs aimed at the in-crate mock server.
//! Owns temp folders and the small default load every test starts from.

#![allow(dead_code)]

use std::path::PathBuf;

use strata_bench::mock::{MockConfig, MockServer};
use strata_bench::{Arrival, BenchConfig, InputSource, LoadShape};

/// A small, fast closed-loop config against `base_url`.
pub fn small_config(base_url: String) -> BenchConfig {
    let mut cfg = BenchConfig::new(base_url);
    cfg.load = LoadShape::ClosedLoop { users: 4 };
    cfg.num_requests = Some(20);
    cfg.input = InputSource::Random { input_len: 12 };
    cfg.output_len = Some(5);
    cfg.timeout_s = 10.0;
    cfg
}

/// A fresh empty folder under the system temp folder.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp folder");
    dir
}

/// An open loop at `rate` requests per second with an optional cap.
pub fn open_loop(rate: f64, arrival: Arrival, max_concurrency: Option<usize>) -> LoadShape {
    LoadShape::OpenLoop {
        rate,
        arrival,
        max_concurrency,
    }
}

/// A mock that sends no `usage`, with or without POST /tokenize.
pub async fn mock_without_usage(tokenize_endpoint: bool) -> MockServer {
    MockServer::start(MockConfig {
        send_usage: false,
        tokenize_endpoint,
        ..MockConfig::default()
    })
    .await
    .expect("mock server")
}
