//! The driver: runs a target's check on generated inputs for a case count or a time budget,
//! fails on a panic or a case over its memory or time bound, and shrinks and saves what failed.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

use crate::alloc::{peak_allocation, CurrentInput};

/// What a check made of one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The loader accepted it (and the check found what it returned consistent).
    Accepted,
    /// The loader refused it with an error.
    Refused,
}

/// How much one case may allocate and how long it may take.
#[derive(Debug, Clone, Copy)]
pub struct Bounds {
    /// Bytes allowed per byte of input: a loader's memory must follow the input's size, never a
    /// number written in it.
    pub bytes_per_input_byte: usize,
    /// Bytes allowed whatever the input (tables, compiled regexes, the check's own work).
    pub fixed_bytes: usize,
    /// Longest one case may take: a hang detector, generous for debug builds on a busy machine.
    pub time: Duration,
}

impl Bounds {
    fn max_bytes(&self, input_len: usize) -> usize {
        self.fixed_bytes + self.bytes_per_input_byte * input_len
    }
}

/// A fuzz target: a name (used in messages and for the saved input), its bounds and the number
/// of cases `make test` runs.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub name: &'static str,
    pub default_cases: u32,
    pub bounds: Bounds,
}

/// How long and from which seed to run, from `STRATA_FUZZ_CASES`, `STRATA_FUZZ_SECONDS` and
/// `STRATA_FUZZ_SEED` (`make fuzz` sets the time; `make test` runs the default cases, seed 0).
struct Plan {
    cases: Option<u64>,
    deadline: Option<Instant>,
    seed: u64,
}

impl Plan {
    fn from_env(default_cases: u32) -> Plan {
        let number = |key: &str| {
            std::env::var(key).ok().map(|v| {
                v.parse::<u64>()
                    .unwrap_or_else(|_| panic!("{key}={v:?} is not a number"))
            })
        };
        let seconds = number("STRATA_FUZZ_SECONDS");
        let seed = number("STRATA_FUZZ_SEED").unwrap_or_else(|| {
            // A timed run explores; a plain `make test` repeats the same cases every time.
            match seconds {
                Some(_) => std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64),
                None => 0,
            }
        });
        Plan {
            cases: number("STRATA_FUZZ_CASES").or(match seconds {
                Some(_) => None,
                None => Some(u64::from(default_cases)),
            }),
            deadline: seconds.map(|s| Instant::now() + Duration::from_secs(s)),
            seed,
        }
    }

    fn more(&self, done: u64) -> bool {
        self.cases.is_none_or(|c| done < c) && self.deadline.is_none_or(|d| Instant::now() < d)
    }
}

/// A case being checked, as the watchdog sees it.
struct RunningCase {
    thread: std::thread::ThreadId,
    name: &'static str,
    hang_after: Instant,
    input: Vec<u8>,
    save_to: &'static str,
}

/// The cases running now, one per fuzzing thread.
static RUNNING: Mutex<Vec<RunningCase>> = Mutex::new(Vec::new());

/// A case that runs this many times its time bound has hung: the check will not return, so no
/// bound checked after it would ever fire.
const HANG_FACTOR: u32 = 15;

/// Starts (once) the thread that saves the input of a hung case and aborts the process, so a
/// hang ends the test run with the input on disk instead of stalling it forever.
fn start_watchdog() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        std::thread::spawn(|| loop {
            std::thread::sleep(Duration::from_millis(200));
            let running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(case) = running.iter().find(|c| Instant::now() > c.hang_after) {
                let _ = std::fs::write(case.save_to, &case.input);
                eprintln!(
                    "strata-fuzz: {}: a case hung (ran {HANG_FACTOR} times its time bound); its {}-byte input \
                     is saved at {}",
                    case.name,
                    case.input.len(),
                    case.save_to
                );
                std::process::abort();
            }
        });
    });
}

/// Keeps a case on the watchdog's list while it runs.
struct Watched;

impl Watched {
    fn start(target: &Target, input: &[u8], save_to: &'static str) -> Watched {
        start_watchdog();
        let case = RunningCase {
            thread: std::thread::current().id(),
            name: target.name,
            hang_after: Instant::now() + target.bounds.time * HANG_FACTOR,
            input: input.to_vec(),
            save_to,
        };
        RUNNING.lock().unwrap_or_else(|e| e.into_inner()).push(case);
        Watched
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let me = std::thread::current().id();
        RUNNING
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|c| c.thread != me);
    }
}

thread_local! {
    /// Where the last panic on this thread happened, kept by the quiet panic hook.
    static LAST_PANIC_AT: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// Replaces the panic hook (once) by one that only notes where a panic happened: the driver
/// reports the panics it catches itself, and the default hook's backtrace would both flood the
/// output and count megabytes against the case (loaders that catch a library's panic see the
/// hook run too).
fn quiet_panics() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        std::panic::set_hook(Box::new(|info| {
            let at = info.location().map(|l| l.to_string()).unwrap_or_default();
            let _ = LAST_PANIC_AT.try_with(|p| *p.borrow_mut() = at);
        }))
    });
}

/// Why a case failed.
fn run_case(
    target: &Target,
    input: &[u8],
    save_to: &'static str,
    check: &dyn Fn(&[u8]) -> Outcome,
) -> Result<Outcome, String> {
    quiet_panics();
    let _watched = Watched::start(target, input, save_to);
    let _registered = CurrentInput::set(input, save_to);
    let started = Instant::now();
    let (result, peak) = peak_allocation(|| catch_unwind(AssertUnwindSafe(|| check(input))));
    let elapsed = started.elapsed();
    let outcome = result.map_err(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        let at = LAST_PANIC_AT.with(|p| p.borrow().clone());
        format!("panicked at {at}: {message}")
    })?;
    let max = target.bounds.max_bytes(input.len());
    if peak > max {
        return Err(format!(
            "allocated {peak} bytes for a {}-byte input (bound {max})",
            input.len()
        ));
    }
    if elapsed > target.bounds.time {
        return Err(format!("took {elapsed:.1?} (bound {:.1?})", target.bounds.time));
    }
    Ok(outcome)
}

/// Where a failing input of `target` is saved.
fn failure_path(target: &Target, seed: u64) -> &'static str {
    let dir = std::env::temp_dir().join("strata-fuzz");
    let _ = std::fs::create_dir_all(&dir);
    let path = dir.join(format!("{}-seed{seed}.bin", target.name));
    Box::leak(path.display().to_string().into_boxed_str())
}

/// Runs `check` on inputs drawn from `inputs` (see [`Plan`] for how many), and panics with the
/// smallest failing input found, saved to a file, when one fails. Also panics when every case
/// was refused or every one accepted, which means the mutations no longer reach past the
/// loader's first checks, or no longer break anything.
pub fn fuzz(target: Target, inputs: impl Strategy<Value = Vec<u8>>, check: impl Fn(&[u8]) -> Outcome) {
    let plan = Plan::from_env(target.default_cases);
    let save_to = failure_path(&target, plan.seed);
    let mut seed_bytes = [0u8; 32];
    seed_bytes[..8].copy_from_slice(&plan.seed.to_le_bytes());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &seed_bytes);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let started = Instant::now();
    let (mut done, mut accepted) = (0u64, 0u64);
    while plan.more(done) {
        let mut tree = inputs
            .new_tree(&mut runner)
            .unwrap_or_else(|e| panic!("{}: cannot generate an input: {e}", target.name));
        match run_case(&target, &tree.current(), save_to, &check) {
            Ok(Outcome::Accepted) => accepted += 1,
            Ok(Outcome::Refused) => {}
            Err(why) => {
                let (input, why) = shrink(&target, &mut tree, why, save_to, &check);
                let _ = std::fs::write(save_to, &input);
                panic!(
                    "{}: case {done} (seed {}) {why}; the {}-byte input is saved at {save_to} \
                     (replay it by adding it to the target's regression folder)",
                    target.name,
                    plan.seed,
                    input.len()
                );
            }
        }
        done += 1;
    }
    eprintln!(
        "{}: {done} cases in {:.1?} (seed {}), {accepted} accepted",
        target.name,
        started.elapsed(),
        plan.seed
    );
    if done >= 100 {
        assert!(accepted > 0, "{}: no input was accepted", target.name);
        assert!(accepted < done, "{}: every input was accepted", target.name);
    }
}

/// Simplifies a failing input while it still fails (at most a minute or 1000 steps).
fn shrink<T: ValueTree<Value = Vec<u8>>>(
    target: &Target,
    tree: &mut T,
    why: String,
    save_to: &'static str,
    check: &dyn Fn(&[u8]) -> Outcome,
) -> (Vec<u8>, String) {
    let mut best = (tree.current(), why);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut simplify = true;
    for _ in 0..1000 {
        if Instant::now() > deadline {
            break;
        }
        let moved = if simplify { tree.simplify() } else { tree.complicate() };
        if !moved {
            break;
        }
        let candidate = tree.current();
        match run_case(target, &candidate, save_to, check) {
            Err(why) => {
                best = (candidate, why);
                simplify = true;
            }
            Ok(_) => simplify = false,
        }
    }
    best
}

/// Where a crate commits `target`'s inputs that once failed: `tests/fuzz_regressions/<name>/`
/// under `manifest_dir` (the fuzz test's `env!("CARGO_MANIFEST_DIR")`).
pub fn regressions_dir(manifest_dir: &str, target: &Target) -> PathBuf {
    Path::new(manifest_dir).join("tests/fuzz_regressions").join(target.name)
}

/// Runs `check` on every file in `dir` (committed inputs that once failed), with the target's
/// bounds; panics naming the first that fails. A missing folder holds no regressions.
pub fn replay_dir(target: Target, dir: &Path, check: impl Fn(&[u8]) -> Outcome) -> usize {
    let mut files: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries.filter_map(|e| e.ok().map(|e| e.path())).collect(),
        Err(_) => return 0,
    };
    files.sort();
    let save_to = failure_path(&target, 0);
    for file in &files {
        let input = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        if let Err(why) = run_case(&target, &input, save_to, &check) {
            panic!("{}: regression {} {why}", target.name, file.display());
        }
    }
    files.len()
}
