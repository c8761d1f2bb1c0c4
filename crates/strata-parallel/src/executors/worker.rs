//! One worker thread of the multi-GPU executor: it opens its GPU, joins its communicators, loads
//! its shard, then runs every step it is sent and reports its result.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, Sender};
use std::sync::Arc;
use std::time::Duration;

use strata_model::cuda::{GpuOptions, GpuTransformer, ProbedShard, Shard, ShardComms, ShardLogits};
use strata_model::{ModelError, SeqChunk, Transformer};
use strata_runtime::cuda::libraries::LibrarySearch;
use strata_runtime::cuda::{CommAbort, Communicator, Gpu, NcclId};

use super::device_error;
use super::watchdog::WorkerProgress;

/// What the executor sends a worker.
pub(super) enum Job {
    Step(u64, Arc<Vec<SeqChunk>>),
    Stop,
}

/// What a worker says during start-up.
pub(super) enum InitMsg {
    /// Its communicators exist (the watchdog may abort them from now on).
    Comms(Vec<CommAbort>),
    /// Weights loaded and the activation peak measured: this many KV blocks fit.
    Probed(usize),
    /// KV cache allocated: its bytes, the weight matrices' bytes, and the GPU's name.
    Ready {
        kv_bytes: usize,
        weight_bytes: u64,
        gpu_name: String,
    },
}

/// A worker's result of one step: the last stage's logits, `None` from other stages.
pub(super) struct Report {
    pub(super) worker: usize,
    pub(super) step: u64,
    pub(super) result: Result<Option<ShardLogits>, ModelError>,
}

/// Everything one worker thread owns.
pub(super) struct WorkerContext {
    pub(super) index: usize,
    pub(super) ordinal: usize,
    pub(super) shard: Shard,
    /// (id, size, rank) of its TP group's and its pipeline column's communicators.
    pub(super) tp_comm: Option<(NcclId, usize, usize)>,
    pub(super) pp_comm: Option<(NcclId, usize, usize)>,
    pub(super) transformer: Arc<Transformer>,
    pub(super) opts: GpuOptions,
    pub(super) libs: LibrarySearch,
    pub(super) init: Sender<(usize, Result<InitMsg, ModelError>)>,
    pub(super) allocs: Receiver<usize>,
    pub(super) jobs: Receiver<Job>,
    pub(super) reports: Sender<Report>,
    pub(super) progress: Arc<Vec<WorkerProgress>>,
    pub(super) upload: Arc<Vec<(AtomicU64, AtomicU64)>>,
    pub(super) stop: Arc<AtomicBool>,
}

impl WorkerContext {
    pub(super) fn run(self) {
        let w = self.index;
        let init = self.init.clone();
        let model = match self.start() {
            Ok(m) => m,
            Err(e) => {
                let _ = init.send((w, Err(e)));
                return;
            }
        };
        let Some(mut model) = model else { return };
        let last = self.shard.is_last_stage();
        while let Ok(job) = self.jobs.recv() {
            let Job::Step(step, batch) = job else { break };
            if self.progress[w].stall_at.load(Ordering::SeqCst) == step {
                tracing::warn!("STRATA_FAULT_STALL: worker {w} (GPU {}) stops responding", self.ordinal);
                while !self.stop.load(Ordering::SeqCst) {
                    std::thread::sleep(Duration::from_millis(50));
                }
                return;
            }
            self.progress[w].started.store(step, Ordering::SeqCst);
            let result = model.forward_shard(&batch).map(|l| last.then_some(l));
            self.progress[w].finished.store(step, Ordering::SeqCst);
            if self
                .reports
                .send(Report {
                    worker: w,
                    step,
                    result,
                })
                .is_err()
            {
                break;
            }
        }
    }

    /// Opens the GPU, joins the communicators, loads the shard and allocates the KV cache the
    /// leader settles on; `None` when told to stop meanwhile.
    fn start(&self) -> Result<Option<GpuTransformer>, ModelError> {
        let w = self.index;
        let gpu = Gpu::open(self.ordinal, &self.libs).map_err(device_error)?;
        let join = |c: Option<(NcclId, usize, usize)>| {
            c.map(|(id, size, rank)| Communicator::init(&gpu, id, size, rank))
                .transpose()
                .map_err(device_error)
        };
        let comms = ShardComms {
            tp: join(self.tp_comm)?,
            pp: join(self.pp_comm)?,
        };
        let aborts = comms
            .tp
            .iter()
            .chain(&comms.pp)
            .map(Communicator::abort_handle)
            .collect();
        let _ = self.init.send((w, Ok(InitMsg::Comms(aborts))));
        let upload = &self.upload[w];
        let probed = ProbedShard::load(
            gpu,
            &self.transformer,
            self.shard.clone(),
            comms,
            &self.opts,
            &|d, t| {
                upload.0.store(d, Ordering::Relaxed);
                upload.1.store(t, Ordering::Relaxed);
            },
        )?;
        let _ = self.init.send((w, Ok(InitMsg::Probed(probed.blocks))));
        let Ok(blocks) = self.allocs.recv() else {
            return Ok(None);
        };
        let model = probed.allocate(blocks, &self.opts)?;
        let _ = self.init.send((
            w,
            Ok(InitMsg::Ready {
                kv_bytes: model.kv.memory_bytes(),
                weight_bytes: model.weights.matrix_bytes,
                gpu_name: model.gpu.info.name.clone(),
            }),
        ));
        Ok(Some(model))
    }
}
