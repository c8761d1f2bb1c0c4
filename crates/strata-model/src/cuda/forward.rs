//! A llama-family decoder (or one GPU's shard of it under TP/PP) resident on one GPU: the
//! `GpuTransformer` that owns it and the one entry of a step, `forward`.
//!
//! The concerns of a step live beside this file: `step_inputs` (staging), `step_buffers`,
//! `layers` (the forward pass), `logits`, `graphs`, `overlap` (started decode steps), `tuning`,
//! `launch` (profiling and ablation) and `knobs` (the `STRATA_*` measurement switches).

use std::collections::HashMap;

use strata_runtime::cpu::ops::RopeLayout;
use strata_runtime::cuda::gemm_call::GEMV_KERNEL_TOKENS;
use strata_runtime::cuda::norm_call::ROW_THREADS;
use strata_runtime::cuda::{
    Communicator, CudaError, Fp8Gemv, Gemm, GemmOperands, Gpu, Graph, KernelSpec, Kernels, QuantizeQ8Call,
};

use crate::batch::{Logits, LogitsWanted, SeqChunk};
use crate::config::{rope_cos_sin_table, ModelConfig};
use crate::error::ModelError;
use crate::kv_cache::KvCacheDtype;

use super::fp8_matmul::fp8_act_scales_offset;
use super::graphs::graph_bucket;
use super::knobs::GpuKnobs;
use super::kv_cache::GpuKvCache;
use super::layers::AttentionKernels;
use super::overlap::OverlapState;
use super::profile::KernelProfile;
use super::row_adjust::RowAdjusts;
use super::shard::Shard;
use super::step_buffers::{StepBuffers, QGEMM_PARTS_VALUES};
use super::step_inputs::StepInputs;
use super::weights::{ComputeDtype, GpuWeights};

pub use super::launch::check_ablation;
pub use super::overlap::StartedDecode;
pub use super::step_inputs::{sampling_words, StepLimits};

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
    pub(super) kernels: Kernels,
    pub(super) gemm: Gemm,
    /// cos and sin of every rotated pair at every position up to `max_model_len`
    /// ([`rope_cos_sin_table`]), read by rope.cu and the QKV GEMV.
    pub(super) rope_table: strata_runtime::cuda::DeviceBuffer,
    pub(super) limits: StepLimits,
    pub(super) inputs: StepInputs,
    pub(super) bufs: StepBuffers,
    pub(super) attention: AttentionKernels,
    pub(super) knobs: GpuKnobs,
    /// Decode graphs by padded batch size and whether they compute the logits (steps with
    /// adjusted rows compute them after the graph, once the host's masks are in).
    pub(super) graphs: HashMap<(usize, bool), Graph>,
    /// Decode steps started and not yet read back.
    pub(super) overlap: OverlapState,
    /// Logit bias and grammar masks of the rows that have them.
    pub(super) adjusts: RowAdjusts,
    /// Capture decode steps as CUDA graphs (off with `--enforce-eager`).
    pub use_graphs: bool,
    /// Fixed-order GEMMs and reductions (see [`GpuTransformer::set_deterministic`]).
    pub(super) deterministic: bool,
    /// `STRATA_GPU_PROFILE`: the GPU time of every kernel of eager steps, printed when the
    /// model is dropped.
    pub(super) profile: Option<KernelProfile>,
    pub(super) capturing: bool,
    /// The bucket of the decode step being launched, if it only decodes (names the profile's
    /// entries and picks the staged attention kernel).
    pub(super) decode_bucket: Option<usize>,
    /// `bench-gpu --ablate`: kernels (a name or part of one) and cuBLASLt products (`gemm NxK`)
    /// left out of every step, to time what each costs inside a graph; outputs are then wrong.
    pub ablate: Vec<String>,
    /// The quantized GEMVs read two int8 passes of their inputs (`--activation-precision high`).
    pub two_pass_activations: bool,
    /// cuBLASLt on FP8 operands for the FP8 matrices' larger products, where the GPU has FP8
    /// tensor cores (compute capability 8.9 on); `None` runs them weight-only in bf16.
    pub(super) fp8_gemm: Option<Gemm>,
    /// cuBLASLt applies the FP8 products' weight-row and token scales itself (opt-in by
    /// `STRATA_FP8_OUTER_SCALES=1`, off again once cuBLASLt refuses them); otherwise fp8.cu's
    /// kernel does.
    pub(super) fp8_outer_scales: bool,
    /// `(x, k, t)`: the FP8 activation buffer already holds x's t rows of k as E4M3, written by
    /// the kernel before the FP8 product that reads them (a norm, `silu_mul_fp8`); taken by
    /// that product, which then quantizes nothing.
    pub(super) fp8_rows_ready: Option<(u64, usize, usize)>,
    /// An output still in the quantized GEMMs' parts buffer as unsummed k splits: `proj` (a
    /// row-parallel product without TP; the next norm adds them) or `qkv` (rope.cu adds them).
    /// It saves `qgemm_reduce`'s launch and a round trip of the output through memory.
    pub(super) split_sums: Option<SplitSums>,
    /// Tiles of `paged_attention_prefill_*` the staged step's inputs hold.
    pub(super) prompt_tiles: usize,
}

/// A product's output left as `splits` partial sums at `parts` (`[splits, t, n]` f32) instead
/// of at `y`.
#[derive(Debug, Clone, Copy)]
pub(super) struct SplitSums {
    pub y: u64,
    pub parts: u64,
    pub splits: i32,
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
        let mut knobs = GpuKnobs::from_env();
        // fp8.cu's tensor-core GEMVs need mma.sync on f16 (sm_80+).
        if gpu.info.compute_capability < (8, 0) {
            knobs.fp8_gemv = Fp8Gemv::Lanes;
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
        let bf16 = weights.dtype == ComputeDtype::Bf16;
        let attention = AttentionKernels::choose(&gpu, &local, bf16, fp8, &knobs);
        let gemm = Gemm::new(&gpu, if bf16 { GemmOperands::Bf16 } else { GemmOperands::F32 })?;
        let table = rope_cos_sin_table(&config.rope.inv_freq(), limits.max_model_len);
        let rope_table = gpu.upload(&table, "the RoPE cos/sin table")?;
        let inputs = StepInputs::new(&gpu, &limits, kv.block_size)?;
        let mut bufs = StepBuffers::new(&gpu, &local, &limits, inputs.layout.len, weights.dtype.bytes())?;
        if weights.dequant_elems > 0 {
            bufs.dequant = Some(gpu.alloc(weights.dequant_elems * 2, "dequantized weights")?);
            // The quantized GEMVs' int8 inputs: GEMV_KERNEL_TOKENS rows of the widest input.
            let k = local.widest_product_input();
            let what = "quantized activations";
            bufs.x_q8 = Some(gpu.alloc(QuantizeQ8Call::value_bytes(k, GEMV_KERNEL_TOKENS), what)?);
            bufs.x_q8_scales = Some(gpu.alloc(QuantizeQ8Call::scale_bytes(k, GEMV_KERNEL_TOKENS), what)?);
            if knobs.quant_gemm_max_tokens > 0 {
                bufs.qgemm_parts = Some(gpu.alloc(QGEMM_PARTS_VALUES * 4, "quantized GEMM sums")?);
            }
        }
        let fp8_gemm = match weights.has_fp8() && gpu.info.compute_capability >= (8, 9) {
            true => {
                let width = local.widest_product_input();
                let bytes = fp8_act_scales_offset(limits.max_tokens, width) + limits.max_tokens * 4;
                bufs.fp8_act = Some(gpu.alloc(bytes, "FP8 activations")?);
                let mut g = Gemm::new(&gpu, GemmOperands::Fp8E4m3)?;
                g.set_fp8_fast_accum(knobs.fp8_fast_accum);
                Some(g)
            }
            false => None,
        };
        let adjusts = RowAdjusts::new(
            &gpu,
            config.vocab_size,
            limits.max_tokens.max(limits.logit_rows),
            limits.max_seqs,
        )?;
        let overlap = OverlapState::new(&gpu, &limits)?;
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
            inputs,
            bufs,
            attention,
            graphs: HashMap::new(),
            overlap,
            adjusts,
            use_graphs: true,
            deterministic: false,
            profile: KernelProfile::when(knobs.profile),
            knobs,
            capturing: false,
            decode_bucket: None,
            ablate: Vec::new(),
            two_pass_activations: false,
            fp8_gemm,
            fp8_outer_scales: knobs.fp8_outer_scales,
            fp8_rows_ready: None,
            split_sums: None,
            prompt_tiles: 0,
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
        self.limits.check(batch, &self.config, &self.kv)?;
        let gpu_err = |e: CudaError| ModelError::Device(e.to_string());
        self.gpu.bind().map_err(gpu_err)?;
        // Decode-shaped steps, where every token is a logits row (one token a sequence, or a
        // speculative verification chunk of a sequence's draft tokens, each attending to the
        // keys up to its own position), run padded to a bucket size, captured as a graph or
        // eagerly: the same shapes either way, so the same numbers.
        let decode = !batch.is_empty()
            && batch.iter().all(|c| match c.logits {
                LogitsWanted::Last | LogitsWanted::LastArgmax | LogitsWanted::LastSampled(_) => c.tokens.len() == 1,
                LogitsWanted::All | LogitsWanted::AllArgmax => !c.tokens.is_empty(),
                _ => false,
            });
        let rows: usize = batch.iter().map(|c| c.tokens.len()).sum();
        let bucket = if decode {
            graph_bucket(rows, self.limits.max_seqs)
        } else {
            None
        };
        self.decode_bucket = bucket;
        let padded = bucket.unwrap_or_else(|| batch.iter().map(|c| c.tokens.len()).sum());
        let max_blocks = self.limits.max_blocks(self.kv.block_size);
        let step = self
            .inputs
            .stage(batch, padded, max_blocks, &self.kv, bucket.is_none())
            .map_err(gpu_err)?;
        if step.tokens == 0 {
            return Ok(self.no_logits());
        }
        let logit_rows = bucket.unwrap_or(step.rows.len());
        let adjusted = match self.shard.is_last_stage() {
            true => self
                .adjusts
                .stage(batch, step.rows.iter().map(|r| r.seq), logit_rows)
                .map_err(gpu_err)?,
            false => None,
        };
        self.inputs.upload(&self.gpu, &self.bufs.inputs).map_err(gpu_err)?;
        // The argmax buffer is about to hold this step's ids.
        self.overlap.argmax_rows_of_started = None;
        self.profile_phase("stage and upload inputs");
        match bucket {
            Some(b) => {
                self.run_decode(b, adjusted.is_some()).map_err(gpu_err)?;
                if let Some(set) = adjusted {
                    self.adjusted_logits(b, set).map_err(gpu_err)?;
                }
                self.profile_phase("launch (graph or eager kernels)");
                self.collect_logits(&step, true, adjusted).map_err(gpu_err)
            }
            None => {
                // Parts of fewer than 32 keys only cost their merge.
                let parts = self.attention_parts(step.tokens).min(step.max_ctx.div_ceil(32));
                self.prompt_tiles = step.tiles;
                self.layers(step.tokens, parts).map_err(gpu_err)?;
                self.profile_phase("launch (graph or eager kernels)");
                self.collect_logits(&step, false, adjusted).map_err(gpu_err)
            }
        }
    }
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
