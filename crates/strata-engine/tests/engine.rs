//! The engine on the real default model: continuous batching, chunked prefill, preemption, aborts,
//! sampling, stop strings, pipelined executors, lost devices, panics and shutdown, against requests run alone.

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;

use common::default_model;
use strata_engine::{
    complete, cpu_executor, Completion, EngineConfig, EngineHandle, FinishReason, GenerationRequest, KvCacheDtype,
    NgramSpeculation, OutputConstraint, RequestOutput, RequestStream, SamplingParams, SubmitError,
};
use strata_model::loader::{default_model_path, load_model};
use strata_model::{
    CpuExecutor, DeviceSampling, Executor, KvLayout, Logits, LogitsWanted, ModelConfig, ModelError, RowAdjust, SeqChunk,
};

fn engine(config: EngineConfig) -> EngineHandle {
    EngineHandle::start(default_model(), config).expect("engine starts")
}

/// An engine on the CPU executor that `wrap` puts behind another interface.
fn engine_on(config: EngineConfig, wrap: impl FnOnce(CpuExecutor) -> Box<dyn Executor>) -> EngineHandle {
    let model = default_model();
    let cpu = cpu_executor(model.transformer, &config).expect("the cache fits");
    EngineHandle::start_with(wrap(cpu), model.tokenizer, model.chat_template, config).expect("engine starts")
}

/// One compute thread: the test harness already runs tests side by side on the two cores.
fn small_config() -> EngineConfig {
    EngineConfig {
        threads: 1,
        kv_cache_memory: 64 << 20,
        max_model_len: Some(1024),
        ..Default::default()
    }
}

fn collect(stream: RequestStream) -> Completion {
    complete(stream, &mut |_| {}).expect("request succeeds")
}

fn prompt(e: &EngineHandle, text: &str) -> Vec<u32> {
    e.tokenizer().encode(text, true, false).expect("encodes")
}

/// Prompts of very different lengths (the long ones take several prefill chunks).
fn prompts(e: &EngineHandle, n: usize) -> Vec<Vec<u32>> {
    (0..n)
        .map(|i| {
            let body = "The quick brown fox jumps over the lazy dog. ".repeat(1 + (i * 7) % 23);
            prompt(e, &format!("Story {i}: {body} Once upon a time, in town number {i},"))
        })
        .collect()
}

fn run_alone(e: &EngineHandle, req: GenerationRequest) -> Completion {
    collect(e.submit(req).expect("submit"))
}

/// Submits `n` greedy requests for `max_tokens` tokens each past end-of-generation, request i's
/// prompt being `text(i)`.
fn submit_numbered(
    e: &EngineHandle,
    n: usize,
    text: impl Fn(usize) -> String,
    max_tokens: usize,
) -> Vec<RequestStream> {
    (0..n)
        .map(|i| {
            let req = GenerationRequest {
                ignore_eos: true,
                ..GenerationRequest::greedy(prompt(e, &text(i)), max_tokens)
            };
            e.submit(req).expect("submit")
        })
        .collect()
}

/// Every message of `stream` until it ends (blocking).
fn drain(mut stream: RequestStream) -> Vec<RequestOutput> {
    let mut log = Vec::new();
    while let Some(out) = stream.blocking_next() {
        log.push(out);
    }
    log
}

fn run_together(e: &EngineHandle, reqs: Vec<GenerationRequest>) -> Vec<Completion> {
    let streams: Vec<RequestStream> = reqs.into_iter().map(|r| e.submit(r).expect("submit")).collect();
    streams.into_iter().map(collect).collect()
}

#[test]
fn greedy_output_is_the_same_alone_and_among_32_others_with_chunked_prefill() {
    let config = EngineConfig {
        max_num_batched_tokens: 64,
        ..small_config()
    };
    let e = engine(config);
    let ps = prompts(&e, 33);
    assert!(ps.iter().any(|p| p.len() > 150), "some prompts need several chunks");
    let req = |p: &Vec<u32>| GenerationRequest {
        ignore_eos: true,
        ..GenerationRequest::greedy(p.clone(), 12)
    };
    let together = run_together(&e, ps.iter().map(req).collect());
    // Alone: a few representative sequences (short, long, first, last).
    let mut longest = 0;
    for (i, p) in ps.iter().enumerate() {
        if p.len() > ps[longest].len() {
            longest = i;
        }
    }
    for i in [0, 5, longest, 32] {
        let alone = run_alone(&e, req(&ps[i]));
        assert_eq!(alone.tokens, together[i].tokens, "sequence {i} changed in the batch");
        assert_eq!(alone.text, together[i].text);
        assert_eq!(alone.tokens.len(), 12);
    }
    assert!(e.wait_idle(Duration::from_secs(10)));
    let s = e.stats();
    assert_eq!(s.kv_blocks_used, 0, "every block is back");
    assert!(
        s.prefix_cache_hit_rate > 0.0,
        "the repeated prompts hit the prefix cache"
    );
    // Decode-only steps are counted apart (benchmarks read them): each of the four sequences run
    // alone took one prompt step and 11 steps that only decoded it.
    assert!(s.decode_steps_total >= 4 * 11, "{s:?}");
    assert!(
        s.decode_steps_total < s.steps_total,
        "prompt steps are not decode-only: {s:?}"
    );
    assert!(s.decode_step_seqs_total >= s.decode_steps_total, "{s:?}");
    assert!(s.decode_step_seconds_total > 0.0, "{s:?}");
}

#[test]
fn preempted_sequences_finish_with_the_same_output() {
    // Room for 20 blocks of 16 tokens: 8 sequences of ~20 + 40 tokens (4 blocks each) cannot all fit.
    let mut config = small_config();
    let per_token = strata_model::PagedKvCache::bytes_per_token(
        &load_model(&default_model_path(), &|_, _| {})
            .unwrap()
            .transformer
            .config,
        KvCacheDtype::Auto,
    );
    config.kv_cache_memory = per_token * 16 * 20;
    config.max_model_len = Some(256);
    let e = engine(config);
    let ps: Vec<Vec<u32>> = (0..8)
        .map(|i| {
            prompt(
                &e,
                &format!("{i} little pigs went to the market and bought {i} apples, then"),
            )
        })
        .collect();
    let req = |p: &Vec<u32>| GenerationRequest {
        ignore_eos: true,
        ..GenerationRequest::greedy(p.clone(), 40)
    };
    let alone: Vec<Completion> = ps.iter().take(3).map(|p| run_alone(&e, req(p))).collect();
    let before = e.stats().preemptions_total;
    let together = run_together(&e, ps.iter().map(req).collect());
    assert!(
        e.stats().preemptions_total > before,
        "the cache was too small, so something was preempted"
    );
    for i in 0..3 {
        assert_eq!(
            alone[i].tokens, together[i].tokens,
            "sequence {i} changed after preemption"
        );
    }
    assert!(e.wait_idle(Duration::from_secs(10)));
    assert_eq!(e.stats().kv_blocks_used, 0);
}

#[test]
fn a_dropped_stream_frees_its_blocks_at_the_next_step() {
    let e = engine(small_config());
    let mut s = e
        .submit(GenerationRequest {
            ignore_eos: true,
            ..GenerationRequest::greedy(prompt(&e, "Count with me: one, two, three,"), 500)
        })
        .unwrap();
    // Read a few tokens, then go away mid-stream.
    for _ in 0..3 {
        assert!(matches!(s.blocking_next(), Some(RequestOutput::Delta { .. })));
    }
    assert!(e.stats().kv_blocks_used > 0);
    drop(s);
    assert!(
        e.wait_idle(Duration::from_secs(10)),
        "the aborted request left the engine"
    );
    assert_eq!(e.stats().kv_blocks_used, 0);
    assert_eq!(e.stats().running, 0);
}

#[test]
fn seeded_sampling_repeats_whatever_else_runs() {
    let e = engine(small_config());
    let req = |seed: u64| GenerationRequest {
        sampling: SamplingParams {
            temperature: 0.9,
            top_p: 0.95,
            top_k: 40,
            seed,
            ..Default::default()
        },
        ignore_eos: true,
        ..GenerationRequest::greedy(prompt(&e, "My favourite colour is"), 16)
    };
    let alone = run_alone(&e, req(7));
    let mut batch = vec![req(7)];
    batch.extend((0..8).map(|i| req(100 + i)));
    let together = run_together(&e, batch);
    assert_eq!(alone.tokens, together[0].tokens);
    assert!(
        together[1..].iter().any(|c| c.tokens != alone.tokens),
        "other seeds give other text"
    );
}

#[test]
fn stop_strings_cut_the_text_also_across_token_boundaries() {
    let e = engine(small_config());
    let base = GenerationRequest {
        ignore_eos: true,
        ..GenerationRequest::greedy(prompt(&e, "List the days of the week: Monday, Tuesday,"), 24)
    };
    let free = run_alone(&e, base.clone());
    // A stop string that starts inside one token and ends inside a later one.
    let pieces: Vec<String> = free
        .tokens
        .iter()
        .map(|&t| e.tokenizer().decode(&[t], true).unwrap())
        .collect();
    let (mut at, mut idx) = (0, 0);
    while idx < pieces.len() && (at < 4 || pieces[idx].len() < 3) {
        at += pieces[idx].len();
        idx += 1;
    }
    assert!(idx + 1 < pieces.len(), "output long enough: {pieces:?}");
    let start = at + pieces[idx].len() - 2;
    let stop: String = free.text[start..start + 4].to_string();
    let cut = free.text.find(&stop).unwrap();
    let got = run_alone(
        &e,
        GenerationRequest {
            stop: vec![stop.clone()],
            ..base.clone()
        },
    );
    assert_eq!(got.finish, FinishReason::Stop);
    assert_eq!(got.stop_string.as_deref(), Some(stop.as_str()));
    assert_eq!(
        got.text,
        free.text[..cut],
        "text ends right before the stop string {stop:?}"
    );

    // Stop token ids end generation without being emitted.
    let stop_id = free.tokens[3];
    let got = run_alone(
        &e,
        GenerationRequest {
            stop_token_ids: vec![stop_id],
            ..base
        },
    );
    assert_eq!(got.finish, FinishReason::Stop);
    assert_eq!(
        got.tokens,
        free.tokens[..free.tokens.iter().position(|&t| t == stop_id).unwrap()]
    );
}

#[test]
fn lengths_logprobs_and_usage() {
    let e = engine(small_config());
    let p = prompt(&e, "The capital of France is");
    let got = run_alone(
        &e,
        GenerationRequest {
            logprobs: Some(3),
            ignore_eos: true,
            ..GenerationRequest::greedy(p.clone(), 5)
        },
    );
    assert_eq!(got.finish, FinishReason::Length);
    assert_eq!(got.tokens.len(), 5);
    assert_eq!(got.usage.prompt_tokens, p.len());
    assert_eq!(got.usage.completion_tokens, 5);
    assert_eq!(got.logprobs.len(), 5);
    for (lp, &t) in got.logprobs.iter().zip(&got.tokens) {
        assert_eq!(lp.token, t);
        assert_eq!(lp.top.len(), 3);
        assert_eq!(lp.top[0].0, t, "greedy picks the most likely token");
        assert!(lp.logprob <= 0.0 && lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
    }
    // A repeated prompt finds its full blocks in the prefix cache.
    let long = prompt(&e, &"A long shared system prompt. ".repeat(12));
    run_alone(&e, GenerationRequest::greedy(long.clone(), 1));
    let again = run_alone(&e, GenerationRequest::greedy(long.clone(), 1));
    assert_eq!(again.usage.cached_prompt_tokens, (long.len() - 1) / 16 * 16);
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    let e = engine(EngineConfig {
        max_queue: 2,
        ..small_config()
    });
    let too_long = vec![1u32; 1024];
    assert_eq!(
        e.submit(GenerationRequest::greedy(too_long, 1)).err(),
        Some(SubmitError::PromptTooLong {
            prompt: 1024,
            max_model_len: 1024
        })
    );
    assert!(matches!(
        e.submit(GenerationRequest::greedy(vec![], 1)),
        Err(SubmitError::Invalid(_))
    ));
    assert!(matches!(
        e.submit(GenerationRequest::greedy(vec![u32::MAX], 1)),
        Err(SubmitError::Invalid(m)) if m.contains("vocabulary")
    ));
    let bad_sampling = GenerationRequest {
        sampling: SamplingParams {
            top_p: 0.0,
            ..Default::default()
        },
        ..GenerationRequest::greedy(vec![1, 2], 1)
    };
    assert!(matches!(e.submit(bad_sampling), Err(SubmitError::Invalid(m)) if m.contains("top_p")));
    // The queue holds 2; a burst of 10 gets some refusals, never a hang.
    let results: Vec<_> = (0..10)
        .map(|_| e.submit(GenerationRequest::greedy(vec![1, 2, 3], 4)))
        .collect();
    assert!(results
        .iter()
        .any(|r| matches!(r, Err(SubmitError::QueueFull { max: 2 }))));
    for r in results.into_iter().flatten() {
        collect(r);
    }
    e.shutdown();
    assert!(matches!(
        e.submit(GenerationRequest::greedy(vec![1], 1)),
        Err(SubmitError::EngineDead(_))
    ));
}

/// What a [`PipelinedCpu`] saw: each submitted batch's sequences (named by their first KV block,
/// unique with prefix caching off) and every broken rule of pipelining.
#[derive(Default)]
struct PipelineLog {
    batches: Vec<Vec<u32>>,
    violations: Vec<String>,
}

/// The CPU executor behind the pipelined interface, as a multi-GPU pipeline presents itself:
/// `submit` queues a batch, `collect` runs the oldest one.
struct PipelinedCpu {
    cpu: CpuExecutor,
    depth: usize,
    queued: VecDeque<Vec<SeqChunk>>,
    log: Arc<Mutex<PipelineLog>>,
}

impl PipelinedCpu {
    fn new(cpu: CpuExecutor, depth: usize) -> (PipelinedCpu, Arc<Mutex<PipelineLog>>) {
        let log = Arc::new(Mutex::new(PipelineLog::default()));
        let exec = PipelinedCpu {
            cpu,
            depth,
            queued: VecDeque::new(),
            log: Arc::clone(&log),
        };
        (exec, log)
    }

    /// The KV blocks a batch writes.
    fn written_blocks(&self, batch: &[SeqChunk]) -> HashSet<u32> {
        let block_size = self.cpu.kv_layout().block_size;
        batch
            .iter()
            .flat_map(|c| (c.first_pos / block_size..c.end_pos().div_ceil(block_size)).map(|b| c.block_table[b]))
            .collect()
    }
}

impl Executor for PipelinedCpu {
    fn config(&self) -> &ModelConfig {
        self.cpu.config()
    }

    fn recycle(&mut self, logits: Logits) {
        self.cpu.recycle(logits);
    }

    fn kv_layout(&self) -> KvLayout {
        self.cpu.kv_layout()
    }

    fn device(&self) -> String {
        format!("{} as a {}-stage pipeline", self.cpu.device(), self.depth)
    }

    fn pipeline_depth(&self) -> usize {
        self.depth
    }

    fn submit(&mut self, batch: Vec<SeqChunk>, tokens_from: Option<Vec<usize>>) -> Result<(), ModelError> {
        let mut log = self.log.lock().unwrap();
        if tokens_from.is_some() {
            log.violations.push("tokens from the device asked of a pipeline".into());
        }
        if self.queued.len() >= self.depth {
            log.violations.push(format!(
                "a batch submitted with {} already in flight",
                self.queued.len()
            ));
        }
        let seqs: Vec<u32> = batch.iter().map(|c| c.block_table[0]).collect();
        let writes = self.written_blocks(&batch);
        for earlier in &self.queued {
            if earlier.iter().any(|c| seqs.contains(&c.block_table[0])) {
                log.violations.push(format!("sequences {seqs:?} are already in flight"));
            }
            if !self.written_blocks(earlier).is_disjoint(&writes) {
                log.violations
                    .push("two batches in flight write the same KV block".to_string());
            }
        }
        log.batches.push(seqs);
        self.queued.push_back(batch);
        Ok(())
    }

    fn collect(&mut self) -> Result<Logits, ModelError> {
        let Some(batch) = self.queued.pop_front() else {
            return Err(ModelError::BadBatch("collect without a submitted batch".into()));
        };
        self.cpu.forward(&batch)
    }
}

/// An engine on the CPU executor posing as a two-stage pipeline, and the log of its batches.
fn two_stage_engine(config: EngineConfig) -> (EngineHandle, Arc<Mutex<PipelineLog>>) {
    let mut log = None;
    let engine = engine_on(config, |cpu| {
        let (exec, l) = PipelinedCpu::new(cpu, 2);
        log = Some(l);
        Box::new(exec)
    });
    (engine, log.expect("the executor was built"))
}

/// What an [`OverlappingCpu`] saw: the batches submitted behind another, and every broken rule
/// of overlapped steps.
#[derive(Default)]
struct OverlapLog {
    overlapped: usize,
    /// Verification rows answered by their argmax alone (`AllArgmax`, when `on_device`).
    verified_ids: usize,
    violations: Vec<String>,
}

/// The CPU executor behind the overlapping interface, as one GPU presents itself: `submit` runs
/// a batch at once, a decode's tokens taken from the previous batch's result when asked (where
/// the GPU takes the argmax on the device), and `collect` returns results in order.
type Pending = (
    Result<Logits, ModelError>,
    Vec<usize>,
    Vec<(usize, RowAdjust, LogitsWanted)>,
);

struct OverlappingCpu {
    cpu: CpuExecutor,
    /// Whether it says it overlaps steps, and whether it samples `LastSampled` rows itself (as
    /// the GPU does, by the Gumbel-max trick).
    overlap: bool,
    on_device: bool,
    /// Results not yet collected, with the positions each batch computed and its rows whose
    /// tokens wait for their masks.
    results: VecDeque<Pending>,
    log: Arc<Mutex<OverlapLog>>,
}

impl OverlappingCpu {
    /// The rows of `batch` whose token is chosen under a bias or mask (on the device).
    fn adjusted(&self, batch: &[SeqChunk]) -> Vec<(usize, RowAdjust, LogitsWanted)> {
        if !self.on_device {
            return Vec::new();
        }
        batch
            .iter()
            .enumerate()
            .filter_map(|(i, c)| Some((i, c.adjust.clone()?, c.logits)))
            .collect()
    }

    /// The CPU's forward pass, then, when `on_device`, the tokens of `LastSampled` rows drawn
    /// here and the rows of `AllArgmax` chunks replaced by their argmax, in position order;
    /// rows with a bias or mask are chosen later ([`Self::choose_adjusted`]), as the GPU
    /// launches their logits only once the host's masks are in.
    fn run(&mut self, batch: &[SeqChunk]) -> Result<Logits, ModelError> {
        let mut logits = self.cpu.forward(batch)?;
        if self.on_device && batch.iter().any(|c| c.logits == LogitsWanted::AllArgmax) {
            let mut kept = Logits {
                vocab: logits.vocab,
                ..Default::default()
            };
            for (i, &(seq, pos)) in logits.rows.iter().enumerate() {
                let row = logits.row(i);
                if batch[seq].logits == LogitsWanted::AllArgmax {
                    kept.argmax.push((seq, greedy_token(row)));
                } else {
                    kept.rows.push((seq, pos));
                    kept.data.extend_from_slice(row);
                }
            }
            self.log.lock().unwrap().verified_ids += kept.argmax.len();
            logits = kept;
        }
        if self.on_device {
            for (i, c) in batch.iter().enumerate() {
                if let (LogitsWanted::LastSampled(sampling), None) = (c.logits, &c.adjust) {
                    let row = logits.last_of(i).expect("a row for the sampled chunk");
                    logits.argmax.push((i, gumbel_max(row, &sampling)));
                }
            }
        }
        Ok(logits)
    }
}

/// Chooses the tokens of a batch's rows with a bias or mask (waiting for the masks), as the GPU
/// does before the next step takes them or the host reads them.
fn choose_adjusted(result: &mut Result<Logits, ModelError>, adjusted: &mut Vec<(usize, RowAdjust, LogitsWanted)>) {
    let Ok(logits) = result else { return };
    for (i, adjust, wanted) in adjusted.drain(..) {
        let row = adjust_row(logits.last_of(i).expect("a row for the adjusted chunk"), &adjust);
        let token = match wanted {
            LogitsWanted::LastSampled(sampling) => gumbel_max(&row, &sampling),
            _ => greedy_token(&row),
        };
        logits.argmax.push((i, token));
    }
}

/// A row with its bias added and its mask applied, as the GPU's `apply_row_adjust` does.
fn adjust_row(row: &[f32], adjust: &RowAdjust) -> Vec<f32> {
    let mut out = row.to_vec();
    for &(t, b) in adjust.bias.iter() {
        out[t as usize] += b;
    }
    if let Some(allowed) = &adjust.allowed {
        let mut words = vec![0u32; row.len().div_ceil(32)];
        if allowed.copy_mask(&mut words) {
            for (t, l) in out.iter_mut().enumerate() {
                if words[t / 32] >> (t % 32) & 1 == 0 {
                    *l = f32::NEG_INFINITY;
                }
            }
        }
    }
    out
}

/// A draw as `sampling` says by the Gumbel-max trick over the tokens it keeps, its variates
/// from the seed.
fn gumbel_max(row: &[f32], sampling: &DeviceSampling) -> u32 {
    let gumbel = |i: usize| {
        let mut z = sampling
            .seed
            .wrapping_add((i as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let u = ((z >> 41) as f32 + 0.5) / 8_388_608.0;
        let e = if u < 0.5 { -u.ln() } else { -(u - 1.0).ln_1p() };
        -e.ln()
    };
    let mut scored = vec![f32::NEG_INFINITY; row.len()];
    for i in sampling.kept_tokens(row) {
        let i = i as usize;
        scored[i] = row[i] / sampling.temperature + gumbel(i);
    }
    greedy_token(&scored)
}

/// The greedy token of a logits row (ties to the lowest id, as the sampler's).
fn greedy_token(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

impl Executor for OverlappingCpu {
    fn config(&self) -> &ModelConfig {
        self.cpu.config()
    }

    fn kv_layout(&self) -> KvLayout {
        self.cpu.kv_layout()
    }

    fn device(&self) -> String {
        format!("{} overlapping steps", self.cpu.device())
    }

    fn overlaps_steps(&self) -> bool {
        self.overlap
    }

    fn samples_on_device(&self) -> bool {
        self.on_device
    }

    fn submit(&mut self, mut batch: Vec<SeqChunk>, tokens_from: Option<Vec<usize>>) -> Result<(), ModelError> {
        let mut log = self.log.lock().unwrap();
        if self.results.len() >= 2 {
            log.violations.push("a third batch submitted".into());
        }
        let ids_on_device = batch.iter().all(|c| c.tokens.len() == 1 && c.logits.wants_id_only());
        if !ids_on_device && !self.results.is_empty() {
            log.violations
                .push("a batch other than decodes of tokens chosen on the device submitted with one in flight".into());
        }
        if let Some((result, _, adjusted)) = self.results.back_mut() {
            choose_adjusted(result, adjusted);
        }
        if let Some(from) = tokens_from {
            log.overlapped += 1;
            let Some((Ok(previous), positions, _)) = self.results.back() else {
                log.violations
                    .push("tokens taken from a batch that is not in flight".into());
                return Err(ModelError::BadBatch("no batch in flight".into()));
            };
            for (c, &row) in batch.iter_mut().zip(&from) {
                if positions.get(row) != Some(&(c.first_pos - 1)) {
                    log.violations.push(format!(
                        "position {} after row {row} at {:?}",
                        c.first_pos,
                        positions.get(row)
                    ));
                }
                let chosen = previous.argmax_of(row);
                c.tokens = vec![chosen.unwrap_or_else(|| greedy_token(previous.row(row)))];
            }
        }
        drop(log);
        let positions = batch.iter().map(|c| c.first_pos).collect();
        let result = self.run(&batch);
        let adjusted = self.adjusted(&batch);
        self.results.push_back((result, positions, adjusted));
        Ok(())
    }

    fn collect(&mut self) -> Result<Logits, ModelError> {
        match self.results.pop_front() {
            Some((mut result, _, mut adjusted)) => {
                choose_adjusted(&mut result, &mut adjusted);
                result
            }
            None => Err(ModelError::BadBatch("collect without a submitted batch".into())),
        }
    }
}

/// An engine on the CPU executor posing as one that overlaps steps, and the log of its batches.
fn overlapping_engine(config: EngineConfig) -> (EngineHandle, Arc<Mutex<OverlapLog>>) {
    device_engine(config, true, false)
}

/// An engine on the CPU executor posing as a device that overlaps steps (`overlap`) and samples
/// plain temperature requests itself (`on_device`), and the log of its batches.
fn device_engine(config: EngineConfig, overlap: bool, on_device: bool) -> (EngineHandle, Arc<Mutex<OverlapLog>>) {
    let log = Arc::new(Mutex::new(OverlapLog::default()));
    let engine = engine_on(config, |cpu| {
        Box::new(OverlappingCpu {
            cpu,
            overlap,
            on_device,
            results: VecDeque::new(),
            log: Arc::clone(&log),
        })
    });
    (engine, log)
}

/// Constrained and biased requests whose tokens the device chooses under its masks: greedy
/// outputs equal the host sampler's, and their steps overlap (each queued step's mask begun
/// once the running step's tokens are in).
#[test]
fn masks_and_biases_applied_on_the_device_match_the_host() {
    let schema = OutputConstraint::JsonSchema(serde_json::json!({
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": false
    }));
    let requests = |e: &EngineHandle| -> Vec<GenerationRequest> {
        let p = |i: usize| prompt(e, &format!("Story {i}: once upon a time,"));
        let banana = e.tokenizer().encode(" banana", false, false).expect("encodes")[0];
        vec![
            GenerationRequest {
                constraint: Some(schema.clone()),
                ..GenerationRequest::greedy(p(0), 40)
            },
            GenerationRequest {
                sampling: SamplingParams {
                    logit_bias: vec![(banana, 8.0)],
                    ..Default::default()
                },
                ..GenerationRequest::greedy(p(1), 12)
            },
            GenerationRequest {
                ignore_eos: true,
                ..GenerationRequest::greedy(p(2), 24)
            },
        ]
    };
    let host = engine(small_config());
    let want: Vec<Vec<u32>> = run_together(&host, requests(&host))
        .into_iter()
        .map(|c| c.tokens)
        .collect();
    let (e, log) = device_engine(small_config(), true, true);
    let got: Vec<Vec<u32>> = run_together(&e, requests(&e)).into_iter().map(|c| c.tokens).collect();
    assert_eq!(got, want);
    let text = e.tokenizer().decode(&got[0], true).expect("decodes");
    assert!(serde_json::from_str::<serde_json::Value>(&text).is_ok(), "{text}");
    let log = log.lock().unwrap();
    assert!(log.violations.is_empty(), "{:?}", log.violations);
    // Masked steps are queued behind the running one too: their masks wait for its tokens.
    assert!(log.overlapped > 10, "{} overlapped steps", log.overlapped);
}

/// Greedy verification on a device that returns each draft position's argmax alone: the same
/// tokens as without speculation, beside a sequence whose logprobs keep its rows coming back.
#[test]
fn greedy_drafts_verified_by_device_argmaxes_give_the_plain_output() {
    let text = "Copy this line twice: the quick brown fox jumps over the lazy dog, and the dog sleeps.";
    let requests = |e: &EngineHandle| -> Vec<GenerationRequest> {
        let p = prompt(e, text);
        vec![
            GenerationRequest {
                ignore_eos: true,
                ..GenerationRequest::greedy(p.clone(), 40)
            },
            GenerationRequest {
                ignore_eos: true,
                logprobs: Some(2),
                ..GenerationRequest::greedy(p, 40)
            },
        ]
    };
    let plain = engine(small_config());
    let want: Vec<Vec<u32>> = run_together(&plain, requests(&plain))
        .into_iter()
        .map(|c| c.tokens)
        .collect();
    let config = EngineConfig {
        speculative_ngram: Some(NgramSpeculation {
            disable_by_batch_size: usize::MAX,
            ..NgramSpeculation::parse("3:1:4").expect("parses")
        }),
        ..small_config()
    };
    let (e, log) = device_engine(config, true, true);
    let got: Vec<Vec<u32>> = run_together(&e, requests(&e)).into_iter().map(|c| c.tokens).collect();
    assert_eq!(got, want, "verified by argmax ids, the tokens are the plain ones");
    let log = log.lock().unwrap();
    assert!(log.violations.is_empty(), "{:?}", log.violations);
    assert!(
        log.verified_ids > 10,
        "{} verification rows came back as ids",
        log.verified_ids
    );
}

/// On a device that overlaps decode steps, no plain step is queued behind a sequence that may
/// draft (it would verify no draft): it drafts in the same steps as without overlap, while a
/// request that opts out keeps its steps overlapped (queued plain steps took most drafts on a GPU).
#[test]
fn prompt_lookup_drafts_in_the_same_steps_when_steps_overlap() {
    let text = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog. The quick brown fox";
    let config = EngineConfig {
        speculative_ngram: Some(NgramSpeculation::parse("3:1:4").expect("parses")),
        ..small_config()
    };
    let mut runs = Vec::new();
    for overlap in [false, true] {
        let (e, log) = device_engine(config.clone(), overlap, true);
        let req = |speculative: bool| GenerationRequest {
            ignore_eos: true,
            speculative,
            ..GenerationRequest::greedy(prompt(&e, text), 96)
        };
        let drafting = run_alone(&e, req(true)).tokens;
        assert!(e.wait_idle(Duration::from_secs(10)));
        let drafted = e.stats().drafted_steps_total;
        let queued_while_drafting = log.lock().unwrap().overlapped;
        let opted_out = run_alone(&e, req(false)).tokens;
        let log = log.lock().unwrap();
        assert!(log.violations.is_empty(), "{:?}", log.violations);
        assert_eq!(drafting, opted_out, "the same tokens with and without drafts");
        assert_eq!(queued_while_drafting, 0, "no step queued behind one that may draft");
        assert_eq!(
            log.overlapped > 0,
            overlap,
            "an opted-out request's steps overlap where the device can"
        );
        runs.push((drafting, drafted));
    }
    assert_eq!(runs[0].0, runs[1].0, "the same tokens with and without overlap");
    assert!(runs[0].1 >= 10, "{} drafted steps without overlap", runs[0].1);
    assert_eq!(runs[0].1, runs[1].1, "drafted steps without and with overlap");
}

#[test]
fn sampled_on_the_device_repeats_alone_together_and_overlapped() {
    let mut got = Vec::new();
    for overlap in [false, true] {
        let (e, log) = device_engine(small_config(), overlap, true);
        // Temperature alone, with top-k, with top-p, with min-p.
        let req = |i: u64| GenerationRequest {
            sampling: SamplingParams {
                temperature: 0.8,
                top_k: if i == 1 { 20 } else { 0 },
                top_p: if i == 2 { 0.9 } else { 1.0 },
                min_p: if i == 3 { 0.05 } else { 0.0 },
                seed: i,
                ..Default::default()
            },
            ignore_eos: true,
            ..GenerationRequest::greedy(prompt(&e, &format!("Story {i}: once upon a time,")), 12)
        };
        let together = run_together(&e, (0..4).map(req).collect());
        assert_eq!(run_alone(&e, req(2)).tokens, together[2].tokens, "a seed repeats alone");
        assert_ne!(together[0].tokens, together[1].tokens);
        let log = log.lock().unwrap();
        assert!(log.violations.is_empty(), "{:?}", log.violations);
        assert_eq!(
            log.overlapped > 0,
            overlap,
            "sampled decode steps overlap when the device can"
        );
        got.push(together.into_iter().map(|c| c.tokens).collect::<Vec<_>>());
    }
    assert_eq!(got[0], got[1], "overlapped steps draw the same tokens");
}

#[test]
fn overlapped_decode_steps_give_the_tokens_of_plain_steps() {
    let config = small_config();
    let (overlapped, log) = overlapping_engine(config.clone());
    let plain = engine(config);
    let mut reqs: Vec<GenerationRequest> = (0..6)
        .map(|i| GenerationRequest {
            ignore_eos: true,
            ..GenerationRequest::greedy(
                prompt(&plain, &format!("Story {i}: once upon a time, in town number {i},")),
                6 + 3 * i,
            )
        })
        .collect();
    // Request 1 stops on a token of its free output (its next step is then in flight already);
    // a sampled request runs alongside at first (no overlap while it does).
    let free = run_alone(&plain, reqs[1].clone());
    reqs[1].stop_token_ids = vec![free.tokens[4]];
    reqs.push(GenerationRequest {
        sampling: SamplingParams {
            temperature: 0.8,
            seed: 5,
            ..Default::default()
        },
        ..reqs[0].clone()
    });
    let want = run_together(&plain, reqs.clone());
    let got = run_together(&overlapped, reqs);
    assert_eq!(want[1].finish, FinishReason::Stop);
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.tokens, g.tokens, "request {i} differs with overlapped steps");
        assert_eq!((&w.text, w.finish), (&g.text, g.finish));
    }
    let log = log.lock().unwrap();
    assert!(log.violations.is_empty(), "{:?}", log.violations);
    assert!(log.overlapped > 0, "greedy decode steps were queued behind one another");
    assert!(overlapped.wait_idle(Duration::from_secs(10)));
    let stats = overlapped.stats();
    assert_eq!(stats.overlapped_steps_total, log.overlapped as u64);
    assert_eq!(stats.kv_blocks_used, 0, "every block is back");
    // The plain engine also ran request 1 alone.
    assert_eq!(
        stats.generation_tokens_total,
        plain.stats().generation_tokens_total - free.tokens.len() as u64,
        "a row computed past a stop token counts no token"
    );
}

/// Two requests for 500 tokens past end-of-generation, each past its first `deltas` deltas.
fn two_long_streams(e: &EngineHandle, deltas: usize) -> (RequestStream, RequestStream) {
    let req = |text: &str| GenerationRequest {
        ignore_eos: true,
        ..GenerationRequest::greedy(prompt(e, text), 500)
    };
    let mut a = e.submit(req("Count with me: one, two, three,")).unwrap();
    let mut b = e.submit(req("The alphabet goes a, b, c,")).unwrap();
    for _ in 0..deltas {
        assert!(matches!(a.blocking_next(), Some(RequestOutput::Delta { .. })));
        assert!(matches!(b.blocking_next(), Some(RequestOutput::Delta { .. })));
    }
    (a, b)
}

/// After aborted requests: the engine is idle, alive, holds no block, and serves the next request
/// as an engine of its own does.
fn assert_serves_on_after_aborts(e: &EngineHandle) {
    assert!(
        e.wait_idle(Duration::from_secs(10)),
        "the aborted requests left the engine"
    );
    assert!(e.is_alive(), "{:?}", e.death());
    assert_eq!(e.stats().kv_blocks_used, 0);
    let alone = engine(small_config());
    let next = GenerationRequest::greedy(prompt(e, "My favourite colour is"), 6);
    assert_eq!(
        run_alone(e, next.clone()).tokens,
        run_alone(&alone, next).tokens,
        "the engine serves on"
    );
}

#[test]
fn streams_dropped_while_overlapped_steps_run_leave_nothing_behind() {
    let (e, log) = overlapping_engine(small_config());
    let (a, mut b) = two_long_streams(&e, 4);
    drop(a);
    assert!(matches!(b.blocking_next(), Some(RequestOutput::Delta { .. })));
    drop(b);
    assert_serves_on_after_aborts(&e);
    let log = log.lock().unwrap();
    assert!(log.violations.is_empty(), "{:?}", log.violations);
    assert!(log.overlapped > 0);
}

#[test]
fn a_two_stage_pipeline_alternates_two_batches_of_different_sequences_with_the_same_output() {
    let config = EngineConfig {
        enable_prefix_caching: false,
        ..small_config()
    };
    let (pipelined, log) = two_stage_engine(config.clone());
    let plain = engine(config);
    let reqs: Vec<GenerationRequest> = (0..8)
        .map(|i| GenerationRequest {
            ignore_eos: true,
            ..GenerationRequest::greedy(
                prompt(&plain, &format!("Story {i}: once upon a time, in town number {i},")),
                10,
            )
        })
        .collect();
    let want = run_together(&plain, reqs.clone());
    let got = run_together(&pipelined, reqs);
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.tokens, g.tokens, "request {i} differs on the pipeline");
        assert_eq!(w.text, g.text);
    }

    let log = log.lock().unwrap();
    assert!(log.violations.is_empty(), "{:?}", log.violations);
    assert!(
        log.batches.iter().all(|b| b.len() <= 4),
        "8 sequences on 2 stages make batches of at most 4: {:?}",
        log.batches
    );
    let alternating = log.batches.windows(3).any(|w| {
        let (a, b) = (HashSet::<&u32>::from_iter(&w[0]), HashSet::<&u32>::from_iter(&w[1]));
        a.len() == 4 && b.len() == 4 && a.is_disjoint(&b) && w[0] == w[2]
    });
    assert!(alternating, "two halves of 4 take turns: {:?}", log.batches);
    assert!(pipelined.wait_idle(Duration::from_secs(10)));
    let stats = pipelined.stats();
    assert_eq!(stats.kv_blocks_used, 0, "every block is back");
    assert_eq!(stats.generation_tokens_total, 80);
    assert!(stats.last_step_seconds > 0.0);
}

#[test]
fn streams_dropped_while_their_batch_is_in_flight_are_skipped_when_it_returns() {
    let (e, _) = two_stage_engine(small_config());
    let (a, b) = two_long_streams(&e, 3);
    // Each runs in its own batch and one of the two is always in flight between steps.
    drop(a);
    drop(b);
    assert_serves_on_after_aborts(&e);
}

#[test]
fn preemption_on_a_pipeline_never_takes_the_blocks_of_a_batch_in_flight() {
    // Room for 18 blocks of 16 tokens: 8 sequences of ~20 + 40 tokens (4 blocks each) cannot all
    // fit, and the first half runs out of blocks while the second half, admitted last, is in flight.
    let per_token =
        strata_model::PagedKvCache::bytes_per_token(&default_model().transformer.config, KvCacheDtype::Auto);
    let config = EngineConfig {
        kv_cache_memory: per_token * 16 * 18,
        max_model_len: Some(256),
        enable_prefix_caching: false,
        ..small_config()
    };
    let (pipelined, log) = two_stage_engine(config.clone());
    let plain = engine(config);
    let reqs: Vec<GenerationRequest> = (0..8)
        .map(|i| GenerationRequest {
            ignore_eos: true,
            ..GenerationRequest::greedy(
                prompt(
                    &plain,
                    &format!("{i} little pigs went to the market and bought {i} apples, then"),
                ),
                40,
            )
        })
        .collect();
    let got = run_together(&pipelined, reqs.clone());
    assert!(
        pipelined.stats().preemptions_total > 0,
        "the cache was too small, so something was preempted"
    );
    let log = log.lock().unwrap();
    assert!(log.violations.is_empty(), "{:?}", log.violations);
    for i in 0..3 {
        assert_eq!(
            run_alone(&plain, reqs[i].clone()).tokens,
            got[i].tokens,
            "sequence {i} changed after preemption on the pipeline"
        );
    }
    assert!(pipelined.wait_idle(Duration::from_secs(10)));
    assert_eq!(pipelined.stats().kv_blocks_used, 0);
}

/// Which executor call loses the devices.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Call {
    Submit,
    Collect,
}

const LOST_GPU: &str = "tensor-parallel all-reduce over GPUs 0,1 did not finish within 30 s (step 17): \
                        GPU 1 stopped responding; communicators aborted";

/// An executor whose devices are lost at the `fail_at`-th call of `call` (counting from 1); from
/// then on every call is refused, as a real one refuses after a fatal error.
struct LosesDevices {
    inner: Box<dyn Executor>,
    call: Call,
    fail_at: usize,
    calls: usize,
    lost: bool,
}

impl LosesDevices {
    fn check(&mut self, call: Call) -> Result<(), ModelError> {
        if call == self.call {
            self.calls += 1;
            self.lost |= self.calls >= self.fail_at;
        }
        if self.lost {
            return Err(ModelError::Unavailable(LOST_GPU.into()));
        }
        Ok(())
    }
}

impl Executor for LosesDevices {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }

    fn kv_layout(&self) -> KvLayout {
        self.inner.kv_layout()
    }

    fn device(&self) -> String {
        self.inner.device()
    }

    fn pipeline_depth(&self) -> usize {
        self.inner.pipeline_depth()
    }

    fn submit(&mut self, batch: Vec<SeqChunk>, tokens_from: Option<Vec<usize>>) -> Result<(), ModelError> {
        self.check(Call::Submit)?;
        self.inner.submit(batch, tokens_from)
    }

    fn collect(&mut self) -> Result<Logits, ModelError> {
        self.check(Call::Collect)?;
        self.inner.collect()
    }
}

#[test]
fn lost_devices_end_every_request_as_unavailable_and_the_engine_refuses_new_ones() {
    for (depth, call) in [
        (1, Call::Submit),
        (1, Call::Collect),
        (2, Call::Submit),
        (2, Call::Collect),
    ] {
        // Two run at a time, so some requests are still waiting when the devices go.
        let config = EngineConfig {
            max_num_seqs: 2,
            ..small_config()
        };
        let e = engine_on(config, |cpu| {
            let inner: Box<dyn Executor> = match depth {
                1 => Box::new(cpu),
                _ => Box::new(PipelinedCpu::new(cpu, depth).0),
            };
            Box::new(LosesDevices {
                inner,
                call,
                fail_at: 4,
                calls: 0,
                lost: false,
            })
        });
        let streams = submit_numbered(&e, 5, |i| format!("Request {i} says"), 50);
        for (i, s) in streams.into_iter().enumerate() {
            let last = drain(s).pop();
            assert!(
                matches!(&last, Some(RequestOutput::Unavailable(why)) if why == LOST_GPU),
                "depth {depth}, {call:?}: request {i} ended with {last:?}"
            );
        }
        assert_eq!(e.death().as_deref(), Some(LOST_GPU), "depth {depth}, {call:?}");
        assert!(!e.is_alive());
        assert!(matches!(
            e.submit(GenerationRequest::greedy(prompt(&e, "Anyone there?"), 4)),
            Err(SubmitError::EngineDead(why)) if why.contains("GPU 1 stopped responding")
        ));
        let stats = e.stats();
        assert_eq!((stats.running, stats.waiting, stats.kv_blocks_used), (0, 0, 0));
        e.shutdown();
        assert_eq!(e.death().as_deref(), Some(LOST_GPU), "shutting down keeps the reason");
    }
}

/// Every message of `stream` that is already delivered, and whether the stream had ended (all its
/// senders gone) by then; never waits.
fn delivered(stream: &mut RequestStream) -> (Vec<RequestOutput>, bool) {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    let mut got = Vec::new();
    loop {
        let next = std::pin::pin!(stream.next());
        match std::future::Future::poll(next, &mut cx) {
            std::task::Poll::Ready(Some(out)) => got.push(out),
            std::task::Poll::Ready(None) => return (got, true),
            std::task::Poll::Pending => return (got, false),
        }
    }
}

#[test]
fn many_consumer_threads_each_get_every_delta_in_order_and_one_finish() {
    let config = EngineConfig {
        max_num_seqs: 32,
        ..small_config()
    };
    let e = engine(config);
    let (n, max_tokens) = (16, 8);
    let req = |i: usize| GenerationRequest {
        ignore_eos: true,
        ..GenerationRequest::greedy(prompt(&e, &format!("Note {i}: the weather in town {i} is")), max_tokens)
    };
    // One thread a request, each blocking on its own stream, as the server's clients do.
    let streams: Vec<RequestStream> = (0..n).map(|i| e.submit(req(i)).expect("submit")).collect();
    let logs: Vec<Vec<RequestOutput>> = std::thread::scope(|s| {
        let readers: Vec<_> = streams
            .into_iter()
            .map(|stream| s.spawn(move || drain(stream)))
            .collect();
        readers.into_iter().map(|r| r.join().expect("reader")).collect()
    });
    for (i, log) in logs.iter().enumerate() {
        let (last, deltas) = log.split_last().expect("some output");
        assert!(
            matches!(
                last,
                RequestOutput::Finished { reason: FinishReason::Length, usage, .. } if usage.completion_tokens == max_tokens
            ),
            "request {i} ended with {last:?}"
        );
        let (mut tokens, mut text) = (Vec::<u32>::new(), String::new());
        for out in deltas {
            let RequestOutput::Delta {
                tokens: t, text: piece, ..
            } = out
            else {
                panic!("request {i}: {out:?} before its last message");
            };
            tokens.extend(t);
            text.push_str(piece);
        }
        assert_eq!(tokens.len(), max_tokens, "request {i}: every token came");
        // A few of them against the same request run alone (each token in its place).
        if i % 5 == 0 {
            let alone = run_alone(&e, req(i));
            assert_eq!(tokens, alone.tokens, "request {i}: the tokens, in order");
            assert_eq!(text, alone.text, "request {i}: the text, in order");
        }
    }
    assert!(e.wait_idle(Duration::from_secs(10)));
    assert_eq!(e.stats().kv_blocks_used, 0);
}

#[test]
fn shutdown_ends_every_stream_before_it_returns() {
    // Two run at a time: the others are still waiting when the engine stops.
    let config = EngineConfig {
        max_num_seqs: 2,
        ..small_config()
    };
    let e = engine(config);
    let mut streams = submit_numbered(&e, 6, |i| format!("Request {i} counts: one, two,"), 500);
    let mut first_tokens = 0;
    for _ in 0..3 {
        match streams[0].blocking_next() {
            Some(RequestOutput::Delta { tokens, .. }) => first_tokens += tokens.len(),
            other => panic!("expected a delta, got {other:?}"),
        }
    }
    e.shutdown();
    for (i, s) in streams.iter_mut().enumerate() {
        let (log, ended) = delivered(s);
        assert!(ended, "request {i}: its stream is still open after shutdown: {log:?}");
        let Some((RequestOutput::Finished { reason, usage, .. }, deltas)) = log.split_last() else {
            panic!("request {i} ended with {:?}", log.last());
        };
        assert_eq!(*reason, FinishReason::Abort, "request {i}");
        assert!(
            deltas.iter().all(|d| matches!(d, RequestOutput::Delta { .. })),
            "request {i}: {log:?}"
        );
        let tokens: usize = deltas
            .iter()
            .map(|d| match d {
                RequestOutput::Delta { tokens, .. } => tokens.len(),
                _ => 0,
            })
            .sum();
        let already = if i == 0 { first_tokens } else { 0 };
        assert_eq!(
            tokens + already,
            usage.completion_tokens,
            "request {i}: every delta came"
        );
    }
    assert!(!e.is_alive());
}

/// The CPU executor, panicking at its `panic_at`-th batch submitted (a bug of ours in a step).
struct PanicsAt {
    cpu: CpuExecutor,
    panic_at: usize,
    calls: usize,
}

impl Executor for PanicsAt {
    fn config(&self) -> &ModelConfig {
        self.cpu.config()
    }

    fn submit(&mut self, batch: Vec<SeqChunk>, tokens_from: Option<Vec<usize>>) -> Result<(), ModelError> {
        self.calls += 1;
        assert!(self.calls < self.panic_at, "step {} went wrong", self.calls);
        self.cpu.submit(batch, tokens_from)
    }

    fn collect(&mut self) -> Result<Logits, ModelError> {
        self.cpu.collect()
    }

    fn kv_layout(&self) -> KvLayout {
        self.cpu.kv_layout()
    }

    fn device(&self) -> String {
        self.cpu.device()
    }
}

#[test]
fn a_panic_in_a_step_fails_every_stream_after_the_deltas_it_sent() {
    let e = engine_on(small_config(), |cpu| {
        Box::new(PanicsAt {
            cpu,
            panic_at: 6,
            calls: 0,
        })
    });
    let streams = submit_numbered(&e, 4, |i| format!("Request {i} says"), 50);
    for (i, s) in streams.into_iter().enumerate() {
        let log = drain(s);
        let Some((RequestOutput::Failed(why), deltas)) = log.split_last() else {
            panic!("request {i} ended with {:?}", log.last());
        };
        assert!(why.contains("step 6 went wrong"), "request {i}: {why}");
        assert!(
            deltas.iter().all(|d| matches!(d, RequestOutput::Delta { .. })),
            "request {i}: {log:?}"
        );
    }
    assert!(e.death().is_some_and(|why| why.contains("step 6 went wrong")));
}

#[test]
fn requests_submitted_together_are_queued_all_or_none() {
    let e = engine(EngineConfig {
        max_num_seqs: 1,
        max_queue: 4,
        ..small_config()
    });
    let greedy =
        |n: usize| -> Vec<GenerationRequest> { (0..n).map(|_| GenerationRequest::greedy(vec![1, 2, 3], 4)).collect() };
    // A runs alone (one sequence at a time): whatever comes next waits in the queue.
    let mut a = e
        .submit(GenerationRequest {
            ignore_eos: true,
            ..GenerationRequest::greedy(vec![1, 2, 3], 300)
        })
        .expect("submit");
    assert!(matches!(a.blocking_next(), Some(RequestOutput::Delta { .. })));
    assert_eq!(
        e.submit_all(greedy(5)).err(),
        Some(SubmitError::MoreThanQueue {
            requests: 5,
            max_queue: 4
        })
    );
    let three = e.submit_all(greedy(3)).expect("3 of 4 slots");
    // Two do not fit in the one slot left: refused whole, the slot stays free ...
    assert_eq!(e.submit_all(greedy(2)).err(), Some(SubmitError::QueueFull { max: 4 }));
    // ... and a bad request among good ones takes nothing either.
    let mut mixed = greedy(1);
    mixed.push(GenerationRequest::greedy(vec![], 1));
    assert!(matches!(e.submit_all(mixed), Err(SubmitError::Invalid(_))));
    let fourth = e
        .submit(GenerationRequest::greedy(vec![1, 2, 3], 4))
        .expect("the last slot");
    assert_eq!(
        e.submit(GenerationRequest::greedy(vec![1], 1)).err(),
        Some(SubmitError::QueueFull { max: 4 })
    );
    drop(a);
    for s in three.into_iter().chain([fourth]) {
        collect(s);
    }
    assert!(e.wait_idle(Duration::from_secs(20)));
    assert_eq!(e.submit_all(greedy(4)).map(|s| s.len()), Ok(4));
}
