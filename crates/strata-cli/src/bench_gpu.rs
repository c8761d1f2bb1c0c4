//! `strata bench-gpu`: one model through the engine on one GPU or a TP/PP layout: TTFT of a long
//! prompt, single-stream decode against the memory roofline, and throughput at many concurrent requests.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Args;
use serde::Serialize;
use strata_engine::constraint::{is_constrained, records_schema};
use strata_engine::{complete, EngineConfig, EngineHandle, GenerationRequest, KvCacheDtype};
use strata_model::cuda::ComputeDtype;
use strata_model::loader::{default_model_path, LoadedModel};
use strata_runtime::cuda::{libraries, Gpu};

/// Dense bf16 GEMM rate measured on the H200 (DEVELOPERS.md): the compute roofline.
const PEAK_BF16_FLOPS: f64 = 790e12;

#[derive(Args, Debug)]
pub struct BenchGpuArgs {
    /// A GGUF file or a Hugging Face checkpoint directory (default: the SmolLM2 file).
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// GPU index (one GPU, unless a layout flag below is given).
    #[arg(long, default_value_t = 0)]
    pub gpu: usize,
    /// Run over every visible GPU as the planner lays them out.
    #[arg(long)]
    pub plan: bool,
    /// Force this many GPUs per pipeline stage (tensor parallel).
    #[arg(long, visible_alias = "tp")]
    pub tensor_parallel_size: Option<usize>,
    /// Force this many pipeline stages.
    #[arg(long, visible_alias = "pp")]
    pub pipeline_parallel_size: Option<usize>,
    /// Prompt tokens of every request.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Output tokens of every concurrent request.
    #[arg(long, default_value_t = 256)]
    pub output_tokens: usize,
    /// Tokens generated for the single-stream decode figure.
    #[arg(long, default_value_t = 256)]
    pub decode_tokens: usize,
    /// Concurrency levels of the throughput table.
    #[arg(long, value_delimiter = ',', default_value = "1,64,256")]
    pub levels: Vec<usize>,
    /// KV cache types to compare at the highest level.
    #[arg(long, value_delimiter = ',', default_value = "auto,fp8", value_parser = KvCacheDtype::parse)]
    pub kv_cache_dtypes: Vec<KvCacheDtype>,
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f64,
    /// Size the GPU as if it had only SIZE of memory (e.g. 24GiB).
    #[arg(long, value_name = "SIZE", value_parser = crate::serve::parse_size)]
    pub gpu_memory_limit: Option<usize>,
    /// Layer matrices on the GPU: auto (as shipped: GGUF blocks, FP8), none (bf16) or fp8.
    #[arg(long, default_value = "auto", value_parser = crate::device::parse_quantization)]
    pub quantization: crate::device::Quantization,
    /// Activations of the GEMVs over GGUF blocks: standard (one int8 pass) or high (two).
    #[arg(long, default_value = "standard", value_parser = strata_engine::ActPrecision::parse)]
    pub activation_precision: strata_engine::ActPrecision,
    #[arg(long, default_value_t = 4096)]
    pub max_num_batched_tokens: usize,
    /// No CUDA graphs.
    #[arg(long)]
    pub enforce_eager: bool,
    /// Time only the attention kernels, on a synthetic cache with Llama-3-8B's heads: the
    /// highest level's sequences, contexts spread over the prompt to prompt + output tokens.
    #[arg(long)]
    pub attention: bool,
    /// Leave these kernels (a name or part of one, as the GPU profile prints them) or cuBLASLt
    /// products ("gemm NxK") out of every step, to time what each costs inside a CUDA graph:
    /// the outputs are then wrong, only the times mean something (and only where nothing later
    /// reads what the kernel writes: attention over a zero KV cache runs at a higher clock).
    #[arg(long, value_delimiter = ',', value_name = "KERNELS")]
    pub ablate: Vec<String>,
    /// Run each level of the first cache type again with this fraction of the requests held to a
    /// JSON schema (structured output), beside the free run, and report the ratio.
    #[arg(long, default_value_t = 0.0, value_parser = fraction)]
    pub constrained: f64,
    /// Where to write the JSON report.
    #[arg(long, default_value = "bench/results/gpu_bench.json")]
    pub out: PathBuf,
}

#[derive(Serialize, Default)]
struct Level {
    kv_cache_dtype: String,
    concurrency: usize,
    /// Requests held to a JSON schema (`--constrained`), their grammar masks' mean compute time
    /// on the mask workers, and the engine's wait for masks per step.
    constrained_fraction: f64,
    mask_ms: f64,
    mask_wait_ms_per_step: f64,
    output_tok_s: f64,
    total_tok_s: f64,
    wall_s: f64,
    ttft_p50_ms: f64,
    ttft_p95_ms: f64,
    /// Decode-step roofline: max(bytes / bandwidth, FLOPs / peak) at the mean context.
    step_roofline_ms: f64,
    /// A request's time from first to last token over its tokens: decode steps plus the prompt
    /// chunks of other requests scheduled in between.
    decode_step_ms: f64,
    roofline_fraction: f64,
    /// Steps that only decoded (no prompt chunk): their mean time, mean batch, and the step
    /// roofline at that batch.
    pure_decode_step_ms: f64,
    pure_decode_batch: f64,
    pure_decode_roofline_ms: f64,
    pure_decode_roofline_fraction: f64,
    /// Steps queued behind the one running, tokens taken on the GPU (overlapped steps).
    overlapped_steps: u64,
    /// FNV-1a of every request's output tokens in request order: equal when two runs (say with
    /// and without overlapped steps) decode the same tokens.
    output_tokens_fnv1a: u64,
    kv_capacity_tokens: usize,
}

#[derive(Serialize, Default)]
struct Report {
    model: String,
    gpu: String,
    /// "one GPU", "planned", or the forced TP/PP sizes.
    layout: String,
    copy_bandwidth_gb_s: f64,
    weight_bytes: u64,
    decode_roofline_tok_s: f64,
    single_stream_decode_tok_s: f64,
    single_stream_roofline_fraction: f64,
    ttft_512_ms: f64,
    levels: Vec<Level>,
    cuda_graphs: bool,
    /// Kernels and products left out of every step (--ablate): timings only.
    ablated: Vec<String>,
}

/// A share in [0, 1] (`--constrained`).
fn fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(f) if (0.0..=1.0).contains(&f) => Ok(f),
        _ => Err(format!("{s} is not a fraction in [0, 1]")),
    }
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub fn bench_gpu(args: BenchGpuArgs) -> anyhow::Result<()> {
    strata_model::cuda::check_ablation(&args.ablate).map_err(anyhow::Error::msg)?;
    if !args.ablate.is_empty() {
        eprintln!(
            "ablated (left out of every step; outputs are wrong, times are what the rest costs): {}",
            args.ablate.join(", ")
        );
    }
    if args.attention {
        let seqs = args.levels.iter().copied().max().unwrap_or(1);
        let contexts = (args.prompt_tokens, args.prompt_tokens + args.output_tokens);
        return crate::bench_attention::bench_attention(args.gpu, seqs, contexts, &args.out);
    }
    let path = args.model.clone().unwrap_or_else(default_model_path);
    let libs = libraries::search(&libraries::candidate_dirs());
    let probe = Gpu::open(args.gpu, &libs)?;
    let bandwidth = probe.copy_bandwidth_gb_s(2 << 30, 10)?;
    let gpu_name = probe.info.name.clone();
    drop(probe);
    let max_level = args.levels.iter().copied().max().unwrap_or(1).max(1);
    let mut report = Report {
        model: path.display().to_string(),
        gpu: gpu_name,
        layout: match (args.plan, args.tensor_parallel_size, args.pipeline_parallel_size) {
            (_, None, None) if !args.plan => format!("one GPU ({})", args.gpu),
            (_, None, None) => "planned over every GPU".into(),
            (_, tp, pp) => format!("forced TP {} x PP {}", tp.unwrap_or(1), pp.unwrap_or(1)),
        },
        copy_bandwidth_gb_s: bandwidth,
        cuda_graphs: !args.enforce_eager,
        ablated: args.ablate.clone(),
        ..Default::default()
    };
    for (i, &dtype) in args.kv_cache_dtypes.iter().enumerate() {
        let model = crate::progress::load_with_progress(&path)?;
        let c = model.transformer.config.clone();
        let prompts = crate::synthetic_prompt::SyntheticPrompts::new(&model.tokenizer)?;
        let max_model_len = (args.prompt_tokens + args.output_tokens.max(args.decode_tokens) + 16).min(c.max_position);
        let (engine, weight_bytes) = start(model, &args, dtype, max_level, max_model_len)?;
        let kv_tokens = engine.capacity().tokens();
        let prompt = |seed: u64| prompts.prompt(args.prompt_tokens, seed);
        let run_with =
            |prompt: Vec<u32>, max_tokens: usize, constrained: bool| -> anyhow::Result<strata_engine::Completion> {
                let req = GenerationRequest {
                    ignore_eos: true,
                    constraint: constrained.then(records_schema),
                    ..GenerationRequest::greedy(prompt, max_tokens)
                };
                complete(engine.submit(req)?, &mut |_| {}).map_err(|e| anyhow::anyhow!(e))
            };
        let run = |prompt: Vec<u32>, max_tokens: usize| run_with(prompt, max_tokens, false);
        // Warm-up: kernels, graphs of every bucket up to the highest level, allocator.
        run(prompt(1_000_000), 4)?;
        if i == 0 {
            report.weight_bytes = weight_bytes;
            report.decode_roofline_tok_s = bandwidth * 1e9 / weight_bytes as f64;
            let mut ttft: Vec<f64> = (0..5)
                .map(|k| run(prompt(2_000_000 + k), 1).map(|c| c.time_to_first_token.as_secs_f64() * 1e3))
                .collect::<anyhow::Result<_>>()?;
            report.ttft_512_ms = percentile(&mut ttft, 0.5);
            let d = run(prompt(3_000_000)[..16].to_vec(), args.decode_tokens)?;
            report.single_stream_decode_tok_s = d.decode_tps();
            report.single_stream_roofline_fraction = d.decode_tps() / report.decode_roofline_tok_s;
        }
        let levels: Vec<usize> = if i == 0 { args.levels.clone() } else { vec![max_level] };
        // Each level free, then (first cache type, --constrained) with that share constrained.
        let fractions: &[f64] = if i == 0 && args.constrained > 0.0 {
            &[0.0, args.constrained]
        } else {
            &[0.0]
        };
        let runs: Vec<(usize, f64)> = levels
            .iter()
            .flat_map(|&n| fractions.iter().map(move |&f| (n, f)))
            .collect();
        for (n, fraction) in runs {
            if fraction > 0.0 {
                // The first constrained steps of each bucket capture the graph without logits.
                run_with(prompt(4_000_000), 4, true)?;
            }
            let before = engine.stats();
            let t0 = Instant::now();
            let results: Vec<anyhow::Result<strata_engine::Completion>> = std::thread::scope(|s| {
                let handles: Vec<_> = (0..n)
                    .map(|k| {
                        // Each run's prompts its own: none is in the prefix cache.
                        let p = prompt(10_000 * (n as u64) + k as u64 + (fraction * 1e6) as u64);
                        let run_with = &run_with;
                        s.spawn(move || run_with(p, args.output_tokens, is_constrained(k, fraction)))
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().expect("request thread")).collect()
            });
            let wall = t0.elapsed().as_secs_f64();
            let done: Vec<_> = results.into_iter().collect::<anyhow::Result<_>>()?;
            let out_tokens: usize = done.iter().map(|c| c.tokens.len()).sum();
            let mut ttft: Vec<f64> = done.iter().map(|c| c.time_to_first_token.as_secs_f64() * 1e3).collect();
            let decode: Vec<Duration> = done.iter().map(|c| c.decode_time).collect();
            let step_ms = decode.iter().map(|d| d.as_secs_f64()).sum::<f64>() * 1e3
                / done
                    .iter()
                    .map(|c| c.tokens.len().saturating_sub(1).max(1))
                    .sum::<usize>() as f64;
            // The roofline of one decode step of `seqs` sequences at the mean context.
            let ctx = args.prompt_tokens as f64 + args.output_tokens as f64 / 2.0;
            let roofline_ms = |seqs: f64| {
                let kv_bytes =
                    seqs * ctx * strata_model::cuda::kv_cache::bytes_per_token(&c, dtype, ComputeDtype::Bf16) as f64;
                let flops = 2.0 * seqs * weight_bytes as f64 / 2.0;
                ((weight_bytes as f64 + kv_bytes) / (bandwidth * 1e9)).max(flops / PEAK_BF16_FLOPS) * 1e3
            };
            let roof_ms = roofline_ms(n as f64);
            let after = engine.stats();
            let pure_steps = (after.decode_steps_total - before.decode_steps_total).max(1) as f64;
            let pure_ms = (after.decode_step_seconds_total - before.decode_step_seconds_total) * 1e3 / pure_steps;
            let pure_batch = (after.decode_step_seqs_total - before.decode_step_seqs_total) as f64 / pure_steps;
            let pure_roof = roofline_ms(pure_batch);
            let fnv = done
                .iter()
                .flat_map(|c| &c.tokens)
                .fold(0xcbf29ce484222325u64, |h, &t| {
                    t.to_le_bytes()
                        .iter()
                        .fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x100000001b3))
                });
            let masks = (after.masks_total - before.masks_total).max(1) as f64;
            let all_steps = (after.steps_total - before.steps_total).max(1) as f64;
            let level = Level {
                kv_cache_dtype: dtype.gpu_value_type(ComputeDtype::Bf16).to_string(),
                concurrency: n,
                constrained_fraction: fraction,
                mask_ms: (after.mask_seconds_total - before.mask_seconds_total) * 1e3 / masks,
                mask_wait_ms_per_step: (after.mask_wait_seconds_total - before.mask_wait_seconds_total) * 1e3
                    / all_steps,
                output_tok_s: out_tokens as f64 / wall,
                total_tok_s: (out_tokens + n * args.prompt_tokens) as f64 / wall,
                wall_s: wall,
                ttft_p50_ms: percentile(&mut ttft, 0.5),
                ttft_p95_ms: percentile(&mut ttft, 0.95),
                step_roofline_ms: roof_ms,
                decode_step_ms: step_ms,
                roofline_fraction: roof_ms / step_ms,
                pure_decode_step_ms: pure_ms,
                pure_decode_batch: pure_batch,
                pure_decode_roofline_ms: pure_roof,
                pure_decode_roofline_fraction: pure_roof / pure_ms,
                overlapped_steps: after.overlapped_steps_total - before.overlapped_steps_total,
                output_tokens_fnv1a: fnv,
                kv_capacity_tokens: kv_tokens,
            };
            eprintln!(
                "{} x{n} ({fraction} constrained): {:.0} output tok/s, step {:.2} ms vs roofline {:.2} ms; decode-only steps {:.2} ms at {:.1} seqs vs {:.2} ms; {} of {} overlapped; output tokens fnv1a {:016x}",
                dtype.gpu_value_type(ComputeDtype::Bf16),
                level.output_tok_s,
                step_ms,
                roof_ms,
                pure_ms,
                pure_batch,
                pure_roof,
                level.overlapped_steps,
                pure_steps,
                level.output_tokens_fnv1a
            );
            report.levels.push(level);
        }
        engine.shutdown();
    }
    println!(
        "model {} on {} ({}) | copy bandwidth {:.0} GB/s per GPU | weights {:.2} GB",
        report.model,
        report.gpu,
        report.layout,
        bandwidth,
        report.weight_bytes as f64 / 1e9
    );
    println!(
        "single stream: {:.1} tok/s = {:.1}% of the {:.1} tok/s roofline | TTFT {} tokens: {:.1} ms",
        report.single_stream_decode_tok_s,
        100.0 * report.single_stream_roofline_fraction,
        report.decode_roofline_tok_s,
        args.prompt_tokens,
        report.ttft_512_ms
    );
    println!("step incl. prefill: a request's first-to-last-token time per token (other requests' prompt chunks included); decode-only: steps without prompt chunks, roofline at their mean batch");
    println!("| kv | concurrency | constrained | output tok/s | total tok/s | TTFT p50 ms | TTFT p95 ms | step incl. prefill ms | roofline ms | of roofline | decode-only step ms | batch | roofline ms | of roofline | KV tokens | mask ms | mask wait ms/step |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for l in &report.levels {
        println!(
            "| {} | {} | {} | {:.0} | {:.0} | {:.1} | {:.1} | {:.2} | {:.2} | {:.0}% | {:.2} | {:.1} | {:.2} | {:.0}% | {} | {:.3} | {:.3} |",
            l.kv_cache_dtype,
            l.concurrency,
            l.constrained_fraction,
            l.output_tok_s,
            l.total_tok_s,
            l.ttft_p50_ms,
            l.ttft_p95_ms,
            l.decode_step_ms,
            l.step_roofline_ms,
            100.0 * l.roofline_fraction,
            l.pure_decode_step_ms,
            l.pure_decode_batch,
            l.pure_decode_roofline_ms,
            100.0 * l.pure_decode_roofline_fraction,
            l.kv_capacity_tokens,
            l.mask_ms,
            l.mask_wait_ms_per_step
        );
    }
    for pair in report.levels.windows(2) {
        let (free, held) = (&pair[0], &pair[1]);
        if held.constrained_fraction > 0.0 && free.constrained_fraction == 0.0 && free.concurrency == held.concurrency {
            println!(
                "{} users, {} constrained: {:.3}x the free run's output tok/s",
                held.concurrency,
                held.constrained_fraction,
                held.output_tok_s / free.output_tok_s
            );
        }
    }
    if let Some(dir) = args.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&args.out, serde_json::to_string_pretty(&report)? + "\n")?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

fn start(
    model: LoadedModel,
    args: &BenchGpuArgs,
    dtype: KvCacheDtype,
    max_seqs: usize,
    max_model_len: usize,
) -> anyhow::Result<(EngineHandle, u64)> {
    let config = EngineConfig {
        max_num_batched_tokens: args.max_num_batched_tokens,
        max_num_seqs: max_seqs,
        max_model_len: Some(max_model_len),
        kv_cache_dtype: dtype,
        ..Default::default()
    };
    let multi = args.plan || args.tensor_parallel_size.is_some() || args.pipeline_parallel_size.is_some();
    let dev = crate::device::DeviceArgs {
        device: if multi {
            crate::device::Device::Gpus
        } else {
            crate::device::Device::Cuda(args.gpu)
        },
        tensor_parallel_size: args.tensor_parallel_size,
        pipeline_parallel_size: args.pipeline_parallel_size,
        gpu_memory_utilization: args.gpu_memory_utilization,
        gpu_memory_limit: args.gpu_memory_limit,
        quantization: args.quantization,
        activation_precision: args.activation_precision,
        enforce_eager: args.enforce_eager,
        ablate: args.ablate.clone(),
        ..Default::default()
    };
    if multi {
        crate::device::start_planned(model, config, &dev)
    } else {
        crate::device::start_gpu(model, config, args.gpu, &dev)
    }
}
