//! The engine: one OS thread that owns the model, the KV cache and every sequence, and runs schedule ->
//! submit -> collect -> sample steps (overlapped on pipelined and overlapping executors); callers use an [`EngineHandle`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use strata_model::chat_template::ChatTemplate;
use strata_model::kv_cache::{KvCacheDtype, DEFAULT_BLOCK_SIZE};
use strata_model::loader::LoadedModel;
use strata_model::tokenizer::Tokenizer;
use strata_model::{
    AllowedTokens, CpuExecutor, DeviceSampling, Executor, Logits, LogitsWanted, ModelError, PagedKvCache, RowAdjust,
    SeqChunk, Transformer,
};
use strata_runtime::cpu::ActPrecision;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::block_manager::BlockManager;
use crate::constraint::{GrammarCompiler, MaskSlot, MaskWorkers, NextTokens, SequenceConstraint};
use crate::draft_model::{check_same_vocabulary, DraftModel, Drafter};
use crate::outbox::Outbox;
use crate::request::{FinishReason, GenerationRequest, RequestOutput, SubmitError, MAX_TOP_LOGPROBS};
use crate::sampler::logprobs;
use crate::scheduler::{ScheduledChunk, Scheduler, SchedulerConfig, StepPlan};
use crate::sequence::{Progress, Sequence, SequenceId};
use crate::speculation::{DraftCounts, DraftModelSpeculation, NgramSpeculation};

/// How the engine runs; flags of `strata serve` map onto these.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineConfig {
    /// Tokens per step, prefill and decode together (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: usize,
    /// Sequences running at once (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Longest prompt + output (`--max-model-len`); `None` = the model's context.
    pub max_model_len: Option<usize>,
    /// Bytes of KV cache (`--kv-cache-memory`).
    pub kv_cache_memory: usize,
    /// Element type of the KV cache (`--kv-cache-dtype`).
    pub kv_cache_dtype: KvCacheDtype,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Share the KV of common prompt prefixes between requests.
    pub enable_prefix_caching: bool,
    /// Requests allowed to wait for admission before new ones are refused (`--max-queue`).
    pub max_queue: usize,
    /// Compute threads.
    pub threads: usize,
    /// Activation precision of the CPU decode path (`--activation-precision high|standard`).
    pub activation_precision: ActPrecision,
    /// Prompt-lookup speculative decoding (`--speculative-ngram`); `None` = off.
    pub speculative_ngram: Option<NgramSpeculation>,
    /// Draft-model speculative decoding (`--speculative-model`); `None` = off. The model goes to
    /// [`EngineHandle::start_with_draft`]; one method at a time.
    pub speculative_model: Option<DraftModelSpeculation>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_batched_tokens: 512,
            max_num_seqs: 64,
            max_model_len: None,
            kv_cache_memory: 1 << 30,
            kv_cache_dtype: KvCacheDtype::Auto,
            block_size: DEFAULT_BLOCK_SIZE,
            enable_prefix_caching: true,
            max_queue: 1024,
            threads: std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            activation_precision: ActPrecision::default(),
            speculative_ngram: None,
            speculative_model: None,
        }
    }
}

/// How much the KV cache holds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvCapacity {
    pub blocks: usize,
    pub block_size: usize,
    pub bytes: usize,
    pub dtype: KvCacheDtype,
    /// What one cached value is on the device (`KvLayout::value_type`).
    pub value_type: &'static str,
    pub max_model_len: usize,
}

impl KvCapacity {
    /// Tokens the cache holds in all.
    pub fn tokens(&self) -> usize {
        self.blocks * self.block_size
    }

    /// How many sequences of `max_model_len` tokens fit at once.
    pub fn max_len_sequences(&self) -> f64 {
        self.tokens() as f64 / self.max_model_len as f64
    }
}

/// Why the engine could not start.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(
        "--max-model-len {max_model_len} needs {need} KV tokens but --kv-cache-memory holds {have}; \
         raise --kv-cache-memory or lower --max-model-len"
    )]
    KvCacheTooSmall {
        max_model_len: usize,
        need: usize,
        have: usize,
    },
    #[error("{0}")]
    Config(String),
    #[error("could not start the engine's threads: {0}")]
    Thread(std::io::Error),
}

/// `--max-model-len`, or the model's context; checked against the model's context.
fn resolve_max_model_len(config: &EngineConfig, model_context: usize) -> Result<usize, EngineError> {
    let max_model_len = config.max_model_len.unwrap_or(model_context);
    if max_model_len == 0 || max_model_len > model_context {
        return Err(EngineError::Config(format!(
            "--max-model-len {max_model_len} is outside 1..={model_context} (the model's context); pass a smaller value"
        )));
    }
    if config.max_num_batched_tokens == 0 || config.max_num_seqs == 0 {
        return Err(EngineError::Config(
            "--max-num-batched-tokens and --max-num-seqs must be at least 1".into(),
        ));
    }
    if let Some(spec) = &config.speculative_ngram {
        spec.validate().map_err(EngineError::Config)?;
    }
    if let Some(spec) = &config.speculative_model {
        spec.validate().map_err(EngineError::Config)?;
    }
    if config.speculative_ngram.is_some() && config.speculative_model.is_some() {
        return Err(EngineError::Config(
            "--speculative-ngram and --speculative-model are two ways to draft; pass one of them".into(),
        ));
    }
    Ok(max_model_len)
}

/// The CPU executor [`EngineHandle::start`] runs `transformer` on: `config`'s activation
/// precision and threads, and a KV cache of `config.kv_cache_memory` bytes.
pub fn cpu_executor(mut transformer: Transformer, config: &EngineConfig) -> Result<CpuExecutor, EngineError> {
    transformer.act_precision = config.activation_precision;
    let mc = &transformer.config;
    let block_size = config.block_size.max(1);
    let max_model_len = resolve_max_model_len(config, mc.max_position)?;
    let blocks = PagedKvCache::blocks_for_bytes(mc, config.kv_cache_dtype, block_size, config.kv_cache_memory);
    let need = max_model_len.div_ceil(block_size);
    if blocks < need {
        return Err(EngineError::KvCacheTooSmall {
            max_model_len,
            need: need * block_size,
            have: blocks * block_size,
        });
    }
    Ok(CpuExecutor::new(
        transformer,
        config.kv_cache_dtype,
        block_size,
        blocks,
        config.threads,
    ))
}

/// A CPU executor for a draft model beside `target`: on the target's threads, with a KV cache of
/// as many tokens as the target's (in `config`'s dtype and block size).
pub fn cpu_draft_executor(mut draft: Transformer, config: &EngineConfig, target: &CpuExecutor) -> CpuExecutor {
    draft.act_precision = config.activation_precision;
    let target_kv = target.kv_layout();
    CpuExecutor::with_pool(
        draft,
        config.kv_cache_dtype,
        target_kv.block_size,
        target_kv.blocks,
        target.pool(),
    )
}

/// Counters and gauges of the engine, as of its last step.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub running: usize,
    pub waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_used: usize,
    pub prefix_cache_hit_rate: f64,
    pub prompt_tokens_total: u64,
    pub generation_tokens_total: u64,
    pub preemptions_total: u64,
    pub steps_total: u64,
    /// Seconds from scheduling the last batch to having its results (batches kept in flight by a
    /// pipelined executor overlap).
    pub last_step_seconds: f64,
    /// Steps in which every sequence decoded one token (no prompt chunk), their summed seconds
    /// and their summed sequences: the pure decode step time and batch size, for benchmarks.
    pub decode_steps_total: u64,
    pub decode_step_seconds_total: f64,
    pub decode_step_seqs_total: u64,
    /// Of those, the steps in which some sequence verified draft tokens (speculative decoding),
    /// and their summed seconds: a drafted step's cost beside a plain one's.
    pub drafted_steps_total: u64,
    pub drafted_step_seconds_total: f64,
    /// Decode steps queued behind the one running, their tokens taken from its chosen ids on the
    /// device (overlapped steps, on executors that can).
    pub overlapped_steps_total: u64,
    /// Grammar masks computed (one a constrained token), their summed compute seconds on the
    /// mask workers, and the seconds the engine waited for them after a step's logits were in.
    pub masks_total: u64,
    pub mask_seconds_total: f64,
    pub mask_wait_seconds_total: f64,
    /// Draft tokens of speculative decoding proposed and accepted, by position in the draft.
    pub drafts: DraftCounts,
    /// Seconds the draft model ran (draft-model speculation; its passes run on the engine thread).
    pub draft_seconds_total: f64,
    /// Blocks of the draft model's KV cache in use.
    pub draft_kv_blocks_used: usize,
}

impl EngineStats {
    pub fn kv_blocks_free(&self) -> usize {
        self.kv_blocks_total - self.kv_blocks_used
    }
}

enum Command {
    Add(Box<Sequence>),
    Abort(SequenceId),
    Shutdown,
}

/// State shared by the handle and the engine thread.
struct Shared {
    stats: Mutex<EngineStats>,
    /// Requests submitted and not yet admitted (for the queue limit).
    queued: AtomicUsize,
    /// Set when the engine thread has stopped; holds why.
    dead: Mutex<Option<String>>,
    alive: AtomicBool,
}

/// A cheap, cloneable handle to a running engine. The engine stops when the last handle is
/// dropped or [`EngineHandle::shutdown`] is called.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<HandleInner>,
}

struct HandleInner {
    commands: Mutex<Sender<Command>>,
    shared: Arc<Shared>,
    tokenizer: Tokenizer,
    /// Built on the first constrained request (or the server's first check of one): most
    /// engines never need it.
    grammar: OnceLock<Result<GrammarCompiler, String>>,
    chat_template: ChatTemplate,
    capacity: KvCapacity,
    config: EngineConfig,
    next_id: AtomicU64,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl HandleInner {
    /// Asks the engine thread to abort everything and stop, and waits for it.
    fn stop(&self) {
        if let Ok(tx) = self.commands.lock() {
            let _ = tx.send(Command::Shutdown);
        }
        if let Some(t) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = t.join();
        }
    }
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The outputs of one request. Dropping it aborts the request (its KV blocks are freed at the
/// next engine step).
pub struct RequestStream {
    id: SequenceId,
    rx: UnboundedReceiver<RequestOutput>,
    commands: Sender<Command>,
    done: bool,
}

impl RequestStream {
    pub fn id(&self) -> SequenceId {
        self.id
    }

    /// The next output; `None` after the last one.
    pub async fn next(&mut self) -> Option<RequestOutput> {
        let out = self.rx.recv().await;
        self.note(&out);
        out
    }

    /// [`Self::next`] for callers outside an async runtime.
    pub fn blocking_next(&mut self) -> Option<RequestOutput> {
        let out = self.rx.blocking_recv();
        self.note(&out);
        out
    }

    fn note(&mut self, out: &Option<RequestOutput>) {
        if matches!(
            out,
            None | Some(RequestOutput::Finished { .. })
                | Some(RequestOutput::Failed(_))
                | Some(RequestOutput::Unavailable(_))
        ) {
            self.done = true;
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.commands.send(Command::Abort(self.id));
        }
    }
}

impl EngineHandle {
    /// Starts the engine thread for `model` on the CPU backend, with a KV cache of
    /// `config.kv_cache_memory` bytes.
    pub fn start(model: LoadedModel, config: EngineConfig) -> Result<EngineHandle, EngineError> {
        EngineHandle::start_with_draft_model(model, None, config)
    }

    /// [`Self::start`], with `draft` (when given) proposing tokens for `model` (draft-model
    /// speculation, as `config.speculative_model` says), both on the CPU's threads.
    pub fn start_with_draft_model(
        model: LoadedModel,
        draft: Option<LoadedModel>,
        config: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        let LoadedModel {
            transformer,
            tokenizer,
            chat_template,
            ..
        } = model;
        let executor = cpu_executor(transformer, &config)?;
        let draft = draft.map(|draft| DraftModel {
            executor: Box::new(cpu_draft_executor(draft.transformer, &config, &executor)),
            tokenizer: draft.tokenizer,
        });
        EngineHandle::start_with_draft(Box::new(executor), draft, tokenizer, chat_template, config)
    }

    /// Starts the engine thread on any backend: `executor` holds the model and its KV cache.
    pub fn start_with(
        executor: Box<dyn Executor>,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        config: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        EngineHandle::start_with_draft(executor, None, tokenizer, chat_template, config)
    }

    /// [`Self::start_with`], and `draft` (on any backend, with its own KV cache) proposing tokens
    /// when `config.speculative_model` is set; its tokenizer must be the target's.
    pub fn start_with_draft(
        executor: Box<dyn Executor>,
        draft: Option<DraftModel>,
        tokenizer: Tokenizer,
        chat_template: ChatTemplate,
        config: EngineConfig,
    ) -> Result<EngineHandle, EngineError> {
        let max_model_len = resolve_max_model_len(&config, executor.config().max_position)?;
        let kv = executor.kv_layout();
        if kv.blocks * kv.block_size < max_model_len {
            return Err(EngineError::KvCacheTooSmall {
                max_model_len,
                need: max_model_len.next_multiple_of(kv.block_size),
                have: kv.blocks * kv.block_size,
            });
        }
        let (blocks, block_size) = (kv.blocks, kv.block_size);
        let capacity = KvCapacity {
            blocks,
            block_size,
            bytes: kv.bytes,
            dtype: kv.dtype,
            value_type: kv.value_type,
            max_model_len,
        };
        let speculation = match (config.speculative_ngram, config.speculative_model, draft) {
            (Some(ngram), None, None) => Some(Proposer::Ngram(ngram)),
            (None, Some(settings), Some(draft)) => {
                check_same_vocabulary(&tokenizer, &draft.tokenizer).map_err(EngineError::Config)?;
                let kv = draft.executor.kv_layout();
                if kv.blocks * kv.block_size < max_model_len {
                    return Err(EngineError::Config(format!(
                        "the draft model's KV cache holds {} tokens, fewer than --max-model-len {max_model_len}; \
                         give it more memory or lower --max-model-len",
                        kv.blocks * kv.block_size
                    )));
                }
                let drafter = Drafter::new(
                    draft.executor,
                    settings,
                    tokenizer.vocab_size(),
                    config.max_num_batched_tokens,
                );
                Some(Proposer::Model(Box::new(drafter)))
            }
            (None, None, None) => None,
            (_, Some(_), None) => {
                return Err(EngineError::Config(
                    "draft-model speculation needs the draft model: pass --speculative-model PATH".into(),
                ))
            }
            (_, None, Some(_)) => return Err(EngineError::Config(
                "a draft model was given without --num-speculative-tokens settings (EngineConfig::speculative_model)"
                    .into(),
            )),
            (Some(_), Some(_), Some(_)) => {
                return Err(EngineError::Config(
                    "--speculative-ngram and --speculative-model are two ways to draft; pass one of them".into(),
                ))
            }
        };
        let depth = executor.pipeline_depth().max(1);
        let overlap = depth == 1 && executor.overlaps_steps();
        if depth > 1 {
            tracing::info!("engine on {}, {depth} batches in flight", executor.device());
        } else if overlap {
            tracing::info!("engine on {}, decode steps overlapped", executor.device());
        } else {
            tracing::info!("engine on {}", executor.device());
        }
        let shared = Arc::new(Shared {
            stats: Mutex::new(EngineStats {
                kv_blocks_total: blocks,
                ..Default::default()
            }),
            queued: AtomicUsize::new(0),
            dead: Mutex::new(None),
            alive: AtomicBool::new(true),
        });
        let (tx, rx) = mpsc::channel();
        let outbox = Outbox::start().map_err(EngineError::Thread)?;
        let worker = EngineLoop {
            executor,
            depth,
            overlap,
            results_taken: Instant::now(),
            in_flight: VecDeque::new(),
            blocks: BlockManager::new(blocks, block_size, config.enable_prefix_caching),
            scheduler: Scheduler::new(SchedulerConfig {
                max_num_batched_tokens: config.max_num_batched_tokens,
                max_num_seqs: config.max_num_seqs,
            }),
            seqs: HashMap::new(),
            commands: rx,
            outbox,
            shared: Arc::clone(&shared),
            max_model_len,
            stats: EngineStats {
                kv_blocks_total: blocks,
                ..Default::default()
            },
            masks: None,
            speculation,
        };
        let thread = std::thread::Builder::new()
            .name("strata-engine".into())
            .spawn(move || worker.run())
            .map_err(EngineError::Thread)?;
        Ok(EngineHandle {
            inner: Arc::new(HandleInner {
                commands: Mutex::new(tx),
                shared,
                tokenizer,
                grammar: OnceLock::new(),
                chat_template,
                capacity,
                config,
                next_id: AtomicU64::new(1),
                thread: Mutex::new(Some(thread)),
            }),
        })
    }

    /// Queues a request. `max_tokens` is capped so prompt + output fit in `max_model_len`.
    pub fn submit(&self, request: GenerationRequest) -> Result<RequestStream, SubmitError> {
        let mut streams = self.submit_all(vec![request])?;
        streams
            .pop()
            .ok_or_else(|| SubmitError::Invalid("the request list is empty".into()))
    }

    /// Queues several requests as one (the prompts and choices of one API call): every one is
    /// checked first and their queue slots are reserved together, so either all are queued or
    /// none is and nothing stays reserved.
    pub fn submit_all(&self, mut requests: Vec<GenerationRequest>) -> Result<Vec<RequestStream>, SubmitError> {
        if let Some(why) = self.death() {
            return Err(SubmitError::EngineDead(why));
        }
        let mut constraints = Vec::with_capacity(requests.len());
        for request in &mut requests {
            constraints.push(self.check(request)?);
        }
        let max_queue = self.inner.config.max_queue;
        if requests.len() > max_queue {
            return Err(SubmitError::MoreThanQueue {
                requests: requests.len(),
                max_queue,
            });
        }
        self.reserve(requests.len())?;
        let commands = match self.inner.commands.lock() {
            Ok(c) => c.clone(),
            Err(_) => {
                self.release_reserved(requests.len());
                return Err(SubmitError::EngineDead("poisoned".into()));
            }
        };
        let mut streams = Vec::with_capacity(requests.len());
        let mut unsent = requests.len();
        for (request, constraint) in requests.into_iter().zip(constraints) {
            let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
            let (tx, rx) = unbounded_channel();
            let mut seq = Sequence::new(id, request, &self.inner.tokenizer, tx);
            seq.constraint = constraint;
            if commands.send(Command::Add(Box::new(seq))).is_err() {
                // The ones sent are aborted when `streams` drops; the engine releases their slots.
                self.release_reserved(unsent);
                return Err(SubmitError::EngineDead(
                    self.death().unwrap_or_else(|| "stopped".into()),
                ));
            }
            unsent -= 1;
            streams.push(RequestStream {
                id,
                rx,
                commands: commands.clone(),
                done: false,
            });
        }
        Ok(streams)
    }

    /// The compiler of output constraints for this model's vocabulary, built on first use.
    pub fn grammar_compiler(&self) -> Result<&GrammarCompiler, SubmitError> {
        let tokenizer = &self.inner.tokenizer;
        self.inner
            .grammar
            .get_or_init(|| GrammarCompiler::new(Arc::new(tokenizer.clone())))
            .as_ref()
            .map_err(|e| SubmitError::Invalid(format!("structured output is unavailable for this model: {e}")))
    }

    /// Refuses a request the engine cannot run, caps its `max_tokens` to the room left, and
    /// compiles its output constraint.
    fn check(&self, request: &mut GenerationRequest) -> Result<Option<SequenceConstraint>, SubmitError> {
        let max_model_len = self.inner.capacity.max_model_len;
        if request.prompt.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        let vocab = self.inner.tokenizer.vocab_size();
        if let Some(bad) = request.prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(SubmitError::Invalid(format!(
                "prompt token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        if request.prompt.len() >= max_model_len {
            return Err(SubmitError::PromptTooLong {
                prompt: request.prompt.len(),
                max_model_len,
            });
        }
        if request.max_tokens == 0 {
            return Err(SubmitError::Invalid("max_tokens must be at least 1".into()));
        }
        request.sampling.validate().map_err(SubmitError::Invalid)?;
        if let Some(k) = request.logprobs {
            if k > MAX_TOP_LOGPROBS {
                return Err(SubmitError::Invalid(format!(
                    "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {k}"
                )));
            }
        }
        if let Some((bad, _)) = request.sampling.logit_bias.iter().find(|&&(t, _)| t as usize >= vocab) {
            return Err(SubmitError::Invalid(format!(
                "logit_bias token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        request.max_tokens = request.max_tokens.min(max_model_len - request.prompt.len());
        let Some(constraint) = &request.constraint else {
            return Ok(None);
        };
        let matcher = self
            .grammar_compiler()?
            .matcher(constraint)
            .map_err(|e| SubmitError::Invalid(format!("the output constraint is unusable: {e}")))?;
        Ok(Some(SequenceConstraint::new(matcher)))
    }

    /// Takes `n` queue slots at once, or none when fewer are free.
    fn reserve(&self, n: usize) -> Result<(), SubmitError> {
        let max_queue = self.inner.config.max_queue;
        self.inner
            .shared
            .queued
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |queued| {
                queued.checked_add(n).filter(|&total| total <= max_queue)
            })
            .map(|_| ())
            .map_err(|_| SubmitError::QueueFull { max: max_queue })
    }

    fn release_reserved(&self, n: usize) {
        self.inner.shared.queued.fetch_sub(n, Ordering::SeqCst);
    }

    /// Why the engine stopped, if it has.
    pub fn death(&self) -> Option<String> {
        if self.inner.shared.alive.load(Ordering::SeqCst) {
            return None;
        }
        Some(
            self.inner
                .shared
                .dead
                .lock()
                .ok()
                .and_then(|d| d.clone())
                .unwrap_or_else(|| "stopped".into()),
        )
    }

    pub fn is_alive(&self) -> bool {
        self.inner.shared.alive.load(Ordering::SeqCst)
    }

    /// Counters as of the last step.
    pub fn stats(&self) -> EngineStats {
        self.inner.shared.stats.lock().map(|s| s.clone()).unwrap_or_default()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.inner.tokenizer
    }

    pub fn chat_template(&self) -> &ChatTemplate {
        &self.inner.chat_template
    }

    pub fn capacity(&self) -> KvCapacity {
        self.inner.capacity
    }

    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Longest prompt + output.
    pub fn max_model_len(&self) -> usize {
        self.inner.capacity.max_model_len
    }

    /// Aborts every request and stops the engine thread (also done when the last handle drops).
    pub fn shutdown(&self) {
        self.inner.stop();
    }

    /// Waits until no request is running or queued, or `timeout` passes; true if idle.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        loop {
            let s = self.stats();
            if s.running == 0 && s.waiting == 0 && self.inner.shared.queued.load(Ordering::SeqCst) == 0 {
                return true;
            }
            if Instant::now() >= end || !self.is_alive() {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// A batch handed to the executor whose logits have not been collected yet.
struct InFlightBatch {
    chunks: Vec<ScheduledChunk>,
    /// When it was scheduled (for `last_step_seconds`).
    started: Instant,
    /// Every chunk decodes a token chosen on the device (greedy, or sampled there): the next
    /// step may take its tokens there.
    tokens_on_device: bool,
}

/// A decode step planned to run behind the one in flight ([`EngineLoop::next_decode`]).
struct QueuedDecode {
    chunks: Vec<ScheduledChunk>,
    batch: Vec<SeqChunk>,
    /// Each chunk's row in the step in flight, whose chosen id is its token.
    tokens_from: Vec<usize>,
}

/// The devices can no longer run the model; holds the executor's reason.
struct DevicesLost(String);

/// Everything the engine thread owns.
struct EngineLoop {
    executor: Box<dyn Executor>,
    /// Batches the executor can hold in flight (its pipeline depth); 1 = one batch per step.
    depth: usize,
    /// At depth 1 on an executor that overlaps steps: a decode step is queued behind the
    /// one running before the host takes that one's results ([`Self::next_decode`]).
    overlap: bool,
    /// When the last batch's results were taken.
    results_taken: Instant,
    /// Submitted batches, oldest first.
    in_flight: VecDeque<InFlightBatch>,
    blocks: BlockManager,
    scheduler: Scheduler,
    seqs: HashMap<SequenceId, Sequence>,
    commands: Receiver<Command>,
    /// Every message to callers goes out through it, a step's worth at a time.
    outbox: Outbox,
    shared: Arc<Shared>,
    max_model_len: usize,
    stats: EngineStats,
    /// Computes constrained sequences' masks during their steps; started with the first one.
    masks: Option<MaskWorkers>,
    /// Speculative decoding's proposer, when on.
    speculation: Option<Proposer>,
}

/// Where draft tokens come from.
enum Proposer {
    /// Prompt lookup in the sequence's own tokens.
    Ngram(NgramSpeculation),
    /// A draft model on its own executor and KV cache.
    Model(Box<Drafter>),
}

impl Proposer {
    /// Whether sequences draft in a step where `active` sequences run or wait.
    fn on_at(&self, active: usize) -> bool {
        match self {
            Proposer::Ngram(n) => n.on_at(active),
            Proposer::Model(d) => d.settings.on_at(active),
        }
    }
}

impl EngineLoop {
    fn run(mut self) {
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.serve()));
        // Batches still in flight finish on the devices before the executor goes; masks they
        // may wait for are given up.
        for seq in self.seqs.values_mut() {
            if let Some(c) = seq.constraint.as_mut() {
                c.abandon();
            }
        }
        while self.in_flight.pop_front().is_some() {
            let _ = self.executor.collect();
        }
        let why = match outcome {
            Ok(()) => "shut down".to_string(),
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                tracing::error!("engine thread panicked: {msg}");
                format!("the engine failed: {msg}")
            }
        };
        self.mark_dead(&why);
        for (_, seq) in self.seqs.drain() {
            seq.fail(&why, &mut self.outbox);
        }
        // Anything still in the channel is refused the same way.
        while let Ok(cmd) = self.commands.try_recv() {
            if let Command::Add(seq) = cmd {
                seq.fail(&why, &mut self.outbox);
            }
        }
        // Every stream has its last message when the engine thread ends.
        self.outbox.close();
    }

    /// Records why the engine stopped (the first reason stays) and refuses new requests from now on.
    fn mark_dead(&self, why: &str) {
        if let Ok(mut d) = self.shared.dead.lock() {
            d.get_or_insert_with(|| why.to_string());
        }
        self.shared.alive.store(false, Ordering::SeqCst);
    }

    fn serve(&mut self) {
        loop {
            if self.seqs.is_empty() && self.in_flight.is_empty() {
                match self.commands.recv() {
                    Ok(cmd) => {
                        if !self.handle(cmd) {
                            return;
                        }
                    }
                    Err(_) => return,
                }
            }
            while let Ok(cmd) = self.commands.try_recv() {
                if !self.handle(cmd) {
                    return;
                }
            }
            let gone: Vec<SequenceId> = self
                .seqs
                .values()
                .filter(|s| s.is_disconnected())
                .map(|s| s.id)
                .collect();
            for id in gone {
                self.abort(id);
            }
            if !self.seqs.is_empty() || !self.in_flight.is_empty() {
                if let Err(DevicesLost(why)) = self.step() {
                    self.lose_devices(&why);
                    self.refuse_until_shutdown(&why);
                    return;
                }
            }
            self.publish();
            // The step's messages leave in one hand-off, after the stats they imply, and reach the
            // streams while the next step runs.
            self.outbox.flush();
        }
    }

    /// The devices are gone: every request, in flight, running or waiting, ends `Unavailable`
    /// with the executor's reason, and the engine is marked dead so that submissions are refused.
    fn lose_devices(&mut self, why: &str) {
        tracing::error!("the engine stops serving, its devices can no longer run the model: {why}");
        self.mark_dead(why);
        self.in_flight.clear();
        let ids: Vec<SequenceId> = self.seqs.keys().copied().collect();
        let lost: Vec<Sequence> = ids.into_iter().filter_map(|id| self.release(id)).collect();
        // The stats say the engine is empty before any caller hears why.
        self.publish();
        for seq in lost {
            seq.unavailable(why, &mut self.outbox);
        }
        self.outbox.flush();
    }

    /// After the devices were lost: answers every request that still reaches the engine with
    /// `Unavailable`, without touching the executor again, until shutdown.
    fn refuse_until_shutdown(&mut self, why: &str) {
        while let Ok(cmd) = self.commands.recv() {
            match cmd {
                Command::Add(seq) => {
                    self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                    seq.unavailable(why, &mut self.outbox);
                    self.outbox.flush();
                }
                Command::Abort(_) => {}
                Command::Shutdown => return,
            }
        }
    }

    /// Applies a command; false on shutdown.
    fn handle(&mut self, cmd: Command) -> bool {
        match cmd {
            Command::Add(seq) => {
                let id = seq.id;
                self.seqs.insert(id, *seq);
                self.scheduler.add(id);
            }
            Command::Abort(id) => self.abort(id),
            Command::Shutdown => {
                let ids: Vec<SequenceId> = self.seqs.keys().copied().collect();
                for id in ids {
                    self.abort(id);
                }
                return false;
            }
        }
        true
    }

    fn abort(&mut self, id: SequenceId) {
        if let Some(seq) = self.seqs.get_mut(&id) {
            seq.finish(FinishReason::Abort, None, &mut self.outbox);
            self.release(id);
        }
    }

    /// Frees a sequence's blocks and forgets it; returns it (its stream still open).
    fn release(&mut self, id: SequenceId) -> Option<Sequence> {
        let mut seq = self.seqs.remove(&id)?;
        if let Some(c) = seq.constraint.as_mut() {
            c.abandon();
        }
        if !seq.admitted {
            self.shared.queued.fetch_sub(1, Ordering::SeqCst);
        }
        self.blocks.free_table(&mut seq.table);
        self.scheduler.remove(id);
        self.forget_draft(id);
        Some(seq)
    }

    /// One step: submit batches of sequences not in flight until the executor holds as many as
    /// its pipeline depth (one on the CPU and one GPU) or nothing more can run; on an executor
    /// that overlaps steps, queue the next decode behind a lone batch of tokens chosen on the
    /// device ([`Self::next_decode`]), so the device does not wait for the host between decode
    /// steps; then take the results of the oldest batch. `Err` when the devices are lost.
    fn step(&mut self) -> Result<(), DevicesLost> {
        while self.in_flight.len() < self.depth {
            let started = Instant::now();
            let Some((chunks, batch)) = self.schedule() else {
                break;
            };
            let tokens_on_device = self.overlap && batch.iter().all(is_device_token_decode);
            let flight = InFlightBatch {
                chunks,
                started,
                tokens_on_device,
            };
            self.submit(flight, batch, None)?;
        }
        if self.overlap && self.in_flight.len() == 1 {
            let started = Instant::now();
            if let Some(next) = self.next_decode() {
                let flight = InFlightBatch {
                    chunks: next.chunks,
                    started,
                    tokens_on_device: true,
                };
                if self.submit(flight, next.batch, Some(next.tokens_from))? {
                    self.stats.overlapped_steps_total += 1;
                }
            }
        }
        let Some(oldest) = self.in_flight.pop_front() else {
            return Ok(());
        };
        let result = self.executor.collect();
        // A batch queued behind another took its step from that one's results on.
        let started = if self.overlap {
            oldest.started.max(self.results_taken)
        } else {
            oldest.started
        };
        self.take_results(&oldest.chunks, started, result)
    }

    /// Hands `batch` to the executor and keeps `flight` as in flight (true); a batch the executor
    /// refuses fails its requests (false), or ends serving when the devices are lost (`Err`).
    fn submit(
        &mut self,
        flight: InFlightBatch,
        batch: Vec<SeqChunk>,
        tokens_from: Option<Vec<usize>>,
    ) -> Result<bool, DevicesLost> {
        match self.executor.submit(batch, tokens_from) {
            Ok(()) => {
                self.in_flight.push_back(flight);
                Ok(true)
            }
            Err(e) => self.fail_batch(&flight.chunks, e).map(|()| false),
        }
    }

    /// The decode step to queue behind the only batch in flight, one of tokens chosen on the
    /// device: its sequences one position on, each token the one chosen for the sequence there. Only when
    /// nothing waits, no running sequence is left out and the cache has room. A sequence that
    /// the step in flight ends by length is left out; one it ends on a stop token or string is
    /// computed once more and dropped.
    fn next_decode(&mut self) -> Option<QueuedDecode> {
        let current = self.in_flight.back()?;
        if !current.tokens_on_device || self.scheduler.num_waiting() > 0 {
            return None;
        }
        // A constrained sequence's queued step needs a mask worker to begin its mask later.
        let constrained = |c: &ScheduledChunk| self.seqs.get(&c.id).is_some_and(|s| s.constraint.is_some());
        if self.masks.is_none() && current.chunks.iter().any(constrained) {
            return None;
        }
        // A sequence that may draft waits for the step in flight: its draft needs that step's
        // token on the host, and a plain step queued behind would verify no draft.
        let speculates = |c: &ScheduledChunk| self.seqs.get(&c.id).is_some_and(|s| s.speculates());
        if self.drafting_on() && current.chunks.iter().any(speculates) {
            return None;
        }
        let mut alive = 0;
        let mut next = Vec::new();
        for (row, c) in current.chunks.iter().enumerate() {
            let Some(seq) = self.seqs.get(&c.id) else { continue };
            alive += 1;
            if !seq.ends_by_length(1, self.max_model_len) {
                next.push((row, c.id));
            }
        }
        if next.is_empty() || alive != self.scheduler.num_running() {
            return None;
        }
        // Room for every position first: a step given up for want of blocks must not have drawn
        // any sequence's next seed.
        for &(_, id) in &next {
            let seq = self.seqs.get_mut(&id)?;
            // The step in flight computes position num_computed; this one the next.
            let need = (seq.num_computed + 2).saturating_sub(seq.table.num_tokens);
            self.blocks.grow(&mut seq.table, need).ok()?;
        }
        let on_device = self.executor.samples_on_device();
        let mut queued = QueuedDecode {
            chunks: Vec::with_capacity(next.len()),
            batch: Vec::with_capacity(next.len()),
            tokens_from: Vec::with_capacity(next.len()),
        };
        for (row, id) in next {
            let seq = self.seqs.get_mut(&id)?;
            let pos = seq.num_computed + 1;
            // Its mask needs the token of the step in flight: begun when that one's results are in.
            let allowed = seq.constraint.as_mut().map(|c| c.reserve());
            queued.chunks.push(ScheduledChunk {
                id,
                num_tokens: 1,
                drafts: 0,
            });
            queued.batch.push(SeqChunk {
                // A placeholder: the token is taken on the device.
                tokens: vec![0],
                first_pos: pos,
                block_table: seq.table.blocks.clone(),
                logits: next_token_logits(seq, on_device),
                prompt_len: seq.request.prompt.len(),
                adjust: row_adjust(seq, allowed),
            });
            queued.tokens_from.push(row);
        }
        Some(queued)
    }

    /// Whether sequences draft at the number that run or wait now (the batch-size rule).
    fn drafting_on(&self) -> bool {
        let active = self.scheduler.num_running() + self.scheduler.num_waiting();
        self.speculation.as_ref().is_some_and(|p| p.on_at(active))
    }

    /// Plans the next batch from the sequences not in flight, at most an even share of them when
    /// batches are kept in flight; `None` when nothing can run.
    fn schedule(&mut self) -> Option<(Vec<ScheduledChunk>, Vec<SeqChunk>)> {
        let busy: HashSet<SequenceId> = self
            .in_flight
            .iter()
            .flat_map(|b| b.chunks.iter().map(|c| c.id))
            .collect();
        let max_seqs = self.scheduler.batch_share(self.depth);
        self.propose_drafts(&busy);
        let plan = self
            .scheduler
            .schedule_step(&mut self.seqs, &mut self.blocks, &busy, max_seqs);
        self.account(&plan);
        if plan.chunks.is_empty() {
            return None;
        }
        let on_device = self.executor.samples_on_device();
        let mut batch: Vec<SeqChunk> = plan
            .chunks
            .iter()
            .map(|c| {
                let seq = self.seqs.get_mut(&c.id).expect("scheduled sequence exists");
                let end = seq.num_computed + c.num_tokens - c.drafts;
                let mut tokens = seq.tokens(seq.num_computed..end);
                tokens.extend_from_slice(&seq.draft[..c.drafts]);
                SeqChunk {
                    tokens,
                    first_pos: seq.num_computed,
                    block_table: seq.table.blocks.clone(),
                    logits: if end < seq.num_tokens() {
                        LogitsWanted::None
                    } else if c.drafts > 0 {
                        // The row of the last token and of each draft token: one verifies the next.
                        verification_logits(seq)
                    } else {
                        next_token_logits(seq, on_device)
                    },
                    prompt_len: seq.request.prompt.len(),
                    adjust: None,
                }
            })
            .collect();
        for (c, chunk) in plan.chunks.iter().zip(&mut batch) {
            if chunk.logits != LogitsWanted::None {
                let allowed = self.begin_mask(c.id);
                if chunk.logits.wants_id_only() {
                    chunk.adjust = self.seqs.get(&c.id).and_then(|seq| row_adjust(seq, allowed));
                }
            }
        }
        Some((plan.chunks, batch))
    }

    /// Sets the draft of every sequence that decodes next and is not in flight: proposed by
    /// prompt lookup or the draft model while speculation is on at this many sequences, empty
    /// otherwise. A draft model that fails is logged and no sequence drafts in this step.
    fn propose_drafts(&mut self, busy: &HashSet<SequenceId>) {
        let on = self.drafting_on();
        let Some(proposer) = self.speculation.as_mut() else {
            return;
        };
        let mut wanting = Vec::new();
        for seq in self.seqs.values_mut() {
            if busy.contains(&seq.id) {
                continue;
            }
            seq.draft.clear();
            if !on || seq.num_computed == 0 || seq.to_compute() != 1 || !seq.speculates() {
                continue;
            }
            let room = seq.draft_room(self.max_model_len).min(seq.draft_limit);
            if room == 0 {
                continue;
            }
            match proposer {
                Proposer::Ngram(ngram) => seq.draft = ngram.propose(&seq.tokens(0..seq.num_tokens()), room),
                Proposer::Model(_) => wanting.push((seq.id, room)),
            }
        }
        if let Proposer::Model(drafter) = proposer {
            if wanting.is_empty() {
                return;
            }
            // In id order: the draft's batches do not depend on the map's.
            wanting.sort_unstable();
            let started = Instant::now();
            if let Err(e) = drafter.propose(&mut self.seqs, &wanting) {
                tracing::warn!("the draft model failed, this step verifies no draft: {e}");
            }
            self.stats.draft_seconds_total += started.elapsed().as_secs_f64();
            self.stats.draft_kv_blocks_used = drafter.blocks_used();
        }
    }

    /// Gives a sequence's draft-model KV back (finished, aborted or preempted).
    fn forget_draft(&mut self, id: SequenceId) {
        if let Some(Proposer::Model(drafter)) = self.speculation.as_mut() {
            drafter.forget(id);
            self.stats.draft_kv_blocks_used = drafter.blocks_used();
        }
    }

    /// Starts computing the mask of a constrained sequence's next token, to run beside the step
    /// that computes its logits; the slot it will be in.
    fn begin_mask(&mut self, id: SequenceId) -> Option<Arc<MaskSlot>> {
        let seq = self.seqs.get_mut(&id)?;
        let constraint = seq.constraint.as_mut()?;
        if self.masks.is_none() {
            let threads = std::thread::available_parallelism().map_or(1, |n| (n.get() / 4).clamp(1, 4));
            match MaskWorkers::start(threads) {
                Ok(workers) => self.masks = Some(workers),
                // Without workers the mask is computed when the logits are in, on the host.
                Err(e) => {
                    tracing::warn!("could not start mask workers: {e}");
                    return None;
                }
            }
        }
        Some(self.masks.as_ref()?.begin(constraint, &seq.output))
    }

    /// Applies the executor's answer for a batch: advances each sequence, commits its full prompt
    /// blocks, samples its next token and releases the sequences that are done. A sequence
    /// aborted while its batch was in flight is already released and is skipped.
    fn take_results(
        &mut self,
        chunks: &[ScheduledChunk],
        started: Instant,
        result: Result<Logits, ModelError>,
    ) -> Result<(), DevicesLost> {
        let logits = match result {
            Ok(l) => l,
            Err(e) => return self.fail_batch(chunks, e),
        };
        let mut finished = Vec::new();
        let mut all_decode = !chunks.is_empty();
        let drafted = chunks.iter().any(|c| c.drafts > 0);
        for (bi, c) in chunks.iter().enumerate() {
            let Some(seq) = self.seqs.get_mut(&c.id) else {
                continue;
            };
            all_decode &= c.num_tokens - c.drafts == 1 && seq.num_computed >= seq.request.prompt.len();
            seq.num_computed += c.num_tokens - c.drafts;
            let prompt_done = seq.num_computed.min(seq.request.prompt.len());
            let prompt = &seq.request.prompt[..prompt_done];
            self.blocks.commit_full_blocks(&mut seq.table, prompt);
            if c.drafts > 0 {
                match take_verified(
                    seq,
                    bi,
                    c.drafts,
                    &logits,
                    self.max_model_len,
                    &mut self.outbox,
                    &mut self.stats,
                ) {
                    Ok(Progress::Running) => self.blocks.truncate(&mut seq.table, seq.num_computed),
                    Ok(_) => finished.push(c.id),
                    Err(why) => {
                        seq.fail(&why, &mut self.outbox);
                        finished.push(c.id);
                    }
                }
                continue;
            }
            let device_token = logits.argmax_of(bi);
            let row = logits.last_of(bi);
            if device_token.is_none() && row.is_none() {
                continue;
            }
            // The grammar's verdict on this position: it may end the sequence here or have failed.
            let waited = Instant::now();
            let verdict = seq.constraint.as_mut().map(|c| c.next_tokens(&seq.output));
            if verdict.is_some() {
                self.stats.mask_wait_seconds_total += waited.elapsed().as_secs_f64();
            }
            let allowed = match verdict {
                None => None,
                Some(NextTokens::Allowed(mask)) => Some(mask),
                Some(NextTokens::Complete) => {
                    seq.finish(FinishReason::Stop, None, &mut self.outbox);
                    finished.push(c.id);
                    continue;
                }
                Some(NextTokens::Failed(why)) => {
                    seq.fail(&why, &mut self.outbox);
                    finished.push(c.id);
                    continue;
                }
            };
            let (token, lp) = match (device_token, row) {
                // Chosen on the device, under the row's mask.
                (Some(token), _) => {
                    if allowed.as_ref().is_some_and(|m| !m.is_allowed(token)) {
                        let why = format!("internal error: the device chose token {token}, which the grammar forbids");
                        seq.fail(&why, &mut self.outbox);
                        finished.push(c.id);
                        continue;
                    }
                    (token, None)
                }
                (None, Some(row)) => {
                    let token = seq
                        .sampler
                        .sample(row, &seq.request.prompt, &seq.output, allowed.as_ref());
                    (token, seq.request.logprobs.map(|k| logprobs(row, token, k)))
                }
                (None, None) => continue,
            };
            self.stats.generation_tokens_total += 1;
            if seq.push_token(token, lp, self.max_model_len, &mut self.outbox) != Progress::Running {
                finished.push(c.id);
            } else if let (Some(constraint), Some(workers)) = (seq.constraint.as_mut(), &self.masks) {
                // The step queued behind this one waits for the mask after this token.
                if constraint.has_reserved() {
                    workers.begin(constraint, &seq.output);
                }
            }
        }
        self.executor.recycle(logits);
        for id in finished {
            self.release(id);
        }
        self.stats.steps_total += 1;
        self.results_taken = Instant::now();
        self.stats.last_step_seconds = (self.results_taken - started).as_secs_f64();
        if all_decode {
            self.stats.decode_steps_total += 1;
            self.stats.decode_step_seconds_total += self.stats.last_step_seconds;
            self.stats.decode_step_seqs_total += chunks.len() as u64;
            if drafted {
                self.stats.drafted_steps_total += 1;
                self.stats.drafted_step_seconds_total += self.stats.last_step_seconds;
            }
        }
        Ok(())
    }

    /// A batch the executor did not run. Lost devices end serving (`Err`); any other error is a
    /// bug of ours in that batch: its requests fail and the engine keeps serving.
    fn fail_batch(&mut self, chunks: &[ScheduledChunk], e: ModelError) -> Result<(), DevicesLost> {
        if let ModelError::Unavailable(why) = e {
            return Err(DevicesLost(why));
        }
        tracing::error!("forward pass failed: {e}");
        for c in chunks {
            if let Some(seq) = self.seqs.get(&c.id) {
                seq.fail(&format!("internal error: {e}"), &mut self.outbox);
            }
            self.release(c.id);
        }
        Ok(())
    }

    /// Bookkeeping of admissions and preemptions.
    fn account(&mut self, plan: &StepPlan) {
        for id in &plan.admitted {
            if let Some(seq) = self.seqs.get_mut(id) {
                if !seq.admitted {
                    seq.admitted = true;
                    self.shared.queued.fetch_sub(1, Ordering::SeqCst);
                    self.stats.prompt_tokens_total += seq.request.prompt.len() as u64;
                }
            }
        }
        self.stats.preemptions_total += plan.preempted.len() as u64;
        for &id in &plan.preempted {
            self.forget_draft(id);
        }
        if !plan.preempted.is_empty() {
            tracing::debug!("preempted {} sequence(s) for lack of KV blocks", plan.preempted.len());
        }
    }

    fn publish(&mut self) {
        if let Some(workers) = &self.masks {
            (self.stats.masks_total, self.stats.mask_seconds_total) = workers.computed();
        }
        self.stats.running = self.scheduler.num_running();
        self.stats.waiting = self.scheduler.num_waiting();
        self.stats.kv_blocks_used = self.blocks.num_used();
        self.stats.prefix_cache_hit_rate = self.blocks.prefix_hit_rate();
        if let Ok(mut s) = self.shared.stats.lock() {
            *s = self.stats.clone();
        }
    }
}

/// What a chunk that ends at `seq`'s last token asks for: the argmax alone for plain greedy
/// requests without logprobs; a token sampled on the device for sampling without penalties when
/// the executor can (`on_device`), its seed the next draw of the sequence's own random stream;
/// the row otherwise (the host samples).
fn next_token_logits(seq: &mut Sequence, on_device: bool) -> LogitsWanted {
    let sampling = &seq.request.sampling;
    let adjusted = seq.constraint.is_some() || !sampling.logit_bias.is_empty();
    if seq.request.logprobs.is_some() || (adjusted && !on_device) {
        return LogitsWanted::Last;
    }
    if sampling.is_plain_greedy() {
        return LogitsWanted::LastArgmax;
    }
    match sampling.on_device() {
        Some(device) if on_device => LogitsWanted::LastSampled(DeviceSampling {
            seed: seq.sampler.next_seed(),
            ..device
        }),
        _ => LogitsWanted::Last,
    }
}

/// What a verification chunk of `seq` asks for: each row's argmax alone when that is all the
/// greedy sampler reads (no penalties, logprobs, bias or grammar), otherwise the rows.
fn verification_logits(seq: &Sequence) -> LogitsWanted {
    let request = &seq.request;
    let plain = request.sampling.is_plain_greedy()
        && request.logprobs.is_none()
        && request.sampling.logit_bias.is_empty()
        && seq.constraint.is_none();
    if plain {
        LogitsWanted::AllArgmax
    } else {
        LogitsWanted::All
    }
}

/// Takes the tokens of a step that verified the first `drafts` tokens of `seq`'s draft (batch
/// row `bi`). The token of each position is chosen from its row exactly as a plain step chooses
/// it (same sampler, same draw of the sequence's random stream); the draft token there is
/// accepted when it is that token, and the next row then chooses the following one. Both
/// proposers (prompt lookup, and a draft model's argmax) propose one token for certain at each
/// position, and for such a one-point proposal this is rejection sampling: the draft is kept with
/// the target's probability of it, and otherwise the token comes from the target's distribution
/// without it. So the output is token for token the output without speculation, greedy or
/// seeded. The KV of accepted tokens stays; the caller drops the rest. `Err` when a row is missing.
fn take_verified(
    seq: &mut Sequence,
    bi: usize,
    drafts: usize,
    logits: &Logits,
    max_model_len: usize,
    outbox: &mut Outbox,
    stats: &mut EngineStats,
) -> Result<Progress, String> {
    let draft = std::mem::take(&mut seq.draft);
    // The row of the last computed token chooses the first new one.
    let first = seq.num_computed - 1;
    let mut accepted = 0;
    let mut progress = Progress::Running;
    // Each position's greedy token, where the executor chose them (`AllArgmax`).
    let ids = logits.argmaxes_of(bi);
    for i in 0..=drafts {
        let missing = || format!("internal error: no logits for draft position {}", first + i);
        let (token, lp) = if ids.is_empty() {
            let row = logits.row_at(bi, first + i).ok_or_else(missing)?;
            let token = seq.sampler.sample(row, &seq.request.prompt, &seq.output, None);
            (token, seq.request.logprobs.map(|k| logprobs(row, token, k)))
        } else {
            (*ids.get(i).ok_or_else(missing)?, None)
        };
        stats.generation_tokens_total += 1;
        progress = seq.push_token(token, lp, max_model_len, outbox);
        if progress != Progress::Running || i == drafts || draft.get(i) != Some(&token) {
            break;
        }
        // The draft token's KV, computed in this step, is the accepted token's.
        seq.num_computed += 1;
        accepted += 1;
    }
    stats.drafts.record(drafts, accepted);
    seq.draft_limit = if accepted == drafts {
        seq.draft_limit.max(drafts + 1)
    } else {
        accepted + 1
    };
    Ok(progress)
}

/// A chunk that decodes one generated token whose id is chosen on the device.
fn is_device_token_decode(c: &SeqChunk) -> bool {
    c.tokens.len() == 1 && c.first_pos >= c.prompt_len && c.logits.wants_id_only()
}

/// The bias and mask of `seq`'s row, for an executor that samples on its device; `None` when
/// neither applies.
fn row_adjust(seq: &Sequence, allowed: Option<Arc<MaskSlot>>) -> Option<RowAdjust> {
    let bias = &seq.request.sampling.logit_bias;
    if bias.is_empty() && allowed.is_none() {
        return None;
    }
    Some(RowAdjust {
        bias: bias.as_slice().into(),
        allowed: allowed.map(|a| a as Arc<dyn AllowedTokens>),
    })
}
