//! The parallel planner: every TP x PP layout that could run the model, its memory per GPU and estimated speed.
//! Chooses the fastest layout that fits, explains the rejected ones, honours forced layouts, refuses with what would fit.

use serde::Serialize;
use strata_model::kv_cache::KvCacheDtype;
use strata_model::ComputeDtype;

use crate::cost::{self, DECODE_BANDWIDTH_EFFICIENCY};
use crate::model_shape::{ModelShape, QUANTIZED_FORMATS};
use crate::topology::Topology;

const GIB: f64 = (1u64 << 30) as f64;
/// Per-GPU memory outside weights and KV: CUDA context, cuBLAS workspace, activations of one step.
pub const RUNTIME_OVERHEAD_BYTES: u64 = 1 << 30;
/// The concurrency of the many-users estimate.
pub const CONCURRENT_STREAMS: usize = 64;
/// Work per decoding stream, as a fraction of one pass over the stage's weights: on an H200 a
/// Llama-3-8B step costs 6.3 ms for 1 stream and 15.6 ms for 64 (0.148 ms a stream, 4.2% of the
/// 3.55 ms weight pass). It is why pipeline stages, each running half the streams, raise
/// throughput even when decode is memory-bound.
pub const PER_STREAM_STEP_FRACTION: f64 = 0.042;
/// Bytes of one activation element on the wire (bf16).
const ACTIVATION_BYTES: u64 = 2;
/// Layouts within this fraction of the fastest count as equal; then fewer GPUs win.
const TIE_FRACTION: f64 = 0.02;
/// Largest GPU count whose every GPU subset and grouping is searched; above it groups are consecutive.
const EXHAUSTIVE_SEARCH_GPUS: usize = 8;

/// Why no plan was made.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{0}")]
    NothingFits(String),
    #[error("{0}")]
    BadOverride(String),
}

/// What the plan must hold.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Targets {
    pub max_model_len: usize,
    pub max_num_seqs: usize,
    pub gpu_memory_utilization: f64,
    pub kv_cache_dtype: KvCacheDtype,
    /// What the GPUs compute in (`--dtype`): what an `auto` KV cache holds.
    pub compute_dtype: ComputeDtype,
}

impl Targets {
    /// Bytes of one cached value on the GPUs (fp8 scales not counted).
    fn kv_value_bytes(&self) -> u64 {
        self.kv_cache_dtype.gpu_value_bytes(self.compute_dtype) as u64
    }

    fn kv_tokens(&self) -> u64 {
        self.max_model_len as u64 * self.max_num_seqs as u64
    }
}

/// A layout the user asked for instead of the automatic choice.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForcedLayout {
    pub tp: usize,
    pub pp: usize,
    /// The GPUs to use in stage order (TP groups are consecutive runs); `None` lets the planner pick.
    pub gpus: Option<Vec<usize>>,
    /// Relative share of layers per stage (llama.cpp `--tensor-split` with `--split-mode layer`).
    pub layer_shares: Option<Vec<f64>>,
}

/// llama.cpp's `--split-mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitMode {
    /// One GPU (`--main-gpu`).
    None,
    /// Layers split over GPUs: pipeline parallel.
    Layer,
    /// Every tensor split by rows: tensor parallel.
    Row,
}

/// The override flags as given on the command line.
#[derive(Debug, Clone, Default)]
pub struct OverrideFlags {
    pub tensor_parallel_size: Option<usize>,
    pub pipeline_parallel_size: Option<usize>,
    pub split_mode: Option<SplitMode>,
    pub tensor_split: Option<Vec<f64>>,
    pub main_gpu: Option<usize>,
}

impl OverrideFlags {
    /// The forced layout these flags describe, or `None` for the automatic plan.
    pub fn layout(&self, n_gpus: usize) -> Result<Option<ForcedLayout>, PlanError> {
        let bad = |m: String| Err(PlanError::BadOverride(m));
        let sizes = self.tensor_parallel_size.is_some() || self.pipeline_parallel_size.is_some();
        if sizes && (self.split_mode.is_some() || self.tensor_split.is_some()) {
            return bad("--tensor-parallel-size/--pipeline-parallel-size (vLLM) and --split-mode/--tensor-split (llama.cpp) describe the same choice; pass one style".into());
        }
        if let Some(main) = self.main_gpu.filter(|&g| g >= n_gpus) {
            return bad(format!("--main-gpu {main}: this machine has GPUs 0-{}", n_gpus - 1));
        }
        if sizes {
            let (tp, pp) = (
                self.tensor_parallel_size.unwrap_or(1),
                self.pipeline_parallel_size.unwrap_or(1),
            );
            if tp == 0 || pp == 0 {
                return bad("--tensor-parallel-size and --pipeline-parallel-size must be at least 1".into());
            }
            if tp * pp > n_gpus {
                return bad(format!(
                    "TP {tp} x PP {pp} needs {} GPUs; this machine has {n_gpus}: lower --tensor-parallel-size or --pipeline-parallel-size",
                    tp * pp
                ));
            }
            return Ok(Some(ForcedLayout {
                tp,
                pp,
                gpus: None,
                layer_shares: None,
            }));
        }
        let split = match &self.tensor_split {
            Some(shares) => {
                if shares.len() > n_gpus {
                    return bad(format!(
                        "--tensor-split has {} values; this machine has {n_gpus} GPUs",
                        shares.len()
                    ));
                }
                if shares.iter().any(|s| !s.is_finite() || *s < 0.0) || shares.iter().all(|s| *s == 0.0) {
                    return bad("--tensor-split needs non-negative numbers, at least one above 0, e.g. 3,1".into());
                }
                Some(shares.clone())
            }
            None => None,
        };
        let selected: Vec<usize> = match &split {
            Some(shares) => (0..shares.len()).filter(|&g| shares[g] > 0.0).collect(),
            None => (0..n_gpus).collect(),
        };
        let mode = match (self.split_mode, &split) {
            (Some(mode), _) => mode,
            (None, Some(_)) => SplitMode::Layer,
            (None, None) => return Ok(None),
        };
        Ok(Some(match mode {
            SplitMode::None => ForcedLayout {
                tp: 1,
                pp: 1,
                gpus: Some(vec![self.main_gpu.unwrap_or(0)]),
                layer_shares: None,
            },
            SplitMode::Layer => ForcedLayout {
                tp: 1,
                pp: selected.len(),
                layer_shares: split.map(|s| selected.iter().map(|&g| s[g]).collect()),
                gpus: Some(selected),
            },
            SplitMode::Row => {
                if let Some(s) = &split {
                    let first = s[selected[0]];
                    if selected.iter().any(|&g| s[g] != first) {
                        return bad("--split-mode row cuts every tensor evenly in strata; give equal --tensor-split values, or use --split-mode layer for uneven shares".into());
                    }
                }
                ForcedLayout {
                    tp: selected.len(),
                    pp: 1,
                    gpus: Some(selected),
                    layer_shares: None,
                }
            }
        }))
    }
}

/// One pipeline stage: a TP group of GPUs and the layers it holds.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Stage {
    pub gpus: Vec<usize>,
    pub first_layer: usize,
    pub n_layers: usize,
    /// Per GPU of the group.
    pub weight_bytes: u64,
    pub kv_bytes: u64,
    pub runtime_bytes: u64,
    /// The smallest usable memory in the group (free memory times --gpu-memory-utilization).
    pub usable_bytes: u64,
}

impl Stage {
    pub fn needed_bytes(&self) -> u64 {
        self.weight_bytes + self.kv_bytes + self.runtime_bytes
    }
}

/// Why a candidate was not chosen.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
pub enum Verdict {
    Chosen,
    DoesNotFit {
        gpu: usize,
        needed_gib: f64,
        usable_gib: f64,
    },
    Slower {
        concurrent_ms: f64,
        best_concurrent_ms: f64,
    },
    /// As fast as the choice (within 2%) but it uses more GPUs.
    MoreGpus {
        gpus: usize,
        best_gpus: usize,
    },
    Impossible {
        reason: String,
    },
}

/// One TP x PP layout with its numbers.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Candidate {
    pub tp: usize,
    pub pp: usize,
    pub stages: Vec<Stage>,
    /// Decode time of one token for one stream alone, in milliseconds.
    pub single_stream_ms: f64,
    /// Time of one decode step with `CONCURRENT_STREAMS` streams, in milliseconds (each stream gets one token).
    pub concurrent_ms: f64,
    /// One TP all-reduce of a single token's activation, in microseconds (0 without TP).
    pub all_reduce_us: f64,
    /// The slowest link inside a TP group, e.g. "NVLink"; empty without TP.
    pub tp_link: String,
    pub verdict: Verdict,
}

impl Candidate {
    pub fn fits(&self) -> bool {
        !matches!(self.verdict, Verdict::DoesNotFit { .. } | Verdict::Impossible { .. })
    }

    pub fn n_gpus(&self) -> usize {
        self.tp * self.pp
    }

    /// Output tokens per second over all streams at `CONCURRENT_STREAMS`.
    pub fn concurrent_tokens_per_s(&self) -> f64 {
        CONCURRENT_STREAMS as f64 / (self.concurrent_ms / 1e3)
    }

    /// "TP 2 x PP 2 on GPUs 0,1 | 2,3".
    pub fn describe(&self) -> String {
        let groups: Vec<String> = self
            .stages
            .iter()
            .map(|s| s.gpus.iter().map(|g| g.to_string()).collect::<Vec<_>>().join(","))
            .collect();
        let layout = match (self.tp, self.pp) {
            (1, 1) => "one GPU".to_string(),
            (t, 1) => format!("TP {t}"),
            (1, p) => format!("PP {p}"),
            (t, p) => format!("TP {t} x PP {p}"),
        };
        if groups.is_empty() {
            layout
        } else {
            format!("{layout} on GPU {}", groups.join(" | "))
        }
    }
}

/// An environment variable the executor will set for NCCL, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NcclSetting {
    pub name: String,
    pub value: String,
    pub reason: String,
}

/// How much a forced layout costs against the automatic one.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ForcedComparison {
    pub auto: Option<Candidate>,
    /// Percent slower at `CONCURRENT_STREAMS` than the automatic plan (0 when it is not slower).
    pub slower_percent: f64,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    pub model: ModelShape,
    pub weight_gib: f64,
    pub kv_bytes_per_token: u64,
    pub targets: Targets,
    pub chosen: Candidate,
    pub forced: Option<ForcedComparison>,
    pub candidates: Vec<Candidate>,
    pub nccl_env: Vec<NcclSetting>,
}

/// Plans `model` on `topology`: the forced layout when given, else the fastest one that fits.
pub fn plan(
    model: &ModelShape,
    topology: &Topology,
    targets: &Targets,
    forced: Option<&ForcedLayout>,
) -> Result<Plan, PlanError> {
    let candidates = candidates(model, topology, targets);
    let auto = choose(&candidates);
    let (chosen, forced_comparison) = match forced {
        Some(layout) => {
            let mut candidate = evaluate_forced(model, topology, targets, layout)?;
            if let Verdict::DoesNotFit {
                gpu,
                needed_gib,
                usable_gib,
            } = candidate.verdict
            {
                return Err(PlanError::NothingFits(format!(
                    "the forced layout {} does not fit: GPU{gpu} needs {needed_gib:.1} GiB of {usable_gib:.1} GiB usable{}",
                    candidate.describe(),
                    auto.as_ref()
                        .map(|a| format!("; the automatic plan would be {}", a.describe()))
                        .unwrap_or_default()
                )));
            }
            candidate.verdict = Verdict::Chosen;
            let slower_percent = auto.as_ref().map_or(0.0, |a| {
                (100.0 * (candidate.concurrent_ms / a.concurrent_ms - 1.0)).max(0.0)
            });
            (
                candidate,
                Some(ForcedComparison {
                    auto: auto.clone(),
                    slower_percent,
                }),
            )
        }
        None => match auto.clone() {
            Some(best) => (best, None),
            None => return Err(PlanError::NothingFits(refusal(model, topology, targets, &candidates))),
        },
    };
    let candidates = with_verdicts(candidates, auto.as_ref());
    let nccl_env = nccl_env(topology, &chosen);
    Ok(Plan {
        weight_gib: model.weight_bytes() as f64 / GIB,
        kv_bytes_per_token: model.kv_bytes_per_token_layer(targets.kv_value_bytes()) * model.config.n_layers as u64,
        model: model.clone(),
        targets: targets.clone(),
        chosen,
        forced: forced_comparison,
        candidates,
        nccl_env,
    })
}

/// The best layout for every TP size (powers of two) and PP size the machine allows.
pub fn candidates(model: &ModelShape, topology: &Topology, targets: &Targets) -> Vec<Candidate> {
    let n = topology.gpus.len();
    let mut out = Vec::new();
    let mut tp = 1;
    while tp <= n {
        if !model.config.n_heads.is_multiple_of(tp) {
            out.push(impossible(
                tp,
                1,
                format!("{} attention heads do not split {tp} ways", model.config.n_heads),
            ));
        } else {
            for pp in 1..=(n / tp).min(model.config.n_layers) {
                let best = groupings(n, tp, pp)
                    .into_iter()
                    .map(|groups| evaluate(model, topology, targets, tp, &groups, None))
                    .reduce(|best, c| if better_fit(&c, &best) { c } else { best });
                out.extend(best);
            }
        }
        tp *= 2;
    }
    out
}

fn impossible(tp: usize, pp: usize, reason: String) -> Candidate {
    Candidate {
        tp,
        pp,
        stages: Vec::new(),
        single_stream_ms: 0.0,
        concurrent_ms: 0.0,
        all_reduce_us: 0.0,
        tp_link: String::new(),
        verdict: Verdict::Impossible { reason },
    }
}

/// Which of two layouts of the same size is better: fitting first, then faster, then less over memory.
fn better_fit(a: &Candidate, b: &Candidate) -> bool {
    match (a.fits(), b.fits()) {
        (true, false) => true,
        (false, true) => false,
        (true, true) => a.concurrent_ms < b.concurrent_ms,
        (false, false) => overflow(a) < overflow(b),
    }
}

fn overflow(c: &Candidate) -> f64 {
    match c.verdict {
        Verdict::DoesNotFit {
            needed_gib, usable_gib, ..
        } => needed_gib - usable_gib,
        _ => f64::INFINITY,
    }
}

/// The fastest fitting layout; near-ties go to fewer GPUs, then to the faster single stream.
fn choose(candidates: &[Candidate]) -> Option<Candidate> {
    let fitting: Vec<&Candidate> = candidates.iter().filter(|c| c.fits()).collect();
    let fastest = fitting.iter().map(|c| c.concurrent_ms).fold(f64::INFINITY, f64::min);
    fitting
        .into_iter()
        .filter(|c| c.concurrent_ms <= fastest * (1.0 + TIE_FRACTION))
        .min_by(|a, b| {
            (a.n_gpus(), a.single_stream_ms)
                .partial_cmp(&(b.n_gpus(), b.single_stream_ms))
                .unwrap_or(std::cmp::Ordering::Equal)
        })
        .cloned()
        .map(|mut c| {
            c.verdict = Verdict::Chosen;
            c
        })
}

fn with_verdicts(candidates: Vec<Candidate>, best: Option<&Candidate>) -> Vec<Candidate> {
    candidates
        .into_iter()
        .map(|mut c| {
            if let (Some(best), true) = (best, c.fits()) {
                c.verdict = if c.tp == best.tp && c.pp == best.pp {
                    Verdict::Chosen
                } else if c.concurrent_ms <= best.concurrent_ms * (1.0 + TIE_FRACTION) {
                    Verdict::MoreGpus {
                        gpus: c.n_gpus(),
                        best_gpus: best.n_gpus(),
                    }
                } else {
                    Verdict::Slower {
                        concurrent_ms: c.concurrent_ms,
                        best_concurrent_ms: best.concurrent_ms,
                    }
                };
            }
            c
        })
        .collect()
}

/// Every way to pick `tp * pp` GPUs and cut them into `pp` TP groups (stages ordered by their lowest GPU).
fn groupings(n: usize, tp: usize, pp: usize) -> Vec<Vec<Vec<usize>>> {
    if n > EXHAUSTIVE_SEARCH_GPUS {
        return vec![(0..pp).map(|s| (s * tp..(s + 1) * tp).collect()).collect()];
    }
    let mut out = Vec::new();
    for subset in combinations(&(0..n).collect::<Vec<_>>(), tp * pp) {
        partitions(&subset, tp, &mut Vec::new(), &mut out);
    }
    out
}

fn combinations(items: &[usize], k: usize) -> Vec<Vec<usize>> {
    if k == 0 {
        return vec![Vec::new()];
    }
    if items.len() < k {
        return Vec::new();
    }
    let mut with_first: Vec<Vec<usize>> = combinations(&items[1..], k - 1)
        .into_iter()
        .map(|mut rest| {
            rest.insert(0, items[0]);
            rest
        })
        .collect();
    with_first.extend(combinations(&items[1..], k));
    with_first
}

/// Cuts `rest` into groups of `size`, each group holding the lowest GPU left (so every grouping appears once).
fn partitions(rest: &[usize], size: usize, current: &mut Vec<Vec<usize>>, out: &mut Vec<Vec<Vec<usize>>>) {
    let Some((&first, others)) = rest.split_first() else {
        out.push(current.clone());
        return;
    };
    for mates in combinations(others, size - 1) {
        let mut group = vec![first];
        group.extend(&mates);
        let left: Vec<usize> = others.iter().copied().filter(|g| !mates.contains(g)).collect();
        current.push(group);
        partitions(&left, size, current, out);
        current.pop();
    }
}

fn evaluate_forced(
    model: &ModelShape,
    topology: &Topology,
    targets: &Targets,
    layout: &ForcedLayout,
) -> Result<Candidate, PlanError> {
    let n = topology.gpus.len();
    if !model.config.n_heads.is_multiple_of(layout.tp) {
        return Err(PlanError::BadOverride(format!(
            "tensor parallel size {} does not divide the model's {} attention heads; use a divisor such as {}",
            layout.tp,
            model.config.n_heads,
            (1..=n)
                .filter(|t| model.config.n_heads.is_multiple_of(*t))
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    }
    if layout.pp > model.config.n_layers {
        return Err(PlanError::BadOverride(format!(
            "pipeline parallel size {} exceeds the model's {} layers",
            layout.pp, model.config.n_layers
        )));
    }
    let shares = layout.layer_shares.as_deref();
    let best = match &layout.gpus {
        Some(gpus) => {
            let groups: Vec<Vec<usize>> = gpus.chunks(layout.tp).map(|c| c.to_vec()).collect();
            evaluate(model, topology, targets, layout.tp, &groups, shares)
        }
        None => groupings(n, layout.tp, layout.pp)
            .into_iter()
            .map(|groups| evaluate(model, topology, targets, layout.tp, &groups, shares))
            .reduce(|best, c| if better_fit(&c, &best) { c } else { best })
            .ok_or_else(|| PlanError::BadOverride("no GPUs to place the forced layout on".into()))?,
    };
    Ok(best)
}

/// Layers per stage: proportional to `shares`, each stage at least one layer, remainders to the largest fractions.
fn split_layers(n_layers: usize, shares: &[f64]) -> Vec<usize> {
    let p = shares.len();
    let total: f64 = shares.iter().map(|s| s.max(0.0)).sum();
    let ideal: Vec<f64> = if total > 0.0 {
        shares.iter().map(|s| s.max(0.0) / total * n_layers as f64).collect()
    } else {
        vec![n_layers as f64 / p as f64; p]
    };
    let mut counts: Vec<usize> = ideal.iter().map(|x| (x.floor() as usize).max(1)).collect();
    while counts.iter().sum::<usize>() > n_layers {
        let Some(i) = (0..p).filter(|&i| counts[i] > 1).max_by(|&a, &b| {
            (counts[a] as f64 - ideal[a])
                .partial_cmp(&(counts[b] as f64 - ideal[b]))
                .unwrap_or(std::cmp::Ordering::Equal)
        }) else {
            break;
        };
        counts[i] -= 1;
    }
    while counts.iter().sum::<usize>() < n_layers {
        let i = (0..p)
            .max_by(|&a, &b| {
                (ideal[a] - counts[a] as f64)
                    .partial_cmp(&(ideal[b] - counts[b] as f64))
                    .unwrap_or(std::cmp::Ordering::Equal)
            })
            .unwrap_or(0);
        counts[i] += 1;
    }
    counts
}

/// Memory and speed of one layout: `groups` are the TP groups in stage order.
fn evaluate(
    model: &ModelShape,
    topology: &Topology,
    targets: &Targets,
    tp: usize,
    groups: &[Vec<usize>],
    layer_shares: Option<&[f64]>,
) -> Candidate {
    let pp = groups.len();
    let config = &model.config;
    let n_layers = config.n_layers;
    let t = tp as u64;
    // KV heads are split across the TP group; with more GPUs than KV heads each GPU keeps a copy of one.
    let kv_heads_per_gpu = config.n_kv_heads.div_ceil(tp) as u64;
    let kv_element = targets.kv_value_bytes();
    let kv_per_token_layer_gpu = 2 * kv_heads_per_gpu * config.head_dim as u64 * kv_element;
    let kv_per_layer_gpu = kv_per_token_layer_gpu * targets.kv_tokens();
    let avg_layer = model.layer_bytes.iter().sum::<u64>() / n_layers.max(1) as u64;
    let usable: Vec<u64> = groups
        .iter()
        .map(|g| {
            g.iter()
                .map(|&i| {
                    (topology.gpus[i].memory_free_mib as f64 * (1 << 20) as f64 * targets.gpu_memory_utilization) as u64
                })
                .min()
                .unwrap_or(0)
        })
        .collect();
    let fixed = |s: usize| -> u64 {
        let mut bytes = RUNTIME_OVERHEAD_BYTES;
        if s == 0 {
            bytes += model.embedding_bytes / t;
        }
        if s == pp - 1 && (pp > 1 || !config.tied_embeddings) {
            bytes += model.lm_head_bytes / t;
        }
        bytes
    };
    let shares: Vec<f64> = match layer_shares {
        Some(shares) => shares.to_vec(),
        None => (0..pp)
            .map(|s| usable[s].saturating_sub(fixed(s)) as f64 / (avg_layer / t + kv_per_layer_gpu) as f64)
            .collect(),
    };
    let counts = split_layers(n_layers, &shares);
    let mut stages = Vec::with_capacity(pp);
    let mut first_layer = 0;
    for (s, group) in groups.iter().enumerate() {
        let layers = first_layer..first_layer + counts[s];
        let layer_weights: u64 = model.layer_bytes[layers.clone()].iter().sum();
        let runtime = RUNTIME_OVERHEAD_BYTES;
        stages.push(Stage {
            gpus: group.clone(),
            first_layer,
            n_layers: counts[s],
            weight_bytes: layer_weights / t + fixed(s) - runtime,
            kv_bytes: kv_per_layer_gpu * counts[s] as u64,
            runtime_bytes: runtime,
            usable_bytes: usable[s],
        });
        first_layer = layers.end;
    }
    let worst = stages
        .iter()
        .max_by_key(|s| s.needed_bytes() as i128 - s.usable_bytes as i128)
        .filter(|s| s.needed_bytes() > s.usable_bytes);
    let verdict = match worst {
        Some(s) => {
            let gpu = s
                .gpus
                .iter()
                .copied()
                .min_by_key(|&g| topology.gpus[g].memory_free_mib)
                .unwrap_or(0);
            Verdict::DoesNotFit {
                gpu,
                needed_gib: s.needed_bytes() as f64 / GIB,
                usable_gib: s.usable_bytes as f64 / GIB,
            }
        }
        None => Verdict::Chosen,
    };
    let mut candidate = Candidate {
        tp,
        pp,
        all_reduce_us: cost::all_reduce_us(topology, &groups[0], config.hidden as u64 * ACTIVATION_BYTES),
        tp_link: groups
            .iter()
            .filter_map(|g| cost::slowest_link(topology, g))
            .max_by(|a, b| a.kind.cmp(&b.kind))
            .map_or(String::new(), |l| l.kind.describe().to_string()),
        stages,
        single_stream_ms: 0.0,
        concurrent_ms: 0.0,
        verdict,
    };
    let timing = Timing {
        model,
        topology,
        kv_per_token_layer_gpu,
    };
    let single_context = targets.max_model_len as f64 / 2.0;
    let concurrent_context = single_context.min(targets.kv_tokens() as f64 / CONCURRENT_STREAMS as f64);
    candidate.single_stream_ms = timing.step_us(&candidate, 1, single_context) / 1e3;
    candidate.concurrent_ms = timing.step_us(&candidate, CONCURRENT_STREAMS, concurrent_context) / 1e3;
    candidate
}

/// The decode-time estimate: memory-bound weight and KV reads, TP all-reduces, PP hand-offs.
struct Timing<'a> {
    model: &'a ModelShape,
    topology: &'a Topology,
    kv_per_token_layer_gpu: u64,
}

impl Timing<'_> {
    /// One decode step of `streams` streams at `context` tokens each.
    /// PP runs `pp` micro-batches through the stages, so the step takes `pp` times the slowest stage
    /// (one stream alone passes through every stage in turn).
    fn step_us(&self, c: &Candidate, streams: usize, context: f64) -> f64 {
        let hidden_bytes = self.model.config.hidden as u64 * ACTIVATION_BYTES;
        if streams == 1 {
            let stages: f64 = c
                .stages
                .iter()
                .enumerate()
                .map(|(s, st)| self.stage_us(c, s, st, 1, context))
                .sum();
            return stages + self.hand_offs_us(c, hidden_bytes);
        }
        let micro = streams.div_ceil(c.pp);
        let slowest = c
            .stages
            .iter()
            .enumerate()
            .map(|(s, st)| self.stage_us(c, s, st, micro, context))
            .fold(0.0, f64::max);
        let hand_off = self.hand_offs_us(c, hidden_bytes * micro as u64) / (c.pp.max(2) - 1) as f64;
        c.pp as f64 * (slowest + if c.pp > 1 { hand_off } else { 0.0 })
    }

    fn stage_us(&self, c: &Candidate, s: usize, stage: &Stage, streams: usize, context: f64) -> f64 {
        let t = c.tp as u64;
        let layers = stage.first_layer..stage.first_layer + stage.n_layers;
        let mut weights: u64 = self.model.layer_bytes[layers].iter().sum::<u64>() / t;
        if s == c.pp - 1 {
            weights += self.model.lm_head_bytes / t;
        }
        let kv = streams as f64 * context * (self.kv_per_token_layer_gpu * stage.n_layers as u64) as f64;
        let bandwidth_gbps = stage
            .gpus
            .iter()
            .map(|&g| cost::memory_bandwidth_gbps(&self.topology.gpus[g]).0)
            .fold(f64::INFINITY, f64::min)
            * DECODE_BANDWIDTH_EFFICIENCY;
        // Every stream adds work a pure weight stream does not count (attention, skinny GEMMs
        // below their roofline): measured as ~4% of a weight pass per stream (bench/NOTES.md).
        let memory_us =
            (weights as f64 * (1.0 + PER_STREAM_STEP_FRACTION * streams as f64) + kv) / (bandwidth_gbps * 1e3);
        let message = self.model.config.hidden as u64 * ACTIVATION_BYTES * streams as u64;
        let all_reduces = 2.0 * stage.n_layers as f64 * cost::all_reduce_us(self.topology, &stage.gpus, message);
        memory_us + all_reduces
    }

    fn hand_offs_us(&self, c: &Candidate, bytes: u64) -> f64 {
        c.stages
            .windows(2)
            .map(|w| cost::hand_off_us(self.topology, &w[0].gpus, &w[1].gpus, bytes))
            .sum()
    }
}

/// NCCL environment for the chosen layout.
fn nccl_env(topology: &Topology, chosen: &Candidate) -> Vec<NcclSetting> {
    let mut env = vec![NcclSetting {
        name: "NCCL_NVLS_ENABLE".into(),
        value: "0".into(),
        reason:
            "never NVLink multicast (NVLS): it needs fabric-manager multicast support and hangs where that is missing"
                .into(),
    }];
    let no_p2p: Vec<String> = chosen
        .stages
        .iter()
        .flat_map(|s| {
            s.gpus.iter().enumerate().flat_map(move |(i, &a)| {
                s.gpus[i + 1..].iter().filter_map(move |&b| {
                    topology
                        .link(a, b)
                        .filter(|l| !l.p2p())
                        .map(|l| format!("GPU{}-GPU{} ({})", l.a, l.b, l.label()))
                })
            })
        })
        .collect();
    if !no_p2p.is_empty() {
        env.push(NcclSetting {
            name: "NCCL_P2P_DISABLE".into(),
            value: "1".into(),
            reason: format!(
                "P2P is unsupported between TP peers {}: NCCL must go through host memory, not try P2P",
                no_p2p.join(", ")
            ),
        });
    }
    env
}

/// The refusal: why nothing fits, and which change would make it fit.
fn refusal(model: &ModelShape, topology: &Topology, targets: &Targets, tried: &[Candidate]) -> String {
    let closest = tried
        .iter()
        .filter(|c| matches!(c.verdict, Verdict::DoesNotFit { .. }))
        .min_by(|a, b| {
            overflow(a)
                .partial_cmp(&overflow(b))
                .unwrap_or(std::cmp::Ordering::Equal)
        });
    let mut message = format!(
        "{} ({}, {:.1} GiB of weights) does not fit on {} GPU(s) with {} sequences x {} tokens of {} KV cache at --gpu-memory-utilization {}",
        model.name,
        model.weight_format,
        model.weight_bytes() as f64 / GIB,
        topology.gpus.len(),
        targets.max_num_seqs,
        targets.max_model_len,
        targets.kv_cache_dtype.gpu_value_type(targets.compute_dtype),
        targets.gpu_memory_utilization
    );
    if let Some(c) = closest {
        if let Verdict::DoesNotFit {
            gpu,
            needed_gib,
            usable_gib,
        } = c.verdict
        {
            message += &format!(
                "; closest: {} needs {needed_gib:.1} GiB on GPU{gpu} of {usable_gib:.1} GiB usable",
                c.describe()
            );
        }
    }
    let fits = |m: &ModelShape, t: &Targets| choose(&candidates(m, topology, t));
    let mut would_fit = Vec::new();
    if let Some(seqs) = largest_fitting(targets.max_num_seqs.saturating_sub(1), |n| {
        fits(
            model,
            &Targets {
                max_num_seqs: n,
                ..targets.clone()
            },
        )
        .is_some()
    }) {
        would_fit.push(format!("--max-num-seqs {seqs}"));
    }
    let steps = targets.max_model_len.saturating_sub(1) / 256;
    if let Some(step) = largest_fitting(steps, |k| {
        fits(
            model,
            &Targets {
                max_model_len: k * 256,
                ..targets.clone()
            },
        )
        .is_some()
    }) {
        would_fit.push(format!("--max-model-len {}", step * 256));
    }
    if targets.kv_cache_dtype == KvCacheDtype::Auto {
        let fp8 = Targets {
            kv_cache_dtype: KvCacheDtype::Fp8E4m3,
            ..targets.clone()
        };
        if fits(model, &fp8).is_some() {
            would_fit.push("--kv-cache-dtype fp8".into());
        }
    }
    let current_bits = model.weight_bytes() as f64 * 8.0 / model.total_params() as f64;
    for (format, bits) in QUANTIZED_FORMATS {
        if bits >= current_bits - 0.1 {
            continue;
        }
        let quantized = model.requantized(format, bits);
        if let Some(plan) = fits(&quantized, targets) {
            would_fit.push(format!(
                "a {format} file ({:.1} GB, {})",
                quantized.weight_bytes() as f64 / 1e9,
                plan.describe()
            ));
            break;
        }
    }
    if would_fit.is_empty() {
        message += ". Nothing simple makes it fit: even one sequence, a 256-token context, fp8 KV or a Q4_K_M file is too big for these GPUs";
    } else {
        message += &format!(". Each of these alone would fit: {}", would_fit.join("; "));
    }
    message
}

/// The largest n in 1..=max with `fits(n)`, given that fitting is monotone (smaller always fits if larger does).
fn largest_fitting(max: usize, fits: impl Fn(usize) -> bool) -> Option<usize> {
    if max == 0 || !fits(1) {
        return None;
    }
    let (mut lo, mut hi) = (1, max);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    Some(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layers_split_in_proportion_and_add_up() {
        assert_eq!(split_layers(64, &[1.0, 1.0]), vec![32, 32]);
        assert_eq!(split_layers(80, &[3.0, 1.0]), vec![60, 20]);
        assert_eq!(split_layers(10, &[1.0, 1.0, 1.0]).iter().sum::<usize>(), 10);
        assert_eq!(split_layers(3, &[0.0, 5.0, 0.0]), vec![1, 1, 1]);
    }

    #[test]
    fn groupings_list_each_cut_once() {
        // 4 GPUs into two pairs: {01,23} {02,13} {03,12}.
        assert_eq!(groupings(4, 2, 2).len(), 3);
        // 8 GPUs, one GPU: 8 choices; all 8 as TP 8: one.
        assert_eq!(groupings(8, 1, 1).len(), 8);
        assert_eq!(groupings(8, 8, 1).len(), 1);
        assert_eq!(groupings(8, 2, 4).len(), 105);
    }

    #[test]
    fn largest_fitting_finds_the_boundary() {
        assert_eq!(largest_fitting(100, |n| n <= 37), Some(37));
        assert_eq!(largest_fitting(100, |_| false), None);
        assert_eq!(largest_fitting(5, |_| true), Some(5));
    }

    #[test]
    fn overrides_map_llama_cpp_flags_to_layouts() {
        let layer = OverrideFlags {
            tensor_split: Some(vec![3.0, 1.0]),
            ..Default::default()
        };
        let layout = layer.layout(2).unwrap().unwrap();
        assert_eq!((layout.tp, layout.pp), (1, 2));
        assert_eq!(layout.layer_shares, Some(vec![3.0, 1.0]));
        let row = OverrideFlags {
            split_mode: Some(SplitMode::Row),
            ..Default::default()
        };
        assert_eq!(row.layout(4).unwrap().unwrap().tp, 4);
        let none = OverrideFlags {
            split_mode: Some(SplitMode::None),
            main_gpu: Some(1),
            ..Default::default()
        };
        assert_eq!(none.layout(2).unwrap().unwrap().gpus, Some(vec![1]));
        let mixed = OverrideFlags {
            tensor_parallel_size: Some(2),
            split_mode: Some(SplitMode::Layer),
            ..Default::default()
        };
        assert!(mixed.layout(2).unwrap_err().to_string().contains("pass one style"));
        let too_many = OverrideFlags {
            tensor_parallel_size: Some(4),
            ..Default::default()
        };
        assert!(too_many.layout(2).unwrap_err().to_string().contains("needs 4 GPUs"));
        assert!(OverrideFlags::default().layout(2).unwrap().is_none());
    }
}
