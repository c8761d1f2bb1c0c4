//! The multi-GPU executor: one step goes to every worker, the last stage's logits come back
//! merged, and as many batches are in flight as there are pipeline stages.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use strata_model::cuda::{GpuOptions, ShardLogits};
use strata_model::{Executor, KvLayout, Logits, ModelConfig, ModelError, SeqChunk, Transformer};
use strata_runtime::cuda::libraries::LibrarySearch;
use strata_runtime::cuda::{check_nccl, CommAbort, Gpu, NcclId};

use super::device_error;
use super::watchdog::{fault_stall, WorkerProgress, FIRST_STEP_TIMEOUTS};
use super::worker::{InitMsg, Job, Report, WorkerContext};
use crate::layout::{gpu_list, ParallelLayout};

/// Loading weights and creating communicators may take this long per worker.
const INIT_TIMEOUT: Duration = Duration::from_secs(1800);

/// The model spread over several GPUs, ready for the engine.
pub struct ParallelExecutor {
    pub(super) config: ModelConfig,
    pub(super) layout: ParallelLayout,
    pub(super) gpu_name: String,
    pub(super) jobs: Vec<Sender<Job>>,
    pub(super) threads: Vec<Option<JoinHandle<()>>>,
    pub(super) reports: Receiver<Report>,
    /// Results of steps in flight, one slot per worker.
    pub(super) pending: HashMap<u64, Vec<Option<Option<ShardLogits>>>>,
    pub(super) progress: Arc<Vec<WorkerProgress>>,
    pub(super) aborts: Vec<CommAbort>,
    /// Threads running `ncclCommAbort` after a hang.
    pub(super) aborting: Vec<JoinHandle<()>>,
    pub(super) stop: Arc<AtomicBool>,
    pub(super) in_flight: VecDeque<u64>,
    pub(super) next_step: u64,
    pub(super) steps_done: u64,
    pub(super) kv: KvLayout,
    pub(super) weight_bytes: u64,
    pub(super) timeout: Duration,
    /// Set once a step hung or a GPU failed: every later call returns it.
    pub(super) failed: Option<String>,
}

impl ParallelExecutor {
    /// Starts one worker per GPU of `layout`: each opens its GPU, joins its communicators,
    /// uploads its shard and measures its activation peak; then every shard gets the KV cache the
    /// tightest of them allows (the engine's block tables address all of them alike).
    pub fn new(
        transformer: Transformer,
        layout: ParallelLayout,
        opts: &GpuOptions,
        collective_timeout: Duration,
        libs: &LibrarySearch,
        progress: &dyn Fn(u64, u64),
    ) -> Result<ParallelExecutor, ModelError> {
        let config = transformer.config.clone();
        layout
            .check(&config)
            .map_err(|e| ModelError::Device(format!("{}: {e}", layout.describe())))?;
        opts.check_dtype(layout.gpus.len())?;
        check_nccl(libs).map_err(device_error)?;
        let n_gpus = Gpu::count(libs).map_err(device_error)?;
        if let Some(g) = layout.gpus.iter().find(|&&g| g >= n_gpus) {
            return Err(ModelError::Device(format!(
                "{} needs GPU {g}, but {n_gpus} are visible; use fewer GPUs (--tensor-parallel-size, --pipeline-parallel-size) or check CUDA_VISIBLE_DEVICES",
                layout.describe()
            )));
        }
        if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
            // NVLink SHARP buffers cost memory and hang in some VMs; strata never needs them.
            std::env::set_var("NCCL_NVLS_ENABLE", "0");
        }
        let fault = fault_stall();
        if let Some((w, s)) = fault {
            tracing::warn!("STRATA_FAULT_STALL: worker {w} will stop responding at step {s} (a test of the watchdog)");
        }
        let (tp, pp, n) = (layout.tp, layout.pp(), layout.gpus.len());
        let new_id = || NcclId::new().map_err(device_error);
        let tp_ids = if tp > 1 {
            (0..pp).map(|_| new_id()).collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        let pp_ids = if pp > 1 {
            (0..tp).map(|_| new_id()).collect::<Result<Vec<_>, _>>()?
        } else {
            Vec::new()
        };
        let transformer = Arc::new(transformer);
        let workers_progress: Arc<Vec<WorkerProgress>> = Arc::new((0..n).map(|_| WorkerProgress::default()).collect());
        if let Some((w, s)) = fault.filter(|&(w, _)| w < n) {
            workers_progress[w].stall_at.store(s, Ordering::SeqCst);
        }
        let upload: Arc<Vec<(AtomicU64, AtomicU64)>> = Arc::new((0..n).map(|_| Default::default()).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let (init_tx, init_rx) = mpsc::channel::<(usize, Result<InitMsg, ModelError>)>();
        let (report_tx, reports) = mpsc::channel();
        let mut jobs = Vec::with_capacity(n);
        let mut allocs = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for w in 0..n {
            let (job_tx, job_rx) = mpsc::channel();
            let (alloc_tx, alloc_rx) = mpsc::channel::<usize>();
            let (stage, rank) = (w / tp, w % tp);
            let ctx = WorkerContext {
                index: w,
                ordinal: layout.gpus[w],
                shard: layout.shard(w, config.n_layers),
                tp_comm: (tp > 1).then(|| (tp_ids[stage], tp, rank)),
                pp_comm: (pp > 1).then(|| (pp_ids[rank], pp, stage)),
                transformer: Arc::clone(&transformer),
                opts: opts.clone(),
                libs: libs.clone(),
                init: init_tx.clone(),
                allocs: alloc_rx,
                jobs: job_rx,
                reports: report_tx.clone(),
                progress: Arc::clone(&workers_progress),
                upload: Arc::clone(&upload),
                stop: Arc::clone(&stop),
            };
            let thread = std::thread::Builder::new()
                .name(format!("strata-gpu{}", layout.gpus[w]))
                .spawn(move || ctx.run())
                .map_err(|e| ModelError::Device(format!("could not start a GPU worker thread: {e}")))?;
            jobs.push(job_tx);
            allocs.push(alloc_tx);
            threads.push(Some(thread));
        }
        drop(transformer);
        let mut exec = ParallelExecutor {
            gpu_name: String::new(),
            config,
            layout,
            jobs,
            threads,
            reports,
            pending: HashMap::new(),
            progress: workers_progress,
            aborts: Vec::new(),
            aborting: Vec::new(),
            stop,
            in_flight: VecDeque::new(),
            next_step: 0,
            steps_done: 0,
            kv: KvLayout {
                blocks: 0,
                block_size: opts.block_size,
                bytes: 0,
                dtype: opts.kv_cache_dtype,
                value_type: opts.kv_cache_dtype.gpu_value_type(opts.dtype),
            },
            weight_bytes: 0,
            timeout: collective_timeout,
            failed: None,
        };
        let show = || {
            let (done, total) = upload.iter().fold((0, 0), |a, (d, t)| {
                (a.0 + d.load(Ordering::Relaxed), a.1 + t.load(Ordering::Relaxed))
            });
            progress(done, total.max(1));
        };
        // Phase 1: communicators, weights and the activation probe on every worker.
        let since = Instant::now();
        let mut blocks = vec![None; n];
        while blocks.iter().any(Option::is_none) {
            show();
            match exec.init_message(&init_rx, since)? {
                Some((_, InitMsg::Comms(a))) => exec.aborts.extend(a),
                Some((w, InitMsg::Probed(b))) => blocks[w] = Some(b),
                Some((_, InitMsg::Ready { .. })) | None => {}
            }
        }
        let least = blocks.iter().flatten().copied().min().unwrap_or(0);
        for tx in &allocs {
            let _ = tx.send(least);
        }
        // Phase 2: every shard allocates the same number of KV blocks.
        let mut ready = 0;
        while ready < n {
            if let Some((
                w,
                InitMsg::Ready {
                    kv_bytes,
                    weight_bytes,
                    gpu_name,
                },
            )) = exec.init_message(&init_rx, since)?
            {
                exec.kv.bytes += kv_bytes;
                exec.weight_bytes += weight_bytes;
                if w == 0 {
                    exec.gpu_name = gpu_name;
                }
                ready += 1;
            }
        }
        progress(1, 1);
        exec.kv.blocks = least;
        tracing::info!(
            "{}: {} KV blocks of {} tokens on every GPU; collective timeout {:.0} s",
            exec.layout.describe(),
            least,
            opts.block_size,
            collective_timeout.as_secs_f64()
        );
        Ok(exec)
    }

    /// The next start-up message (`None` after 200 ms without one, to refresh the progress bar),
    /// or the error that ends start-up (the workers are stopped): a worker's, or start-up taking
    /// longer than `INIT_TIMEOUT` since `since`.
    fn init_message(
        &mut self,
        rx: &Receiver<(usize, Result<InitMsg, ModelError>)>,
        since: Instant,
    ) -> Result<Option<(usize, InitMsg)>, ModelError> {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok((w, Ok(msg))) => Ok(Some((w, msg))),
            Ok((w, Err(e))) => {
                let msg = format!("GPU {} ({}): {e}", self.layout.gpus[w], self.layout.describe());
                self.shut_down(&msg);
                Err(ModelError::Device(msg))
            }
            Err(RecvTimeoutError::Timeout) if since.elapsed() < INIT_TIMEOUT => Ok(None),
            Err(_) => {
                let msg = format!(
                    "{}: the GPU workers did not finish starting within {} s",
                    self.layout.describe(),
                    INIT_TIMEOUT.as_secs()
                );
                self.shut_down(&msg);
                Err(ModelError::Device(msg))
            }
        }
    }

    /// Bytes of the weight matrices over all GPUs.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    pub fn layout(&self) -> &ParallelLayout {
        &self.layout
    }

    /// Makes worker `worker` stop responding when step `after + 1` from now reaches it, as a
    /// hung GPU or link would (tests of the watchdog; `STRATA_FAULT_STALL=W:S` does the same for
    /// a server).
    pub fn stall_worker(&self, worker: usize, after: u64) {
        if let Some(p) = self.progress.get(worker) {
            p.stall_at.store(self.next_step + after + 1, Ordering::SeqCst);
        }
    }
}

/// Merges the last stage's vocabulary slices (TP rank order) into whole-vocabulary logits.
fn merge_slices(mut parts: Vec<ShardLogits>, vocab: usize) -> Logits {
    if parts.len() == 1 {
        let mut l = parts.pop().map(|p| p.logits).unwrap_or_default();
        l.vocab = vocab;
        return l;
    }
    let first = &parts[0].logits;
    let mut out = Logits {
        vocab,
        rows: first.rows.clone(),
        data: Vec::with_capacity(first.rows.len() * vocab),
        argmax: Vec::with_capacity(first.argmax.len()),
    };
    for j in 0..first.rows.len() {
        for p in &parts {
            let v = p.logits.vocab;
            out.data.extend_from_slice(&p.logits.data[j * v..(j + 1) * v]);
        }
    }
    for j in 0..first.argmax.len() {
        // Ties go to the lower rank, i.e. the lower token id, as on one GPU.
        let mut best = 0;
        for (r, p) in parts.iter().enumerate().skip(1) {
            if p.argmax_values[j] > parts[best].argmax_values[j] {
                best = r;
            }
        }
        out.argmax.push(parts[best].logits.argmax[j]);
    }
    out
}

impl Executor for ParallelExecutor {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// One batch per stage. (One more, to hide the engine's turnaround, was measured slower:
    /// 64 streams then run as three batches of 22 on two stages; bench/NOTES.md.)
    fn pipeline_depth(&self) -> usize {
        self.layout.pp()
    }

    fn submit(&mut self, batch: Vec<SeqChunk>, tokens_from: Option<Vec<usize>>) -> Result<(), ModelError> {
        if let Some(e) = self.dead() {
            return Err(e);
        }
        if tokens_from.is_some() {
            return Err(ModelError::BadBatch(
                "steps over several GPUs take their tokens from the host; submit them without tokens_from".into(),
            ));
        }
        self.next_step += 1;
        let step = self.next_step;
        let batch = Arc::new(batch);
        for (w, tx) in self.jobs.iter().enumerate() {
            if tx.send(Job::Step(step, Arc::clone(&batch))).is_err() {
                let msg = format!("the worker of GPU {} has stopped", self.layout.gpus[w]);
                self.shut_down(&msg);
                return Err(ModelError::Unavailable(msg));
            }
        }
        self.in_flight.push_back(step);
        self.pending.insert(step, (0..self.jobs.len()).map(|_| None).collect());
        Ok(())
    }

    fn collect(&mut self) -> Result<Logits, ModelError> {
        if let Some(e) = self.dead() {
            return Err(e);
        }
        let Some(step) = self.in_flight.pop_front() else {
            return Err(ModelError::BadBatch("collect called with no batch in flight".into()));
        };
        let limit = if self.steps_done == 0 {
            self.timeout * FIRST_STEP_TIMEOUTS
        } else {
            self.timeout
        };
        let started = Instant::now();
        let mut refused = None;
        while self.pending[&step].iter().any(Option::is_none) {
            let left = limit.saturating_sub(started.elapsed());
            match self.reports.recv_timeout(left) {
                Ok(r) => match r.result {
                    Ok(l) => {
                        if let Some(slots) = self.pending.get_mut(&r.step) {
                            slots[r.worker] = Some(l);
                        }
                    }
                    // Every worker checks a batch alike and refuses it before any collective.
                    Err(ModelError::BadBatch(m)) => {
                        refused = Some(m);
                        if let Some(slots) = self.pending.get_mut(&r.step) {
                            slots[r.worker] = Some(None);
                        }
                    }
                    Err(e) => {
                        let msg = format!(
                            "GPU {} failed in step {} ({}): {e}; strata aborted the NCCL communicators and stopped serving",
                            self.layout.gpus[r.worker],
                            r.step,
                            self.layout.describe()
                        );
                        tracing::error!("{msg}");
                        self.shut_down(&msg);
                        return Err(ModelError::Unavailable(msg));
                    }
                },
                Err(RecvTimeoutError::Timeout) => return Err(self.hung(step, limit)),
                Err(RecvTimeoutError::Disconnected) => {
                    let msg = "the GPU workers have stopped".to_string();
                    self.shut_down(&msg);
                    return Err(ModelError::Unavailable(msg));
                }
            }
        }
        let slots = self.pending.remove(&step).unwrap_or_default();
        self.steps_done += 1;
        if let Some(m) = refused {
            return Err(ModelError::BadBatch(m));
        }
        let parts: Vec<ShardLogits> = slots.into_iter().flatten().flatten().collect();
        Ok(merge_slices(parts, self.config.vocab_size))
    }

    fn kv_layout(&self) -> KvLayout {
        self.kv
    }

    fn device(&self) -> String {
        format!(
            "cuda:{} ({}, {})",
            gpu_list(&self.layout.gpus),
            self.gpu_name,
            self.layout.describe()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    fn slice(argmax: Vec<(usize, u32)>, values: Vec<f32>, data: Vec<f32>, vocab: usize) -> ShardLogits {
        ShardLogits {
            logits: Logits {
                vocab,
                rows: if data.is_empty() { vec![] } else { vec![(0, 5)] },
                data,
                argmax,
            },
            argmax_values: values,
        }
    }

    #[test]
    fn vocabulary_slices_merge_into_rows_and_argmaxes() {
        // Two rows' argmax over ranks holding ids 0..3 and 3..5; ties go to rank 0.
        let a = slice(vec![(0, 1), (1, 2)], vec![2.0, 7.0], vec![], 3);
        let b = slice(vec![(0, 4), (1, 3)], vec![3.0, 7.0], vec![], 2);
        let m = merge_slices(vec![a, b], 5);
        assert_eq!(m.argmax, vec![(0, 4), (1, 2)]);
        let a = slice(vec![], vec![], vec![0.0, 1.0, 2.0], 3);
        let b = slice(vec![], vec![], vec![3.0, 4.0], 2);
        let m = merge_slices(vec![a, b], 5);
        assert_eq!(m.data, vec![0.0, 1.0, 2.0, 3.0, 4.0]);
        assert_eq!(m.rows, vec![(0, 5)]);
    }
}
