//! Tensor- and pipeline-parallel execution over several GPUs of one process: one worker thread per
//! GPU holding its shard, NCCL between them, several batches in flight, and a watchdog per step.
//!
//! Every step goes to every worker. A TP group's ranks run the same kernels on their heads and MLP
//! columns and all-reduce after attention and after the MLP; a pipeline stage receives the
//! residual stream from the stage before and sends it on. The last stage's ranks return logits of
//! their vocabulary slices, merged here. A step that does not finish within the collective
//! timeout (a rank stopped responding, a link hangs) aborts the communicators and fails with
//! [`ModelError::Unavailable`], naming the GPUs and the operation: strata never waits forever.

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use strata_runtime::cuda::libraries::LibrarySearch;
use strata_runtime::cuda::{check_nccl, CommAbort, Communicator, Gpu, NcclId};

use crate::batch::{Logits, SeqChunk};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::executor::{Executor, KvLayout};
use crate::transformer::Transformer;

use super::forward::{ShardComms, ShardLogits};
use super::shard::Shard;
use super::{cuda, GpuOptions, ProbedShard};

/// The first step also sets up NCCL's connections and captures graphs: it gets this many
/// collective timeouts.
const FIRST_STEP_TIMEOUTS: u32 = 4;
/// Loading weights and creating communicators may take this long per worker.
const INIT_TIMEOUT: Duration = Duration::from_secs(1800);

/// How the model is spread: `tp` GPUs per stage, one layer range per pipeline stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelLayout {
    pub tp: usize,
    /// Layers of each pipeline stage, in order, covering the model.
    pub stages: Vec<Range<usize>>,
    /// GPU ordinal of each worker: stage by stage, TP ranks within a stage.
    pub gpus: Vec<usize>,
}

impl ParallelLayout {
    /// `pp` stages of near-equal layer counts (earlier stages take the remainder) over GPUs
    /// `0..tp * pp`.
    pub fn even(n_layers: usize, tp: usize, pp: usize) -> ParallelLayout {
        let pp = pp.max(1);
        let mut stages = Vec::with_capacity(pp);
        let mut start = 0;
        for s in 0..pp {
            let n = n_layers / pp + usize::from(s < n_layers % pp);
            stages.push(start..start + n);
            start += n;
        }
        ParallelLayout {
            tp: tp.max(1),
            stages,
            gpus: (0..tp.max(1) * pp).collect(),
        }
    }

    pub fn pp(&self) -> usize {
        self.stages.len()
    }

    /// Checks the layout against the model: the stages cover every layer in order, one GPU per
    /// worker, and the TP size divides the heads.
    pub fn check(&self, c: &ModelConfig) -> Result<(), String> {
        Shard::check_tp(c, self.tp)?;
        let mut next = 0;
        for r in &self.stages {
            if r.start != next || r.is_empty() {
                return Err(format!(
                    "pipeline stages {:?} must cover layers 0..{} in order, each non-empty",
                    self.stages, c.n_layers
                ));
            }
            next = r.end;
        }
        if next != c.n_layers {
            return Err(format!(
                "pipeline stages {:?} must cover layers 0..{} in order",
                self.stages, c.n_layers
            ));
        }
        if self.gpus.len() != self.tp * self.pp() {
            return Err(format!(
                "{} GPUs listed for TP {} x PP {}",
                self.gpus.len(),
                self.tp,
                self.pp()
            ));
        }
        let mut seen = self.gpus.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != self.gpus.len() {
            return Err(format!("GPU listed twice in {:?}", self.gpus));
        }
        Ok(())
    }

    /// The shard of worker `w`.
    fn shard(&self, w: usize, n_layers: usize) -> Shard {
        Shard {
            tp_rank: w % self.tp,
            tp_size: self.tp,
            layers: self.stages[w / self.tp].clone(),
            n_layers,
        }
    }

    /// "TP 2 x PP 1 on GPUs 0,1".
    pub fn describe(&self) -> String {
        format!("TP {} x PP {} on GPUs {}", self.tp, self.pp(), gpu_list(&self.gpus))
    }
}

fn gpu_list(gpus: &[usize]) -> String {
    gpus.iter().map(|g| g.to_string()).collect::<Vec<_>>().join(",")
}

/// A test hook: `STRATA_FAULT_STALL=W:S` makes worker W stop responding when step S reaches it,
/// as a hung GPU or link would (the watchdog tests use it).
fn fault_stall() -> Option<(usize, u64)> {
    let v = std::env::var("STRATA_FAULT_STALL").ok()?;
    let (w, s) = v.split_once(':')?;
    Some((w.trim().parse().ok()?, s.trim().parse().ok()?))
}

enum Job {
    Step(u64, Arc<Vec<SeqChunk>>),
    Stop,
}

/// What a worker says during start-up.
enum InitMsg {
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
struct Report {
    worker: usize,
    step: u64,
    result: Result<Option<ShardLogits>, ModelError>,
}

/// The last step each worker started and finished (0 = none), for the watchdog's message, and
/// the step at which it is to stop responding (a test of the watchdog; 0 = never).
#[derive(Default)]
struct WorkerProgress {
    started: AtomicU64,
    finished: AtomicU64,
    stall_at: AtomicU64,
}

/// The model spread over several GPUs, ready for the engine.
pub struct ParallelExecutor {
    config: ModelConfig,
    layout: ParallelLayout,
    gpu_name: String,
    jobs: Vec<Sender<Job>>,
    threads: Vec<Option<JoinHandle<()>>>,
    reports: Receiver<Report>,
    /// Results of steps in flight, one slot per worker.
    pending: HashMap<u64, Vec<Option<Option<ShardLogits>>>>,
    progress: Arc<Vec<WorkerProgress>>,
    aborts: Vec<CommAbort>,
    /// Threads running `ncclCommAbort` after a hang.
    aborting: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    in_flight: VecDeque<u64>,
    next_step: u64,
    steps_done: u64,
    kv: KvLayout,
    weight_bytes: u64,
    timeout: Duration,
    /// Set once a step hung or a GPU failed: every later call returns it.
    failed: Option<String>,
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
        check_nccl(libs).map_err(cuda)?;
        let n_gpus = Gpu::count(libs).map_err(cuda)?;
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
        let new_id = || NcclId::new().map_err(cuda);
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
                value_type: super::kv_cache::value_type_name(opts.kv_cache_dtype, opts.dtype),
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

    /// Aborts the communicators and tells every worker to stop; later calls fail with `why`.
    fn shut_down(&mut self, why: &str) {
        self.stop.store(true, Ordering::SeqCst);
        // ncclCommAbort returns only once the graphs that captured the communicator are gone,
        // and those belong to workers that may be stuck: abort from threads of their own (the
        // abort flag is raised at once) and never wait for them here.
        for a in self.aborts.drain(..) {
            if let Ok(t) = std::thread::Builder::new()
                .name("strata-nccl-abort".into())
                .spawn(move || a.abort())
            {
                self.aborting.push(t);
            }
        }
        for tx in &self.jobs {
            let _ = tx.send(Job::Stop);
        }
        self.failed.get_or_insert_with(|| why.to_string());
    }

    /// The watchdog's verdict on `step`, which did not finish in time.
    fn hung(&mut self, step: u64, waited: Duration) -> ModelError {
        let l = &self.layout;
        let mut who = Vec::new();
        for (w, p) in self.progress.iter().enumerate() {
            if p.finished.load(Ordering::SeqCst) >= step {
                continue;
            }
            let g = l.gpus[w];
            let (stage, rank) = (w / l.tp, w % l.tp);
            let state = if p.started.load(Ordering::SeqCst) >= step {
                "is waiting on the GPU"
            } else {
                "stopped responding (never started the step)"
            };
            who.push(format!("GPU {g} (stage {stage}, TP rank {rank}) {state}"));
        }
        let all = gpu_list(&l.gpus);
        let op = match (l.tp > 1, l.pp() > 1) {
            (true, false) => format!("the tensor-parallel all-reduce over GPUs {all}"),
            (false, true) => format!("the pipeline hand-off between stages on GPUs {all}"),
            _ => format!("the tensor-parallel all-reduces and pipeline hand-offs over GPUs {all}"),
        };
        let advice = if l.tp > 1 {
            format!(
                "if the GPUs lack a fast link, split by layers instead (--tensor-parallel-size 1 --pipeline-parallel-size {}: one hand-off per stage, no all-reduce per layer; `strata plan` compares them), or set NCCL_P2P_DISABLE=1 when peer-to-peer copies hang; `strata topo --measure` shows the links",
                l.tp * l.pp()
            )
        } else {
            "set NCCL_P2P_DISABLE=1 (and NCCL_SHM_DISABLE=1) when peer-to-peer copies hang; `strata topo --measure` shows the links".to_string()
        };
        let msg = format!(
            "{op} did not finish within {:.0} s (step {step}): {}. strata aborted the NCCL communicators and stopped serving. Try: {advice}",
            waited.as_secs_f64(),
            if who.is_empty() { "no worker reported".to_string() } else { who.join("; ") }
        );
        tracing::error!("{msg}");
        self.shut_down(&msg);
        ModelError::Unavailable(msg)
    }

    fn dead(&self) -> Option<ModelError> {
        self.failed.as_ref().map(|f| ModelError::Unavailable(f.clone()))
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

/// How long dropping a hung executor waits for its threads to leave the GPU libraries.
const HUNG_EXIT_GRACE: Duration = Duration::from_secs(3);

impl Drop for ParallelExecutor {
    fn drop(&mut self) {
        let hung = self.failed.is_some();
        self.stop.store(true, Ordering::SeqCst);
        for tx in &self.jobs {
            let _ = tx.send(Job::Stop);
        }
        let threads = self.threads.iter_mut().filter_map(Option::take);
        if !hung {
            for t in threads {
                let _ = t.join();
            }
            return;
        }
        // Workers and aborts of a hung group may stay blocked in the driver: give them a while
        // to release their GPUs (a process that exits while they are inside CUDA or NCCL can
        // crash in the libraries' teardown), then leave the rest.
        let mut left: Vec<JoinHandle<()>> = threads.chain(self.aborting.drain(..)).collect();
        let deadline = Instant::now() + HUNG_EXIT_GRACE;
        while !left.is_empty() && Instant::now() < deadline {
            left.retain(|t| !t.is_finished());
            std::thread::sleep(Duration::from_millis(20));
        }
        if !left.is_empty() {
            tracing::warn!(
                "{} GPU thread(s) still blocked in the driver after {} s; leaving them",
                left.len(),
                HUNG_EXIT_GRACE.as_secs()
            );
        }
    }
}

/// Everything one worker thread owns.
struct WorkerContext {
    index: usize,
    ordinal: usize,
    shard: Shard,
    /// (id, size, rank) of its TP group's and its pipeline column's communicators.
    tp_comm: Option<(NcclId, usize, usize)>,
    pp_comm: Option<(NcclId, usize, usize)>,
    transformer: Arc<Transformer>,
    opts: GpuOptions,
    libs: LibrarySearch,
    init: Sender<(usize, Result<InitMsg, ModelError>)>,
    allocs: Receiver<usize>,
    jobs: Receiver<Job>,
    reports: Sender<Report>,
    progress: Arc<Vec<WorkerProgress>>,
    upload: Arc<Vec<(AtomicU64, AtomicU64)>>,
    stop: Arc<AtomicBool>,
}

impl WorkerContext {
    fn run(self) {
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
    fn start(&self) -> Result<Option<super::GpuTransformer>, ModelError> {
        let w = self.index;
        let gpu = Gpu::open(self.ordinal, &self.libs).map_err(cuda)?;
        let join = |c: Option<(NcclId, usize, usize)>| {
            c.map(|(id, size, rank)| Communicator::init(&gpu, id, size, rank))
                .transpose()
                .map_err(cuda)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_layouts_cover_the_layers() {
        let l = ParallelLayout::even(32, 1, 3);
        assert_eq!(l.stages, vec![0..11, 11..22, 22..32]);
        assert_eq!(l.gpus, vec![0, 1, 2]);
        let l = ParallelLayout::even(80, 2, 2);
        assert_eq!(l.stages, vec![0..40, 40..80]);
        assert_eq!(l.describe(), "TP 2 x PP 2 on GPUs 0,1,2,3");
        assert_eq!(l.shard(3, 80).tp_rank, 1);
        assert_eq!(l.shard(3, 80).layers, 40..80);
    }

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

    fn config() -> ModelConfig {
        crate::cuda::shard::tests_support::llama_8b()
    }

    #[test]
    fn layouts_are_checked_against_the_model() {
        let c = config();
        assert!(ParallelLayout::even(32, 2, 1).check(&c).is_ok());
        let mut gaps = ParallelLayout::even(32, 1, 2);
        gaps.stages[1] = 17..32;
        assert!(gaps.check(&c).unwrap_err().contains("cover layers"));
        let mut twice = ParallelLayout::even(32, 2, 1);
        twice.gpus = vec![0, 0];
        assert!(twice.check(&c).unwrap_err().contains("twice"));
        assert!(ParallelLayout::even(32, 3, 1).check(&c).is_err());
    }
}
