//! `strata bench`: a load generator for any OpenAI-compatible server (strata, vLLM, llama.cpp, Ollama, SGLang).
//! Owns the public API: `BenchArgs`/`run` for the CLI, `run_bench(&BenchConfig) -> BenchReport` for code and tests.

pub mod args;
pub mod client;
pub mod config;
pub mod mock;
pub mod plot;
pub mod report;
mod rng;
pub mod runner;
pub mod server_metrics;
pub mod sse;
pub mod table;
pub mod workload;

use std::sync::Arc;

pub use args::{compare_files, run, BenchArgs};
pub use client::ErrorKind;
pub use config::{Arrival, BenchConfig, Endpoint, InputSource, LoadShape, Sampling};
pub use report::{BenchReport, BenchResults, ErrorBreakdown, LatencySummary, RequestCounts, TokenTotals};
pub use rng::SeededRng;
pub use workload::CountSource;

/// Runs one bench: checks the server, prepares every prompt, warms up, measures, and reports.
pub async fn run_bench(cfg: &BenchConfig) -> anyhow::Result<BenchReport> {
    cfg.validate()?;
    let pool = cfg.load.concurrency().unwrap_or(1024);
    let client = client::http_client(cfg, pool)?;
    let model = workload::resolve_model(cfg, &client).await?;
    let workload = Arc::new(workload::prepare_workload(cfg, &client, model).await?);
    let counters_before = server_metrics::scrape(cfg, &client).await;
    let sender = client::RequestSender::new(client.clone(), cfg)?;
    let records = runner::drive(cfg, &workload, &sender).await;
    let mut report = report::build_report(cfg, &workload, records).await;
    if let (Some(before), Some(after)) = (counters_before, server_metrics::scrape(cfg, &client).await) {
        report.speculative_decoding = server_metrics::summarize(&before, &after);
        report.server_preemptions = server_metrics::preemptions_between(&before, &after);
    }
    Ok(report)
}

/// Runs one bench per concurrency level, one after another, with fresh prompts for each level
/// (seed + level index) so that a server's prefix cache does not carry over between levels.
pub async fn run_sweep(
    cfg: &BenchConfig,
    levels: &[usize],
    mut on_level: impl FnMut(&BenchReport),
) -> anyhow::Result<Vec<BenchReport>> {
    let mut reports = Vec::with_capacity(levels.len());
    for (i, &level) in levels.iter().enumerate() {
        let mut level_cfg = cfg.clone();
        level_cfg.load = cfg.load.with_concurrency(level);
        level_cfg.seed = cfg.seed.wrapping_add(i as u64);
        let report = run_bench(&level_cfg).await?;
        on_level(&report);
        reports.push(report);
    }
    Ok(reports)
}
