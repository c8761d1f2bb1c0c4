//! Drives the load: warm-up, then a closed loop (N users) or an open loop (Poisson or constant arrivals with a
//! concurrency cap) until a request count or a duration. Owns scheduling and the progress bar.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use indicatif::{ProgressBar, ProgressStyle};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::client::{RequestFailure, RequestSender, TimedCompletion};
use crate::config::{Arrival, BenchConfig, LoadShape};
use crate::rng::SeededRng;
use crate::workload::{PreparedRequest, Workload};

/// What happened to one sent request.
#[derive(Debug)]
pub struct RequestRecord {
    /// Prompt tokens as counted when the request was prepared.
    pub input_tokens: u64,
    pub result: Result<TimedCompletion, RequestFailure>,
    /// Resent once on a new connection after its kept-alive one closed unanswered.
    pub retried: bool,
}

/// Every measured request of a run, and the counts of the warm-up.
#[derive(Debug)]
pub struct RunRecords {
    pub measured: Vec<RequestRecord>,
    pub warmup_sent: u64,
    pub warmup_failed: u64,
    /// From the first measured request sent to the last one finished.
    pub wall: Duration,
    pub started_unix_s: f64,
}

/// Warm-up users when an open loop has no concurrency cap.
const OPEN_LOOP_WARMUP_USERS: usize = 8;

#[derive(Clone, Copy, Debug)]
enum Phase {
    Warmup,
    Measured,
}

fn request_for(workload: &Workload, phase: Phase, i: u64) -> &PreparedRequest {
    match phase {
        Phase::Warmup => &workload.warmup[i as usize],
        Phase::Measured => workload.measured_request(i),
    }
}

/// Runs the warm-up and then the measured phase.
pub async fn drive(cfg: &BenchConfig, workload: &Arc<Workload>, sender: &RequestSender) -> RunRecords {
    let warmup_count = workload.warmup.len() as u64;
    let (mut warmup_sent, mut warmup_failed) = (0, 0);
    if warmup_count > 0 {
        let users = cfg.load.concurrency().unwrap_or(OPEN_LOOP_WARMUP_USERS);
        let users = users.min(warmup_count as usize);
        let bar = progress_bar(cfg, "warm-up", Some(warmup_count));
        let records = closed_loop(sender, workload, Phase::Warmup, users, Some(warmup_count), None, &bar).await;
        finish(bar);
        warmup_sent = records.len() as u64;
        warmup_failed = records.iter().filter(|r| r.result.is_err()).count() as u64;
    }
    let started_unix_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0);
    let start = Instant::now();
    let deadline = cfg.duration_s.map(|s| start + Duration::from_secs_f64(s));
    let prefix = match cfg.load.concurrency() {
        Some(c) => format!("c={c}"),
        None => "run".to_string(),
    };
    let bar = progress_bar(cfg, &prefix, cfg.num_requests);
    let measured = match &cfg.load {
        LoadShape::ClosedLoop { users } => {
            closed_loop(
                sender,
                workload,
                Phase::Measured,
                *users,
                cfg.num_requests,
                deadline,
                &bar,
            )
            .await
        }
        LoadShape::OpenLoop {
            rate,
            arrival,
            max_concurrency,
        } => {
            let schedule = Schedule {
                rate: *rate,
                arrival: *arrival,
                max_concurrency: *max_concurrency,
                limit: cfg.num_requests,
                deadline,
                seed: cfg.seed,
            };
            open_loop(sender, workload, schedule, &bar).await
        }
    };
    finish(bar);
    RunRecords {
        measured,
        warmup_sent,
        warmup_failed,
        wall: start.elapsed(),
        started_unix_s,
    }
}

/// `users` tasks, each sending its next request as soon as its previous one ends.
async fn closed_loop(
    sender: &RequestSender,
    workload: &Arc<Workload>,
    phase: Phase,
    users: usize,
    limit: Option<u64>,
    deadline: Option<Instant>,
    bar: &Option<ProgressBar>,
) -> Vec<RequestRecord> {
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..users {
        let (next, workload, sender, bar) = (next.clone(), workload.clone(), sender.clone(), bar.clone());
        tasks.spawn(async move {
            let mut records = Vec::new();
            loop {
                if deadline.is_some_and(|d| Instant::now() >= d) {
                    break;
                }
                let i = next.fetch_add(1, Ordering::Relaxed);
                if limit.is_some_and(|l| i >= l) {
                    break;
                }
                let request = request_for(&workload, phase, i);
                let sent = sender.send(request.body.clone()).await;
                if let Some(bar) = &bar {
                    bar.inc(1);
                }
                records.push(RequestRecord {
                    input_tokens: request.input_tokens,
                    result: sent.result,
                    retried: sent.retried,
                });
            }
            records
        });
    }
    let mut all = Vec::new();
    while let Some(joined) = tasks.join_next().await {
        if let Ok(records) = joined {
            all.extend(records);
        }
    }
    all
}

/// When requests arrive in an open loop.
#[derive(Clone, Copy, Debug)]
struct Schedule {
    rate: f64,
    arrival: Arrival,
    max_concurrency: Option<usize>,
    limit: Option<u64>,
    deadline: Option<Instant>,
    seed: u64,
}

/// Sends requests at scheduled arrival times, whether or not earlier ones have finished.
/// With a cap, an arrival waits for a free slot and is sent as soon as one frees.
async fn open_loop(
    sender: &RequestSender,
    workload: &Arc<Workload>,
    schedule: Schedule,
    bar: &Option<ProgressBar>,
) -> Vec<RequestRecord> {
    let slots = schedule.max_concurrency.map(|c| Arc::new(Semaphore::new(c)));
    let mut rng = SeededRng::new(schedule.seed ^ 0x6172_7269_7661_6c73);
    let start = Instant::now();
    let mut offset_s = 0.0f64;
    let mut tasks = JoinSet::new();
    let mut records = Vec::new();
    let mut i = 0u64;
    loop {
        if schedule.limit.is_some_and(|l| i >= l) {
            break;
        }
        let at = start + Duration::from_secs_f64(offset_s);
        if schedule.deadline.is_some_and(|d| at >= d) {
            break;
        }
        tokio::time::sleep_until(at).await;
        let permit = match &slots {
            Some(s) => s.clone().acquire_owned().await.ok(),
            None => None,
        };
        let (workload, sender, bar) = (workload.clone(), sender.clone(), bar.clone());
        tasks.spawn(async move {
            let request = workload.measured_request(i);
            let sent = sender.send(request.body.clone()).await;
            drop(permit);
            if let Some(bar) = &bar {
                bar.inc(1);
            }
            RequestRecord {
                input_tokens: request.input_tokens,
                result: sent.result,
                retried: sent.retried,
            }
        });
        i += 1;
        offset_s += match schedule.arrival {
            Arrival::Poisson => rng.exponential(schedule.rate),
            Arrival::Constant => 1.0 / schedule.rate,
        };
        while let Some(joined) = tasks.try_join_next() {
            records.extend(joined.ok());
        }
    }
    while let Some(joined) = tasks.join_next().await {
        records.extend(joined.ok());
    }
    records
}

fn progress_bar(cfg: &BenchConfig, prefix: &str, total: Option<u64>) -> Option<ProgressBar> {
    if !cfg.progress {
        return None;
    }
    let (bar, template) = match total {
        Some(n) => (
            ProgressBar::new(n),
            "{prefix:>8} [{bar:30}] {pos}/{len} requests, {per_sec}, {elapsed_precise}",
        ),
        None => (
            ProgressBar::new_spinner(),
            "{prefix:>8} {spinner} {pos} requests, {per_sec}, {elapsed_precise}",
        ),
    };
    bar.set_style(ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar()));
    bar.set_prefix(prefix.to_string());
    bar.enable_steady_tick(Duration::from_millis(200));
    Some(bar)
}

fn finish(bar: Option<ProgressBar>) {
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
}
