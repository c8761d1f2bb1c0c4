//! Offline engine throughput (no HTTP): closed-loop load at several concurrencies on the default
//! model, printing aggregate decode tok/s and per-step latency and writing JSON to bench/results/.
//!
//! `cargo bench -p strata-engine --bench throughput -- [--threads 2] [--levels 1,4,16,32,64]
//! [--output-len 64] [--kv-cache-dtype auto|fp8] [--activation-precision high|standard]
//! [--constrained FRACTION] [--out PATH]`
//!
//! With `--constrained`, each level runs twice, side by side: all requests free, then that
//! fraction of them held to a JSON schema (`records_schema`); the table gives the ratio.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_engine::constraint::{is_constrained, records_schema};
use strata_engine::{ActPrecision, EngineConfig, EngineHandle, GenerationRequest, KvCacheDtype, RequestOutput};

mod common;

struct Options {
    threads: usize,
    levels: Vec<usize>,
    output_len: usize,
    dtype: KvCacheDtype,
    precision: ActPrecision,
    /// Fraction of requests held to `records_schema` in the second run of each level (0 = one run).
    constrained: f64,
    out: std::path::PathBuf,
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        threads: 2,
        levels: vec![1, 4, 16, 32, 64],
        output_len: 64,
        dtype: KvCacheDtype::Auto,
        precision: ActPrecision::default(),
        constrained: 0.0,
        out: common::results_path(None, "engine_throughput.json"),
    };
    let args = common::bench_args();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || it.next().cloned().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--threads" => o.threads = value()?.parse().map_err(|e| format!("--threads: {e}"))?,
            "--output-len" => o.output_len = value()?.parse().map_err(|e| format!("--output-len: {e}"))?,
            "--levels" => o.levels = common::levels(&value()?)?,
            "--kv-cache-dtype" => o.dtype = KvCacheDtype::parse(&value()?)?,
            "--activation-precision" => o.precision = ActPrecision::parse(&value()?)?,
            "--constrained" => {
                o.constrained = value()?.parse().map_err(|e| format!("--constrained: {e}"))?;
                if !(0.0..=1.0).contains(&o.constrained) {
                    return Err("--constrained is a fraction in [0, 1]".into());
                }
            }
            "--out" => o.out = common::results_path(Some(&value()?), ""),
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(o)
}

/// Figures of one concurrency level.
struct Level {
    requests: usize,
    output_tokens: usize,
    prompt_tokens: usize,
    wall_s: f64,
    /// Gaps between consecutive tokens of a request: one engine step each.
    step_ms: Vec<f64>,
    ttft_ms: Vec<f64>,
}

fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p).round() as usize]
}

/// Mixed prompt lengths (16..128 tokens) with distinct content, so the prefix cache does not
/// turn prefill into a no-op.
fn prompt_for(i: usize, e: &EngineHandle) -> Vec<u32> {
    let lens = [16, 32, 64, 128];
    let want = lens[i % lens.len()];
    let vocab = e.tokenizer().vocab_size() as u64;
    let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (i as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    (0..want)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (1000 + x % (vocab - 2000)) as u32
        })
        .collect()
}

/// One closed-loop run; `salt` makes its prompts its own (a run must not find another's in the
/// prefix cache).
fn run_level(e: &EngineHandle, concurrency: usize, output_len: usize, constrained: f64, salt: usize) -> Level {
    let requests = (concurrency * 2).max(8);
    let next = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new((Vec::new(), Vec::new(), 0usize, 0usize)));
    let t0 = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..concurrency {
            let (next, results) = (Arc::clone(&next), Arc::clone(&results));
            s.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::SeqCst);
                if i >= requests {
                    return;
                }
                let prompt = prompt_for(salt + i, e);
                let n_prompt = prompt.len();
                let req = GenerationRequest {
                    ignore_eos: true,
                    constraint: is_constrained(i, constrained).then(records_schema),
                    ..GenerationRequest::greedy(prompt, output_len)
                };
                let start = Instant::now();
                let mut stream = e.submit(req).expect("the bench request is valid");
                let (mut last, mut gaps, mut ttft, mut n) = (None::<Instant>, Vec::new(), 0.0, 0);
                while let Some(out) = stream.blocking_next() {
                    match out {
                        RequestOutput::Delta { tokens, .. } if !tokens.is_empty() => {
                            let now = Instant::now();
                            match last {
                                None => ttft = (now - start).as_secs_f64() * 1e3,
                                Some(l) => gaps.push((now - l).as_secs_f64() * 1e3),
                            }
                            last = Some(now);
                            n += tokens.len();
                        }
                        RequestOutput::Failed(e) | RequestOutput::Unavailable(e) => {
                            panic!("bench request failed: {e}")
                        }
                        _ => {}
                    }
                }
                let mut r = results.lock().unwrap();
                r.0.extend(gaps);
                r.1.push(ttft);
                r.2 += n;
                r.3 += n_prompt;
            });
        }
    });
    let wall_s = t0.elapsed().as_secs_f64();
    let (step_ms, ttft_ms, output_tokens, prompt_tokens) = std::mem::take(&mut *results.lock().unwrap());
    Level {
        requests,
        output_tokens,
        prompt_tokens,
        wall_s,
        step_ms,
        ttft_ms,
    }
}

fn main() {
    let o = common::options_or_exit(options());
    let (path, model) = common::default_model_or_exit();
    let config = EngineConfig {
        threads: o.threads,
        kv_cache_dtype: o.dtype,
        activation_precision: o.precision,
        max_model_len: Some(2048),
        max_num_seqs: 64,
        max_num_batched_tokens: 512,
        kv_cache_memory: 2 << 30,
        ..Default::default()
    };
    let e = EngineHandle::start(model, config.clone()).expect("engine starts");
    // Warm-up: page in weights, fill caches.
    run_level(&e, 2, 8, o.constrained, 1 << 20);
    println!(
        "| concurrency | constrained | requests | output tok/s | total tok/s | step p50 ms | step p99 ms | TTFT p50 ms | TTFT p95 ms | decode-only tok/s | decode-only step ms | its batch | mask ms | mask wait ms/step |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut ratios = Vec::new();
    let runs: Vec<(usize, f64)> = o
        .levels
        .iter()
        .flat_map(|&c| {
            let both = [(c, 0.0), (c, o.constrained)];
            both.into_iter().take(if o.constrained > 0.0 { 2 } else { 1 })
        })
        .collect();
    let mut free_tps = 0.0;
    for (r, (c, fraction)) in runs.into_iter().enumerate() {
        let before = e.stats();
        let l = run_level(&e, c, o.output_len, fraction, r << 12);
        // Steps without prompt chunks: the aggregate decode rate while every sequence decodes.
        let after = e.stats();
        let steps = (after.decode_steps_total - before.decode_steps_total).max(1) as f64;
        let seqs = (after.decode_step_seqs_total - before.decode_step_seqs_total) as f64;
        let secs = after.decode_step_seconds_total - before.decode_step_seconds_total;
        let (decode_tps, decode_ms, decode_batch) = (seqs / secs.max(1e-9), secs * 1e3 / steps, seqs / steps);
        let out_tps = l.output_tokens as f64 / l.wall_s;
        let total_tps = (l.output_tokens + l.prompt_tokens) as f64 / l.wall_s;
        let (s50, s99) = (percentile(&l.step_ms, 0.5), percentile(&l.step_ms, 0.99));
        let (t50, t95) = (percentile(&l.ttft_ms, 0.5), percentile(&l.ttft_ms, 0.95));
        let masks = (after.masks_total - before.masks_total).max(1) as f64;
        let mask_ms = (after.mask_seconds_total - before.mask_seconds_total) * 1e3 / masks;
        let all_steps = (after.steps_total - before.steps_total).max(1) as f64;
        let wait_ms = (after.mask_wait_seconds_total - before.mask_wait_seconds_total) * 1e3 / all_steps;
        println!(
            "| {c} | {fraction} | {} | {out_tps:.1} | {total_tps:.1} | {s50:.1} | {s99:.1} | {t50:.0} | {t95:.0} | {decode_tps:.1} | {decode_ms:.1} | {decode_batch:.1} | {mask_ms:.3} | {wait_ms:.3} |",
            l.requests
        );
        if fraction == 0.0 {
            free_tps = out_tps;
        } else {
            ratios.push(format!(
                "{c} users, {fraction} constrained: {:.3}x the free run's output tok/s",
                out_tps / free_tps
            ));
        }
        rows.push(format!(
            "{{\"concurrency\":{c},\"constrained_fraction\":{fraction},\"mask_ms\":{mask_ms:.4},\"mask_wait_ms_per_step\":{wait_ms:.4},\"requests\":{},\"output_tokens\":{},\"prompt_tokens\":{},\"wall_s\":{:.3},\
             \"output_tok_s\":{out_tps:.2},\"total_tok_s\":{total_tps:.2},\"step_ms_p50\":{s50:.2},\
             \"step_ms_p99\":{s99:.2},\"ttft_ms_p50\":{t50:.1},\"ttft_ms_p95\":{t95:.1},\
             \"decode_only_tok_s\":{decode_tps:.2},\"decode_only_step_ms\":{decode_ms:.2},\"decode_only_batch\":{decode_batch:.2}}}",
            l.requests, l.output_tokens, l.prompt_tokens, l.wall_s
        ));
        std::thread::sleep(Duration::from_millis(200));
    }
    for r in &ratios {
        println!("{r}");
    }
    let json = format!(
        "{{\"model\":\"{}\",\"threads\":{},\"kv_cache_dtype\":\"{}\",\"activation_precision\":\"{}\",\"output_len\":{},\
         \"prompt_lens\":[16,32,64,128],\"max_num_batched_tokens\":{},\"levels\":[{}]}}\n",
        path.file_name().and_then(|f| f.to_str()).unwrap_or("?"),
        o.threads,
        o.dtype.cpu_value_type(),
        o.precision.as_str(),
        o.output_len,
        config.max_num_batched_tokens,
        rows.join(",")
    );
    if let Some(dir) = o.out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    match std::fs::write(&o.out, json) {
        Ok(()) => println!("wrote {}", o.out.display()),
        Err(e) => eprintln!("error: cannot write {}: {e}", o.out.display()),
    }
}
