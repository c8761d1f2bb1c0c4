//! `strata bench-local`: prompt-processing and single-stream decode speed of one model on this CPU.
//! Prints a table and writes JSON under bench/results/; speed targets live here, not in tests.

use std::path::PathBuf;

use clap::Args;
use serde::Serialize;
use strata_engine::{complete, GenerationRequest};
use strata_model::loader::default_model_path;
use strata_runtime::cpu::{ActPrecision, ThreadPool};

#[derive(Args, Debug)]
pub struct BenchLocalArgs {
    /// Path of a GGUF model or an HF checkpoint directory (default: the SmolLM2 file `make fetch` installs).
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// CPU threads.
    #[arg(long, short = 't', default_value_t = 2)]
    pub threads: usize,
    /// Prompt length for the prompt-processing figure.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Tokens generated for the decode figure.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Repetitions of each measurement (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Activation precision of the decode path: standard (8-bit, the default) or high (~14-bit).
    #[arg(long, default_value = "standard", value_parser = ActPrecision::parse)]
    pub activation_precision: ActPrecision,
    /// Where to write the JSON report.
    #[arg(long, default_value = "bench/results/cpu_local.json")]
    pub out: PathBuf,
}

#[derive(Serialize)]
struct Report {
    model: String,
    threads: usize,
    activation_precision: &'static str,
    prompt_tokens: usize,
    gen_tokens: usize,
    repeats: usize,
    prompt_tps_runs: Vec<f64>,
    decode_tps_runs: Vec<f64>,
    prompt_tps_median: f64,
    decode_tps_median: f64,
    weight_bytes_per_token: u64,
    decode_effective_gb_s: f64,
    /// Read bandwidth of this machine with `threads` threads over a buffer far larger than cache.
    memory_read_gb_s: f64,
    /// Decode ceiling if every step only streamed the weights once: bandwidth / weight bytes.
    decode_roofline_tps: f64,
    cpu: String,
    isa: &'static str,
    date_unix: u64,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn bench_local(args: BenchLocalArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.threads >= 1, "--threads must be at least 1");
    anyhow::ensure!(args.repeats >= 1, "--repeats must be at least 1");
    anyhow::ensure!(
        args.prompt_tokens >= 1 && args.gen_tokens >= 2,
        "--prompt-tokens >= 1 and --gen-tokens >= 2"
    );
    let path = args.model.clone().unwrap_or_else(default_model_path);
    let model = crate::progress::load_with_progress(&path)?;
    // A fixed pseudo-random prompt of ordinary tokens.
    let prompt = crate::synthetic_prompt::SyntheticPrompts::new(&model.tokenizer)?.prompt(args.prompt_tokens, 0);
    let weight_bytes = model.transformer.weights.matrix_bytes();
    let cpu = crate::device::DeviceArgs {
        device: crate::device::Device::Cpu,
        activation_precision: args.activation_precision,
        ..Default::default()
    };
    let tokens = args.prompt_tokens.max(1 + args.gen_tokens) + 1;
    let engine = crate::run::start_single_stream(model, args.threads, tokens, &cpu)?;
    let greedy = |prompt: &[u32], max_tokens: usize| -> anyhow::Result<strata_engine::Completion> {
        let req = GenerationRequest {
            ignore_eos: true,
            ..GenerationRequest::greedy(prompt.to_vec(), max_tokens)
        };
        complete(engine.submit(req)?, &mut |_| {}).map_err(|e| anyhow::anyhow!(e))
    };
    // Warm-up (page cache, thread start, allocator).
    greedy(&prompt[..prompt.len().min(32)], args.gen_tokens)?;
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    for _ in 0..args.repeats {
        pp.push(greedy(&prompt, 1)?.prompt_tps());
        tg.push(greedy(&prompt[..1], args.gen_tokens)?.decode_tps());
    }
    drop(engine);
    let pool = ThreadPool::new(args.threads);
    let bandwidth = read_bandwidth_gb_s(&pool);
    let (pp_med, tg_med) = (median(&mut pp.clone()), median(&mut tg.clone()));
    let report = Report {
        model: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        threads: args.threads,
        activation_precision: args.activation_precision.as_str(),
        prompt_tokens: args.prompt_tokens,
        gen_tokens: args.gen_tokens,
        repeats: args.repeats,
        prompt_tps_runs: pp,
        decode_tps_runs: tg,
        prompt_tps_median: pp_med,
        decode_tps_median: tg_med,
        weight_bytes_per_token: weight_bytes,
        decode_effective_gb_s: weight_bytes as f64 * tg_med / 1e9,
        memory_read_gb_s: bandwidth,
        decode_roofline_tps: bandwidth * 1e9 / weight_bytes as f64,
        cpu: cpu_name(),
        // The level the 8-bit kernels dispatch to (every level has a Q8_0 build).
        isa: strata_runtime::cpu::quant_dot::kernel_for(strata_formats::GgmlType::Q8_0).map_or("scalar", |k| k.isa()),
        date_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    println!(
        "| model | threads | pp{} tok/s | tg{} tok/s | weights GB/s in decode | memory GB/s | decode roofline tok/s |",
        args.prompt_tokens, args.gen_tokens
    );
    println!("|---|---|---|---|---|---|---|");
    println!(
        "| {} | {} | {:.1} | {:.1} | {:.2} | {:.2} | {:.0} |",
        report.model,
        report.threads,
        pp_med,
        tg_med,
        report.decode_effective_gb_s,
        bandwidth,
        report.decode_roofline_tps
    );
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)? + "\n")?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

/// Best of three passes summing a 512 MiB buffer split over the pool's threads.
fn read_bandwidth_gb_s(pool: &ThreadPool) -> f64 {
    let words = 64 << 20; // 512 MiB of u64
    let buf: Vec<u64> = (0..words as u64).collect();
    let mut best = 0.0f64;
    for _ in 0..3 {
        let sums: Vec<std::sync::atomic::AtomicU64> = (0..pool.n_threads()).map(|_| Default::default()).collect();
        let t = std::time::Instant::now();
        pool.split_even(words, 4096, &|range| {
            let mut acc = [0u64; 8];
            for chunk in buf[range.clone()].chunks_exact(8) {
                for (a, &v) in acc.iter_mut().zip(chunk) {
                    *a = a.wrapping_add(v);
                }
            }
            let slot = range.start * pool.n_threads() / words;
            sums[slot.min(sums.len() - 1)].fetch_add(acc.iter().sum(), std::sync::atomic::Ordering::Relaxed);
        });
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(&sums);
        best = best.max((words * 8) as f64 / secs / 1e9);
    }
    best
}

fn cpu_name() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}
