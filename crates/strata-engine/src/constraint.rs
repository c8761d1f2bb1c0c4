//! Constrained decoding: the grammar a request's output must match (any JSON object, a JSON schema,
//! or a Lark grammar), compiled by llguidance against the model's vocabulary into per-step token masks.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use strata_model::tokenizer::Tokenizer;
use strata_model::AllowedTokens;
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputConstraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`response_format: {"type": "json_schema", ...}`).
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark dialect, which may embed JSON schemas as `%json { ... }`
    /// (tool calls forced by `tool_choice`).
    Lark(String),
}

impl OutputConstraint {
    /// What tells one grammar from another in the compiled cache.
    fn key(&self) -> String {
        match self {
            OutputConstraint::JsonObject => "object".into(),
            OutputConstraint::JsonSchema(schema) => format!("schema {schema}"),
            OutputConstraint::Lark(text) => format!("lark {text}"),
        }
    }

    fn grammar(&self) -> TopLevelGrammar {
        match self {
            OutputConstraint::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
            OutputConstraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            OutputConstraint::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        }
    }
}

/// The benchmarks' constrained workload: a list of records, as an extraction API returns, at
/// least 64 long so that it fills their output lengths.
pub fn records_schema() -> OutputConstraint {
    OutputConstraint::JsonSchema(serde_json::json!({
        "type": "array",
        "minItems": 64,
        "items": {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                "name": {"type": "string", "maxLength": 24},
                "kind": {"enum": ["book", "film", "song"]}
            },
            "required": ["id", "name", "kind"],
            "additionalProperties": false
        }
    }))
}

/// Whether request `i` of a benchmark is constrained when `fraction` of them are (spread evenly).
pub fn is_constrained(i: usize, fraction: f64) -> bool {
    ((i + 1) as f64 * fraction).floor() > (i as f64 * fraction).floor()
}

/// The model's vocabulary as llguidance sees it: each token's bytes (special tokens marked with
/// 0xFF so grammars can name them), and our tokenizer for the text a grammar forces.
struct VocabEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s), false, false)
            .unwrap_or_default()
    }
}

/// Grammars kept compiled: the server's check and the engine's submit compile each request's
/// once between them, and clients that send one schema every time compile it once.
const COMPILED_GRAMMARS: usize = 64;

/// Compiles requests' constraints against one model's vocabulary; built once per engine.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    /// Fresh matchers of the grammars compiled last, most recent first, by [`OutputConstraint::key`].
    compiled: Arc<Mutex<VecDeque<(String, Matcher)>>>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrammarCompiler")
    }
}

impl GrammarCompiler {
    /// The compiler for `tokenizer`'s vocabulary; `None` for a vocabulary without an
    /// end-of-sequence token (a constrained output could never end).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<GrammarCompiler, String> {
        let eos = tokenizer
            .eos_id()
            .or_else(|| tokenizer.eog_ids().first().copied())
            .ok_or("the model's vocabulary has no end-of-sequence token")?;
        let words: Vec<Vec<u8>> = (0..tokenizer.vocab_size() as u32)
            .map(|id| {
                let piece = tokenizer.token_to_piece(id).unwrap_or_default();
                if tokenizer.is_special(id) {
                    let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    marked.extend_from_slice(piece);
                    marked
                } else {
                    piece.to_vec()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(words.len() as u32, eos);
        info.tok_bos = tokenizer.bos_id();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(VocabEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
            compiled: Arc::default(),
        })
    }

    /// A fresh matcher for `constraint` (a copy of the compiled one when it is cached), or why
    /// the grammar or schema is unusable.
    pub fn matcher(&self, constraint: &OutputConstraint) -> Result<Matcher, String> {
        let key = constraint.key();
        if let Ok(mut compiled) = self.compiled.lock() {
            if let Some(i) = compiled.iter().position(|(k, _)| *k == key) {
                let hit = compiled.remove(i).expect("position is in range");
                let matcher = hit.1.clone();
                compiled.push_front(hit);
                return Ok(matcher);
            }
        }
        let parser = self
            .factory
            .create_parser(constraint.grammar())
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Ok(mut compiled) = self.compiled.lock() {
            compiled.push_front((key, matcher.clone()));
            compiled.truncate(COMPILED_GRAMMARS);
        }
        Ok(matcher)
    }
}

/// The tokens a constrained sequence may take next, as its mask job found them.
#[derive(Debug, Clone)]
pub enum NextTokens {
    /// The allowed token ids (a bit per id of the tokenizer's vocabulary).
    Allowed(SimpleVob),
    /// The grammar is complete: the output ends here.
    Complete,
    /// The output left the grammar or the matcher failed; the request fails with this.
    Failed(String),
}

/// One step's [`NextTokens`], filled by a mask worker while the device runs the step; read by
/// the executor (to mask on the device) and then by the engine.
#[derive(Default)]
pub struct MaskSlot {
    result: Mutex<Option<NextTokens>>,
    ready: Condvar,
}

impl MaskSlot {
    fn put(&self, next: NextTokens) {
        if let Ok(mut r) = self.result.lock() {
            *r = Some(next);
            self.ready.notify_all();
        }
    }

    /// Waits for the result and runs `f` on it (it stays for later readers).
    fn read<R>(&self, f: impl FnOnce(&NextTokens) -> R) -> R {
        let Ok(mut r) = self.result.lock() else {
            return f(&NextTokens::Failed("a mask worker panicked".into()));
        };
        loop {
            if let Some(next) = r.as_ref() {
                return f(next);
            }
            r = match self.ready.wait(r) {
                Ok(r) => r,
                Err(_) => return f(&NextTokens::Failed("a mask worker panicked".into())),
            };
        }
    }
}

impl AllowedTokens for MaskSlot {
    fn copy_mask(&self, out: &mut [u32]) -> bool {
        self.read(|next| match next {
            NextTokens::Allowed(mask) => {
                let words = mask.as_slice();
                let n = words.len().min(out.len());
                out[..n].copy_from_slice(&words[..n]);
                out[n..].fill(0);
                true
            }
            NextTokens::Complete | NextTokens::Failed(_) => false,
        })
    }
}

/// A constrained sequence's grammar state: its matcher (behind a lock, as workers advance it)
/// and the slots of the masks of its steps in flight, oldest first. A slot is reserved for a
/// step queued behind another (its mask needs that one's token) and begun once the token is in.
pub struct SequenceConstraint {
    matcher: Arc<Mutex<Matcher>>,
    /// Output tokens handed to the matcher so far.
    consumed: usize,
    /// (slot, whether its job has begun).
    pending: VecDeque<(Arc<MaskSlot>, bool)>,
}

impl std::fmt::Debug for SequenceConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequenceConstraint")
            .field("consumed", &self.consumed)
            .field("pending", &self.pending.len())
            .finish()
    }
}

impl SequenceConstraint {
    pub fn new(matcher: Matcher) -> SequenceConstraint {
        SequenceConstraint {
            matcher: Arc::new(Mutex::new(matcher)),
            consumed: 0,
            pending: VecDeque::new(),
        }
    }

    /// The tokens allowed after `output`: the oldest step's mask, waited for, or computed here
    /// when none was begun.
    pub fn next_tokens(&mut self, output: &[u32]) -> NextTokens {
        match self.pending.pop_front() {
            Some((slot, true)) => slot.read(NextTokens::clone),
            reserved => {
                let new = output.get(self.consumed..).unwrap_or_default().to_vec();
                self.consumed = output.len();
                let next = advance(&self.matcher, &new);
                if let Some((slot, _)) = reserved {
                    slot.put(next.clone());
                }
                next
            }
        }
    }

    /// A slot for the mask of a step queued behind the one running: begun by
    /// [`MaskWorkers::begin`] once that one's token is in.
    pub fn reserve(&mut self) -> Arc<MaskSlot> {
        let slot = Arc::new(MaskSlot::default());
        self.pending.push_back((Arc::clone(&slot), false));
        slot
    }

    /// Whether a reserved slot waits for its job.
    pub fn has_reserved(&self) -> bool {
        self.pending.iter().any(|(_, begun)| !begun)
    }

    /// The sequence is gone: reserved slots say so, for an executor that may wait on them.
    pub fn abandon(&mut self) {
        for (slot, begun) in self.pending.drain(..) {
            if !begun {
                slot.put(NextTokens::Complete);
            }
        }
    }
}

/// Hands `new` tokens to the matcher and computes the mask of the token after them.
fn advance(matcher: &Mutex<Matcher>, new: &[u32]) -> NextTokens {
    let Ok(mut m) = matcher.lock() else {
        return NextTokens::Failed("the grammar's matcher panicked".into());
    };
    if let Err(e) = m.consume_tokens(new) {
        return NextTokens::Failed(format!("the output left the grammar: {e}"));
    }
    if m.is_stopped() {
        return NextTokens::Complete;
    }
    match m.compute_mask() {
        Ok(mask) if mask.is_zero() => NextTokens::Failed("the grammar allows no next token".into()),
        Ok(mask) => NextTokens::Allowed(mask),
        Err(e) => NextTokens::Failed(format!("the grammar failed: {e}")),
    }
}

type MaskJob = Box<dyn FnOnce() + Send>;

/// Threads that compute constrained sequences' masks while the device runs their step, so the
/// grammar adds nothing to a step's time unless it is slower than the step itself.
pub struct MaskWorkers {
    jobs: Sender<MaskJob>,
    /// Masks computed and their summed nanoseconds of compute (the engine's statistics).
    computed: Arc<(AtomicU64, AtomicU64)>,
}

impl MaskWorkers {
    /// `threads` workers (at least one); they end when the pool is dropped.
    pub fn start(threads: usize) -> std::io::Result<MaskWorkers> {
        let (jobs, rx) = mpsc::channel::<MaskJob>();
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..threads.max(1) {
            let rx = Arc::clone(&rx);
            std::thread::Builder::new()
                .name(format!("strata-mask-{i}"))
                .spawn(move || loop {
                    let job = match rx.lock() {
                        Ok(rx) => rx.recv(),
                        Err(_) => return,
                    };
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                })?;
        }
        Ok(MaskWorkers {
            jobs,
            computed: Arc::default(),
        })
    }

    /// Masks computed so far and their summed compute seconds.
    pub fn computed(&self) -> (u64, f64) {
        let (n, nanos) = &*self.computed;
        (n.load(Ordering::Relaxed), nanos.load(Ordering::Relaxed) as f64 * 1e-9)
    }

    /// Starts computing the mask of the token after `output` on a worker, into the oldest
    /// reserved slot or a new one; the engine takes it with [`SequenceConstraint::next_tokens`]
    /// once the step's logits are in, and an executor that samples on its device reads it
    /// through the returned slot.
    pub fn begin(&self, constraint: &mut SequenceConstraint, output: &[u32]) -> Arc<MaskSlot> {
        let new = output.get(constraint.consumed..).unwrap_or_default().to_vec();
        let reserved = constraint.pending.iter().position(|(_, begun)| !begun);
        let slot = match reserved {
            Some(i) => Arc::clone(&constraint.pending[i].0),
            None => Arc::new(MaskSlot::default()),
        };
        let (matcher, done, computed) = (
            Arc::clone(&constraint.matcher),
            Arc::clone(&slot),
            Arc::clone(&self.computed),
        );
        let job: MaskJob = Box::new(move || {
            let start = Instant::now();
            // A panic must still fill the slot: an executor may be waiting on it.
            let next = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| advance(&matcher, &new)))
                .unwrap_or_else(|_| NextTokens::Failed("the grammar's matcher panicked".into()));
            computed.0.fetch_add(1, Ordering::Relaxed);
            computed
                .1
                .fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
            done.put(next)
        });
        // Without workers (they are gone) the job runs here: a reserved slot must be filled.
        if let Err(mpsc::SendError(job)) = self.jobs.send(job) {
            job();
        }
        constraint.consumed = output.len();
        match reserved {
            Some(i) => constraint.pending[i].1 = true,
            None => constraint.pending.push_back((Arc::clone(&slot), true)),
        }
        slot
    }
}
