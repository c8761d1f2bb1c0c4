//! Draft-model speculative decoding: a smaller model with the target's tokenizer, run through its
//! own executor and paged KV cache, proposes each speculating sequence's next tokens greedily.

use std::collections::HashMap;

use strata_model::tokenizer::Tokenizer;
use strata_model::{Executor, Logits, LogitsWanted, ModelError, SeqChunk};

use crate::block_manager::{BlockManager, BlockTable};
use crate::sampler::argmax;
use crate::sequence::{Sequence, SequenceId};
use crate::speculation::DraftModelSpeculation;

/// The draft model handed to the engine: its executor (any backend, its own KV cache) and its
/// tokenizer, which must be the target's.
pub struct DraftModel {
    pub executor: Box<dyn Executor>,
    pub tokenizer: Tokenizer,
}

/// Checks that the draft's token ids mean what the target's do: the same vocabulary size and the
/// same bytes for every id. The message is one line and says what to pass instead.
pub fn check_same_vocabulary(target: &Tokenizer, draft: &Tokenizer) -> Result<(), String> {
    const FIX: &str =
        "pass a draft model of the target's family that shares its tokenizer (e.g. Qwen2.5-0.5B for Qwen2.5-7B)";
    if target.vocab_size() != draft.vocab_size() {
        return Err(format!(
            "--speculative-model has a vocabulary of {} tokens and the target {}; {FIX}",
            draft.vocab_size(),
            target.vocab_size()
        ));
    }
    let differs = (0..target.vocab_size() as u32).find(|&id| target.token_to_piece(id) != draft.token_to_piece(id));
    if let Some(id) = differs {
        let show = |t: &Tokenizer| String::from_utf8_lossy(t.token_to_piece(id).unwrap_or_default()).into_owned();
        return Err(format!(
            "--speculative-model's token {id} is {:?} where the target's is {:?}; {FIX}",
            show(draft),
            show(target)
        ));
    }
    Ok(())
}

/// What the draft cache holds of one sequence.
#[derive(Debug, Default)]
struct DraftKv {
    table: BlockTable,
    /// Leading tokens of the sequence whose KV is in the draft cache.
    computed: usize,
    /// Draft tokens whose KV follows them, not yet known to be the sequence's tokens.
    unverified: Vec<u32>,
}

/// One sequence drafting in this step.
struct Drafting {
    id: SequenceId,
    /// Draft tokens wanted.
    wanted: usize,
    /// Position of the sequence's last token (its logits give the first draft token).
    last: usize,
    /// Next token of the catch-up to compute.
    next: usize,
    prompt_len: usize,
    draft: Vec<u32>,
}

/// The engine's side of a draft model: its executor, the block bookkeeping of its cache and what
/// that cache holds of each sequence.
pub(crate) struct Drafter {
    executor: Box<dyn Executor>,
    blocks: BlockManager,
    held: HashMap<SequenceId, DraftKv>,
    pub(crate) settings: DraftModelSpeculation,
    /// Token ids the target knows (a draft's padded logits may name more).
    vocab: usize,
    /// Tokens one draft pass takes at most (the target's step budget).
    max_batch_tokens: usize,
}

impl Drafter {
    pub(crate) fn new(
        executor: Box<dyn Executor>,
        settings: DraftModelSpeculation,
        vocab: usize,
        max_batch_tokens: usize,
    ) -> Drafter {
        let kv = executor.kv_layout();
        Drafter {
            executor,
            // Drafts live one step; sharing prompt prefixes would save the draft's prefill only.
            blocks: BlockManager::new(kv.blocks, kv.block_size, false),
            held: HashMap::new(),
            settings,
            vocab,
            max_batch_tokens: max_batch_tokens.max(1),
        }
    }

    /// Forgets a sequence (finished, aborted or preempted) and gives its draft blocks back.
    pub(crate) fn forget(&mut self, id: SequenceId) {
        if let Some(mut held) = self.held.remove(&id) {
            self.blocks.free_table(&mut held.table);
        }
    }

    /// Blocks of the draft cache in use.
    pub(crate) fn blocks_used(&self) -> usize {
        self.blocks.num_used()
    }

    /// Sets the draft of each sequence in `wanting` (id, most draft tokens it can use): its
    /// tokens not yet in the draft cache are run first (the whole prompt the first time, then the
    /// tokens accepted since), then one draft pass a token, every sequence a row of the same
    /// pass, each token the draft's argmax. When the draft cache is full, the sequences not
    /// drafting now give their draft KV back; one it still has no room for drafts nothing this
    /// step. `Err` when the draft executor fails; no sequence has a draft then. Each draft token
    /// is certain given the tokens before it (a one-point proposal), so the engine's
    /// verification keeps the target's distribution exactly, greedy and sampled.
    pub(crate) fn propose(
        &mut self,
        seqs: &mut HashMap<SequenceId, Sequence>,
        wanting: &[(SequenceId, usize)],
    ) -> Result<(), ModelError> {
        let mut rows = Vec::with_capacity(wanting.len());
        let max_position = self.executor.config().max_position;
        for &(id, room) in wanting {
            let Some(seq) = seqs.get(&id) else { continue };
            let len = seq.num_tokens();
            // The last draft token's position is computed by the target only.
            let wanted = room.min(self.settings.num_tokens).min(max_position.saturating_sub(len));
            if wanted == 0 {
                continue;
            }
            let held = self.held.entry(id).or_default();
            // Draft tokens that were accepted keep their KV; the last token is always run, its
            // logits give the first draft token.
            let verified = held
                .unverified
                .iter()
                .zip(held.computed..len)
                .take_while(|&(&t, pos)| seq.token(pos) == t)
                .count();
            let computed = (held.computed + verified).min(len - 1);
            held.computed = computed;
            held.unverified.clear();
            self.blocks.truncate(&mut held.table, computed);
            // Room for the sequence and every draft token but the last.
            let need = (len + wanted - 1).saturating_sub(held.table.num_tokens);
            if self.blocks.grow(&mut held.table, need).is_err() {
                // Sequences that do not draft now (speculation was off for them) give their
                // draft KV back, and they catch up when they draft again.
                let idle: Vec<SequenceId> = self
                    .held
                    .keys()
                    .copied()
                    .filter(|held_id| !wanting.iter().any(|&(w, _)| w == *held_id))
                    .collect();
                idle.into_iter().for_each(|idle_id| self.forget(idle_id));
                let Some(held) = self.held.get_mut(&id) else { continue };
                if self.blocks.grow(&mut held.table, need).is_err() {
                    continue;
                }
            }
            rows.push(Drafting {
                id,
                wanted,
                last: len - 1,
                next: computed,
                prompt_len: seq.request.prompt.len(),
                draft: Vec::with_capacity(wanted),
            });
        }
        let result = self.catch_up(seqs, &mut rows).and_then(|()| self.draft(&mut rows));
        if let Err(e) = result {
            // What the failed passes wrote is unknown: those sequences start over next time.
            for r in &rows {
                self.forget(r.id);
            }
            return Err(e);
        }
        for r in rows {
            if let Some(seq) = seqs.get_mut(&r.id) {
                seq.draft = r.draft;
            }
        }
        Ok(())
    }

    /// Runs each row's tokens up to and including its last one, in passes of at most the step
    /// budget; the pass with a row's last token gives its first draft token.
    fn catch_up(&mut self, seqs: &HashMap<SequenceId, Sequence>, rows: &mut [Drafting]) -> Result<(), ModelError> {
        while rows.iter().any(|r| r.next <= r.last) {
            let mut budget = self.max_batch_tokens;
            let mut batch = Vec::new();
            let mut in_batch = Vec::new();
            for (i, r) in rows.iter().enumerate() {
                if r.next > r.last || budget == 0 {
                    continue;
                }
                let Some(seq) = seqs.get(&r.id) else { continue };
                let end = (r.last + 1).min(r.next + budget);
                budget -= end - r.next;
                batch.push(SeqChunk {
                    tokens: seq.tokens(r.next..end),
                    first_pos: r.next,
                    block_table: self.table_of(r.id),
                    logits: if end > r.last {
                        LogitsWanted::LastArgmax
                    } else {
                        LogitsWanted::None
                    },
                    prompt_len: r.prompt_len,
                    adjust: None,
                });
                in_batch.push((i, end));
            }
            if batch.is_empty() {
                // A row whose sequence is gone: nothing left to run for it.
                rows.iter_mut().for_each(|r| r.next = r.next.max(r.last + 1));
                break;
            }
            let logits = self.executor.forward(&batch)?;
            for (bi, &(i, end)) in in_batch.iter().enumerate() {
                let r = &mut rows[i];
                r.next = end;
                if end > r.last {
                    r.draft.extend(chosen(&logits, bi));
                }
            }
            self.executor.recycle(logits);
        }
        for r in rows.iter() {
            if let Some(held) = self.held.get_mut(&r.id) {
                held.computed = r.last + 1;
            }
        }
        Ok(())
    }

    /// Extends each row's draft one token a pass until it has as many as it wants, or its draft
    /// ends (an id the target does not know).
    fn draft(&mut self, rows: &mut [Drafting]) -> Result<(), ModelError> {
        loop {
            let vocab = self.vocab;
            let growing =
                |r: &Drafting| r.draft.len() < r.wanted && r.draft.last().is_some_and(|&t| (t as usize) < vocab);
            let at: Vec<usize> = (0..rows.len()).filter(|&i| growing(&rows[i])).collect();
            if at.is_empty() {
                break;
            }
            let batch: Vec<SeqChunk> = at
                .iter()
                .map(|&i| {
                    let r = &rows[i];
                    SeqChunk {
                        tokens: vec![*r.draft.last().expect("a growing draft has a token")],
                        first_pos: r.last + r.draft.len(),
                        block_table: self.table_of(r.id),
                        logits: LogitsWanted::LastArgmax,
                        prompt_len: r.prompt_len,
                        adjust: None,
                    }
                })
                .collect();
            let logits = self.executor.forward(&batch)?;
            for (bi, &i) in at.iter().enumerate() {
                let r = &mut rows[i];
                if let Some(held) = self.held.get_mut(&r.id) {
                    held.unverified
                        .push(*r.draft.last().expect("a growing draft has a token"));
                }
                r.draft.extend(chosen(&logits, bi));
            }
            self.executor.recycle(logits);
        }
        for r in rows.iter_mut() {
            // An id the target does not know ends the draft before it.
            if let Some(end) = r.draft.iter().position(|&t| t as usize >= self.vocab) {
                r.draft.truncate(end);
            }
        }
        Ok(())
    }

    fn table_of(&self, id: SequenceId) -> Vec<u32> {
        self.held.get(&id).map(|h| h.table.blocks.clone()).unwrap_or_default()
    }
}

/// The draft's greedy token for batch row `bi`: the executor's argmax, or the argmax of its row.
fn chosen(logits: &Logits, bi: usize) -> Option<u32> {
    logits.argmax_of(bi).or_else(|| logits.last_of(bi).map(argmax))
}
