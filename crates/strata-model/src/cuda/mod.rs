//! The CUDA executor (feature `cuda`): a model's weights, KV cache and forward pass on one GPU,
//! sized by `--gpu-memory-utilization` after measuring the activation peak.

pub mod forward;
mod fp8_matmul;
mod graphs;
mod knobs;
pub mod kv_cache;
mod launch;
mod layers;
mod logits;
mod overlap;
pub mod profile;
pub mod row_adjust;
pub mod shard;
mod step_buffers;
mod step_inputs;
mod tuning;
pub mod weights;

use std::collections::VecDeque;

use strata_runtime::cpu::ActPrecision;
use strata_runtime::cuda::libraries::LibrarySearch;
use strata_runtime::cuda::{CudaError, Gpu};

use crate::batch::{Logits, LogitsWanted, SeqChunk};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::executor::{Executor, KvLayout};
use crate::kv_cache::KvCacheDtype;
use crate::transformer::Transformer;

pub use forward::{check_ablation, GpuTransformer, ShardComms, ShardLogits, StartedDecode, StepLimits};
pub use shard::Shard;
pub use weights::{ComputeDtype, GpuQuantization};

/// How to place a model on a GPU.
#[derive(Debug, Clone)]
pub struct GpuOptions {
    pub ordinal: usize,
    /// Fraction of the GPU's memory strata may use in all (weights, activations, KV cache).
    pub gpu_memory_utilization: f64,
    /// Bytes the GPU is sized as if it had (`--gpu-memory-limit`), when less than it has.
    pub gpu_memory_limit: Option<usize>,
    /// Whether GGUF matrices stay quantized (`--quantization`).
    pub quantization: GpuQuantization,
    /// What weights, activations and the `auto` KV cache are (`--dtype`).
    pub dtype: ComputeDtype,
    pub kv_cache_dtype: KvCacheDtype,
    pub block_size: usize,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    /// Never capture CUDA graphs.
    pub enforce_eager: bool,
    /// Fixed-order GEMMs: the same greedy output on one GPU, under TP and under PP (slower; see
    /// [`GpuTransformer::set_deterministic`]).
    pub deterministic: bool,
    /// Kernels and products left out of every step (`bench-gpu --ablate`, timing only; see
    /// [`check_ablation`]).
    pub ablate: Vec<String>,
    /// Activations of the quantized GEMVs (`--activation-precision`, as on the CPU): one int8
    /// pass (`standard`) or two (`high`, ~14 bits).
    pub activation_precision: ActPrecision,
}

impl GpuOptions {
    /// Refuses what `--dtype float32` cannot do, with the fix: it is a one-GPU reference path
    /// (`gpus` is how many the layout spans) whose kernels have no fp8 cache and no fixed-order GEMM.
    pub fn check_dtype(&self, gpus: usize) -> Result<(), ModelError> {
        if self.dtype != ComputeDtype::F32 {
            return Ok(());
        }
        let why = if gpus > 1 {
            format!("runs on one GPU, not {gpus}; use --device cuda:N, or --dtype bfloat16 across GPUs")
        } else if self.kv_cache_dtype == KvCacheDtype::Fp8E4m3 {
            "does not combine with --kv-cache-dtype fp8; drop it or use --dtype bfloat16".to_string()
        } else if self.deterministic {
            "does not combine with --deterministic; drop it or use --dtype bfloat16".to_string()
        } else if self.quantization == GpuQuantization::Fp8 {
            "does not combine with --quantization fp8; drop it or use --dtype bfloat16".to_string()
        } else {
            return Ok(());
        };
        Err(ModelError::Device(format!("--dtype float32 {why}")))
    }
}

/// The model on a GPU, ready for the engine.
pub struct GpuExecutor {
    model: GpuTransformer,
    /// Batches submitted and not yet collected, oldest first.
    submitted: VecDeque<Submitted>,
}

/// A batch handed to [`GpuExecutor::submit`].
enum Submitted {
    /// A decode step of tokens chosen on the GPU, running (overlapped steps).
    Started(StartedDecode),
    /// Any other step, run at once.
    Done(Logits),
}

/// A shard on its GPU with a probe-sized KV cache, and how many KV blocks its memory allows (the
/// multi-GPU executors of strata-parallel load one per worker).
pub struct ProbedShard {
    model: GpuTransformer,
    /// KV blocks that fit in what is left.
    pub blocks: usize,
    budget: usize,
    /// Weights, activations and workspaces.
    used: usize,
    /// The part of `used` that is not strata's own buffers.
    foreign: usize,
}

impl ProbedShard {
    /// Uploads `shard` of `transformer` to `gpu`, measures the activation peak with a full-budget
    /// forward pass (every shard of a TP/PP group runs it together: it includes their
    /// collectives), and works out how many KV blocks the rest of the allowed memory holds.
    pub fn load(
        gpu: Gpu,
        transformer: &Transformer,
        shard: Shard,
        comms: ShardComms,
        opts: &GpuOptions,
        progress: &dyn Fn(u64, u64),
    ) -> Result<ProbedShard, ModelError> {
        let util = opts.gpu_memory_utilization;
        if !(util > 0.0 && util <= 1.0) {
            return Err(ModelError::Device(format!(
                "--gpu-memory-utilization {util} must be in (0, 1]"
            )));
        }
        opts.check_dtype(1)?;
        let c = transformer.config.clone();
        let local = shard.local_config(&c);
        let (free0, total) = gpu.memory().map_err(cuda)?;
        let own0 = gpu.allocated_bytes();
        let card = opts.gpu_memory_limit.map_or(total, |limit| limit.min(total));
        let budget = (card as f64 * util) as usize;
        let weights = weights::GpuWeights::upload(
            &gpu,
            &c,
            &shard,
            &transformer.weights,
            opts.dtype,
            opts.quantization,
            progress,
        )
        .map_err(cuda)?;
        tracing::info!(
            "{} (GPU {}): weight matrices {:.2} GiB on the GPU{} ({:.2} GiB in the file){}",
            gpu.info.name,
            gpu.info.ordinal,
            weights.matrix_bytes as f64 / GIB,
            if weights.has_fp8() { ", layers in FP8 E4M3" } else { "" },
            weights.file_bytes as f64 / GIB,
            opts.gpu_memory_limit.map_or(String::new(), |l| format!(
                ", sized as a {:.1} GiB card (--gpu-memory-limit)",
                l.min(total) as f64 / GIB
            ))
        );
        let limits = StepLimits {
            max_tokens: opts.max_num_batched_tokens.max(opts.max_num_seqs),
            max_seqs: opts.max_num_seqs,
            max_model_len: opts.max_model_len,
            logit_rows: opts.max_num_seqs.max(64),
        };
        // A cache of one sequence to profile the activation peak with; replaced by `allocate`.
        let probe_kv = kv_cache::GpuKvCache::new(
            &gpu,
            &local,
            (opts.kv_cache_dtype, opts.dtype),
            opts.block_size,
            limits.max_model_len.div_ceil(opts.block_size),
        )
        .map_err(cuda)?;
        let probe_kv_bytes = probe_kv.memory_bytes();
        let mut model = GpuTransformer::new(c, shard, comms, gpu, weights, probe_kv, limits).map_err(cuda)?;
        model.use_graphs = false;
        model.set_deterministic(opts.deterministic).map_err(cuda)?;
        let probe_tokens = limits.max_tokens.min(limits.max_model_len);
        let probe = SeqChunk {
            tokens: vec![0; probe_tokens],
            first_pos: 0,
            block_table: (0..probe_tokens.div_ceil(opts.block_size) as u32).collect(),
            logits: LogitsWanted::Last,
            prompt_len: usize::MAX,
            adjust: None,
        };
        model.forward(std::slice::from_ref(&probe))?;
        model.gpu.sync().map_err(cuda)?;
        let (free1, _) = model.gpu.memory().map_err(cuda)?;
        let used = (free0 - free1).saturating_sub(probe_kv_bytes);
        // What the fall in free memory holds beyond strata's own buffers: the CUDA libraries'
        // workspaces and kernels (well under a GiB), or another process loading on this GPU.
        let own = model.gpu.allocated_bytes().saturating_sub(own0 + probe_kv_bytes);
        let foreign = used.saturating_sub(own);
        if foreign > FOREIGN_WARN_BYTES {
            tracing::warn!(
                "{} (GPU {}): free memory fell by {:.1} GiB while loading, {:.1} GiB of it strata's own buffers; \
                 is another process using this GPU (nvidia-smi)? The KV cache is sized as if all of it stays taken",
                model.gpu.info.name,
                model.gpu.info.ordinal,
                used as f64 / GIB,
                own as f64 / GIB
            );
        }
        let per_block = kv_cache::bytes_per_token(&local, opts.kv_cache_dtype, opts.dtype) * opts.block_size;
        // Headroom for CUDA graphs and allocator slack.
        let reserve = 256 << 20;
        // This executor may use `budget` in all, and never more than is free (other processes
        // or executors may hold the rest).
        let free_now = free1 + probe_kv_bytes;
        let avail = budget
            .saturating_sub(used + reserve)
            .min(free_now.saturating_sub(reserve));
        Ok(ProbedShard {
            model,
            blocks: avail / per_block.max(1),
            budget,
            used,
            foreign,
        })
    }

    /// The error when `blocks` (this shard's, or the least of a group's) cannot hold one sequence.
    pub(crate) fn check_fits(&self, blocks: usize, opts: &GpuOptions) -> Result<(), ModelError> {
        let need = opts.max_model_len.div_ceil(opts.block_size);
        if blocks >= need {
            return Ok(());
        }
        let weight_bytes = self.model.weights.matrix_bytes as usize;
        let foreign = match self.foreign > FOREIGN_WARN_BYTES {
            true => format!(
                " ({:.1} GiB of it not strata's buffers: another process on this GPU?)",
                self.foreign as f64 / GIB
            ),
            false => String::new(),
        };
        Err(ModelError::Device(format!(
            "not enough GPU memory for the KV cache on {}: {:.1} GiB allowed (--gpu-memory-utilization {}), weights {:.1} GiB, activations at --max-num-batched-tokens {} {:.1} GiB{foreign}, leaving room for {} tokens but one --max-model-len {} sequence needs {}; lower --max-model-len or --max-num-batched-tokens, use --kv-cache-dtype fp8, spread the model over more GPUs, or raise --gpu-memory-utilization",
            self.model.gpu.info.name,
            self.budget as f64 / GIB,
            opts.gpu_memory_utilization,
            weight_bytes as f64 / GIB,
            opts.max_num_batched_tokens,
            self.used.saturating_sub(weight_bytes) as f64 / GIB,
            blocks * opts.block_size,
            opts.max_model_len,
            need * opts.block_size
        )))
    }

    /// Replaces the probe cache with one of `blocks` blocks and turns CUDA graphs on (unless
    /// `--enforce-eager`).
    pub fn allocate(self, blocks: usize, opts: &GpuOptions) -> Result<GpuTransformer, ModelError> {
        self.check_fits(blocks, opts)?;
        let mut model = self.model;
        // Free the probe cache first.
        let kv_type = (opts.kv_cache_dtype, opts.dtype);
        model.kv = kv_cache::GpuKvCache::new(&model.gpu, &model.local, kv_type, opts.block_size, 0).map_err(cuda)?;
        model.kv =
            kv_cache::GpuKvCache::new(&model.gpu, &model.local, kv_type, opts.block_size, blocks).map_err(cuda)?;
        model.use_graphs = !opts.enforce_eager;
        model.ablate = opts.ablate.clone();
        model.two_pass_activations = opts.activation_precision == ActPrecision::High;
        model.tune_decode_gemms().map_err(cuda)?;
        let weight_bytes = model.weights.matrix_bytes as usize;
        tracing::info!(
            "{} (GPU {}): weights {:.2} GiB, activations {:.2} GiB, KV cache {:.2} GiB = {} tokens ({:.1} sequences of {})",
            model.gpu.info.name,
            model.gpu.info.ordinal,
            weight_bytes as f64 / GIB,
            self.used.saturating_sub(weight_bytes) as f64 / GIB,
            model.kv.memory_bytes() as f64 / GIB,
            blocks * opts.block_size,
            (blocks * opts.block_size) as f64 / opts.max_model_len as f64,
            opts.max_model_len
        );
        Ok(model)
    }
}

fn cuda(e: CudaError) -> ModelError {
    ModelError::Device(e.to_string())
}

impl GpuExecutor {
    /// Uploads `transformer`'s weights to GPU `opts.ordinal`, measures the activation peak with a
    /// full-budget forward pass, and gives the rest of the allowed memory to the KV cache.
    pub fn new(
        transformer: Transformer,
        opts: &GpuOptions,
        libs: &LibrarySearch,
        progress: &dyn Fn(u64, u64),
    ) -> Result<GpuExecutor, ModelError> {
        let gpu = Gpu::open(opts.ordinal, libs).map_err(cuda)?;
        let shard = Shard::whole(&transformer.config);
        let probed = ProbedShard::load(gpu, &transformer, shard, ShardComms::default(), opts, progress)?;
        drop(transformer);
        let blocks = probed.blocks;
        Ok(GpuExecutor {
            model: probed.allocate(blocks, opts)?,
            submitted: VecDeque::new(),
        })
    }

    /// Bytes of all weight matrices (what one decode step reads).
    pub fn weight_bytes(&self) -> u64 {
        self.model.weights.matrix_bytes
    }

    /// The model on the GPU (benchmarks and tests).
    pub fn model(&mut self) -> &mut GpuTransformer {
        &mut self.model
    }
}

const GIB: f64 = (1u64 << 30) as f64;
/// A load whose fall in free memory exceeds strata's own buffers by more than this warns.
const FOREIGN_WARN_BYTES: usize = 1 << 30;

impl Executor for GpuExecutor {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn overlaps_steps(&self) -> bool {
        self.model.overlaps_steps()
    }

    fn samples_on_device(&self) -> bool {
        true
    }

    /// Starts a decode step of tokens chosen on the GPU without waiting for it when the GPU
    /// overlaps steps (and always with `tokens_from`); runs any other step at once, once the
    /// steps started before it are collected.
    fn submit(&mut self, batch: Vec<SeqChunk>, tokens_from: Option<Vec<usize>>) -> Result<(), ModelError> {
        let ids_on_gpu = !batch.is_empty() && batch.iter().all(|c| c.tokens.len() == 1 && c.logits.wants_id_only());
        let step = if tokens_from.is_some() || (ids_on_gpu && self.model.overlaps_steps()) {
            Submitted::Started(self.model.start_decode(&batch, tokens_from.as_deref())?)
        } else if !self.submitted.is_empty() {
            return Err(ModelError::BadBatch(
                "only decode steps of tokens chosen on the GPU queue behind a step in flight; collect it first".into(),
            ));
        } else {
            Submitted::Done(self.model.forward(&batch)?)
        };
        self.submitted.push_back(step);
        Ok(())
    }

    fn collect(&mut self) -> Result<Logits, ModelError> {
        match self.submitted.pop_front() {
            Some(Submitted::Started(step)) => self.model.finish_decode(step),
            Some(Submitted::Done(logits)) => Ok(logits),
            None => Err(ModelError::BadBatch("collect called with no batch submitted".into())),
        }
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            blocks: self.model.kv.num_blocks,
            block_size: self.model.kv.block_size,
            bytes: self.model.kv.memory_bytes(),
            dtype: self.model.kv.dtype,
            value_type: self.model.kv.value_type(),
        }
    }

    fn device(&self) -> String {
        format!("cuda:{} ({})", self.model.gpu.info.ordinal, self.model.gpu.info.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(dtype: ComputeDtype, kv_cache_dtype: KvCacheDtype, deterministic: bool) -> GpuOptions {
        GpuOptions {
            ordinal: 0,
            gpu_memory_utilization: 0.9,
            gpu_memory_limit: None,
            quantization: Default::default(),
            dtype,
            kv_cache_dtype,
            block_size: 16,
            max_num_batched_tokens: 512,
            max_num_seqs: 16,
            max_model_len: 1024,
            enforce_eager: false,
            deterministic,
            ablate: Vec::new(),
            activation_precision: Default::default(),
        }
    }

    #[test]
    fn float32_refuses_what_it_cannot_do_with_a_way_out() {
        let (bf16, f32) = (ComputeDtype::Bf16, ComputeDtype::F32);
        assert!(options(bf16, KvCacheDtype::Fp8E4m3, true).check_dtype(2).is_ok());
        assert!(options(f32, KvCacheDtype::Auto, false).check_dtype(1).is_ok());
        for (kv, det, gpus, flag) in [
            (KvCacheDtype::Auto, false, 2, "runs on one GPU, not 2"),
            (KvCacheDtype::Fp8E4m3, false, 1, "--kv-cache-dtype fp8"),
            (KvCacheDtype::Auto, true, 1, "--deterministic"),
        ] {
            let err = options(f32, kv, det).check_dtype(gpus).unwrap_err().to_string();
            assert!(err.contains(flag) && err.contains("--dtype bfloat16"), "{err}");
        }
    }
}
