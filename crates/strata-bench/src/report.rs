//! The figures of a run: latency percentiles, throughput, token counts with their sources, errors by kind.
//! Owns turning raw request records into a `BenchReport`, and the JSON results file.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::client::ErrorKind;
use crate::config::{BenchConfig, Endpoint};
use crate::runner::RunRecords;
use crate::server_metrics::SpeculationSummary;
use crate::workload::{CountSource, TokenCounter, Workload};

/// Distribution of one latency, in milliseconds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    pub count: u64,
    pub mean: f64,
    pub min: f64,
    pub p50: f64,
    pub p90: f64,
    pub p95: f64,
    pub p99: f64,
    pub max: f64,
}

impl LatencySummary {
    /// Summarizes samples (any order); None when there are none.
    pub fn from_samples(mut samples: Vec<f64>) -> Option<Self> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_by(f64::total_cmp);
        let n = samples.len();
        Some(Self {
            count: n as u64,
            mean: samples.iter().sum::<f64>() / n as f64,
            min: samples[0],
            p50: percentile(&samples, 50.0),
            p90: percentile(&samples, 90.0),
            p95: percentile(&samples, 95.0),
            p99: percentile(&samples, 99.0),
            max: samples[n - 1],
        })
    }
}

/// The `p`-th percentile of sorted samples, interpolating linearly between ranks (numpy's default).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let low = rank.floor() as usize;
    let high = rank.ceil() as usize;
    sorted[low] + (sorted[high] - sorted[low]) * (rank - low as f64)
}

/// How many requests went out and how they ended. `completed + failed == sent`; warm-up is apart.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestCounts {
    pub sent: u64,
    pub completed: u64,
    pub failed: u64,
    /// Measured requests resent once on a new connection because the kept-alive connection they
    /// went out on closed before any response byte (not errors: their resend counts instead).
    #[serde(default)]
    pub retried: u64,
    pub warmup_sent: u64,
    pub warmup_failed: u64,
}

/// Failed measured requests by kind, with the first message seen for each kind.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ErrorBreakdown {
    pub total: u64,
    /// Count per HTTP status code.
    pub http_status: BTreeMap<u16, u64>,
    pub timeout: u64,
    pub connect: u64,
    pub disconnect: u64,
    pub malformed_stream: u64,
    pub stream_error_event: u64,
    /// Kind name (`http_500`, `timeout`, ...) to the first message of that kind.
    pub first_message: BTreeMap<String, String>,
}

impl ErrorBreakdown {
    fn add(&mut self, kind: ErrorKind, message: &str) {
        self.total += 1;
        match kind {
            ErrorKind::HttpStatus(code) => *self.http_status.entry(code).or_default() += 1,
            ErrorKind::Timeout => self.timeout += 1,
            ErrorKind::Connect => self.connect += 1,
            ErrorKind::Disconnect => self.disconnect += 1,
            ErrorKind::MalformedStream => self.malformed_stream += 1,
            ErrorKind::StreamErrorEvent => self.stream_error_event += 1,
        }
        self.first_message
            .entry(kind.to_string())
            .or_insert_with(|| message.to_string());
    }

    /// `kind=count` pairs, e.g. `http_500=2 disconnect=1`.
    pub fn compact(&self) -> String {
        let mut parts: Vec<String> = self
            .http_status
            .iter()
            .map(|(code, n)| format!("http_{code}={n}"))
            .collect();
        for (name, n) in [
            ("timeout", self.timeout),
            ("connect", self.connect),
            ("disconnect", self.disconnect),
            ("malformed_stream", self.malformed_stream),
            ("stream_error_event", self.stream_error_event),
        ] {
            if n > 0 {
                parts.push(format!("{name}={n}"));
            }
        }
        parts.join(" ")
    }
}

/// Tokens of completed requests, and how many requests were counted by each source.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenTotals {
    pub total: u64,
    pub mean_per_request: f64,
    /// Source name (`server_usage`, `tokenizer`, ...) to the number of requests it counted.
    pub counted_by: BTreeMap<String, u64>,
}

impl TokenTotals {
    fn add(&mut self, tokens: u64, source: CountSource) {
        self.total += tokens;
        *self.counted_by.entry(source_key(source)).or_default() += 1;
    }

    /// e.g. `server usage (200 of 200)`.
    pub fn describe_sources(&self) -> String {
        let requests: u64 = self.counted_by.values().sum();
        let parts: Vec<String> = self
            .counted_by
            .iter()
            .map(|(k, n)| format!("{} ({n} of {requests})", k.replace('_', " ")))
            .collect();
        if parts.is_empty() {
            "none".to_string()
        } else {
            parts.join(", ")
        }
    }
}

fn source_key(source: CountSource) -> String {
    serde_json::to_value(source)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{source:?}"))
}

/// Name and version of the client that measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClientInfo {
    pub name: String,
    pub version: String,
}

/// Every figure of one run, and the configuration that produced it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchReport {
    pub label: String,
    pub base_url: String,
    pub model: String,
    pub endpoint: Endpoint,
    pub stream: bool,
    /// Users of a closed loop, or the cap of an open loop (None: no cap).
    pub concurrency: Option<usize>,
    /// Requests per second of an open loop; None for a closed loop.
    pub request_rate: Option<f64>,
    pub started_unix_s: f64,
    /// Measured phase, from the first request sent to the last one finished.
    pub duration_s: f64,
    pub requests: RequestCounts,
    /// failed / sent.
    pub error_rate: f64,
    pub errors: ErrorBreakdown,
    /// Time to first content chunk (streamed runs only).
    pub ttft_ms: Option<LatencySummary>,
    /// Gaps between streamed content chunks, over all requests.
    pub itl_ms: Option<LatencySummary>,
    /// Time per output token after the first: (e2e - ttft) / (output tokens - 1), per request.
    pub tpot_ms: Option<LatencySummary>,
    /// Whole-request latency.
    pub e2e_ms: Option<LatencySummary>,
    /// Completed requests per second.
    pub request_throughput: f64,
    /// Output tokens of completed requests per second.
    pub output_token_throughput: f64,
    /// Input plus output tokens of completed requests per second.
    pub total_token_throughput: f64,
    pub input_tokens: TokenTotals,
    pub output_tokens: TokenTotals,
    /// How prompt lengths were counted when the prompts were built.
    pub prompt_lengths_counted_by: CountSource,
    /// Draft tokens proposed and accepted during the run (warm-up included), where the server's
    /// `/metrics` exposes them.
    #[serde(default)]
    pub speculative_decoding: Option<SpeculationSummary>,
    /// Sequences the server preempted for KV space during the run (warm-up included), where its
    /// `/metrics` counts them: a stream paused and recomputed.
    #[serde(default)]
    pub server_preemptions: Option<f64>,
    pub notes: Vec<String>,
    pub config: BenchConfig,
    pub client: ClientInfo,
}

/// Turns the records of a run into its report; counts output tokens the server did not report.
pub async fn build_report(cfg: &BenchConfig, workload: &Workload, records: RunRecords) -> BenchReport {
    let mut requests = RequestCounts {
        warmup_sent: records.warmup_sent,
        warmup_failed: records.warmup_failed,
        ..RequestCounts::default()
    };
    let mut errors = ErrorBreakdown::default();
    let (mut ttft, mut itl, mut tpot, mut e2e) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut input_tokens, mut output_tokens) = (TokenTotals::default(), TokenTotals::default());
    for record in &records.measured {
        requests.sent += 1;
        requests.retried += u64::from(record.retried);
        let completion = match &record.result {
            Ok(c) => c,
            Err(failure) => {
                requests.failed += 1;
                errors.add(failure.kind, &failure.message);
                continue;
            }
        };
        requests.completed += 1;
        let (output, output_source) = count_output(&workload.counter, &workload.model, completion).await;
        output_tokens.add(output, output_source);
        match completion.usage.and_then(|u| u.prompt_tokens) {
            Some(n) => input_tokens.add(n, CountSource::ServerUsage),
            None => input_tokens.add(record.input_tokens, workload.prompt_counting),
        }
        let e2e_ms = ms(completion.e2e);
        e2e.push(e2e_ms);
        if let Some(first) = completion.ttft {
            let ttft_ms = ms(first);
            ttft.push(ttft_ms);
            if output > 1 {
                tpot.push((e2e_ms - ttft_ms) / (output - 1) as f64);
            }
        }
        itl.extend(completion.inter_chunk_gaps.iter().map(|g| ms(*g)));
    }
    let seconds = records.wall.as_secs_f64().max(f64::MIN_POSITIVE);
    for totals in [&mut input_tokens, &mut output_tokens] {
        totals.mean_per_request = if requests.completed > 0 {
            totals.total as f64 / requests.completed as f64
        } else {
            0.0
        };
    }
    BenchReport {
        label: cfg.display_label(),
        base_url: cfg.base_url.clone(),
        model: workload.model.clone(),
        endpoint: cfg.endpoint,
        stream: cfg.stream,
        concurrency: cfg.load.concurrency(),
        request_rate: cfg.load.request_rate(),
        started_unix_s: records.started_unix_s,
        duration_s: records.wall.as_secs_f64(),
        error_rate: if requests.sent > 0 {
            requests.failed as f64 / requests.sent as f64
        } else {
            0.0
        },
        request_throughput: requests.completed as f64 / seconds,
        output_token_throughput: output_tokens.total as f64 / seconds,
        total_token_throughput: (input_tokens.total + output_tokens.total) as f64 / seconds,
        requests,
        errors,
        ttft_ms: LatencySummary::from_samples(ttft),
        itl_ms: LatencySummary::from_samples(itl),
        tpot_ms: LatencySummary::from_samples(tpot),
        e2e_ms: LatencySummary::from_samples(e2e),
        input_tokens,
        output_tokens,
        prompt_lengths_counted_by: workload.prompt_counting,
        speculative_decoding: None,
        server_preemptions: None,
        notes: workload.notes.clone(),
        config: cfg.clone(),
        client: ClientInfo {
            name: env!("CARGO_PKG_NAME").to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        },
    }
}

/// Output tokens of one completion: server usage, else the tokenizer, else chunks, else words.
async fn count_output(
    counter: &TokenCounter,
    model: &str,
    completion: &crate::client::TimedCompletion,
) -> (u64, CountSource) {
    if let Some(n) = completion.usage.and_then(|u| u.completion_tokens) {
        return (n, CountSource::ServerUsage);
    }
    if !matches!(counter, TokenCounter::Words) {
        if let Ok(n) = counter.count_with_model(&completion.text, model).await {
            return (n, counter.source());
        }
    }
    if completion.content_chunks > 0 {
        return (u64::from(completion.content_chunks), CountSource::StreamChunks);
    }
    (completion.text.split_whitespace().count() as u64, CountSource::Words)
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The JSON file a bench writes: one run, or one run per sweep level.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchResults {
    pub tool: String,
    pub version: String,
    pub created_unix_s: f64,
    pub runs: Vec<BenchReport>,
}

impl BenchResults {
    pub fn new(runs: Vec<BenchReport>) -> Self {
        Self {
            tool: env!("CARGO_PKG_NAME").to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            created_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs_f64())
                .unwrap_or(0.0),
            runs,
        }
    }

    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| anyhow::anyhow!("cannot create {}: {e}; pass another --output", dir.display()))?;
        }
        let text = serde_json::to_string_pretty(self)?;
        std::fs::write(path, text + "\n")
            .map_err(|e| anyhow::anyhow!("cannot write {}: {e}; pass another --output", path.display()))
    }

    pub fn read(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            anyhow::anyhow!(
                "cannot read {}: {e}; pass a file written by strata bench",
                path.display()
            )
        })?;
        serde_json::from_str(&text).map_err(|e| {
            anyhow::anyhow!(
                "{} is not a strata bench results file ({e}); pass a file written by strata bench --output",
                path.display()
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let samples: Vec<f64> = (1..=10).map(f64::from).collect();
        let s = LatencySummary::from_samples(samples).unwrap();
        assert_eq!((s.min, s.max, s.mean), (1.0, 10.0, 5.5));
        assert!((s.p50 - 5.5).abs() < 1e-12);
        assert!((s.p90 - 9.1).abs() < 1e-12);
        assert!((s.p99 - 9.91).abs() < 1e-12);
        assert!(LatencySummary::from_samples(Vec::new()).is_none());
    }

    #[test]
    fn error_breakdown_counts_each_kind() {
        let mut errors = ErrorBreakdown::default();
        errors.add(ErrorKind::HttpStatus(500), "boom");
        errors.add(ErrorKind::HttpStatus(500), "boom again");
        errors.add(ErrorKind::Disconnect, "closed");
        assert_eq!(errors.total, 3);
        assert_eq!(errors.http_status.get(&500), Some(&2));
        assert_eq!(errors.first_message.get("http_500").map(String::as_str), Some("boom"));
        assert_eq!(errors.compact(), "http_500=2 disconnect=1");
    }
}
