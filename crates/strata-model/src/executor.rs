//! The device-independent face of a loaded model with its KV cache: what the engine calls each
//! step. The CPU executor lives here; the CUDA one under `cuda/` (feature `cuda`).

use std::collections::VecDeque;
use std::sync::Arc;

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

/// Runs forward passes of one model over its own paged KV cache. One protocol: `submit` hands a
/// batch over, `collect` returns the logits of the oldest one submitted; how many may be in
/// flight at once is what [`Self::pipeline_depth`] and [`Self::overlaps_steps`] say.
pub trait Executor: Send {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;
    /// Starts `batch` (an executor may also run it at once and keep its logits); `collect` returns
    /// results in submission order. Every new token's K/V goes into the cache. With `tokens_from`
    /// (overlapped steps only), chunk i's token is the id chosen for row `tokens_from[i]` of the
    /// batch submitted just before, and its own token is a placeholder.
    fn submit(&mut self, batch: Vec<SeqChunk>, tokens_from: Option<Vec<usize>>) -> Result<(), ModelError>;
    /// The logits of the oldest submitted batch, waiting for them.
    fn collect(&mut self) -> Result<Logits, ModelError>;
    /// Runs one batch and waits for its logits (`submit`, then `collect`); only with nothing in
    /// flight, or the logits returned are an earlier batch's.
    fn forward(&mut self, batch: &[SeqChunk]) -> Result<Logits, ModelError> {
        self.submit(batch.to_vec(), None)?;
        self.collect()
    }
    /// Hands a consumed logits buffer back for reuse.
    fn recycle(&mut self, _logits: Logits) {}
    /// The KV cache's size.
    fn kv_layout(&self) -> KvLayout;
    /// Where it runs, in words (for logs and `/health`).
    fn device(&self) -> String;
    /// Batches this executor can hold in flight at once (pipeline stages); 1 = submit one, collect
    /// it, then the next.
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
}

/// The CPU backend: the transformer, its cache and a thread pool.
pub struct CpuExecutor {
    transformer: Transformer,
    kv: PagedKvCache,
    /// Shared with a draft model's executor, which runs between the target's steps.
    pool: Arc<ThreadPool>,
    scratch: ForwardScratch,
    threads: usize,
    /// Logits of batches run at `submit` and not yet collected, oldest first.
    done: VecDeque<Logits>,
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
        CpuExecutor::with_pool(
            transformer,
            dtype,
            block_size,
            blocks,
            Arc::new(ThreadPool::new(threads)),
        )
    }

    /// [`Self::new`] on the threads of `pool` (a draft model's executor on its target's).
    pub fn with_pool(
        transformer: Transformer,
        dtype: KvCacheDtype,
        block_size: usize,
        blocks: usize,
        pool: Arc<ThreadPool>,
    ) -> CpuExecutor {
        let kv = PagedKvCache::new(&transformer.config, dtype, block_size, blocks);
        CpuExecutor {
            transformer,
            kv,
            threads: pool.n_threads(),
            pool,
            scratch: ForwardScratch::default(),
            done: VecDeque::new(),
        }
    }

    /// Its compute threads, for another executor to share.
    pub fn pool(&self) -> Arc<ThreadPool> {
        Arc::clone(&self.pool)
    }
}

impl Executor for CpuExecutor {
    fn config(&self) -> &ModelConfig {
        &self.transformer.config
    }

    /// Runs `batch` now and keeps its logits for `collect`.
    fn submit(&mut self, batch: Vec<SeqChunk>, tokens_from: Option<Vec<usize>>) -> Result<(), ModelError> {
        if tokens_from.is_some() {
            return Err(ModelError::BadBatch(
                "the CPU takes every token from the host; submit without tokens_from".into(),
            ));
        }
        let logits = self
            .transformer
            .forward(&batch, &mut self.kv, &self.pool, &mut self.scratch)?;
        self.done.push_back(logits);
        Ok(())
    }

    fn collect(&mut self) -> Result<Logits, ModelError> {
        self.done
            .pop_front()
            .ok_or_else(|| ModelError::BadBatch("collect called with no batch submitted".into()))
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
