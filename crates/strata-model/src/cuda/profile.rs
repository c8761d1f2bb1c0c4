//! `STRATA_GPU_PROFILE=1`: the GPU time of every kernel of eager steps and of every graph launch
//! (CUDA events around each, no host synchronisation in between) and the host time of each phase.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::time::Instant;

use strata_runtime::cuda::{CudaError, Event, Gpu};

/// Timed launches not yet read back are resolved in batches of this many.
const PENDING_MAX: usize = 4096;

/// Per-name totals of kernel GPU time.
#[derive(Default)]
pub struct KernelProfile {
    /// Name -> (milliseconds, calls).
    totals: RefCell<HashMap<String, (f64, u64)>>,
    pending: RefCell<Vec<(String, Event, Event)>>,
    /// Host phase -> (milliseconds, steps).
    host: RefCell<HashMap<&'static str, (f64, u64)>>,
    /// When the previous step returned to the engine, and the current phase's start.
    last_exit: Cell<Option<Instant>>,
    phase_start: Cell<Option<Instant>>,
    /// The longest gap between steps, in ms: start-up work (the memory probe's step, then the
    /// cache allocation) lands in one gap, which the report also leaves out of the mean.
    longest_gap: Cell<f64>,
}

/// The host phase between two steps.
const BETWEEN_STEPS: &str = "between steps (engine, sampling)";

impl KernelProfile {
    /// A profile when `on` (`STRATA_GPU_PROFILE` is set: [`super::knobs::GpuKnobs`]).
    pub fn when(on: bool) -> Option<KernelProfile> {
        on.then(KernelProfile::default)
    }

    /// Marks the start of a launch.
    pub fn start(&self, gpu: &Gpu) -> Result<Event, CudaError> {
        gpu.record_event()
    }

    /// Marks the end of the launch begun at `start`.
    pub fn end(&self, gpu: &Gpu, start: Event, name: String) -> Result<(), CudaError> {
        let end = gpu.record_event()?;
        let full = {
            let mut p = self.pending.borrow_mut();
            p.push((name, start, end));
            p.len() >= PENDING_MAX
        };
        if full {
            self.resolve()?;
        }
        Ok(())
    }

    /// A step begins: the time since the previous one returned is the engine's.
    pub fn step_begins(&self) {
        let now = Instant::now();
        if let Some(t) = self.last_exit.get() {
            self.add_host(BETWEEN_STEPS, now - t);
            let ms = (now - t).as_secs_f64() * 1e3;
            self.longest_gap.set(self.longest_gap.get().max(ms));
        }
        self.phase_start.set(Some(now));
    }

    /// The current host phase of a step ends.
    pub fn phase_ends(&self, name: &'static str) {
        let now = Instant::now();
        if let Some(t) = self.phase_start.replace(Some(now)) {
            self.add_host(name, now - t);
        }
    }

    /// The step returns to the engine.
    pub fn step_ends(&self) {
        self.phase_ends("wait for the GPU, read back");
        self.last_exit.set(Some(Instant::now()));
    }

    fn add_host(&self, name: &'static str, d: std::time::Duration) {
        let mut h = self.host.borrow_mut();
        let e = h.entry(name).or_default();
        e.0 += d.as_secs_f64() * 1e3;
        e.1 += 1;
    }

    fn resolve(&self) -> Result<(), CudaError> {
        let pending = std::mem::take(&mut *self.pending.borrow_mut());
        let mut totals = self.totals.borrow_mut();
        for (name, start, end) in pending {
            let ms = start.elapsed_ms(&end)? as f64;
            let e = totals.entry(name).or_default();
            e.0 += ms;
            e.1 += 1;
        }
        Ok(())
    }

    /// Prints the totals, largest first.
    pub fn report(&self) {
        if let Err(e) = self.resolve() {
            eprintln!("GPU profile incomplete: {e}");
        }
        let mut rows: Vec<_> = self.totals.borrow().iter().map(|(k, v)| (k.clone(), *v)).collect();
        rows.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        let total: f64 = rows.iter().map(|r| r.1 .0).sum();
        eprintln!(
            "GPU profile (GPU time by CUDA events of each kernel of eager steps, of each graph launch \
             otherwise): {total:.1} ms in all"
        );
        for (name, (ms, n)) in rows {
            eprintln!(
                "  {name:<40} {ms:>9.2} ms {:>5.1}% {n:>7} calls {:>8.1} us/call",
                100.0 * ms / total.max(1e-12),
                ms * 1e3 / n.max(1) as f64
            );
        }
        let mut host: Vec<_> = self.host.borrow().iter().map(|(k, v)| (*k, *v)).collect();
        host.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
        eprintln!("host time per step (graph and eager steps):");
        for (name, (ms, n)) in host {
            eprintln!(
                "  {name:<36} {ms:>9.2} ms {n:>7} steps {:>8.1} us/step",
                ms * 1e3 / n.max(1) as f64
            );
            if name == BETWEEN_STEPS && n > 1 {
                let longest = self.longest_gap.get();
                eprintln!(
                    "    without the longest gap ({longest:.2} ms, start-up work): {:.1} us/step",
                    (ms - longest) * 1e3 / (n - 1) as f64
                );
            }
        }
    }
}
