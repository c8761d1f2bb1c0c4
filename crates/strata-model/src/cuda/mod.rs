//! The CUDA executor (feature `cuda`): a model's weights, KV cache and forward pass on one GPU,
//! sized by `--gpu-memory-utilization` after measuring the activation peak.

pub mod forward;
pub mod kv_cache;
pub mod weights;

use strata_runtime::cuda::libraries::LibrarySearch;
use strata_runtime::cuda::{CudaError, Gpu};

use crate::batch::{Logits, LogitsWanted, SeqChunk};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::executor::{Executor, KvLayout};
use crate::kv_cache::KvCacheDtype;
use crate::transformer::Transformer;

pub use forward::{GpuTransformer, StepLimits};

/// How to place a model on a GPU.
#[derive(Debug, Clone)]
pub struct GpuOptions {
    pub ordinal: usize,
    /// Fraction of the GPU's memory strata may use in all (weights, activations, KV cache).
    pub gpu_memory_utilization: f64,
    pub kv_cache_dtype: KvCacheDtype,
    pub block_size: usize,
    pub max_num_batched_tokens: usize,
    pub max_num_seqs: usize,
    pub max_model_len: usize,
    /// Never capture CUDA graphs.
    pub enforce_eager: bool,
}

/// The model on a GPU, ready for the engine.
pub struct GpuExecutor {
    model: GpuTransformer,
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
        let err = |e: CudaError| ModelError::Device(e.to_string());
        let util = opts.gpu_memory_utilization;
        if !(util > 0.0 && util <= 1.0) {
            return Err(ModelError::Device(format!(
                "--gpu-memory-utilization {util} must be in (0, 1]"
            )));
        }
        let gpu = Gpu::open(opts.ordinal, libs).map_err(err)?;
        let c = transformer.config.clone();
        let (free0, total) = gpu.memory().map_err(err)?;
        let budget = (total as f64 * util) as usize;
        let weights = weights::GpuWeights::upload(&gpu, &c, &transformer.weights, progress).map_err(err)?;
        drop(transformer);
        let limits = StepLimits {
            max_tokens: opts.max_num_batched_tokens.max(opts.max_num_seqs),
            max_seqs: opts.max_num_seqs,
            max_model_len: opts.max_model_len,
            logit_rows: opts.max_num_seqs.max(64),
        };
        // A one-block cache to profile the activation peak with; replaced below.
        let probe_kv = kv_cache::GpuKvCache::new(
            &gpu,
            &c,
            opts.kv_cache_dtype,
            opts.block_size,
            limits.max_model_len.div_ceil(opts.block_size),
        )
        .map_err(err)?;
        let probe_kv_bytes = probe_kv.memory_bytes();
        let mut model = GpuTransformer::new(c.clone(), gpu, weights, probe_kv, limits).map_err(err)?;
        model.use_graphs = false;
        let probe_tokens = limits.max_tokens.min(limits.max_model_len);
        let probe = SeqChunk {
            tokens: vec![0; probe_tokens],
            first_pos: 0,
            block_table: (0..probe_tokens.div_ceil(opts.block_size) as u32).collect(),
            logits: LogitsWanted::Last,
            prompt_len: usize::MAX,
        };
        model.forward(std::slice::from_ref(&probe))?;
        model.gpu.sync().map_err(err)?;
        let (free1, _) = model.gpu.memory().map_err(err)?;
        // What this executor holds besides the probe cache: weights, activations, workspaces.
        let used = (free0 - free1).saturating_sub(probe_kv_bytes);
        let weight_bytes = model.weights.matrix_bytes as usize;
        let per_token = kv_cache::bytes_per_token(&c, opts.kv_cache_dtype);
        let per_block = per_token * opts.block_size;
        // Headroom for CUDA graphs and allocator slack.
        let reserve = 256 << 20;
        // This executor may use `budget` in all, and never more than is free (other processes
        // or executors may hold the rest).
        let free_now = free1 + probe_kv_bytes;
        let avail = budget
            .saturating_sub(used + reserve)
            .min(free_now.saturating_sub(reserve));
        let blocks = avail / per_block.max(1);
        let need = opts.max_model_len.div_ceil(opts.block_size);
        if blocks < need {
            return Err(ModelError::Device(format!(
                "not enough GPU memory for the KV cache: {:.1} GiB allowed (--gpu-memory-utilization {util}), weights {:.1} GiB, activations at --max-num-batched-tokens {} {:.1} GiB, leaving room for {} tokens but one --max-model-len {} sequence needs {}; lower --max-model-len or --max-num-batched-tokens, use --kv-cache-dtype fp8, or raise --gpu-memory-utilization",
                budget as f64 / GIB,
                weight_bytes as f64 / GIB,
                opts.max_num_batched_tokens,
                used.saturating_sub(weight_bytes) as f64 / GIB,
                blocks * opts.block_size,
                opts.max_model_len,
                need * opts.block_size
            )));
        }
        model.kv =
            kv_cache::GpuKvCache::new(&model.gpu, &c, opts.kv_cache_dtype, opts.block_size, blocks).map_err(err)?;
        model.use_graphs = !opts.enforce_eager;
        let kv_bytes = model.kv.memory_bytes();
        tracing::info!(
            "{}: weights {:.2} GiB, activations {:.2} GiB, KV cache {:.2} GiB = {} tokens ({:.1} sequences of {})",
            model.gpu.info.name,
            weight_bytes as f64 / GIB,
            used.saturating_sub(weight_bytes) as f64 / GIB,
            kv_bytes as f64 / GIB,
            blocks * opts.block_size,
            (blocks * opts.block_size) as f64 / opts.max_model_len as f64,
            opts.max_model_len
        );
        Ok(GpuExecutor { model })
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

impl Executor for GpuExecutor {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn forward(&mut self, batch: &[SeqChunk]) -> Result<Logits, ModelError> {
        self.model.forward(batch)
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            blocks: self.model.kv.num_blocks,
            block_size: self.model.kv.block_size,
            bytes: self.model.kv.memory_bytes(),
            dtype: self.model.kv.dtype,
        }
    }

    fn device(&self) -> String {
        format!("cuda:{} ({})", self.model.gpu.info.ordinal, self.model.gpu.info.name)
    }
}
