//! The watchdog of the multi-GPU executor: how long a step may take, which GPU stopped and what
//! to try, aborting the NCCL communicators of a hung group, and leaving its threads on drop.

use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use strata_model::ModelError;

use super::tensor_pipeline::ParallelExecutor;
use super::worker::Job;
use crate::layout::gpu_list;

/// The first step also sets up NCCL's connections and captures graphs: it gets this many
/// collective timeouts.
pub(super) const FIRST_STEP_TIMEOUTS: u32 = 4;

/// A test hook: `STRATA_FAULT_STALL=W:S` makes worker W stop responding when step S reaches it,
/// as a hung GPU or link would (the watchdog tests use it).
pub(super) fn fault_stall() -> Option<(usize, u64)> {
    let v = std::env::var("STRATA_FAULT_STALL").ok()?;
    let (w, s) = v.split_once(':')?;
    Some((w.trim().parse().ok()?, s.trim().parse().ok()?))
}

/// The last step each worker started and finished (0 = none), for the watchdog's message, and
/// the step at which it is to stop responding (a test of the watchdog; 0 = never).
#[derive(Default)]
pub(super) struct WorkerProgress {
    pub(super) started: AtomicU64,
    pub(super) finished: AtomicU64,
    pub(super) stall_at: AtomicU64,
}

impl ParallelExecutor {
    /// Aborts the communicators and tells every worker to stop; later calls fail with `why`.
    pub(super) fn shut_down(&mut self, why: &str) {
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
    pub(super) fn hung(&mut self, step: u64, waited: Duration) -> ModelError {
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

    pub(super) fn dead(&self) -> Option<ModelError> {
        self.failed.as_ref().map(|f| ModelError::Unavailable(f.clone()))
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
