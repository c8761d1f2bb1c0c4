//! `strata bench-gpu --attention`: the decode attention kernels alone on a synthetic paged cache
//! (Llama-3-8B's heads by default), each variant timed by CUDA events and set against the bandwidth.

use std::path::Path;

use serde::Serialize;
use strata_runtime::cuda::kernels::{KernelSpec, Kernels};
use strata_runtime::cuda::{libraries, AttentionCall, Gpu};

/// Llama-3-8B's attention: head width, query heads per KV head, KV heads; the engine's block size.
const HEAD_DIM: usize = 128;
const GROUP: usize = 4;
const N_KV: usize = 8;
const BLOCK_SIZE: usize = 16;
/// Timed calls per variant, after the warm-up ones.
const WARM_UP: usize = 3;
const REPS: usize = 20;

#[derive(Serialize)]
struct Row {
    kv_cache_dtype: &'static str,
    kernel: &'static str,
    stages: usize,
    parts: usize,
    us_per_call: f64,
    gb_s: f64,
    of_copy_bandwidth: f64,
}

#[derive(Serialize)]
struct AttentionReport {
    gpu: String,
    sequences: usize,
    mean_context: f64,
    copy_bandwidth_gb_s: f64,
    rows: Vec<Row>,
}

/// Times every attention variant for `seqs` decoding sequences whose contexts spread evenly
/// over `ctx_lo..ctx_hi`, their cache blocks scattered; writes the table as JSON to `out`.
pub fn bench_attention(
    ordinal: usize,
    seqs: usize,
    (ctx_lo, ctx_hi): (usize, usize),
    out: &Path,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        seqs > 0 && ctx_lo > 0 && ctx_hi > ctx_lo,
        "--attention needs concurrency > 0 and a context range (prompt tokens > 0, output tokens > 0)"
    );
    let libs = libraries::search(&libraries::candidate_dirs());
    let gpu = Gpu::open(ordinal, &libs)?;
    let bandwidth = gpu.copy_bandwidth_gb_s(2 << 30, 10)?;
    let kernels = Kernels::load(
        &gpu,
        KernelSpec {
            head_dim: HEAD_DIM,
            group: GROUP,
        },
    )?;
    let contexts: Vec<usize> = (0..seqs).map(|i| ctx_lo + (i * 97) % (ctx_hi - ctx_lo)).collect();
    let max_blocks = ctx_hi.div_ceil(BLOCK_SIZE);
    let num_blocks = seqs * max_blocks;
    // Blocks handed out in a scrambled order, as a long-running engine's free list would.
    let mut tables = vec![0i32; seqs * max_blocks];
    for (i, b) in tables.iter_mut().enumerate() {
        *b = ((i * 7919) % num_blocks) as i32;
    }
    let vectors = num_blocks * N_KV * BLOCK_SIZE;
    let width = N_KV * GROUP * HEAD_DIM;
    let pattern: Vec<u16> = (0..vectors * HEAD_DIM).map(|i| 0x3c00 + (i % 97) as u16).collect();
    let k = gpu.upload(&pattern, "K cache")?;
    let v = gpu.upload(&pattern, "V cache")?;
    let scales = gpu.upload(&vec![1.0f32; vectors], "scales")?;
    let q = gpu.upload(&vec![0x3c00u16; seqs * width], "queries")?;
    let tb = gpu.upload(&tables, "block tables")?;
    let ts = gpu.upload(&(0..seqs as i32).collect::<Vec<_>>(), "token rows")?;
    let ps = gpu.upload(&contexts.iter().map(|&c| c as i32 - 1).collect::<Vec<_>>(), "positions")?;
    let max_parts = 4;
    let out_buf = gpu.alloc(seqs * width * 2, "attention output")?;
    let part_acc = gpu.alloc(seqs * N_KV * GROUP * max_parts * HEAD_DIM * 4, "partial sums")?;
    let part_ml = gpu.alloc(seqs * N_KV * GROUP * max_parts * 2 * 4, "partial maxima")?;
    let keys: usize = contexts.iter().sum();
    let mut report = AttentionReport {
        gpu: gpu.info.name.clone(),
        sequences: seqs,
        mean_context: keys as f64 / seqs as f64,
        copy_bandwidth_gb_s: bandwidth,
        rows: Vec::new(),
    };
    // One call over these buffers; each variant below sets its kernel's cache type, stages and
    // context parts.
    let base = AttentionCall {
        q: q.ptr(),
        q_stride: width as i32,
        k_cache: k.ptr(),
        v_cache: v.ptr(),
        k_scale: scales.ptr(),
        v_scale: scales.ptr(),
        block_tables: tb.ptr(),
        max_blocks: max_blocks as i32,
        token_seq: ts.ptr(),
        positions: ps.ptr(),
        out: out_buf.ptr(),
        part_acc: part_acc.ptr(),
        part_ml: part_ml.ptr(),
        n_kv: N_KV as i32,
        block_size: BLOCK_SIZE as i32,
        scale: 0.088,
        stages: 0,
        tokens: seqs,
        parts: 1,
        n_heads: N_KV * GROUP,
        head_dim: HEAD_DIM,
        fp8: false,
    };
    for (dtype, fp8, mma, staged) in [
        ("bf16", false, "paged_attention_mma_bf16", "paged_attention_staged_bf16"),
        (
            "fp8_e4m3",
            true,
            "paged_attention_mma_fp8",
            "paged_attention_staged_fp8",
        ),
    ] {
        // K and V of every key, plus an fp8 cache's two scales.
        let bytes = keys * N_KV * (2 * HEAD_DIM * if fp8 { 1 } else { 2 } + if fp8 { 8 } else { 0 });
        let mut variants = vec![(mma, 0, 1), (mma, 0, 2), (mma, 0, 4)];
        variants.extend([(staged, 2, 1), (staged, 3, 1), (staged, 2, 2), (staged, 3, 2)]);
        for (kernel, stages, parts) in variants {
            let call = AttentionCall {
                stages: stages as i32,
                parts: parts as i32,
                fp8,
                ..base
            };
            // SAFETY: buffers sized above for `seqs` tokens and up to `max_parts` parts.
            let run = || unsafe { call.launch(&gpu, &kernels, kernel) };
            for _ in 0..WARM_UP {
                run()?;
            }
            let start = gpu.record_event()?;
            for _ in 0..REPS {
                run()?;
            }
            let end = gpu.record_event()?;
            gpu.sync()?;
            let us = start.elapsed_ms(&end)? as f64 * 1e3 / REPS as f64;
            let gb_s = bytes as f64 / us / 1e3;
            report.rows.push(Row {
                kv_cache_dtype: dtype,
                kernel,
                stages,
                parts,
                us_per_call: us,
                gb_s,
                of_copy_bandwidth: gb_s / bandwidth,
            });
        }
    }
    println!(
        "attention alone on {} | {seqs} sequences, contexts {ctx_lo}..{ctx_hi} (mean {:.0}), {N_KV} KV heads x {GROUP} x {HEAD_DIM} | copy bandwidth {bandwidth:.0} GB/s",
        report.gpu, report.mean_context
    );
    println!("| kv | kernel | stages | parts | us / call | GB/s | of copy bandwidth |");
    println!("|---|---|---|---|---|---|---|");
    for r in &report.rows {
        println!(
            "| {} | {} | {} | {} | {:.1} | {:.0} | {:.0}% |",
            r.kv_cache_dtype,
            r.kernel,
            r.stages,
            r.parts,
            r.us_per_call,
            r.gb_s,
            100.0 * r.of_copy_bandwidth
        );
    }
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(out, serde_json::to_string_pretty(&report)?)?;
    println!("wrote {}", out.display());
    Ok(())
}
