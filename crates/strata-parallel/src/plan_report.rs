//! The human-readable plan: the model and targets, the chosen layout stage by stage, NCCL settings, rejected layouts.
//! Every number printed comes from the `Plan`; the JSON form is the `Plan` itself.

use std::fmt::Write as _;

use crate::cost::{self, DECODE_BANDWIDTH_EFFICIENCY};
use crate::planner::{Candidate, Plan, Verdict, CONCURRENT_STREAMS, PER_STREAM_STEP_FRACTION, RUNTIME_OVERHEAD_BYTES};
use crate::topology::Topology;

const GIB: f64 = (1u64 << 30) as f64;

fn gib(bytes: u64) -> f64 {
    bytes as f64 / GIB
}

/// The plan as text, for `strata plan`.
pub fn render(plan: &Plan, topology: &Topology) -> String {
    let mut out = String::new();
    let m = &plan.model;
    let d = &m.config;
    let t = &plan.targets;
    let kv_name = t.kv_cache_dtype.gpu_value_type(t.compute_dtype);
    let kv_tokens = t.max_model_len as u64 * t.max_num_seqs as u64;
    let _ = writeln!(
        out,
        "model:    {} ({}): {} layers, hidden {}, {} heads / {} KV heads, {:.1} GiB of weights",
        m.name, m.weight_format, d.n_layers, d.hidden, d.n_heads, d.n_kv_heads, plan.weight_gib
    );
    let _ = writeln!(
        out,
        "KV cache: {:.0} KiB per token ({kv_name}); {} sequences x {} tokens = {} tokens = {:.1} GiB",
        plan.kv_bytes_per_token as f64 / 1024.0,
        t.max_num_seqs,
        t.max_model_len,
        kv_tokens,
        gib(plan.kv_bytes_per_token * kv_tokens)
    );
    let _ = writeln!(
        out,
        "GPUs:     {} ({}); usable = free memory x {}, of which {:.1} GiB per GPU is kept for the CUDA context and activations",
        gpu_summary(topology),
        topology.source,
        t.gpu_memory_utilization,
        gib(RUNTIME_OVERHEAD_BYTES)
    );
    let c = &plan.chosen;
    let _ = writeln!(out, "\nplan: {}", c.describe());
    let _ = writeln!(
        out,
        "  {:<6} {:<10} {:<10} {:>9} {:>8} {:>8} {:>18}",
        "stage", "GPUs", "layers", "weights", "KV", "runtime", "needed / usable"
    );
    for (s, stage) in c.stages.iter().enumerate() {
        let gpus = stage.gpus.iter().map(|g| g.to_string()).collect::<Vec<_>>().join(",");
        let layers = format!("{}-{}", stage.first_layer, stage.first_layer + stage.n_layers - 1);
        let _ = writeln!(
            out,
            "  {:<6} {:<10} {:<10} {:>9.1} {:>8.1} {:>8.1} {:>8.1} / {:>5.1} GiB",
            s,
            gpus,
            layers,
            gib(stage.weight_bytes),
            gib(stage.kv_bytes),
            gib(stage.runtime_bytes),
            gib(stage.needed_bytes()),
            gib(stage.usable_bytes)
        );
    }
    let _ = writeln!(
        out,
        "  estimate: {:.2} ms/token for one stream; {:.2} ms per step with {CONCURRENT_STREAMS} streams = {:.0} tokens/s",
        c.single_stream_ms,
        c.concurrent_ms,
        c.concurrent_tokens_per_s()
    );
    if c.tp > 1 {
        let _ = writeln!(
            out,
            "  TP all-reduce: {:.1} us each for one token over {}, 2 per layer",
            c.all_reduce_us, c.tp_link
        );
    }
    if let Some(forced) = &plan.forced {
        match &forced.auto {
            Some(auto) if forced.slower_percent > 0.5 => {
                let _ = writeln!(
                    out,
                    "  warning: this forced layout is {:.0}% slower than the automatic plan {} ({:.2} vs {:.2} ms per step with {CONCURRENT_STREAMS} streams; {:.2} vs {:.2} ms/token for one stream)",
                    forced.slower_percent,
                    auto.describe(),
                    c.concurrent_ms,
                    auto.concurrent_ms,
                    c.single_stream_ms,
                    auto.single_stream_ms
                );
            }
            Some(_) => {
                let _ = writeln!(out, "  forced layout: as fast as the automatic plan");
            }
            None => {
                let _ = writeln!(out, "  forced layout: no automatic plan fits these targets");
            }
        }
    }
    let _ = writeln!(out, "\nNCCL environment:");
    for setting in &plan.nccl_env {
        let _ = writeln!(out, "  {}={}  # {}", setting.name, setting.value, setting.reason);
    }
    let _ = writeln!(out, "\ncandidates:");
    let _ = writeln!(
        out,
        "  {:<30} {:>10} {:>11}  verdict",
        "layout",
        "1 stream",
        format!("{CONCURRENT_STREAMS} streams")
    );
    for candidate in &plan.candidates {
        let times = if candidate.stages.is_empty() {
            format!("{:>10} {:>11}", "-", "-")
        } else {
            format!(
                "{:>7.2} ms {:>8.2} ms",
                candidate.single_stream_ms, candidate.concurrent_ms
            )
        };
        let _ = writeln!(
            out,
            "  {:<30} {times}  {}",
            candidate.describe(),
            verdict_text(candidate, plan)
        );
    }
    let _ = writeln!(out, "\n{}", explanation(plan, topology));
    out
}

fn verdict_text(c: &Candidate, plan: &Plan) -> String {
    let forced = plan.forced.is_some();
    match &c.verdict {
        Verdict::Chosen if forced => "the automatic choice".into(),
        Verdict::Chosen => "chosen".into(),
        Verdict::DoesNotFit {
            gpu,
            needed_gib,
            usable_gib,
        } => format!("doesn't fit: GPU{gpu} needs {needed_gib:.1} GiB, {usable_gib:.1} GiB usable"),
        Verdict::Slower {
            concurrent_ms,
            best_concurrent_ms,
        } => format!(
            "slower: {concurrent_ms:.2} vs {best_concurrent_ms:.2} ms per step with {CONCURRENT_STREAMS} streams{}",
            if c.tp > 1 {
                format!(" (all-reduce {:.1} us over {})", c.all_reduce_us, c.tp_link)
            } else {
                String::new()
            }
        ),
        Verdict::MoreGpus { gpus, best_gpus } => {
            format!("no faster (within 2%) but uses {gpus} GPUs instead of {best_gpus}")
        }
        Verdict::Impossible { reason } => format!("impossible: {reason}"),
    }
}

fn gpu_summary(topology: &Topology) -> String {
    let mut groups: Vec<(String, usize)> = Vec::new();
    for gpu in &topology.gpus {
        let label = format!("{} {:.0} GiB", gpu.name, gpu.memory_total_mib as f64 / 1024.0);
        match groups.iter_mut().find(|(l, _)| *l == label) {
            Some((_, count)) => *count += 1,
            None => groups.push((label, 1)),
        }
    }
    groups
        .iter()
        .map(|(label, count)| format!("{count}x {label}"))
        .collect::<Vec<_>>()
        .join(" + ")
}

fn explanation(plan: &Plan, topology: &Topology) -> String {
    let mut bandwidths: Vec<String> = Vec::new();
    for gpu in &topology.gpus {
        let (gbps, source) = cost::memory_bandwidth_gbps(gpu);
        let entry = format!("{} {gbps:.0} GB/s ({source})", gpu.name);
        if !bandwidths.contains(&entry) {
            bandwidths.push(entry);
        }
    }
    let measured = topology.links.iter().any(|l| l.measured_gbps.is_some()) || !topology.all_reduce.is_empty();
    format!(
        "how the estimate is made: decode is memory-bound, so each GPU streams its weights and the KV of its layers once per \
         step at {:.0}% of its memory bandwidth ({}), and each stream adds {:.1}% of a weight pass (attention and \
         small GEMMs, measured on an H200). TP splits that by the TP size and adds 2 all-reduces per layer \
         (ring: 2(t-1) steps, each the slowest link's latency plus bytes/t over its bandwidth: NVLink 25 GB/s per link \
         and ~1.5 us, PCIe P2P ~25 GB/s (gen4 x16) and ~4 us, no P2P through host memory ~10 GB/s and 15-25 us). \
         PP adds one activation ({} bytes per token) per stage boundary; with many streams it runs one micro-batch per \
         stage, so a step takes PP x the slowest stage at 1/PP of the streams. Layers are split in proportion to each stage's free memory. {}\
         The choice is the fastest layout with {CONCURRENT_STREAMS} streams that fits; layouts within 2% of it lose to fewer GPUs.",
        DECODE_BANDWIDTH_EFFICIENCY * 100.0,
        bandwidths.join(", "),
        PER_STREAM_STEP_FRACTION * 100.0,
        plan.model.config.hidden * 2,
        if measured {
            "Measured link bandwidths and all-reduce latencies from `strata topo --measure` replace the table values. "
        } else {
            ""
        }
    )
}
