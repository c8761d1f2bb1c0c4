//! The forward pass of a llama-family decoder on one GPU (or its shard under TP/PP) over a flat
//! batch of sequences: bf16 (or `--dtype float32`) weights and activations, f32 residual stream,
//! paged attention, f32 logits.

use std::collections::HashMap;

use strata_runtime::cpu::ops::RopeLayout;
use strata_runtime::cuda::kernels::{rope_block_threads, FAMILIES};
use strata_runtime::cuda::{
    AttentionCall, Communicator, CudaError, DeviceBuffer, Event, Gemm, GemmOperands, GemmOut, Gpu, Graph, KernelSpec,
    Kernels, PinnedBuffer, STAGED_ATTENTION_MAX_STAGES,
};
use strata_runtime::kernel_args;

use crate::batch::{Logits, LogitsWanted, SeqChunk};
use crate::config::{rope_cos_sin_table, ModelConfig};
use crate::error::ModelError;
use crate::kv_cache::KvCacheDtype;

use super::kv_cache::GpuKvCache;
use super::profile::KernelProfile;
use super::row_adjust::RowAdjusts;
use super::shard::Shard;
use super::weights::{ComputeDtype, GpuLayer, GpuWeights};

/// Decode steps of at least this bucket are profiled apart from smaller ones.
const PROFILE_BUCKET_APART: usize = 128;
/// Shared-memory stages a warp of the staged attention kernel uses by default.
const DEFAULT_ATTN_STAGES: usize = 3;
/// Most parts one token's attention context is split into (flash-decoding style).
const MAX_PARTS: usize = 16;
/// Batches of at most this many tokens may split attention over the context (few blocks otherwise).
const SPLIT_MAX_TOKENS: usize = 64;
/// Threads of the row-wise kernels (norm.cu holds a row of up to 16 per thread in registers).
const ROW_THREADS: u32 = 1024;
/// Parts the reduction of every GEMM is cut into under `--deterministic` (gemm.cu's
/// FO_MAX_CHUNKS): the largest TP size whose results equal one GPU's bit for bit.
pub const DETERMINISTIC_CHUNKS: usize = 8;
/// Rows per block and tokens per warp of `gemm_fixed_order`.
const FO_WARPS: usize = 8;
const FO_TOKENS: usize = 8;
/// The decode GEMVs of gemm.cu compiled for steps of up to `tokens` tokens (`gemv_t{T}` and its
/// variants); a block of GEMV_THREADS computes two rows, or one gate/up pair, its threads
/// splitting k.
struct GemvKernels {
    tokens: usize,
    /// `y = x · wᵀ` (bf16 or f32), optionally scaled by a norm carried in from the step before.
    plain: &'static str,
    /// The gate/up projection and SiLU.
    silu: &'static str,
    /// The QKV projection with RoPE and the cache write.
    qkv_rope: &'static str,
    /// The o or down projection added into the residual, with the next norm's sums.
    residual: &'static str,
}

const GEMV_KERNELS: [GemvKernels; 4] = [
    GemvKernels {
        tokens: 1,
        plain: "gemv_t1",
        silu: "gemv_silu_t1",
        qkv_rope: "gemv_qkv_rope_t1",
        residual: "gemv_residual_t1",
    },
    GemvKernels {
        tokens: 2,
        plain: "gemv_t2",
        silu: "gemv_silu_t2",
        qkv_rope: "gemv_qkv_rope_t2",
        residual: "gemv_residual_t2",
    },
    GemvKernels {
        tokens: 4,
        plain: "gemv_t4",
        silu: "gemv_silu_t4",
        qkv_rope: "gemv_qkv_rope_t4",
        residual: "gemv_residual_t4",
    },
    GemvKernels {
        tokens: 8,
        plain: "gemv_t8",
        silu: "gemv_silu_t8",
        qkv_rope: "gemv_qkv_rope_t8",
        residual: "gemv_residual_t8",
    },
];
/// The most tokens a GEMV kernel is compiled for.
const GEMV_KERNEL_TOKENS: usize = GEMV_KERNELS[GEMV_KERNELS.len() - 1].tokens;
/// Slots of {coarse, fine} u64 sums per token and norm (gemm.cu's NORM_SLOTS).
const NORM_SLOTS: usize = 32;
/// Bytes of one norm's sums for the most tokens a GEMV takes.
const NORM_SUMS_BYTES: usize = GEMV_KERNEL_TOKENS * NORM_SLOTS * 2 * 8;
const GEMV_THREADS: usize = 128;
/// Blocks a row's argmax is split over (sampling.cu's ARGMAX_SLICES).
const ARGMAX_SLICES: usize = 32;
/// Words of a logits row's sampling parameters (sampling.cu's SAMPLING_WORDS).
pub const SAMPLING_WORDS: usize = 6;
/// Threads of sampling.cu's `sampling_limits` (its LIMIT_THREADS).
const LIMIT_THREADS: u32 = 512;
/// The kernels that read or write activations, each with its twin for `--dtype float32` (the same
/// arguments, f32 where the first has bf16), which `launch` runs in its place. The attention
/// kernel is chosen in `new`; the other kernels take f32 or ids only, or are bf16 fast paths that
/// float32 does not use (decode GEMVs, tensor-core attention, fp8 cache writes).
const F32_TWINS: [(&str, &str); 7] = [
    ("embedding_lookup", "embedding_lookup_f32"),
    ("rms_norm", "rms_norm_f32"),
    ("add_rms_norm", "add_rms_norm_f32"),
    ("rms_norm_rows", "rms_norm_rows_f32"),
    ("silu_mul", "silu_mul_f32"),
    ("qkv_rope_kv_write_bf16", "qkv_rope_kv_write_f32"),
    ("attention_reduce", "attention_reduce_f32"),
];
/// Steps of at most this many tokens use the GEMVs instead of cuBLASLt (`STRATA_GEMV_MAX_TOKENS`
/// overrides it for measurements; 0 turns them off).
const GEMV_MAX_TOKENS: usize = 8;

/// The largest step the buffers are sized for.
#[derive(Debug, Clone, Copy)]
pub struct StepLimits {
    pub max_tokens: usize,
    pub max_seqs: usize,
    pub max_model_len: usize,
    /// Rows of logits computed at once (more are done in chunks).
    pub logit_rows: usize,
}

impl StepLimits {
    fn max_blocks(&self, block_size: usize) -> usize {
        self.max_model_len.div_ceil(block_size)
    }
}

/// Offsets (in i32 elements) of each input array in the staging buffer.
#[derive(Debug, Clone, Copy)]
struct InputLayout {
    tokens: usize,
    positions: usize,
    token_seq: usize,
    slots: usize,
    rows: usize,
    /// Per logits row, SAMPLING_WORDS words (sampling.cu's): 1 / temperature (f32 bits, 0 for an
    /// argmax), the seed's two words, top_k, top_p and min_p (f32 bits).
    sampling: usize,
    tables: usize,
    len: usize,
}

impl InputLayout {
    /// The layout of a step of `tokens` (padded) tokens over `seqs` sequences: the arrays end to
    /// end, so a step copies only its own inputs. Offsets depend on `tokens` alone, so a graph
    /// captured for a bucket keeps pointing at the right arrays.
    fn for_step(tokens: usize, seqs: usize, max_blocks: usize) -> InputLayout {
        let t = tokens;
        InputLayout {
            tokens: 0,
            positions: t,
            token_seq: 2 * t,
            slots: 3 * t,
            rows: 4 * t,
            sampling: 5 * t,
            tables: (5 + SAMPLING_WORDS) * t,
            len: (5 + SAMPLING_WORDS) * t + (seqs + 1) * max_blocks,
        }
    }

    /// The largest step's layout (the staging buffer's size).
    fn largest(l: &StepLimits, block_size: usize) -> InputLayout {
        InputLayout::for_step(l.max_tokens, l.max_seqs, l.max_blocks(block_size))
    }
}

struct StepBuffers {
    inputs: DeviceBuffer,
    x: DeviceBuffer,
    xn: DeviceBuffer,
    qkv: DeviceBuffer,
    attn: DeviceBuffer,
    proj: DeviceBuffer,
    gate_up: DeviceBuffer,
    act: DeviceBuffer,
    normed: DeviceBuffer,
    logits: DeviceBuffer,
    /// Each logits row's argmax (u32, from 0) and, from `logit_rows` on, its logit (f32: to merge
    /// the vocabulary slices of TP ranks); one buffer so that one copy brings both back.
    argmax: DeviceBuffer,
    /// The best logit and its id of each slice of each row (`argmax_slices`), values first.
    argmax_parts: DeviceBuffer,
    /// Each sampled row's best logit and the limit of top-k / top-p / min-p (`sampling_limits`).
    sampling_limits: DeviceBuffer,
    part_acc: DeviceBuffer,
    part_ml: DeviceBuffer,
    /// Every TP rank's row-parallel partial sums, under `--deterministic`.
    gathered: Option<DeviceBuffer>,
    /// The sums of squares each norm of a step carries between GEMVs (gemm.cu's NormIn):
    /// `2 * layers + 1` norms of NORM_SUMS_BYTES.
    norm_sums: DeviceBuffer,
}

/// The communicators of a shard: its TP group's and its pipeline column's (rank = stage).
#[derive(Default)]
pub struct ShardComms {
    pub tp: Option<Communicator>,
    pub pp: Option<Communicator>,
}

/// The logits of one step on one GPU: whole rows cover this shard's vocabulary slice, and each
/// argmax comes with its logit so the slices of TP ranks can be merged.
pub struct ShardLogits {
    pub logits: Logits,
    pub argmax_values: Vec<f32>,
}

/// A model (or one GPU's shard of it) resident on one GPU with its KV cache.
pub struct GpuTransformer {
    /// The whole model's shape.
    pub config: ModelConfig,
    /// The shapes this GPU computes with (see [`Shard::local_config`]).
    pub local: ModelConfig,
    pub shard: Shard,
    pub comms: ShardComms,
    pub gpu: Gpu,
    pub weights: GpuWeights,
    pub kv: GpuKvCache,
    kernels: Kernels,
    gemm: Gemm,
    /// cos and sin of every rotated pair at every position up to `max_model_len`
    /// ([`rope_cos_sin_table`]), read by rope.cu and the QKV GEMV.
    rope_table: DeviceBuffer,
    limits: StepLimits,
    layout: InputLayout,
    bufs: StepBuffers,
    /// Host staging of a step's inputs: two page-locked buffers, filled in turn, so that one is
    /// filled while the upload of a started step ([`Self::start_decode`]) from the other may
    /// still be queued; `staging` is the next one, `uploaded` the mark after each one's upload.
    host_inputs: [PinnedBuffer<i32>; 2],
    staging: usize,
    uploaded: [Option<Event>; 2],
    /// The chosen ids of a started decode step come back into the buffer of its staging slot.
    started_ids: [PinnedBuffer<u32>; 2],
    /// Decode steps started and not yet finished (at most two), and the rows of the last one
    /// started when the argmax buffer still holds its ids (the next may take its tokens there).
    started: usize,
    argmax_rows_of_started: Option<usize>,
    /// Decode steps may start before the previous one is read ([`Self::overlaps_steps`]);
    /// `STRATA_OVERLAP=0` turns it off, for measurements.
    overlap: bool,
    /// Decode graphs by padded batch size and whether they compute the logits (steps with
    /// adjusted rows compute them after the graph, once the host's masks are in).
    graphs: HashMap<(usize, bool), Graph>,
    /// Logit bias and grammar masks of the rows that have them.
    adjusts: RowAdjusts,
    /// The started step whose logits wait for its masks, and the marks of such steps' ids.
    deferred: Option<DeferredLogits>,
    deferred_done: [Option<Event>; 2],
    /// Capture decode steps as CUDA graphs (off with `--enforce-eager`).
    pub use_graphs: bool,
    /// Fixed-order GEMMs and reductions (see [`GpuTransformer::set_deterministic`]).
    deterministic: bool,
    /// Products of at most this many tokens run as gemm.cu's GEMVs.
    gemv_max_tokens: usize,
    /// GEMV-sized steps do RoPE and the cache write in the QKV GEMV when they can
    /// ([`Self::qkv_rope_kernel`]); `STRATA_FUSE_ROPE=0` keeps rope.cu's kernel, for measurements.
    fuse_rope: bool,
    /// GEMV-sized steps on one GPU carry each RMSNorm from the GEMV that writes the residual to
    /// the one that reads it ([`Self::norms_in_gemvs`]); `STRATA_FUSE_NORM=0` runs the norm
    /// kernels instead, for measurements.
    fuse_norm: bool,
    /// The attention kernel for this model, cache type, dtype and GPU: on tensor cores
    /// (`paged_attention_mma_*`: head sizes 64 and 128; bf16 from sm_80, fp8 from sm_89) unless
    /// `STRATA_ATTENTION=simt` asks for the CUDA-core kernel (measurements) or the dtype is
    /// float32 (`paged_attention_f32`).
    attention_kernel: &'static str,
    /// Decode steps of more than [`SPLIT_MAX_TOKENS`] tokens run the tensor-core kernel with its tiles
    /// staged through shared memory (`paged_attention_staged_*`), this many stages a warp
    /// (`STRATA_ATTN_STAGES`, 2 to 4, default 3; 0 keeps `attention_kernel` for every step).
    staged_attention: Option<(&'static str, usize)>,
    /// `STRATA_GPU_PROFILE=1`: the GPU time of every kernel of eager steps, printed when the
    /// model is dropped.
    profile: Option<KernelProfile>,
    capturing: bool,
    /// The bucket of the decode step being launched, if it only decodes (names the profile's
    /// entries).
    decode_bucket: Option<usize>,
    /// `bench-gpu --ablate`: kernels (a name or part of one) and cuBLASLt products (`gemm NxK`)
    /// left out of every step, to time what each costs inside a graph; outputs are then wrong.
    pub ablate: Vec<String>,
}

impl Drop for GpuTransformer {
    fn drop(&mut self) {
        // Graphs that captured NCCL operations hold references on their communicators, which
        // destroy (and abort) wait for: the graphs go first.
        self.graphs.clear();
        if let Some(p) = &self.profile {
            p.report();
        }
    }
}

/// A decode step started by [`GpuTransformer::start_decode`], not yet read back.
pub struct StartedDecode {
    /// The batch index of the sequence of each argmax row.
    seqs: Vec<usize>,
    /// Its staging slot, where its ids come back.
    slot: usize,
    /// Marked after the ids' copy back; `None` while its logits wait for the host's masks
    /// ([`GpuTransformer::launch_deferred`] marks it then).
    done: Option<Event>,
}

/// A started decode step whose logits wait for the host's masks.
struct DeferredLogits {
    bucket: usize,
    /// Its row adjustments' staging set, and its staging slot and logits rows.
    set: usize,
    slot: usize,
    rows: usize,
}

/// Host-side description of one step.
struct StepPlan {
    tokens: usize,
    /// (sequence, position, flat token index, whole row wanted) of each logits row; rows not
    /// wanted whole return their argmax only.
    rows: Vec<(usize, usize, usize, bool)>,
    max_ctx: usize,
}

impl GpuTransformer {
    /// Builds the runtime state around uploaded weights and an allocated cache.
    pub fn new(
        config: ModelConfig,
        shard: Shard,
        comms: ShardComms,
        gpu: Gpu,
        weights: GpuWeights,
        kv: GpuKvCache,
        limits: StepLimits,
    ) -> Result<GpuTransformer, CudaError> {
        let mut gpu = gpu;
        // Programmatic dependent launch is measured on one GPU only so far: shards that exchange
        // data over NCCL launch their kernels in plain stream order.
        if comms.tp.is_some() || comms.pp.is_some() {
            gpu.programmatic_launch = false;
        }
        let local = shard.local_config(&config);
        let (h, inter) = (local.hidden, local.intermediate);
        if !h.is_multiple_of(4) || h > 16 * ROW_THREADS as usize || !inter.is_multiple_of(8) {
            return Err(CudaError::Compile {
                family: "norm".into(),
                log: format!(
                    "hidden size {h} / intermediate size {inter} (per GPU) is not supported by the CUDA kernels \
                     (hidden: a multiple of 4 up to {}; intermediate: a multiple of 8); use --device cpu",
                    16 * ROW_THREADS
                ),
            });
        }
        rope_fits_the_lanes(&local).map_err(|log| CudaError::Compile {
            family: "rope".into(),
            log,
        })?;
        let spec = KernelSpec {
            head_dim: local.head_dim,
            group: local.n_heads / local.n_kv_heads.max(1),
        };
        let kernels = Kernels::load(&gpu, spec)?;
        let fp8 = kv.dtype == KvCacheDtype::Fp8E4m3;
        let cc = gpu.info.compute_capability;
        let bf16 = weights.dtype == ComputeDtype::Bf16;
        let mma = bf16
            && matches!(local.head_dim, 64 | 128)
            && cc >= if fp8 { (8, 9) } else { (8, 0) }
            && std::env::var("STRATA_ATTENTION").map_or(true, |v| v != "simt");
        let attention_kernel = match (fp8, mma) {
            _ if !bf16 => "paged_attention_f32",
            (true, true) => "paged_attention_mma_fp8",
            (true, false) => "paged_attention_fp8",
            (false, true) => "paged_attention_mma_bf16",
            (false, false) => "paged_attention_bf16",
        };
        // A measurement knob like the others here: 0 turns staging off, other values are clamped.
        let stages = std::env::var("STRATA_ATTN_STAGES")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(DEFAULT_ATTN_STAGES, |n| match n {
                0 => 0,
                n => n.clamp(2, STAGED_ATTENTION_MAX_STAGES),
            });
        let staged_attention = (mma && stages > 0).then(|| {
            let name = if fp8 {
                "paged_attention_staged_fp8"
            } else {
                "paged_attention_staged_bf16"
            };
            (name, stages)
        });
        let gemm = Gemm::new(&gpu, if bf16 { GemmOperands::Bf16 } else { GemmOperands::F32 })?;
        let table = rope_cos_sin_table(&config.rope.inv_freq(), limits.max_model_len);
        let rope_table = gpu.upload(&table, "the RoPE cos/sin table")?;
        let layout = InputLayout::largest(&limits, kv.block_size);
        let c = &local;
        let t = limits.max_tokens;
        let width = c.q_dim() + 2 * c.kv_dim();
        let split_t = SPLIT_MAX_TOKENS.min(t);
        // Bytes of an activation between kernels (the residual stream is f32 either way).
        let e = weights.dtype.bytes();
        let bufs = StepBuffers {
            inputs: gpu.alloc(layout.len * 4, "step inputs")?,
            x: gpu.alloc(t * c.hidden * 4, "activations")?,
            xn: gpu.alloc(t * c.hidden * e, "activations")?,
            qkv: gpu.alloc(t * width * e, "activations")?,
            attn: gpu.alloc(t * c.q_dim() * e, "activations")?,
            proj: gpu.alloc(t * c.hidden * 4, "activations")?,
            gate_up: gpu.alloc(t * 2 * c.intermediate * e, "activations")?,
            act: gpu.alloc(t * c.intermediate * e, "activations")?,
            normed: gpu.alloc(limits.logit_rows * c.hidden * e, "activations")?,
            logits: gpu.alloc(limits.logit_rows * c.vocab_size * 4, "logits")?,
            argmax: gpu.alloc(2 * limits.logit_rows * 4, "greedy token ids")?,
            argmax_parts: gpu.alloc(2 * limits.logit_rows * ARGMAX_SLICES * 4, "greedy token ids")?,
            sampling_limits: gpu.alloc(2 * limits.logit_rows * 4, "sampling limits")?,
            part_acc: gpu.alloc(split_t * c.n_heads * MAX_PARTS * c.head_dim * 4, "attention partials")?,
            part_ml: gpu.alloc(split_t * c.n_heads * MAX_PARTS * 2 * 4, "attention partials")?,
            gathered: None,
            norm_sums: gpu.alloc((2 * c.n_layers + 1) * NORM_SUMS_BYTES, "norm sums")?,
        };
        let adjusts = RowAdjusts::new(
            &gpu,
            config.vocab_size,
            limits.max_tokens.max(limits.logit_rows),
            limits.max_seqs,
        )?;
        let host_inputs = [
            gpu.alloc_pinned(layout.len, "step inputs")?,
            gpu.alloc_pinned(layout.len, "step inputs")?,
        ];
        let started_ids = [
            gpu.alloc_pinned(limits.logit_rows, "greedy token ids")?,
            gpu.alloc_pinned(limits.logit_rows, "greedy token ids")?,
        ];
        Ok(GpuTransformer {
            config,
            local,
            shard,
            comms,
            gpu,
            weights,
            kv,
            kernels,
            gemm,
            rope_table,
            limits,
            layout,
            bufs,
            host_inputs,
            staging: 0,
            uploaded: [None, None],
            started_ids,
            started: 0,
            argmax_rows_of_started: None,
            overlap: std::env::var("STRATA_OVERLAP").map_or(true, |v| v != "0"),
            graphs: HashMap::new(),
            adjusts,
            deferred: None,
            deferred_done: [None, None],
            use_graphs: true,
            deterministic: false,
            gemv_max_tokens: std::env::var("STRATA_GEMV_MAX_TOKENS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(GEMV_MAX_TOKENS),
            fuse_rope: std::env::var("STRATA_FUSE_ROPE").map_or(true, |v| v != "0"),
            fuse_norm: std::env::var("STRATA_FUSE_NORM").map_or(true, |v| v != "0"),
            attention_kernel,
            staged_attention,
            profile: KernelProfile::from_env(),
            capturing: false,
            decode_bucket: None,
            ablate: Vec::new(),
        })
    }

    /// `--deterministic`: every GEMM sums in one fixed order whatever its shape (gemm.cu), TP
    /// ranks gather their row-parallel partial sums and add them in that order's tree instead of
    /// NCCL's, and attention splits contexts by the whole model's KV heads. Greedy output is then
    /// the same bit for bit on one GPU, under TP (up to 8 ranks) and under PP; slower than cuBLAS.
    pub fn set_deterministic(&mut self, on: bool) -> Result<(), CudaError> {
        if on {
            let c = &self.config;
            let tp = self.shard.tp_size;
            let step = 8 * DETERMINISTIC_CHUNKS;
            for (what, k) in [
                ("hidden size", c.hidden),
                ("attention width", c.q_dim()),
                ("intermediate size", c.intermediate),
            ] {
                if !k.is_multiple_of(step) {
                    return Err(CudaError::NoDevice(format!(
                        "--deterministic needs the {what} to be a multiple of {step} (this model's is {k}); run without --deterministic"
                    )));
                }
            }
            if !tp.is_power_of_two() || tp > DETERMINISTIC_CHUNKS {
                return Err(CudaError::NoDevice(format!(
                    "--deterministic works with a tensor-parallel size of 1, 2, 4 or 8, not {tp}"
                )));
            }
            if tp > 1 && self.bufs.gathered.is_none() {
                let bytes = tp * self.limits.max_tokens * self.local.hidden * 4;
                self.bufs.gathered = Some(self.gpu.alloc(bytes, "gathered partial sums")?);
            }
        }
        self.graphs.clear();
        self.deterministic = on;
        Ok(())
    }

    /// Checks a batch against the model, the cache and the buffers.
    fn validate(&self, batch: &[SeqChunk]) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::BadBatch(m));
        let tokens: usize = batch.iter().map(|c| c.tokens.len()).sum();
        if tokens > self.limits.max_tokens {
            return bad(format!(
                "{tokens} tokens in one step, the GPU buffers hold {}",
                self.limits.max_tokens
            ));
        }
        if batch.len() > self.limits.max_seqs {
            return bad(format!(
                "{} sequences in one step, at most {}",
                batch.len(),
                self.limits.max_seqs
            ));
        }
        let bs = self.kv.block_size;
        for (i, ch) in batch.iter().enumerate() {
            if ch.end_pos() > self.limits.max_model_len {
                return bad(format!(
                    "sequence {i} reaches {} positions, max {}",
                    ch.end_pos(),
                    self.limits.max_model_len
                ));
            }
            if ch.block_table.len() * bs < ch.end_pos() {
                return bad(format!(
                    "sequence {i}: block table too short for {} positions",
                    ch.end_pos()
                ));
            }
            if let Some(b) = ch.block_table.iter().find(|&&b| b as usize >= self.kv.num_blocks) {
                return bad(format!(
                    "sequence {i}: block {b} outside the cache of {}",
                    self.kv.num_blocks
                ));
            }
            if let Some(t) = ch.tokens.iter().find(|&&t| t as usize >= self.config.vocab_size) {
                return bad(format!(
                    "token id {t} outside the vocabulary of {}",
                    self.config.vocab_size
                ));
            }
        }
        Ok(())
    }

    /// Lays out and fills the host staging array for `batch`, padded to `padded` tokens for a graph,
    /// once the array's previous upload is done.
    fn stage(&mut self, batch: &[SeqChunk], padded: usize) -> Result<StepPlan, CudaError> {
        if let Some(mark) = self.uploaded[self.staging].take() {
            mark.synchronize()?;
        }
        let bs = self.kv.block_size;
        let max_blocks = self.limits.max_blocks(bs);
        self.layout = InputLayout::for_step(padded, batch.len(), max_blocks);
        let l = self.layout;
        let pad_row = batch.len(); // a table row that points at the padding block
        let h = &mut self.host_inputs[self.staging];
        let mut t = 0;
        let mut rows = Vec::new();
        let mut max_ctx = 0;
        for (si, ch) in batch.iter().enumerate() {
            let table = &mut h[l.tables + si * max_blocks..l.tables + (si + 1) * max_blocks];
            for (d, &b) in table.iter_mut().zip(&ch.block_table) {
                *d = b as i32;
            }
            for (i, &tok) in ch.tokens.iter().enumerate() {
                let pos = ch.first_pos + i;
                h[l.tokens + t] = tok as i32;
                h[l.positions + t] = pos as i32;
                h[l.token_seq + t] = si as i32;
                h[l.slots + t] = (ch.block_table[pos / bs] as usize * bs + pos % bs) as i32;
                let last = i + 1 == ch.tokens.len();
                let row = rows.len();
                match ch.logits {
                    LogitsWanted::None => {}
                    LogitsWanted::Last if last => rows.push((si, pos, t, true)),
                    w if last && w.wants_id_only() => rows.push((si, pos, t, false)),
                    LogitsWanted::All => rows.push((si, pos, t, true)),
                    _ => {}
                }
                if rows.len() > row {
                    let at = l.sampling + SAMPLING_WORDS * row;
                    h[at..at + SAMPLING_WORDS].copy_from_slice(&sampling_words(ch.logits));
                }
                t += 1;
            }
            max_ctx = max_ctx.max(ch.end_pos());
        }
        let real = t;
        h[l.tables + pad_row * max_blocks] = self.kv.num_blocks as i32;
        while t < padded {
            h[l.tokens + t] = 0;
            h[l.positions + t] = 0;
            h[l.token_seq + t] = pad_row as i32;
            h[l.slots + t] = (self.kv.num_blocks * bs) as i32;
            t += 1;
        }
        for (j, &(_, _, ti, _)) in rows.iter().enumerate() {
            h[l.rows + j] = ti as i32;
        }
        // A captured decode step computes logits for every padded token, row j = token j: their
        // argmax, for rows no sequence reads.
        for j in rows.len()..padded {
            h[l.rows + j] = j as i32;
            h[l.sampling + SAMPLING_WORDS * j..l.sampling + SAMPLING_WORDS * (j + 1)].fill(0);
        }
        Ok(StepPlan {
            tokens: real,
            rows,
            max_ctx,
        })
    }

    /// Runs the batch: appends every new token's K/V to the cache and returns the logits asked for.
    pub fn forward(&mut self, batch: &[SeqChunk]) -> Result<Logits, ModelError> {
        self.forward_shard(batch).map(|l| l.logits)
    }

    /// [`Self::forward`] on this GPU's shard: only the last stage returns logits, over its
    /// vocabulary slice (argmax ids are of the whole vocabulary).
    pub fn forward_shard(&mut self, batch: &[SeqChunk]) -> Result<ShardLogits, ModelError> {
        if let Some(p) = &self.profile {
            p.step_begins();
        }
        let out = self.forward_step(batch);
        if let Some(p) = &self.profile {
            p.step_ends();
        }
        out
    }

    fn forward_step(&mut self, batch: &[SeqChunk]) -> Result<ShardLogits, ModelError> {
        self.validate(batch)?;
        let gpu_err = |e: CudaError| ModelError::Device(e.to_string());
        self.gpu.bind().map_err(gpu_err)?;
        let decode = !batch.is_empty()
            && batch.iter().all(|c| {
                c.tokens.len() == 1
                    && matches!(
                        c.logits,
                        LogitsWanted::Last | LogitsWanted::LastArgmax | LogitsWanted::LastSampled(_)
                    )
            });
        // Decode steps run padded to a bucket size, captured as a graph or eagerly: the same
        // shapes either way, so the same numbers.
        let bucket = if decode {
            graph_bucket(batch.len(), self.limits.max_seqs)
        } else {
            None
        };
        self.decode_bucket = bucket;
        let padded = bucket.unwrap_or_else(|| batch.iter().map(|c| c.tokens.len()).sum());
        let plan = self.stage(batch, padded).map_err(gpu_err)?;
        if plan.tokens == 0 {
            return Ok(self.no_logits());
        }
        let logit_rows = bucket.unwrap_or(plan.rows.len());
        let adjusted = match self.shard.is_last_stage() {
            true => self
                .adjusts
                .stage(batch, plan.rows.iter().map(|r| r.0), logit_rows)
                .map_err(gpu_err)?,
            false => None,
        };
        let l = self.layout;
        self.gpu
            .write(&self.bufs.inputs, 0, &self.host_inputs[self.staging][..l.len])
            .map_err(gpu_err)?;
        // The argmax buffer is about to hold this step's ids.
        self.argmax_rows_of_started = None;
        self.profile_phase("stage and upload inputs");
        match bucket {
            Some(b) => {
                self.run_decode(b, adjusted.is_some()).map_err(gpu_err)?;
                if let Some(set) = adjusted {
                    self.adjusted_logits(b, set).map_err(gpu_err)?;
                }
                self.profile_phase("launch (graph or eager kernels)");
                self.collect_logits(&plan, true, adjusted).map_err(gpu_err)
            }
            None => {
                // Parts of fewer than 32 keys only cost their merge.
                let parts = self.attention_parts(plan.tokens).min(plan.max_ctx.div_ceil(32));
                self.layers(plan.tokens, parts).map_err(gpu_err)?;
                self.profile_phase("launch (graph or eager kernels)");
                self.collect_logits(&plan, false, adjusted).map_err(gpu_err)
            }
        }
    }

    /// Queues a decode step padded to bucket `b` (its inputs uploaded): its layers and, on the last
    /// stage, its logits rows and their argmax, as the bucket's CUDA graph (captured on first use)
    /// or kernel by kernel. With `adjusted` rows the graph stops before the logits, which follow
    /// ([`Self::adjusted_logits`]) once the host's masks, computed while the layers run, are in.
    fn run_decode(&mut self, b: usize, adjusted: bool) -> Result<(), CudaError> {
        let parts = self.attention_parts(b);
        let logits_in_graph = self.shard.is_last_stage() && !adjusted;
        let step = |m: &mut Self| {
            m.layers(b, parts)?;
            if logits_in_graph {
                m.logits_chunk(0, b, false)?;
            }
            Ok(())
        };
        if !self.use_graphs {
            step(self)?;
        } else {
            let key = (b, logits_in_graph);
            if !self.graphs.contains_key(&key) {
                self.gpu.begin_capture()?;
                self.capturing = true;
                let run = step(self);
                self.capturing = false;
                let graph = self.gpu.end_capture();
                run?;
                self.graphs.insert(key, graph?);
            }
            // Profiled: the graph's GPU time, against the step's wall time.
            let timer = self.profile_start()?;
            self.graphs[&key].launch()?;
            self.profile_end(timer, || "the whole step's CUDA graph".to_string())?;
        }
        Ok(())
    }

    /// The logits of a decode step of bucket `b` whose layers are queued: waits for its masks
    /// (staging set `set`), uploads them, then the norm, LM head, bias and mask, and the choice.
    fn adjusted_logits(&mut self, b: usize, set: usize) -> Result<(), CudaError> {
        self.adjusts.upload(&self.gpu, set)?;
        self.profile_phase("wait for the host's grammar masks");
        self.logits_chunk(0, b, true)
    }

    /// Launches the logits of the started step that waits for its masks, if any, and queues its
    /// ids' copy back.
    fn launch_deferred(&mut self) -> Result<(), CudaError> {
        let Some(d) = self.deferred.take() else {
            return Ok(());
        };
        self.adjusted_logits(d.bucket, d.set)?;
        // SAFETY: as in `start_decode`: `started_ids[d.slot]` is read only after this mark.
        unsafe {
            self.gpu
                .read_async(&self.bufs.argmax, 0, &mut self.started_ids[d.slot], d.rows)?;
        }
        self.deferred_done[d.slot] = Some(self.gpu.mark()?);
        Ok(())
    }

    /// Whether decode steps of ids chosen on the GPU may be started before the host has read the
    /// previous one
    /// ([`Self::start_decode`]): the whole model on this GPU, not profiled, not turned off by
    /// `STRATA_OVERLAP=0`.
    pub fn overlaps_steps(&self) -> bool {
        self.overlap
            && self.profile.is_none()
            && self.comms.tp.is_none()
            && self.comms.pp.is_none()
            && self.shard.is_first_stage()
            && self.shard.is_last_stage()
    }

    /// Starts a decode step whose tokens are chosen on the GPU (one each, `LogitsWanted::LastArgmax`
    /// or `LastSampled`) without waiting for it: inputs uploaded from pinned memory, the step
    /// queued, its chosen ids queued to come back. With `tokens_from`, chunk i's token is not
    /// known on the host yet: it is the id chosen for row `tokens_from[i]` of the decode step
    /// started just before, taken on the device (sampling.cu's `tokens_from_argmax`), and the
    /// chunk's own token is a placeholder (any id of the vocabulary). At most two steps are
    /// started and not finished; [`Self::finish_decode`] returns each.
    pub fn start_decode(
        &mut self,
        batch: &[SeqChunk],
        tokens_from: Option<&[usize]>,
    ) -> Result<StartedDecode, ModelError> {
        let bad = |m: &str| Err(ModelError::BadBatch(m.to_string()));
        if !self.overlaps_steps() {
            return bad(
                "this GPU runs one step at a time here (several GPUs, profiling or STRATA_OVERLAP=0); call forward",
            );
        }
        if self.started >= 2 {
            return bad("two decode steps are started already; finish one first");
        }
        let tokens_on_device = batch.iter().all(|c| c.tokens.len() == 1 && c.logits.wants_id_only());
        if batch.is_empty() || !tokens_on_device {
            return bad(
                "only steps of decodes whose token is chosen on the GPU (argmax or sampled) start without waiting",
            );
        }
        let Some(b) = graph_bucket(batch.len(), self.limits.max_seqs) else {
            return bad("more sequences than --max-num-seqs in one decode step");
        };
        if let Some(from) = tokens_from {
            let rows = self.argmax_rows_of_started.unwrap_or(0);
            if from.len() != batch.len() || from.iter().any(|&r| r >= rows) {
                return bad("tokens taken from rows the decode step started before does not have");
            }
        }
        let gpu_err = |e: CudaError| ModelError::Device(e.to_string());
        self.gpu.bind().map_err(gpu_err)?;
        self.validate(batch)?;
        // The step before may wait for its masks (begun once the one before it was read): its
        // logits go first, as this step may take its tokens.
        self.launch_deferred().map_err(gpu_err)?;
        self.decode_bucket = Some(b);
        let plan = self.stage(batch, b).map_err(gpu_err)?;
        let adjusted = self
            .adjusts
            .stage(batch, plan.rows.iter().map(|r| r.0), b)
            .map_err(gpu_err)?;
        let (slot, l) = (self.staging, self.layout);
        // Tokens that come from the device: their rows take the placeholders' place.
        if let Some(from) = tokens_from {
            for (i, &row) in from.iter().enumerate() {
                self.host_inputs[slot][l.tokens + i] = row as i32;
            }
        }
        // SAFETY: the staging buffer is not written again before `uploaded[slot]` has passed
        // (stage waits for it); `started_ids[slot]` is read only after `done`, and no other step
        // starts in this slot before this one is finished (at most two started, slots in turn).
        unsafe {
            self.gpu
                .write_async(&self.bufs.inputs, 0, &self.host_inputs[slot], l.len)
                .map_err(gpu_err)?;
        }
        self.uploaded[slot] = Some(self.gpu.mark().map_err(gpu_err)?);
        if tokens_from.is_some() {
            let (tokens, ids, n) = (
                self.bufs.inputs.at(l.tokens * 4),
                self.bufs.argmax.ptr(),
                batch.len() as i32,
            );
            self.launch(
                "tokens_from_argmax",
                (batch.len().div_ceil(128) as u32, 1, 1),
                128,
                0,
                &mut kernel_args!(tokens, ids, n),
            )
            .map_err(gpu_err)?;
        }
        self.run_decode(b, adjusted.is_some()).map_err(gpu_err)?;
        let rows = plan.rows.len();
        // Adjusted rows: the logits wait for the masks, which the host begins once it has read
        // the step before (at the next start or at the finish).
        let done = match adjusted {
            Some(set) => {
                self.deferred = Some(DeferredLogits {
                    bucket: b,
                    set,
                    slot,
                    rows,
                });
                None
            }
            None => {
                unsafe {
                    self.gpu
                        .read_async(&self.bufs.argmax, 0, &mut self.started_ids[slot], rows)
                        .map_err(gpu_err)?;
                }
                Some(self.gpu.mark().map_err(gpu_err)?)
            }
        };
        self.staging ^= 1;
        self.started += 1;
        self.argmax_rows_of_started = Some(rows);
        Ok(StartedDecode {
            seqs: plan.rows.iter().map(|r| r.0).collect(),
            slot,
            done,
        })
    }

    /// Waits for a step of [`Self::start_decode`] and returns its chosen tokens.
    pub fn finish_decode(&mut self, step: StartedDecode) -> Result<Logits, ModelError> {
        let gpu_err = |e: CudaError| ModelError::Device(e.to_string());
        self.started = self.started.saturating_sub(1);
        let done = match step.done {
            Some(done) => done,
            None => {
                if self.deferred.as_ref().is_some_and(|d| d.slot == step.slot) {
                    self.launch_deferred().map_err(gpu_err)?;
                }
                self.deferred_done[step.slot]
                    .take()
                    .ok_or_else(|| ModelError::BadBatch("a started step's logits were never launched".into()))?
            }
        };
        done.synchronize().map_err(gpu_err)?;
        let ids = &self.started_ids[step.slot];
        Ok(Logits {
            vocab: self.local.vocab_size,
            argmax: step.seqs.iter().enumerate().map(|(j, &seq)| (seq, ids[j])).collect(),
            ..Default::default()
        })
    }

    /// Times cuBLASLt's candidate algorithms (gemm.rs's `tune`) for the products of every
    /// decode batch size that does not run as GEMVs, each over this shard's layers, and keeps
    /// the fastest; `STRATA_GEMM_TUNE=0` keeps the heuristic's first choices. Under
    /// `--deterministic` cuBLASLt is not used; under `--dtype float32`, a reference path, the
    /// heuristic's choices are kept.
    pub fn tune_decode_gemms(&mut self) -> Result<(), CudaError> {
        if self.deterministic
            || self.weights.dtype == ComputeDtype::F32
            || std::env::var("STRATA_GEMM_TUNE").is_ok_and(|v| v == "0")
        {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let c = &self.local;
        let b = &self.bufs;
        let of_layers = |f: fn(&GpuLayer) -> &DeviceBuffer| -> Vec<u64> {
            self.weights.layers.iter().map(|l| f(l).ptr()).collect()
        };
        let width = c.q_dim() + 2 * c.kv_dim();
        let products = [
            (
                of_layers(|l| &l.wqkv),
                b.xn.ptr(),
                b.qkv.ptr(),
                (width, c.hidden),
                GemmOut::Bf16,
            ),
            (
                of_layers(|l| &l.wo),
                b.attn.ptr(),
                b.proj.ptr(),
                (c.hidden, c.q_dim()),
                GemmOut::F32,
            ),
            (
                of_layers(|l| &l.w_gate_up),
                b.xn.ptr(),
                b.gate_up.ptr(),
                (2 * c.intermediate, c.hidden),
                GemmOut::Bf16,
            ),
            (
                of_layers(|l| &l.w_down),
                b.act.ptr(),
                b.proj.ptr(),
                (c.hidden, c.intermediate),
                GemmOut::F32,
            ),
        ];
        let lm_head = self.weights.lm_head().filter(|_| self.shard.is_last_stage()).map(|w| {
            (
                vec![w.ptr()],
                b.normed.ptr(),
                b.logits.ptr(),
                (c.vocab_size, c.hidden),
                GemmOut::F32,
            )
        });
        let mut buckets: Vec<usize> = (1..=self.limits.max_seqs)
            .filter_map(|n| graph_bucket(n, self.limits.max_seqs))
            .filter(|&t| t <= self.limits.max_tokens && self.gemv_for(t, c.hidden).is_none())
            .collect();
        buckets.dedup();
        let mut summary = None;
        for &t in &buckets {
            let head = lm_head.iter().filter(|_| t <= self.limits.logit_rows);
            let (mut first, mut best) = (0.0f32, 0.0f32);
            for (weights, x, y, (n, k), out) in products.iter().chain(head) {
                // SAFETY: the weights are this shard's matrices of shape n x k; x and y are the
                // step buffers these products read and write, sized for the step limits, which
                // hold `t` tokens (t <= max_tokens, and t <= logit_rows for the LM head).
                let (f, b) = unsafe { self.gemm.tune(&self.gpu, weights, *x, *y, (*n, *k, t), *out) }?;
                first += f;
                best += b;
            }
            tracing::debug!(
                "decode GEMMs at {t} tokens: {first:.2} ms a step with cuBLASLt's first choices, {best:.2} ms tuned"
            );
            summary = Some((t, first, best));
        }
        if let Some((t, first, best)) = summary {
            tracing::info!(
                "tuned the GEMMs of {} decode batch sizes in {:.1} s; at {t} tokens {first:.2} -> {best:.2} ms a step",
                buckets.len(),
                started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }

    /// Context parts per token for a step of `t` tokens: enough attention blocks to fill the
    /// GPU about four times over when the batch alone does not.
    fn attention_parts(&self, t: usize) -> usize {
        if t > SPLIT_MAX_TOKENS {
            return 1;
        }
        // Deterministic: the same split whatever share of the heads this GPU holds.
        let kv_heads = if self.deterministic {
            self.config.n_kv_heads
        } else {
            self.local.n_kv_heads
        };
        let blocks = t * kv_heads;
        (4 * self.gpu.info.multiprocessors)
            .div_ceil(blocks.max(1))
            .clamp(1, MAX_PARTS)
    }

    /// Embedding (first stage) or the previous stage's residual, then this shard's layers for the
    /// first `t` staged tokens; leaves the residual in `x` and hands it to the next stage.
    fn layers(&mut self, t: usize, parts: usize) -> Result<(), CudaError> {
        let c = self.local.clone();
        let l = self.layout;
        let inp = |off: usize| self.bufs.inputs.at(off * 4);
        let (tokens, positions, token_seq, slots, tables) = (
            inp(l.tokens),
            inp(l.positions),
            inp(l.token_seq),
            inp(l.slots),
            inp(l.tables),
        );
        let h = c.hidden as i32;
        let eps = c.rms_eps;
        let width = (c.q_dim() + 2 * c.kv_dim()) as i32;
        let (x, xn, qkv, attn, proj, gate_up, act) = (
            self.bufs.x.ptr(),
            self.bufs.xn.ptr(),
            self.bufs.qkv.ptr(),
            self.bufs.attn.ptr(),
            self.bufs.proj.ptr(),
            self.bufs.gate_up.ptr(),
            self.bufs.act.ptr(),
        );
        let grid_t = (t as u32, 1, 1);
        let stage = self.shard_stage();
        match (&self.weights.token_embd, self.shard.is_first_stage()) {
            (Some(embd), true) => {
                let table = embd.ptr();
                let vocab = self.shard.vocab(&self.config);
                let (v0, vn) = (vocab.start as i32, vocab.len() as i32);
                self.launch(
                    "embedding_lookup",
                    grid_t,
                    ROW_THREADS,
                    0,
                    &mut kernel_args!(table, tokens, x, h, v0, vn),
                )?;
                self.all_reduce(&self.bufs.x, t * c.hidden)?;
            }
            _ => self
                .pp_comm()?
                .recv_f32(&self.gpu, &self.bufs.x, t * c.hidden, stage - 1)?,
        }
        let (n_heads, n_kv, hd) = (c.n_heads as i32, c.n_kv_heads as i32, c.head_dim as i32);
        let rot = c.rope.dim as i32;
        let neox = matches!(c.rope.layout, RopeLayout::Neox) as i32;
        let rope_table = self.rope_table.ptr();
        let bs = self.kv.block_size as i32;
        let max_blocks = self.limits.max_blocks(self.kv.block_size) as i32;
        let fp8 = self.kv.dtype == KvCacheDtype::Fp8E4m3;
        let scale = 1.0f32 / (c.head_dim as f32).sqrt();
        let (part_acc, part_ml) = (self.bufs.part_acc.ptr(), self.bufs.part_ml.ptr());
        let qkv_rope = self.qkv_rope_kernel(t);
        // Norms carried between GEMVs (norms_in_gemvs): norm i's sums, i = 2 * layer (attention)
        // or 2 * layer + 1 (MLP); the first layer's attention norm stays a kernel.
        let gemv_norms = self.norms_in_gemvs(t);
        let sums_at = self.bufs.norm_sums.ptr();
        let sums = |i: usize| sums_at + (i * NORM_SUMS_BYTES) as u64;
        if gemv_norms.is_some() {
            self.gpu.zero(&self.bufs.norm_sums, 0, self.bufs.norm_sums.bytes())?;
        }
        let no_weight = 0u64;
        for li in 0..c.n_layers {
            let lw = &self.weights.layers[li];
            let (wqkv, wo, wgu, wdown) = (lw.wqkv.ptr(), lw.wo.ptr(), lw.w_gate_up.ptr(), lw.w_down.ptr());
            let bias = lw.bqkv.as_ref().map(|b| b.ptr()).unwrap_or(0);
            let qn = lw.q_norm.as_ref().map(|b| b.ptr()).unwrap_or(0);
            let kn = lw.k_norm.as_ref().map(|b| b.ptr()).unwrap_or(0);
            // The norms' weights are folded into wqkv and w_gate_up (weights.rs).
            let attn_norm_in = if li == 0 {
                self.launch(
                    "rms_norm",
                    grid_t,
                    ROW_THREADS,
                    0,
                    &mut kernel_args!(x, no_weight, xn, h, eps),
                )?;
                0
            } else if gemv_norms.is_some() {
                sums(2 * li)
            } else {
                self.add_rms_norm(t)?;
                0
            };
            let (kc, vc, ks, vs) = self.kv.layer(li);
            if let Some(kernel) = qkv_rope {
                let (k, t32) = (c.hidden as i32, t as i32);
                self.launch(
                    kernel,
                    ((width / 2) as u32, 1, 1),
                    GEMV_THREADS as u32,
                    0,
                    &mut kernel_args!(
                        wqkv,
                        xn,
                        qkv,
                        k,
                        t32,
                        bias,
                        positions,
                        rope_table,
                        n_heads,
                        n_kv,
                        hd,
                        rot,
                        neox,
                        slots,
                        kc,
                        vc,
                        bs,
                        attn_norm_in,
                        eps
                    ),
                )?;
            } else {
                let shape = (width as usize, c.hidden, t);
                match gemv_norms {
                    Some(g) => self.gemv(g.plain, wqkv, xn, qkv, shape, GemmOut::Bf16, attn_norm_in)?,
                    None => self.matmul(wqkv, xn, qkv, shape, GemmOut::Bf16)?,
                }
                let rope_kernel = if fp8 {
                    "qkv_rope_kv_write_fp8"
                } else {
                    "qkv_rope_kv_write_bf16"
                };
                self.launch(
                    rope_kernel,
                    (t as u32, c.n_kv_heads as u32, 1),
                    rope_block_threads(c.n_heads / c.n_kv_heads),
                    0,
                    &mut kernel_args!(
                        qkv, bias, qn, kn, positions, rope_table, n_heads, n_kv, hd, rot, neox, eps, slots, kc, vc, ks,
                        vs, bs
                    ),
                )?;
            }
            // Prompt chunks re-read their context from L2, where more resident blocks beat
            // deeper staging (1,198 vs 902 us a 4096-token chunk on an H200).
            let (kernel, stages) = match self.staged_attention {
                Some(staged) if t > SPLIT_MAX_TOKENS && self.decode_bucket.is_some() => staged,
                _ => (self.attention_kernel, 0),
            };
            let call = AttentionCall {
                q: qkv,
                q_stride: width,
                k_cache: kc,
                v_cache: vc,
                k_scale: ks,
                v_scale: vs,
                block_tables: tables,
                max_blocks,
                token_seq,
                positions,
                out: attn,
                part_acc,
                part_ml,
                n_kv,
                block_size: bs,
                scale,
                stages: stages as i32,
                tokens: t,
                parts: parts as i32,
                n_heads: c.n_heads,
                head_dim: c.head_dim,
                fp8,
            };
            call.launch_with(kernel, |name, grid, threads, shared, args| {
                self.launch(name, grid, threads, shared, args)
            })?;
            let mlp_norm_in = if let Some(g) = gemv_norms {
                self.gemv_residual(g, wo, attn, (c.hidden, c.q_dim(), t), sums(2 * li + 1))?;
                sums(2 * li + 1)
            } else {
                self.row_parallel(wo, attn, (c.hidden, c.q_dim(), t))?;
                self.add_rms_norm(t)?;
                0
            };
            if let Some(g) = self.gemv_for(t, c.hidden) {
                let (inter32, k, t32) = (c.intermediate as i32, c.hidden as i32, t as i32);
                self.launch(
                    g.silu,
                    (c.intermediate as u32, 1, 1),
                    GEMV_THREADS as u32,
                    0,
                    &mut kernel_args!(wgu, xn, act, inter32, k, t32, mlp_norm_in, eps),
                )?;
            } else {
                self.matmul(wgu, xn, gate_up, (2 * c.intermediate, c.hidden, t), GemmOut::Bf16)?;
                let inter32 = c.intermediate as i32;
                self.launch(
                    "silu_mul",
                    ((c.intermediate / 8).div_ceil(256) as u32, t as u32, 1),
                    256,
                    0,
                    &mut kernel_args!(gate_up, act, inter32),
                )?;
            }
            if let Some(g) = gemv_norms {
                self.gemv_residual(g, wdown, act, (c.hidden, c.intermediate, t), sums(2 * li + 2))?;
            } else {
                self.row_parallel(wdown, act, (c.hidden, c.intermediate, t))?;
            }
        }
        if gemv_norms.is_none() {
            self.launch("add_residual", grid_t, ROW_THREADS, 0, &mut kernel_args!(x, proj, h))?;
        }
        if !self.shard.is_last_stage() {
            self.pp_comm()?
                .send_f32(&self.gpu, &self.bufs.x, t * c.hidden, stage + 1)?;
        }
        Ok(())
    }

    /// This shard's pipeline stage (its rank in the pipeline communicator).
    fn shard_stage(&self) -> usize {
        self.comms.pp.as_ref().map(|c| c.rank).unwrap_or(0)
    }

    fn pp_comm(&self) -> Result<&Communicator, CudaError> {
        self.comms
            .pp
            .as_ref()
            .ok_or_else(|| CudaError::NoDevice("a pipeline stage without its communicator".into()))
    }

    /// Sums `count` f32 values of `buf` over the TP group (nothing on one GPU).
    fn all_reduce(&self, buf: &DeviceBuffer, count: usize) -> Result<(), CudaError> {
        match &self.comms.tp {
            Some(comm) => {
                let t = self.profile_start()?;
                comm.all_reduce_sum_f32(&self.gpu, buf, count)?;
                self.profile_end(t, || "nccl all-reduce".to_string())
            }
            None => Ok(()),
        }
    }

    /// `proj = x · wᵀ` of a row-parallel weight (attention output, MLP down), summed over the TP
    /// group: NCCL's all-reduce, or under `--deterministic` a gather and the fixed-order tree.
    fn row_parallel(&mut self, w: u64, x: u64, (n, k, t): (usize, usize, usize)) -> Result<(), CudaError> {
        let proj = self.bufs.proj.ptr();
        let tp = self.shard.tp_size;
        if !self.deterministic {
            self.matmul(w, x, proj, (n, k, t), GemmOut::F32)?;
            return self.all_reduce(&self.bufs.proj, t * n);
        }
        self.gemm_fixed_order(w, x, proj, (n, k, t), DETERMINISTIC_CHUNKS / tp, GemmOut::F32)?;
        let (Some(comm), Some(gathered)) = (&self.comms.tp, &self.bufs.gathered) else {
            return Ok(());
        };
        let timer = self.profile_start()?;
        comm.all_gather_f32(&self.gpu, &self.bufs.proj, gathered, t * n)?;
        self.profile_end(timer, || "nccl all-gather".to_string())?;
        let (parts, count, ranks) = (gathered.ptr(), (t * n) as i64, tp as i32);
        let blocks = ((t * n) as u64).div_ceil(256).min(65535) as u32;
        self.launch(
            "sum_ranks",
            (blocks, 1, 1),
            256,
            0,
            &mut kernel_args!(parts, proj, count, ranks),
        )
    }

    /// `y = x · wᵀ` by `gemm_fixed_order`, its reduction cut into `chunks` parts.
    fn gemm_fixed_order(
        &self,
        w: u64,
        x: u64,
        y: u64,
        (n, k, t): (usize, usize, usize),
        chunks: usize,
        out: GemmOut,
    ) -> Result<(), CudaError> {
        if t == 0 {
            return Ok(());
        }
        let grid = (n.div_ceil(FO_WARPS) as u32, t.div_ceil(FO_TOKENS) as u32, 1);
        let (n, k, t, chunks, f32_out) = (
            n as i32,
            k as i32,
            t as i32,
            chunks as i32,
            (out == GemmOut::F32) as i32,
        );
        self.launch(
            "gemm_fixed_order",
            grid,
            (FO_WARPS * 32) as u32,
            0,
            &mut kernel_args!(w, x, y, n, k, t, chunks, f32_out),
        )
    }

    /// Final norm and LM head of logits rows `first..first + n` (at most `logit_rows`), into the
    /// logits buffer, then the rows' bias and masks when `adjust` (uploaded), then their argmax.
    fn logits_chunk(&mut self, first: usize, n: usize, adjust: bool) -> Result<(), CudaError> {
        let c = &self.local;
        let rows = self.bufs.inputs.at((self.layout.rows + first) * 4);
        let (x, norm, normed, logits) = (
            self.bufs.x.ptr(),
            self.weights.output_norm.ptr(),
            self.bufs.normed.ptr(),
            self.bufs.logits.ptr(),
        );
        let (h, eps) = (c.hidden as i32, c.rms_eps);
        let (vocab, hidden) = (c.vocab_size, c.hidden);
        self.launch(
            "rms_norm_rows",
            (n as u32, 1, 1),
            ROW_THREADS,
            0,
            &mut kernel_args!(x, rows, norm, normed, h, eps),
        )?;
        let lm = match self.weights.lm_head() {
            Some(b) => b.ptr(),
            None => {
                return Err(CudaError::NoDevice(
                    "logits asked of a stage without the LM head".into(),
                ))
            }
        };
        self.matmul(lm, normed, logits, (vocab, hidden, n), GemmOut::F32)?;
        let (ids, vals, v) = (
            self.bufs.argmax.ptr(),
            self.bufs.argmax.at(self.limits.logit_rows * 4),
            vocab as i32,
        );
        let (part_vals, part_ids) = (
            self.bufs.argmax_parts.ptr(),
            self.bufs.argmax_parts.at(self.limits.logit_rows * ARGMAX_SLICES * 4),
        );
        let sampling = self.bufs.inputs.at((self.layout.sampling + SAMPLING_WORDS * first) * 4);
        let sampling_limits = self.bufs.sampling_limits.ptr();
        let vocab_start = self.shard.vocab(&self.config).start as i32;
        if adjust {
            let call = self.adjusts.call(logits, vocab, vocab_start as usize, first, n);
            call.launch_with(|name, grid, threads, shared, args| self.launch(name, grid, threads, shared, args))?;
        }
        self.launch(
            "sampling_limits",
            (n as u32, 1, 1),
            LIMIT_THREADS,
            0,
            &mut kernel_args!(logits, v, sampling, sampling_limits),
        )?;
        self.launch(
            "argmax_slices",
            (n as u32, ARGMAX_SLICES as u32, 1),
            256,
            0,
            &mut kernel_args!(logits, v, part_vals, part_ids, sampling, sampling_limits, vocab_start),
        )?;
        self.launch(
            "argmax_merge",
            (n as u32, 1, 1),
            32,
            0,
            &mut kernel_args!(part_vals, part_ids, ids, vals),
        )
    }

    /// Empty logits of this shard's vocabulary width.
    fn no_logits(&self) -> ShardLogits {
        ShardLogits {
            logits: Logits {
                vocab: self.local.vocab_size,
                ..Default::default()
            },
            argmax_values: Vec::new(),
        }
    }

    /// Copies the wanted results to the host: the argmax of argmax-only rows, whole rows of the
    /// others (running the LM head in chunks unless a captured step already did). Stages other
    /// than the last only wait for their work.
    fn collect_logits(
        &mut self,
        plan: &StepPlan,
        computed: bool,
        adjusted: Option<usize>,
    ) -> Result<ShardLogits, CudaError> {
        let mut out = self.no_logits();
        if !self.shard.is_last_stage() {
            self.gpu.sync()?;
            return Ok(out);
        }
        let vocab = self.local.vocab_size;
        let vocab_start = self.shard.vocab(&self.config).start as u32;
        let r = plan.rows.len();
        let lr = self.limits.logit_rows;
        let mut words = vec![0u32; 2 * lr];
        // A captured decode step computed one row per (padded) token, row j = token j, with the
        // real tokens first.
        let chunk = if computed { r.max(1) } else { self.limits.logit_rows };
        let mut first = 0;
        while first < r {
            let n = chunk.min(r - first);
            if !computed {
                if let (Some(set), 0) = (adjusted, first) {
                    self.adjusts.upload(&self.gpu, set)?;
                }
                self.logits_chunk(first, n, adjusted.is_some())?;
            }
            // The ids and the logits of this chunk's rows: [0, n) and [lr, lr + n).
            self.gpu.read(&self.bufs.argmax, 0, &mut words[..lr + n])?;
            for (j, &(seq, pos, _, whole)) in plan.rows.iter().enumerate().skip(first).take(n) {
                if whole {
                    let start = out.logits.data.len();
                    out.logits.data.resize(start + vocab, 0.0);
                    self.gpu.read(
                        &self.bufs.logits,
                        (j - first) * vocab * 4,
                        &mut out.logits.data[start..],
                    )?;
                    out.logits.rows.push((seq, pos));
                } else {
                    out.logits.argmax.push((seq, vocab_start + words[j - first]));
                    out.argmax_values.push(f32::from_bits(words[lr + j - first]));
                }
            }
            first += n;
        }
        Ok(out)
    }

    fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), CudaError> {
        if self.ablated(name) {
            return Ok(());
        }
        let name = match self.weights.dtype {
            ComputeDtype::Bf16 => name,
            ComputeDtype::F32 => F32_TWINS.iter().find(|(b, _)| *b == name).map_or(name, |(_, f)| f),
        };
        let t = self.profile_start()?;
        // SAFETY: each call site passes the arguments of the kernel's signature in its .cu file,
        // with device pointers into buffers sized for the step limits that `validate` enforces.
        unsafe { self.gpu.launch(self.kernels.get(name), grid, block, shared, args) }?;
        self.profile_end(t, || name.to_string())
    }

    /// Whether `bench-gpu --ablate` leaves the kernel or product `name` out.
    fn ablated(&self, name: &str) -> bool {
        self.ablate.iter().any(|a| name.contains(a.as_str()))
    }

    fn profile_phase(&self, name: &'static str) {
        if let Some(p) = &self.profile {
            p.phase_ends(name);
        }
    }

    fn profile_start(&self) -> Result<Option<Event>, CudaError> {
        match &self.profile {
            Some(p) if !self.capturing => p.start(&self.gpu).map(Some),
            _ => Ok(None),
        }
    }

    fn profile_end(&self, start: Option<Event>, name: impl FnOnce() -> String) -> Result<(), CudaError> {
        match (start, &self.profile) {
            (Some(start), Some(p)) => {
                let kind = match self.decode_bucket {
                    // Large decode steps apart: their per-call times are the steady state of
                    // many users.
                    Some(b) if b >= PROFILE_BUCKET_APART => format!("decode x{b}"),
                    Some(_) => "decode".to_string(),
                    None => "prefill".to_string(),
                };
                p.end(&self.gpu, start, format!("{} ({kind})", name()))
            }
            _ => Ok(()),
        }
    }

    /// The GEMV kernels for a product of `t` tokens over `k`, when they apply: bf16 weights, not
    /// under `--deterministic`, k a multiple of 8.
    fn gemv_for(&self, t: usize, k: usize) -> Option<&'static GemvKernels> {
        if self.deterministic
            || self.weights.dtype != ComputeDtype::Bf16
            || t == 0
            || t > self.gemv_max_tokens
            || !k.is_multiple_of(8)
        {
            return None;
        }
        GEMV_KERNELS.iter().find(|g| g.tokens >= t)
    }

    /// `gemv_qkv_rope_t{T}` for a step of `t` tokens when the QKV product may do the RoPE and
    /// cache write itself: a GEMV-sized step, a bf16 cache, no per-head q/k norm (Qwen3), even
    /// head and rotary widths.
    fn qkv_rope_kernel(&self, t: usize) -> Option<&'static str> {
        let c = &self.local;
        let applies = self.fuse_rope
            && self.kv.dtype != KvCacheDtype::Fp8E4m3
            && !c.qk_norm
            && c.head_dim.is_multiple_of(2)
            && c.rope.dim.is_multiple_of(2)
            && c.rope.dim <= c.head_dim;
        if !applies {
            return None;
        }
        self.gemv_for(t, c.hidden).map(|g| g.qkv_rope)
    }

    /// The GEMVs of a step of `t` tokens when it carries its RMSNorms between them instead of
    /// running norm kernels (gemm.cu's gemv_residual and NormIn): every product of the layer is
    /// a GEMV, and the o and down outputs are whole on this GPU (no TP all-reduce before the
    /// residual).
    fn norms_in_gemvs(&self, t: usize) -> Option<&'static GemvKernels> {
        let c = &self.local;
        if !self.fuse_norm || self.comms.tp.is_some() {
            return None;
        }
        // The kernels depend on `t` alone; every k of the layer must allow them.
        let g = self.gemv_for(t, c.hidden)?;
        [c.q_dim(), c.intermediate]
            .iter()
            .all(|&k| self.gemv_for(t, k).is_some())
            .then_some(g)
    }

    /// `y = x · wᵀ` by a decode GEMV, its dot products scaled by the norm whose sums are at
    /// `norm_in` (0: none).
    #[allow(clippy::too_many_arguments)]
    fn gemv(
        &self,
        kernel: &str,
        w: u64,
        x: u64,
        y: u64,
        (n, k, t): (usize, usize, usize),
        out: GemmOut,
        norm_in: u64,
    ) -> Result<(), CudaError> {
        let (n32, k32, t32, f32_out, eps) = (
            n as i32,
            k as i32,
            t as i32,
            (out == GemmOut::F32) as i32,
            self.local.rms_eps,
        );
        self.launch(
            kernel,
            (n.div_ceil(2) as u32, 1, 1),
            GEMV_THREADS as u32,
            0,
            &mut kernel_args!(w, x, y, n32, k32, t32, f32_out, norm_in, eps),
        )
    }

    /// `x += proj` and `xn = rms_norm(x)` over the step's `t` rows, without weights: the norms'
    /// weights are folded into the matrices that read `xn` (weights.rs).
    fn add_rms_norm(&self, t: usize) -> Result<(), CudaError> {
        let (x, proj, xn, no_weight) = (self.bufs.x.ptr(), self.bufs.proj.ptr(), self.bufs.xn.ptr(), 0u64);
        let (h, eps) = (self.local.hidden as i32, self.local.rms_eps);
        self.launch(
            "add_rms_norm",
            (t as u32, 1, 1),
            ROW_THREADS,
            0,
            &mut kernel_args!(x, proj, no_weight, xn, h, eps),
        )
    }

    /// The residual `x += a · wᵀ` of a step whose norms ride the GEMVs `g`, its bf16 copy into
    /// `xn` and its sums of squares into `norm_out`.
    fn gemv_residual(
        &self,
        g: &GemvKernels,
        w: u64,
        a: u64,
        (n, k, t): (usize, usize, usize),
        norm_out: u64,
    ) -> Result<(), CudaError> {
        let (x, xn) = (self.bufs.x.ptr(), self.bufs.xn.ptr());
        let (n32, k32, t32) = (n as i32, k as i32, t as i32);
        self.launch(
            g.residual,
            (n.div_ceil(2) as u32, 1, 1),
            GEMV_THREADS as u32,
            0,
            &mut kernel_args!(w, a, x, xn, norm_out, n32, k32, t32),
        )
    }

    /// `y = x · wᵀ` of `shape` (n, k, t): a GEMV, the fixed-order GEMM or cuBLASLt; `out` is the
    /// output's type with bf16 weights (f32 is f32 throughout).
    fn matmul(&mut self, w: u64, x: u64, y: u64, shape: (usize, usize, usize), out: GemmOut) -> Result<(), CudaError> {
        let out = match self.weights.dtype {
            ComputeDtype::Bf16 => out,
            ComputeDtype::F32 => GemmOut::F32,
        };
        if self.deterministic {
            return self.gemm_fixed_order(w, x, y, shape, DETERMINISTIC_CHUNKS, out);
        }
        if let Some(g) = self.gemv_for(shape.2, shape.1) {
            return self.gemv(g.plain, w, x, y, shape, out, 0);
        }
        if !self.ablate.is_empty() && self.ablated(&format!("gemm {}x{}", shape.0, shape.1)) {
            return Ok(());
        }
        let t = self.profile_start()?;
        // SAFETY: the weight and activation buffers hold the shapes given (see `new`).
        unsafe { self.gemm.matmul(&self.gpu, w, x, y, shape, out) }?;
        let bucket = if shape.2 <= 8 {
            "t<=8"
        } else if shape.2 <= 256 {
            "t<=256"
        } else {
            "t>256"
        };
        self.profile_end(t, || format!("gemm {}x{} {bucket}", shape.0, shape.1))
    }
}

/// Checks `bench-gpu --ablate`'s entries: each must name (a part of) a kernel of the .cu files or
/// a cuBLASLt product as the GPU profile prints it (`gemm NxK`, n outputs of k inputs).
pub fn check_ablation(entries: &[String]) -> Result<(), String> {
    for e in entries {
        let product = e
            .strip_prefix("gemm ")
            .and_then(|shape| shape.split_once('x'))
            .is_some_and(|(n, k)| {
                !n.is_empty() && !k.is_empty() && n.bytes().chain(k.bytes()).all(|b| b.is_ascii_digit())
            });
        let kernel = !e.is_empty()
            && FAMILIES
                .iter()
                .flat_map(|(_, _, names)| names.iter())
                .any(|name| name.contains(e.as_str()));
        if !product && !kernel {
            return Err(format!(
                "--ablate {e:?} names no kernel or product; use a kernel name or part of one (paged_attention, \
                 qkv_rope, add_rms_norm, silu_mul, ...) or a cuBLASLt product as the GPU profile prints it \
                 (\"gemm 4096x4096\")"
            ));
        }
    }
    Ok(())
}

/// rope.cu gives each lane head_dim / 32 consecutive dims: a rotation's partner must be in the
/// same lane or, for halves, a whole number of lanes away.
fn rope_fits_the_lanes(c: &ModelConfig) -> Result<(), String> {
    let per = (c.head_dim / 32).max(1);
    let fits = match c.rope.layout {
        RopeLayout::Neox => c.rope.dim.is_multiple_of(2 * per),
        RopeLayout::Interleaved => per == 1 || per.is_multiple_of(2),
    };
    if fits {
        return Ok(());
    }
    Err(format!(
        "rotary embeddings over {} of {} dims ({:?} layout) are not supported by the CUDA RoPE kernel \
         (halves: rotary dims a multiple of head_dim / 16; adjacent pairs: head_dim / 32 of 1 or even); \
         use --device cpu",
        c.rope.dim, c.head_dim, c.rope.layout
    ))
}

/// A logits row's SAMPLING_WORDS parameters: zeros (the argmax) unless the row is sampled.
pub fn sampling_words(wanted: LogitsWanted) -> [i32; SAMPLING_WORDS] {
    let LogitsWanted::LastSampled(s) = wanted else {
        return [0; SAMPLING_WORDS];
    };
    [
        (1.0 / s.temperature).to_bits(),
        s.seed as u32,
        (s.seed >> 32) as u32,
        s.top_k,
        s.top_p.to_bits(),
        s.min_p.to_bits(),
    ]
    .map(|w| w as i32)
}

/// The padded batch size a decode step of `n` sequences runs as a graph: powers of two up to 8,
/// then multiples of 8 up to 64, then of 32; `None` past `max`.
pub fn graph_bucket(n: usize, max: usize) -> Option<usize> {
    let b = if n <= 8 {
        n.next_power_of_two()
    } else if n <= 64 {
        n.next_multiple_of(8)
    } else {
        n.next_multiple_of(32)
    };
    (b <= max).then_some(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ablation_names_kernels_or_cublaslt_products() {
        let ok = |e: &[&str]| check_ablation(&e.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        for good in [
            &["paged_attention"][..],
            &["qkv_rope", "add_rms_norm", "silu_mul"],
            &["gemm 4096x4096", "gemm 28672x4096"],
            &["paged_attention_staged_bf16"],
        ] {
            assert!(ok(good).is_ok(), "{good:?}");
        }
        for bad in [
            &[""][..],
            &["nonsense"],
            &["gemm 4096"],
            &["gemm x4096"],
            &["gemm 4096x"],
            &["silu_mul", "gemm ax4"],
        ] {
            let err = ok(bad).unwrap_err();
            assert!(err.contains("names no kernel") && !err.contains('\n'), "{bad:?}: {err}");
        }
    }
}
