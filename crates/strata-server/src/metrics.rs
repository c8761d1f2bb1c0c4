//! Prometheus metrics (`strata_*`): HTTP requests by route and status, latency histograms
//! (time to first token, inter-token, end to end) and the engine's gauges, in the text format.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use strata_engine::{DraftCounts, EngineStats, FinishReason, KvCapacity};

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 300.0,
];

/// A cumulative histogram with fixed bucket bounds.
struct Histogram {
    bounds: &'static [f64],
    /// Non-cumulative counts per bucket, plus one for +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        let i = self.bounds.iter().position(|b| v <= *b).unwrap_or(self.bounds.len());
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cumulative += c;
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum {}", self.sum);
        let _ = writeln!(out, "{name}_count {}", self.count);
    }
}

struct Recorded {
    /// (route, status) -> count.
    requests: BTreeMap<(String, u16), u64>,
    finished: BTreeMap<&'static str, u64>,
    ttft: Histogram,
    itl: Histogram,
    e2e: Histogram,
}

/// What the server records; rendered together with engine stats on `/metrics`.
pub struct Metrics {
    recorded: Mutex<Recorded>,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            recorded: Mutex::new(Recorded {
                requests: BTreeMap::new(),
                finished: BTreeMap::new(),
                ttft: Histogram::new(TTFT_BUCKETS),
                itl: Histogram::new(ITL_BUCKETS),
                e2e: Histogram::new(E2E_BUCKETS),
            }),
        }
    }
}

impl Metrics {
    fn with<R>(&self, f: impl FnOnce(&mut Recorded) -> R) -> R {
        let mut guard = self.recorded.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }

    /// One HTTP response (for streams: when its headers go out).
    pub fn count_request(&self, route: &str, status: u16) {
        self.with(|r| *r.requests.entry((route.to_string(), status)).or_default() += 1);
    }

    fn observe_ttft(&self, seconds: f64) {
        self.with(|r| r.ttft.observe(seconds));
    }

    fn observe_itl(&self, seconds: f64, tokens: usize) {
        self.with(|r| {
            for _ in 0..tokens {
                r.itl.observe(seconds);
            }
        });
    }

    fn observe_finish(&self, seconds: f64, reason: FinishReason) {
        self.with(|r| {
            r.e2e.observe(seconds);
            *r.finished.entry(reason.as_str()).or_default() += 1;
        });
    }

    /// The Prometheus text exposition of everything.
    pub fn render(&self, stats: &EngineStats, capacity: &KvCapacity, engine_alive: bool) -> String {
        let mut out = String::new();
        self.with(|r| {
            out.push_str("# HELP strata_http_requests_total HTTP responses by route and status code.\n");
            out.push_str("# TYPE strata_http_requests_total counter\n");
            for ((route, status), n) in &r.requests {
                let _ = writeln!(
                    out,
                    "strata_http_requests_total{{route=\"{}\",status=\"{status}\"}} {n}",
                    escape_label(route)
                );
            }
            out.push_str("# HELP strata_request_finished_total Generations finished, by finish reason.\n");
            out.push_str("# TYPE strata_request_finished_total counter\n");
            for reason in ["stop", "length", "abort"] {
                let n = r.finished.get(reason).copied().unwrap_or(0);
                let _ = writeln!(out, "strata_request_finished_total{{finish_reason=\"{reason}\"}} {n}");
            }
            r.ttft.render(
                &mut out,
                "strata_time_to_first_token_seconds",
                "Seconds from request arrival to its first generated token.",
            );
            r.itl.render(
                &mut out,
                "strata_inter_token_latency_seconds",
                "Seconds between consecutive generated tokens of a request.",
            );
            r.e2e.render(
                &mut out,
                "strata_e2e_request_latency_seconds",
                "Seconds from request arrival to its last token.",
            );
        });
        let gauges: [(&str, &str, &str, f64); 19] = [
            (
                "strata_num_requests_running",
                "gauge",
                "Sequences in the running batch.",
                stats.running as f64,
            ),
            (
                "strata_num_requests_waiting",
                "gauge",
                "Sequences waiting for admission.",
                stats.waiting as f64,
            ),
            (
                "strata_kv_blocks_used",
                "gauge",
                "KV cache blocks held by sequences.",
                stats.kv_blocks_used as f64,
            ),
            (
                "strata_kv_blocks_free",
                "gauge",
                "KV cache blocks free (including evictable cached prefixes).",
                stats.kv_blocks_free() as f64,
            ),
            (
                "strata_kv_blocks_total",
                "gauge",
                "KV cache blocks in all.",
                stats.kv_blocks_total as f64,
            ),
            (
                "strata_kv_block_size_tokens",
                "gauge",
                "Tokens per KV cache block.",
                capacity.block_size as f64,
            ),
            (
                "strata_prefix_cache_hit_rate",
                "gauge",
                "Fraction of full prompt blocks found in the prefix cache.",
                stats.prefix_cache_hit_rate,
            ),
            (
                "strata_prompt_tokens_total",
                "counter",
                "Prompt tokens admitted.",
                stats.prompt_tokens_total as f64,
            ),
            (
                "strata_generation_tokens_total",
                "counter",
                "Tokens generated.",
                stats.generation_tokens_total as f64,
            ),
            (
                "strata_preemptions_total",
                "counter",
                "Sequences preempted for lack of KV blocks.",
                stats.preemptions_total as f64,
            ),
            (
                "strata_engine_steps_total",
                "counter",
                "Engine steps run.",
                stats.steps_total as f64,
            ),
            (
                "strata_engine_decode_steps_total",
                "counter",
                "Engine steps in which every sequence decoded (no prompt chunk).",
                stats.decode_steps_total as f64,
            ),
            (
                "strata_engine_decode_step_seconds_total",
                "counter",
                "Seconds of those steps, from scheduling to results.",
                stats.decode_step_seconds_total,
            ),
            (
                "strata_engine_drafted_steps_total",
                "counter",
                "Of those, the steps that verified draft tokens (speculative decoding).",
                stats.drafted_steps_total as f64,
            ),
            (
                "strata_engine_drafted_step_seconds_total",
                "counter",
                "Seconds of the steps that verified draft tokens.",
                stats.drafted_step_seconds_total,
            ),
            (
                "strata_grammar_masks_total",
                "counter",
                "Grammar masks computed for constrained requests (one a token).",
                stats.masks_total as f64,
            ),
            (
                "strata_grammar_mask_seconds_total",
                "counter",
                "Seconds the mask workers spent computing grammar masks.",
                stats.mask_seconds_total,
            ),
            (
                "strata_grammar_mask_wait_seconds_total",
                "counter",
                "Seconds the engine waited for grammar masks after a step's logits were in.",
                stats.mask_wait_seconds_total,
            ),
            (
                "strata_engine_alive",
                "gauge",
                "1 while the engine thread runs.",
                if engine_alive { 1.0 } else { 0.0 },
            ),
        ];
        for (name, kind, help, value) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        }
        render_drafts(&mut out, &stats.drafts);
        out
    }
}

/// Speculative decoding: draft tokens proposed and accepted, in all and by position in the draft
/// (vLLM's `spec_decode_*` families), and the acceptance rates.
fn render_drafts(out: &mut String, drafts: &DraftCounts) {
    let totals = [
        (
            "strata_spec_decode_num_draft_tokens_total",
            "counter",
            "Draft tokens proposed and verified (speculative decoding).",
            drafts.proposed_total() as f64,
        ),
        (
            "strata_spec_decode_num_accepted_tokens_total",
            "counter",
            "Draft tokens accepted (speculative decoding).",
            drafts.accepted_total() as f64,
        ),
        (
            "strata_spec_decode_acceptance_rate",
            "gauge",
            "Draft tokens accepted over proposed (0 before any draft).",
            drafts.acceptance_rate(),
        ),
    ];
    for (name, kind, help, value) in totals {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
    }
    let rates: Vec<f64> = (drafts.accepted.iter().zip(&drafts.proposed))
        .map(|(&a, &p)| a as f64 / p.max(1) as f64)
        .collect();
    let as_f64 = |v: &[u64]| v.iter().map(|&n| n as f64).collect::<Vec<f64>>();
    let by_position = [
        (
            "strata_spec_decode_num_draft_tokens_per_pos",
            "counter",
            "Draft tokens proposed, by position in the draft (0 = first).",
            as_f64(&drafts.proposed),
        ),
        (
            "strata_spec_decode_num_accepted_tokens_per_pos",
            "counter",
            "Draft tokens accepted, by position in the draft (0 = first).",
            as_f64(&drafts.accepted),
        ),
        (
            "strata_spec_decode_acceptance_rate_per_pos",
            "gauge",
            "Draft tokens accepted over proposed, by position in the draft (0 = first).",
            rates,
        ),
    ];
    for (name, kind, help, values) in by_position {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (i, v) in values.iter().enumerate() {
            let _ = writeln!(out, "{name}{{position=\"{i}\"}} {v}");
        }
    }
}

fn escape_label(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Times one generation: first token, gaps between tokens, the end. One dropped before its
/// end (the client went away) counts as aborted.
pub struct GenerationTimer {
    metrics: Arc<Metrics>,
    arrival: Instant,
    last_token: Option<Instant>,
    finished: bool,
}

impl GenerationTimer {
    pub fn new(metrics: Arc<Metrics>, arrival: Instant) -> Self {
        GenerationTimer {
            metrics,
            arrival,
            last_token: None,
            finished: false,
        }
    }

    /// `tokens` new tokens arrived now.
    pub fn tokens(&mut self, tokens: usize) {
        if tokens == 0 {
            return;
        }
        let now = Instant::now();
        match self.last_token {
            None => self.metrics.observe_ttft((now - self.arrival).as_secs_f64()),
            Some(prev) => self
                .metrics
                .observe_itl((now - prev).as_secs_f64() / tokens as f64, tokens),
        }
        self.last_token = Some(now);
    }

    pub fn finished(&mut self, reason: FinishReason) {
        if !self.finished {
            self.finished = true;
            self.metrics
                .observe_finish(self.arrival.elapsed().as_secs_f64(), reason);
        }
    }
}

impl Drop for GenerationTimer {
    fn drop(&mut self) {
        self.finished(FinishReason::Abort);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.7, 3.0] {
            h.observe(v);
        }
        let mut out = String::new();
        h.render(&mut out, "x", "help");
        assert!(out.contains("x_bucket{le=\"0.1\"} 1\n"));
        assert!(out.contains("x_bucket{le=\"1\"} 3\n"));
        assert!(out.contains("x_bucket{le=\"+Inf\"} 4\n"));
        assert!(out.contains("x_count 4\n"));
    }

    #[test]
    fn render_has_every_family() {
        let m = Arc::new(Metrics::default());
        m.count_request("/v1/completions", 200);
        let mut t = GenerationTimer::new(Arc::clone(&m), Instant::now());
        t.tokens(1);
        t.tokens(2);
        t.finished(FinishReason::Length);
        drop(t);
        drop(GenerationTimer::new(Arc::clone(&m), Instant::now()));
        let mut stats = EngineStats {
            kv_blocks_total: 10,
            kv_blocks_used: 3,
            decode_steps_total: 4,
            decode_step_seconds_total: 0.5,
            drafted_steps_total: 1,
            drafted_step_seconds_total: 0.25,
            ..Default::default()
        };
        stats.drafts.record(3, 1);
        stats.drafts.record(2, 2);
        let cap = KvCapacity {
            blocks: 10,
            block_size: 16,
            bytes: 0,
            dtype: strata_engine::KvCacheDtype::Auto,
            value_type: "f32",
            max_model_len: 64,
        };
        let text = m.render(&stats, &cap, true);
        assert!(text.contains("strata_http_requests_total{route=\"/v1/completions\",status=\"200\"} 1"));
        assert!(text.contains("strata_time_to_first_token_seconds_count 1"));
        assert!(text.contains("strata_inter_token_latency_seconds_count 2"));
        assert!(text.contains("strata_request_finished_total{finish_reason=\"length\"} 1"));
        assert!(text.contains("strata_request_finished_total{finish_reason=\"abort\"} 1"));
        assert!(text.contains("strata_e2e_request_latency_seconds_count 2"));
        assert!(text.contains("strata_kv_blocks_free 7"));
        assert!(text.contains("strata_kv_blocks_used 3"));
        assert!(text.contains("strata_engine_decode_steps_total 4\n"));
        assert!(text.contains("strata_engine_decode_step_seconds_total 0.5\n"));
        assert!(text.contains("strata_engine_drafted_steps_total 1\n"));
        assert!(text.contains("strata_engine_drafted_step_seconds_total 0.25\n"));
        assert!(text.contains("strata_spec_decode_num_draft_tokens_total 5\n"));
        assert!(text.contains("strata_spec_decode_num_accepted_tokens_total 3\n"));
        assert!(text.contains("strata_spec_decode_acceptance_rate 0.6\n"));
        assert!(text.contains("strata_spec_decode_num_accepted_tokens_per_pos{position=\"1\"} 1\n"));
        assert!(text.contains("strata_spec_decode_acceptance_rate_per_pos{position=\"0\"} 1\n"));
        assert!(text.contains("strata_spec_decode_acceptance_rate_per_pos{position=\"2\"} 0\n"));
    }
}
