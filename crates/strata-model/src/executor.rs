//! The device-independent face of a loaded model with its KV cache: what the engine calls each
//! step. The CPU executor lives here; the CUDA one under `cuda/` (feature `cuda`).

use strata_runtime::cpu::ThreadPool;

use crate::batch::{Logits, SeqChunk};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::kv_cache::{KvCacheDtype, PagedKvCache};
use crate::transformer::{ForwardScratch, Transformer};

/// How much KV cache an executor holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub blocks: usize,
    pub block_size: usize,
    pub bytes: usize,
    pub dtype: KvCacheDtype,
    /// What one cached value is on the device ("f32" on the CPU; "bf16" for `auto` on a GPU).
    pub value_type: &'static str,
}

/// Runs forward passes of one model over its own paged KV cache.
pub trait Executor: Send {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;
    /// Runs one batch: appends every new token's K/V to the cache and returns the logits asked for.
    fn forward(&mut self, batch: &[SeqChunk]) -> Result<Logits, ModelError>;
    /// Hands a consumed logits buffer back for reuse.
    fn recycle(&mut self, _logits: Logits) {}
    /// The KV cache's size.
    fn kv_layout(&self) -> KvLayout;
    /// Where it runs, in words (for logs and `/health`).
    fn device(&self) -> String;
    /// Batches this executor can hold in flight at once (pipeline stages); 1 = `forward` only.
    fn pipeline_depth(&self) -> usize {
        1
    }
    /// Whether a batch of decodes whose tokens are chosen on the device (one token each,
    /// `LogitsWanted::LastArgmax` or `LastSampled`) may be submitted while the one before it
    /// runs, with its tokens taken from that one's chosen ids on the device (overlapped steps:
    /// the host reads a step while the next runs).
    fn overlaps_steps(&self) -> bool {
        false
    }
    /// Whether `LogitsWanted::LastSampled` rows are sampled on the device (only the id comes
    /// back), each row's [`crate::RowAdjust`] applied there first; otherwise they come back as
    /// rows and the host samples.
    fn samples_on_device(&self) -> bool {
        false
    }
    /// Starts `batch` without waiting for its logits (executors with `pipeline_depth() > 1`, or
    /// decodes of ids chosen on the device on executors that [`Self::overlaps_steps`]); `collect`
    /// returns results in submission order. With `tokens_from` (overlapped steps only), chunk i's
    /// token is the id chosen for row `tokens_from[i]` of the batch submitted just before, and
    /// its own token is a placeholder.
    fn submit(&mut self, _batch: Vec<SeqChunk>, _tokens_from: Option<Vec<usize>>) -> Result<(), ModelError> {
        Err(ModelError::BadBatch(
            "this executor runs one batch at a time; call forward".into(),
        ))
    }
    /// The logits of the oldest submitted batch, waiting for them.
    fn collect(&mut self) -> Result<Logits, ModelError> {
        Err(ModelError::BadBatch(
            "this executor runs one batch at a time and holds no submitted batch; call forward".into(),
        ))
    }
}

/// The CPU backend: the transformer, its cache and a thread pool.
pub struct CpuExecutor {
    transformer: Transformer,
    kv: PagedKvCache,
    pool: ThreadPool,
    scratch: ForwardScratch,
    threads: usize,
}

impl CpuExecutor {
    /// A cache of `blocks` blocks of `block_size` tokens in `dtype`, and `threads` threads.
    pub fn new(
        transformer: Transformer,
        dtype: KvCacheDtype,
        block_size: usize,
        blocks: usize,
        threads: usize,
    ) -> CpuExecutor {
        let kv = PagedKvCache::new(&transformer.config, dtype, block_size, blocks);
        CpuExecutor {
            transformer,
            kv,
            pool: ThreadPool::new(threads.max(1)),
            scratch: ForwardScratch::default(),
            threads: threads.max(1),
        }
    }
}

impl Executor for CpuExecutor {
    fn config(&self) -> &ModelConfig {
        &self.transformer.config
    }

    fn forward(&mut self, batch: &[SeqChunk]) -> Result<Logits, ModelError> {
        self.transformer
            .forward(batch, &mut self.kv, &self.pool, &mut self.scratch)
    }

    fn recycle(&mut self, logits: Logits) {
        self.scratch.recycle(logits);
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            blocks: self.kv.num_blocks,
            block_size: self.kv.block_size,
            bytes: self.kv.memory_bytes(),
            dtype: self.kv.dtype(),
            value_type: self.kv.value_type(),
        }
    }

    fn device(&self) -> String {
        format!("cpu ({} threads)", self.threads)
    }
}
