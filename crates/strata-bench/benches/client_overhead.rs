//! Client overhead of `strata bench`: streamed requests/s it drives against the in-process mock server, and how
//! far its TTFT is from an independent raw-TCP measurement (and from curl's, when curl is installed).
//! Run: `cargo bench -p strata-bench --bench client_overhead`. Writes bench/results/client_overhead.json.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;
use strata_bench::mock::{MockConfig, MockServer};
use strata_bench::{run_bench, BenchConfig, InputSource, LoadShape};

const TARGET_REQ_PER_S: f64 = 2000.0;
const THROUGHPUT_RUNS: usize = 3;
const THROUGHPUT_REQUESTS: u64 = 20_000;
const THROUGHPUT_USERS: usize = 64;
const CHUNKS_PER_REQUEST: u32 = 16;
const TTFT_DELAY: Duration = Duration::from_millis(20);
const TTFT_SAMPLES: usize = 50;

fn runtime(threads: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn chat_body(max_tokens: u32) -> String {
    json!({"model": "mock-model", "messages": [{"role": "user", "content": "one two three four"}],
           "max_tokens": max_tokens, "stream": true, "stream_options": {"include_usage": true}})
    .to_string()
}

/// Time from writing the request to the first response byte and to the first content chunk, over a fresh
/// connection, with nothing but a socket: the stand-in for curl.
fn raw_tcp_ttft(addr: SocketAddr, body: &str) -> std::io::Result<(f64, f64)> {
    let mut stream = TcpStream::connect(addr)?;
    stream.set_nodelay(true)?;
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let start = Instant::now();
    stream.write_all(request.as_bytes())?;
    let mut seen = Vec::new();
    let mut buf = [0u8; 16384];
    let mut first_byte = None;
    loop {
        let n = stream.read(&mut buf)?;
        if n == 0 {
            return Err(std::io::Error::other("connection closed before any content"));
        }
        let at = start.elapsed().as_secs_f64() * 1000.0;
        first_byte.get_or_insert(at);
        seen.extend_from_slice(&buf[..n]);
        if seen.windows(17).any(|w| w == b"\"content\":\" word\"") {
            return Ok((first_byte.unwrap_or(at), at));
        }
    }
}

/// curl's time_starttransfer in ms for the same request, when curl is installed.
fn curl_ttft(url: &str, body: &str) -> Option<f64> {
    let output = Command::new("curl")
        .args(["-s", "-N", "-o", "/dev/null", "-w", "%{time_starttransfer}"])
        .args(["-H", "Content-Type: application/json", "-d", body, url])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    text.trim().parse::<f64>().ok().map(|s| s * 1000.0)
}

fn main() {
    let cpus = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let client_threads = (cpus / 2).max(1);
    let mock_threads = (cpus - client_threads).max(1);
    let mock_rt = runtime(mock_threads);
    let client_rt = runtime(client_threads);
    println!("client overhead: {cpus} CPUs, client {client_threads} thread(s), mock {mock_threads} thread(s)");

    // 1. Streamed requests per second against a mock that answers at once.
    let fast = mock_rt
        .block_on(MockServer::start(MockConfig {
            output_tokens: Some(CHUNKS_PER_REQUEST),
            ..MockConfig::default()
        }))
        .expect("mock server");
    let mut cfg = BenchConfig::new(fast.base_url());
    cfg.load = LoadShape::ClosedLoop {
        users: THROUGHPUT_USERS,
    };
    cfg.num_requests = Some(THROUGHPUT_REQUESTS);
    cfg.warmup = 1000;
    cfg.input = InputSource::Random { input_len: 16 };
    cfg.output_len = Some(CHUNKS_PER_REQUEST);
    let mut throughput_runs = Vec::new();
    for run in 0..THROUGHPUT_RUNS {
        cfg.seed = run as u64;
        let report = client_rt.block_on(run_bench(&cfg)).expect("bench against the mock");
        println!(
            "  run {}: {:.0} streamed req/s, {:.0} chunks/s, {} errors, e2e p50 {:.2} ms",
            run + 1,
            report.request_throughput,
            report.output_token_throughput,
            report.requests.failed,
            report.e2e_ms.as_ref().map(|s| s.p50).unwrap_or(f64::NAN)
        );
        throughput_runs.push(report);
    }
    let req_per_s = median(throughput_runs.iter().map(|r| r.request_throughput).collect());

    // 2. TTFT against a mock that waits before the headers and the first token.
    let slow = mock_rt
        .block_on(MockServer::start(MockConfig {
            output_tokens: Some(4),
            time_to_first_token: TTFT_DELAY,
            ..MockConfig::default()
        }))
        .expect("mock server");
    let mut ttft_cfg = BenchConfig::new(slow.base_url());
    ttft_cfg.load = LoadShape::ClosedLoop { users: 1 };
    ttft_cfg.num_requests = Some(TTFT_SAMPLES as u64);
    ttft_cfg.warmup = 5;
    ttft_cfg.input = InputSource::Random { input_len: 4 };
    ttft_cfg.output_len = Some(4);
    let report = client_rt
        .block_on(run_bench(&ttft_cfg))
        .expect("bench against the mock");
    let client_ttft = report.ttft_ms.as_ref().map(|s| s.p50).unwrap_or(f64::NAN);
    let body = chat_body(4);
    let raw: Vec<(f64, f64)> = (0..TTFT_SAMPLES)
        .filter_map(|_| raw_tcp_ttft(slow.addr(), &body).ok())
        .collect();
    let raw_first_byte = median(raw.iter().map(|r| r.0).collect());
    let raw_content = median(raw.iter().map(|r| r.1).collect());
    let url = format!("{}/v1/chat/completions", slow.base_url());
    let curl: Vec<f64> = (0..20).filter_map(|_| curl_ttft(&url, &body)).collect();
    let curl_p50 = (!curl.is_empty()).then(|| median(curl));

    println!();
    println!("| measure | value | target |");
    println!("|---|---|---|");
    println!(
        "| streamed requests/s ({CHUNKS_PER_REQUEST} chunks, {THROUGHPUT_USERS} users), median of {THROUGHPUT_RUNS} | {req_per_s:.0} | >= {TARGET_REQ_PER_S:.0} |"
    );
    println!("| mock TTFT delay | {:.1} ms | |", TTFT_DELAY.as_secs_f64() * 1000.0);
    println!("| strata bench TTFT p50 | {client_ttft:.2} ms | |");
    println!("| raw TCP first byte / first content p50 | {raw_first_byte:.2} / {raw_content:.2} ms | |");
    match curl_p50 {
        Some(c) => println!("| curl time_starttransfer p50 | {c:.2} ms | |"),
        None => println!("| curl time_starttransfer p50 | (curl not found) | |"),
    }
    let delta = client_ttft - raw_content;
    println!("| TTFT delta, strata bench - raw TCP | {delta:+.2} ms | within a few ms |");
    if let Some(c) = curl_p50 {
        println!(
            "| TTFT delta, strata bench - curl | {:+.2} ms | within a few ms |",
            client_ttft - c
        );
    }
    let verdict = req_per_s >= TARGET_REQ_PER_S && delta.abs() < 3.0;
    println!("\n{}", if verdict { "PASS" } else { "BELOW TARGET" });

    let results = json!({
        "bench": "client_overhead",
        "cpus": cpus,
        "client_threads": client_threads,
        "mock_threads": mock_threads,
        "throughput": {
            "users": THROUGHPUT_USERS,
            "requests_per_run": THROUGHPUT_REQUESTS,
            "chunks_per_request": CHUNKS_PER_REQUEST,
            "req_per_s_runs": throughput_runs.iter().map(|r| r.request_throughput).collect::<Vec<_>>(),
            "chunks_per_s_runs": throughput_runs.iter().map(|r| r.output_token_throughput).collect::<Vec<_>>(),
            "errors_runs": throughput_runs.iter().map(|r| r.requests.failed).collect::<Vec<_>>(),
            "req_per_s_median": req_per_s,
            "target_req_per_s": TARGET_REQ_PER_S,
        },
        "ttft": {
            "mock_delay_ms": TTFT_DELAY.as_secs_f64() * 1000.0,
            "samples": TTFT_SAMPLES,
            "strata_bench_p50_ms": client_ttft,
            "raw_tcp_first_byte_p50_ms": raw_first_byte,
            "raw_tcp_first_content_p50_ms": raw_content,
            "curl_starttransfer_p50_ms": curl_p50,
            "delta_vs_raw_tcp_ms": delta,
            "delta_vs_curl_ms": curl_p50.map(|c| client_ttft - c),
        },
        "pass": verdict,
    });
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let workspace = manifest_dir.parent().and_then(|p| p.parent()).unwrap_or(&manifest_dir);
    let dir = workspace.join("bench/results");
    let path = dir.join("client_overhead.json");
    let written = std::fs::create_dir_all(&dir)
        .and_then(|_| std::fs::write(&path, serde_json::to_string_pretty(&results).unwrap_or_default() + "\n"));
    match written {
        Ok(()) => println!("wrote {}", path.display()),
        Err(e) => eprintln!("cannot write {}: {e}", path.display()),
    }
}
