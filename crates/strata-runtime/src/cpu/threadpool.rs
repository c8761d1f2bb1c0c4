//! A small fork-join thread pool tuned for the many short parallel steps of a forward pass.
//! Workers spin briefly between jobs (a decode step issues hundreds) and then park; a job's parts
//! that no worker has claimed yet are run by the caller, so a descheduled worker never stalls a step.

use std::cell::UnsafeCell;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before it parks.
const SPIN_FOR: Duration = Duration::from_millis(2);
/// How long the caller spins on a worker's part before it starts yielding its core.
const YIELD_AFTER: Duration = Duration::from_micros(50);

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// The job of the current epoch; written only while no worker runs one.
    job: UnsafeCell<Option<&'static Job>>,
    epoch: AtomicU64,
    /// Next part index of the current job to hand out (parts 1..n; part 0 is the caller's).
    next_part: AtomicUsize,
    /// Parts 1..n finished in the current job.
    done: AtomicUsize,
    /// Workers blocked on `wake` (so `run` can skip the wake-up syscall while all spin).
    parked: AtomicUsize,
    shutdown: AtomicBool,
    park: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is written by the one thread that calls `run` (serialised by `&mut`-like use
// through `run_lock`) while every worker is idle, and read by workers only after they observe
// the epoch bump that publishes it (Release/Acquire on `epoch`).
unsafe impl Sync for Shared {}

/// A pool of `n` threads: the calling thread plus `n - 1` workers.
pub struct ThreadPool {
    n_threads: usize,
    shared: Arc<Shared>,
    run_lock: Mutex<()>,
    workers: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool")
            .field("n_threads", &self.n_threads)
            .finish()
    }
}

impl ThreadPool {
    /// A pool of `n_threads` (at least 1; the caller of `run` is thread 0).
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            job: UnsafeCell::new(None),
            epoch: AtomicU64::new(0),
            next_part: AtomicUsize::new(usize::MAX / 2),
            done: AtomicUsize::new(0),
            parked: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
            park: Mutex::new(()),
            wake: Condvar::new(),
        });
        let workers = (1..n_threads)
            .map(|index| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("strata-cpu-{index}"))
                    .spawn(move || worker_loop(&shared, n_threads))
                    .unwrap_or_else(|e| panic!("cannot start CPU worker thread: {e}"))
            })
            .collect();
        ThreadPool {
            n_threads,
            shared,
            run_lock: Mutex::new(()),
            workers,
        }
    }

    /// A pool with one thread per available core.
    pub fn with_all_cores() -> ThreadPool {
        ThreadPool::new(std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1))
    }

    /// Number of threads, the caller included.
    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(part)` for every part `0..n_threads`, each exactly once, and returns when all are
    /// done. The caller runs part 0 and any part no worker has claimed by then.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.n_threads == 1 {
            f(0);
            return;
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: we erase the lifetime of `f` to store it; `run` does not return before every
        // part is done, so no worker holds it after that.
        let job: &'static Job = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), &'static Job>(f) };
        // SAFETY: no worker runs a job now: the previous `run` waited until every part it
        // handed out was done, and parts are handed out only after the reset below.
        unsafe { *self.shared.job.get() = Some(job) };
        let n = self.n_threads;
        self.shared.done.store(0, Ordering::Relaxed);
        // Publishes the job to whoever claims a part from here on (Release pairs with the
        // claim's AcqRel).
        self.shared.next_part.store(1, Ordering::Release);
        self.shared.epoch.fetch_add(1, Ordering::SeqCst);
        // A worker increments `parked` before its last look at `epoch` (both SeqCst), so either
        // we see it parked and wake it, or it sees the new epoch and does not sleep.
        if self.shared.parked.load(Ordering::SeqCst) > 0 {
            let _p = self.shared.park.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        f(0);
        // Parts no worker has claimed yet (it is parked, or descheduled by the OS) are ours.
        loop {
            let part = self.shared.next_part.fetch_add(1, Ordering::AcqRel);
            if part >= n {
                break;
            }
            f(part);
            self.shared.done.fetch_add(1, Ordering::Release);
        }
        // Wait for parts that workers are running. Spin first (parts take microseconds); yield
        // only when one takes long, i.e. its worker was preempted and needs this core back.
        let start = Instant::now();
        while self.shared.done.load(Ordering::Acquire) != n - 1 {
            if start.elapsed() > YIELD_AFTER {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // SAFETY: every part is done; no worker holds the job.
        unsafe { *self.shared.job.get() = None };
    }

    /// Splits `0..n` into contiguous ranges of a multiple of `min_chunk` items (the last may be
    /// shorter), so every range starts at a multiple of `min_chunk`, and runs `f` on them across
    /// the pool (dynamic: threads take the next range when they finish one).
    pub fn parallel_for(&self, n: usize, min_chunk: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        if n == 0 {
            return;
        }
        let min_chunk = min_chunk.max(1);
        if self.n_threads == 1 || n <= min_chunk {
            f(0..n);
            return;
        }
        // Aim for a few chunks per thread so uneven work balances.
        let chunk = n.div_ceil(self.n_threads * 4).next_multiple_of(min_chunk);
        let next = AtomicUsize::new(0);
        self.run(&|_| loop {
            let start = next.fetch_add(chunk, Ordering::Relaxed);
            if start >= n {
                break;
            }
            f(start..(start + chunk).min(n));
        });
    }

    /// Splits `0..n` into one contiguous, equal part per thread (static; cheapest for
    /// uniform work such as the rows of a matrix-vector product).
    pub fn split_even(&self, n: usize, align: usize, f: &(dyn Fn(Range<usize>) + Sync)) {
        let align = align.max(1);
        let threads = self.n_threads;
        if threads == 1 || n <= align {
            f(0..n);
            return;
        }
        let per = n.div_ceil(threads).div_ceil(align) * align;
        self.run(&|t| {
            let start = (t * per).min(n);
            let end = ((t + 1) * per).min(n);
            if start < end {
                f(start..end);
            }
        });
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _p = self.shared.park.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

fn worker_loop(shared: &Shared, n_threads: usize) {
    let mut seen = 0u64;
    loop {
        let spin_start = Instant::now();
        let mut spins = 0u32;
        let epoch = loop {
            let e = shared.epoch.load(Ordering::Acquire);
            if e != seen || shared.shutdown.load(Ordering::Acquire) {
                break e;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(1024) && spin_start.elapsed() > SPIN_FOR {
                let mut guard = shared.park.lock().unwrap_or_else(|p| p.into_inner());
                shared.parked.fetch_add(1, Ordering::SeqCst);
                while shared.epoch.load(Ordering::SeqCst) == seen && !shared.shutdown.load(Ordering::Acquire) {
                    guard = shared.wake.wait(guard).unwrap_or_else(|p| p.into_inner());
                }
                shared.parked.fetch_sub(1, Ordering::SeqCst);
                break shared.epoch.load(Ordering::Acquire);
            }
            std::hint::spin_loop();
        };
        if shared.shutdown.load(Ordering::Acquire) {
            return;
        }
        seen = epoch;
        // Claim a part; late claims (the caller took the parts already) get none.
        let part = shared.next_part.fetch_add(1, Ordering::AcqRel);
        if part >= n_threads {
            continue;
        }
        // SAFETY: the claim (AcqRel, after the caller's Release reset) published the job, which
        // stays valid until this part is counted done.
        let job = unsafe { *shared.job.get() };
        if let Some(job) = job {
            job(part);
        }
        shared.done.fetch_add(1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_exactly_once_also_when_workers_are_parked() {
        let pool = ThreadPool::new(3);
        for round in 0..2000 {
            if round % 500 == 0 {
                std::thread::sleep(SPIN_FOR * 2); // workers park; the caller takes their parts
            }
            let hits: Vec<AtomicUsize> = (0..3).map(|_| AtomicUsize::new(0)).collect();
            pool.run(&|part| {
                hits[part].fetch_add(1, Ordering::Relaxed);
            });
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "round {round}");
        }
    }

    #[test]
    fn every_item_visited_once() {
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads);
            for n in [0, 1, 7, 100, 1000] {
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.parallel_for(n, 3, &|r| {
                    assert_eq!(r.start % 3, 0, "parallel_for ranges start on a multiple of min_chunk");
                    for i in r {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(
                    hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                    "parallel_for n={n}"
                );
                let hits: Vec<AtomicUsize> = (0..n).map(|_| AtomicUsize::new(0)).collect();
                pool.split_even(n, 4, &|r| {
                    assert_eq!(r.start % 4, 0, "split_even ranges start on a multiple of align");
                    for i in r {
                        hits[i].fetch_add(1, Ordering::Relaxed);
                    }
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1), "split_even n={n}");
            }
        }
    }

    #[test]
    fn many_short_jobs_and_parking() {
        let pool = ThreadPool::new(2);
        let total = AtomicUsize::new(0);
        for i in 0..5000 {
            pool.run(&|_| {
                total.fetch_add(1, Ordering::Relaxed);
            });
            if i == 100 {
                std::thread::sleep(SPIN_FOR * 3); // let the worker park, then wake it
            }
        }
        assert_eq!(total.load(Ordering::Relaxed), 10000);
    }
}
