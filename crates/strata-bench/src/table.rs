//! Text output: the summary table of one or more runs, the detail block of a run, and `--compare`.
//! Owns number formatting and column alignment; nothing here measures.

use crate::config::Endpoint;
use crate::report::{BenchReport, BenchResults, LatencySummary};

/// Renders rows under headers; the first column is left-aligned, the others right-aligned.
pub fn render_table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| -> String {
        let parts: Vec<String> = cells
            .zip(&widths)
            .enumerate()
            .map(|(i, (cell, w))| {
                if i == 0 {
                    format!("{cell:<w$}")
                } else {
                    format!("{cell:>w$}")
                }
            })
            .collect();
        parts.join("  ").trim_end().to_string()
    };
    let mut out = line(&mut headers.iter().copied());
    out.push('\n');
    out.push_str(&line(
        &mut widths
            .iter()
            .map(|w| "-".repeat(*w))
            .collect::<Vec<_>>()
            .iter()
            .map(String::as_str),
    ));
    out.push('\n');
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
        out.push('\n');
    }
    out
}

fn fixed(value: f64, decimals: usize) -> String {
    if value.is_finite() {
        format!("{value:.decimals$}")
    } else {
        "-".to_string()
    }
}

fn pick(summary: &Option<LatencySummary>, f: fn(&LatencySummary) -> f64) -> String {
    summary
        .as_ref()
        .map(|s| fixed(f(s), 1))
        .unwrap_or_else(|| "-".to_string())
}

fn concurrency_cell(run: &BenchReport) -> String {
    run.concurrency
        .map(|c| c.to_string())
        .unwrap_or_else(|| "-".to_string())
}

fn rate_cell(run: &BenchReport) -> String {
    run.request_rate
        .map(|r| fixed(r, 1))
        .unwrap_or_else(|| "inf".to_string())
}

/// One row per run: server | concurrency | TTFT P95 | tokens/s | error rate, and the other headline figures.
pub fn summary_table(runs: &[BenchReport]) -> String {
    let headers = [
        "server",
        "concurrency",
        "rate",
        "requests",
        "TTFT p50 ms",
        "TTFT p95 ms",
        "ITL p50 ms",
        "TPOT p50 ms",
        "E2E p50 ms",
        "req/s",
        "output tok/s",
        "total tok/s",
        "acceptance",
        "error rate",
    ];
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                r.label.clone(),
                concurrency_cell(r),
                rate_cell(r),
                r.requests.sent.to_string(),
                pick(&r.ttft_ms, |s| s.p50),
                pick(&r.ttft_ms, |s| s.p95),
                pick(&r.itl_ms, |s| s.p50),
                pick(&r.tpot_ms, |s| s.p50),
                pick(&r.e2e_ms, |s| s.p50),
                fixed(r.request_throughput, 2),
                fixed(r.output_token_throughput, 1),
                fixed(r.total_token_throughput, 1),
                r.speculative_decoding
                    .as_ref()
                    .map_or("-".to_string(), |s| fixed(s.acceptance_rate, 2)),
                format!("{:.2}%", r.error_rate * 100.0),
            ]
        })
        .collect();
    render_table(&headers, &rows)
}

/// Every figure of one run, for a terminal.
pub fn run_details(run: &BenchReport) -> String {
    let shape = match (run.request_rate, run.concurrency) {
        (None, Some(c)) => format!("closed loop, {c} users"),
        (Some(rate), Some(c)) => format!("open loop, {rate} req/s, at most {c} in flight"),
        (Some(rate), None) => format!("open loop, {rate} req/s, no concurrency cap"),
        (None, None) => "closed loop".to_string(),
    };
    let endpoint = match run.endpoint {
        Endpoint::Chat => "chat",
        Endpoint::Completions => "completions",
    };
    let mut out = format!(
        "{} at {} ({endpoint}, {}), {}: {} requests in {:.2} s\n",
        run.model,
        run.base_url,
        if run.stream { "streamed" } else { "not streamed" },
        shape,
        run.requests.sent,
        run.duration_s
    );
    let rows: Vec<Vec<String>> = [
        ("TTFT ms", &run.ttft_ms),
        ("ITL ms", &run.itl_ms),
        ("TPOT ms", &run.tpot_ms),
        ("E2E ms", &run.e2e_ms),
    ]
    .into_iter()
    .map(|(name, s)| {
        let mut row = vec![name.to_string()];
        for f in [
            |s: &LatencySummary| s.mean,
            |s: &LatencySummary| s.p50,
            |s: &LatencySummary| s.p90,
            |s: &LatencySummary| s.p95,
            |s: &LatencySummary| s.p99,
            |s: &LatencySummary| s.max,
        ] {
            row.push(pick(s, f));
        }
        row
    })
    .collect();
    out.push_str(&render_table(&["", "mean", "p50", "p90", "p95", "p99", "max"], &rows));
    let c = &run.requests;
    out.push_str(&format!(
        "requests: {} sent, {} completed, {} failed",
        c.sent, c.completed, c.failed
    ));
    if run.errors.total > 0 {
        out.push_str(&format!(" ({})", run.errors.compact()));
    }
    out.push_str(&format!("; warm-up {} not counted", c.warmup_sent));
    if c.warmup_failed > 0 {
        out.push_str(&format!(" ({} of them failed)", c.warmup_failed));
    }
    out.push('\n');
    if c.retried > 0 {
        out.push_str(&format!(
            "retried: {} requests resent on a new connection after a kept-alive one closed before any response byte (not errors)\n",
            c.retried
        ));
    }
    for (kind, message) in &run.errors.first_message {
        out.push_str(&format!("  first {kind}: {message}\n"));
    }
    out.push_str(&format!(
        "throughput: {:.2} req/s, {:.1} output tok/s, {:.1} total tok/s\n",
        run.request_throughput, run.output_token_throughput, run.total_token_throughput
    ));
    out.push_str(&format!(
        "tokens: input {} counted by {}; output {} counted by {}; prompts built with {}\n",
        run.input_tokens.total,
        run.input_tokens.describe_sources(),
        run.output_tokens.total,
        run.output_tokens.describe_sources(),
        run.prompt_lengths_counted_by.describe()
    ));
    if let Some(s) = &run.speculative_decoding {
        let by_position: Vec<String> = s.acceptance_by_position.iter().map(|a| format!("{a:.2}")).collect();
        out.push_str(&format!(
            "speculative decoding (server /metrics, warm-up included): {} draft tokens, {} accepted, acceptance {:.2}; by position {}\n",
            s.draft_tokens,
            s.accepted_tokens,
            s.acceptance_rate,
            if by_position.is_empty() { "-".to_string() } else { by_position.join(" ") }
        ));
    }
    if let Some(n) = run.server_preemptions {
        out.push_str(&format!(
            "preemptions (server /metrics, warm-up included): {n} sequence(s) paused for KV space and recomputed\n"
        ));
    }
    for note in &run.notes {
        out.push_str(&format!("note: {note}\n"));
    }
    out
}

fn ratio(a: f64, b: f64) -> String {
    if a.is_finite() && b.is_finite() && a != 0.0 {
        format!("{:.2}x", b / a)
    } else {
        "-".to_string()
    }
}

/// A compared figure: its name, decimals shown, and how to read it from a run.
type Metric = (&'static str, usize, fn(&BenchReport) -> Option<f64>);

const COMPARED: [Metric; 12] = [
    ("TTFT p50 ms", 2, |r| r.ttft_ms.as_ref().map(|s| s.p50)),
    ("TTFT p95 ms", 2, |r| r.ttft_ms.as_ref().map(|s| s.p95)),
    ("TTFT p99 ms", 2, |r| r.ttft_ms.as_ref().map(|s| s.p99)),
    ("ITL p50 ms", 2, |r| r.itl_ms.as_ref().map(|s| s.p50)),
    ("TPOT p50 ms", 2, |r| r.tpot_ms.as_ref().map(|s| s.p50)),
    ("E2E p50 ms", 2, |r| r.e2e_ms.as_ref().map(|s| s.p50)),
    ("E2E p95 ms", 2, |r| r.e2e_ms.as_ref().map(|s| s.p95)),
    ("req/s", 2, |r| Some(r.request_throughput)),
    ("output tok/s", 1, |r| Some(r.output_token_throughput)),
    ("total tok/s", 1, |r| Some(r.total_token_throughput)),
    ("error rate %", 2, |r| Some(r.error_rate * 100.0)),
    ("requests", 0, |r| Some(r.requests.sent as f64)),
];

/// Pairs the runs of two files: by equal concurrency and rate where any match, else in order.
fn pair_runs<'a>(a: &'a [BenchReport], b: &'a [BenchReport]) -> Vec<(&'a BenchReport, &'a BenchReport)> {
    let same_level =
        |x: &BenchReport, y: &BenchReport| x.concurrency == y.concurrency && x.request_rate == y.request_rate;
    let matched: Vec<_> = a
        .iter()
        .filter_map(|run_a| {
            b.iter()
                .find(|run_b| same_level(run_a, run_b))
                .map(|run_b| (run_a, run_b))
        })
        .collect();
    if matched.is_empty() {
        a.iter().zip(b).collect()
    } else {
        matched
    }
}

/// Two results files side by side, run by run, with B/A ratios.
pub fn compare_table(a: &BenchResults, b: &BenchResults, a_name: &str, b_name: &str) -> String {
    let label = |r: &BenchResults, name: &str| {
        r.runs
            .first()
            .map(|run| format!("{} ({name})", run.label))
            .unwrap_or_else(|| name.to_string())
    };
    let mut out = format!("A = {}\nB = {}\n", label(a, a_name), label(b, b_name));
    let pairs = pair_runs(&a.runs, &b.runs);
    if pairs.len() != a.runs.len() || pairs.len() != b.runs.len() {
        out.push_str(&format!(
            "note: A has {} runs and B has {}; comparing {} pair(s)\n",
            a.runs.len(),
            b.runs.len(),
            pairs.len()
        ));
    }
    for (run_a, run_b) in pairs {
        out.push_str(&format!(
            "\nconcurrency A {} / B {}, rate A {} / B {}\n",
            concurrency_cell(run_a),
            concurrency_cell(run_b),
            rate_cell(run_a),
            rate_cell(run_b)
        ));
        let rows: Vec<Vec<String>> = COMPARED
            .iter()
            .map(|(name, decimals, get)| {
                let (va, vb) = (get(run_a), get(run_b));
                let cell = |v: Option<f64>| v.map(|x| fixed(x, *decimals)).unwrap_or_else(|| "-".to_string());
                vec![
                    name.to_string(),
                    cell(va),
                    cell(vb),
                    ratio(va.unwrap_or(f64::NAN), vb.unwrap_or(f64::NAN)),
                ]
            })
            .collect();
        out.push_str(&render_table(&["metric", "A", "B", "B/A"], &rows));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align() {
        let table = render_table(
            &["name", "n"],
            &[vec!["a".into(), "100".into()], vec!["long name".into(), "2".into()]],
        );
        let lines: Vec<&str> = table.lines().collect();
        assert_eq!(lines[0], "name         n");
        assert_eq!(lines[2], "a          100");
        assert_eq!(lines[3], "long name    2");
    }

    #[test]
    fn ratios_guard_zero_and_missing() {
        assert_eq!(ratio(2.0, 3.0), "1.50x");
        assert_eq!(ratio(0.0, 3.0), "-");
        assert_eq!(ratio(f64::NAN, 3.0), "-");
    }
}
