//! Iteration-level scheduling: which sequences run in the next forward pass and how many of
//! their tokens, under a token budget, with chunked prefill, FCFS admission and preemption.

use std::collections::{HashMap, HashSet, VecDeque};

use crate::block_manager::BlockManager;
use crate::sequence::{Sequence, SequenceId};

/// Limits of one engine step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens (prefill and decode together) in one forward pass.
    pub max_num_batched_tokens: usize,
    /// Sequences running at once.
    pub max_num_seqs: usize,
}

/// `num_tokens` of sequence `id`, starting at its `num_computed`, run in this step; the last
/// `drafts` of them are the first tokens of its [`Sequence::draft`], to be verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledChunk {
    pub id: SequenceId,
    pub num_tokens: usize,
    pub drafts: usize,
}

/// The outcome of [`Scheduler::schedule_step`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct StepPlan {
    pub chunks: Vec<ScheduledChunk>,
    /// Sequences whose KV was dropped this step; they wait at the front and are recomputed.
    pub preempted: Vec<SequenceId>,
    /// Sequences admitted from the queue this step (first admission or after a preemption).
    pub admitted: Vec<SequenceId>,
}

impl StepPlan {
    /// Tokens in the step.
    pub fn num_tokens(&self) -> usize {
        self.chunks.iter().map(|c| c.num_tokens).sum()
    }
}

/// Waiting and running sequences, in arrival order.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    waiting: VecDeque<SequenceId>,
    /// Admitted sequences, earliest first; the last one is preempted first.
    running: Vec<SequenceId>,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Scheduler {
        Scheduler {
            config: SchedulerConfig {
                max_num_batched_tokens: config.max_num_batched_tokens.max(1),
                max_num_seqs: config.max_num_seqs.max(1),
            },
            waiting: VecDeque::new(),
            running: Vec::new(),
        }
    }

    /// Queues a new sequence behind the others.
    pub fn add(&mut self, id: SequenceId) {
        self.waiting.push_back(id);
    }

    /// Forgets a sequence (finished or aborted); its blocks are the caller's to free.
    pub fn remove(&mut self, id: SequenceId) {
        self.waiting.retain(|&w| w != id);
        self.running.retain(|&r| r != id);
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Most sequences in one batch when `depth` batches are kept in flight: no limit at depth 1;
    /// otherwise an even share of the sequences that run or could be admitted, so that `depth`
    /// batches of different sequences alternate.
    pub fn batch_share(&self, depth: usize) -> usize {
        if depth <= 1 {
            return usize::MAX;
        }
        let total = (self.running.len() + self.waiting.len()).min(self.config.max_num_seqs);
        total.div_ceil(depth).max(1)
    }

    /// Plans one step of at most `max_seqs` sequences, none of them in `busy` (sequences whose
    /// batch is still in flight: they neither run nor are preempted until its results are in).
    /// Running sequences come first (decodes cost one token each, unfinished prefills take the
    /// next chunk), then waiting ones are admitted in arrival order while the budget,
    /// `max_num_seqs`, `max_seqs` and free blocks allow. A decoding sequence with a draft runs
    /// its draft tokens too, as many as the budget leaves, unless their blocks would leave fewer
    /// free blocks than running sequences after it (a decode needs at most one). When a running sequence needs a block and none is left, the most recently
    /// admitted sequence that is not busy is preempted: its blocks are freed and it goes back to
    /// the front of the queue, to be recomputed.
    pub fn schedule_step(
        &mut self,
        seqs: &mut HashMap<SequenceId, Sequence>,
        bm: &mut BlockManager,
        busy: &HashSet<SequenceId>,
        max_seqs: usize,
    ) -> StepPlan {
        let mut plan = StepPlan::default();
        let mut budget = self.config.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 && plan.chunks.len() < max_seqs {
            let id = self.running[i];
            if busy.contains(&id) {
                i += 1;
                continue;
            }
            let seq = seqs.get_mut(&id).expect("running sequence exists");
            let n = seq.to_compute().min(budget);
            if n < seq.to_compute() {
                seq.draft.clear();
            }
            seq.draft.truncate(budget - n);
            // Draft tokens only take blocks that leave one for each running sequence after this one.
            let with_draft = bm.blocks_for(seq.num_computed + n + seq.draft.len());
            let later = self.running.len() - i - 1;
            if with_draft.saturating_sub(seq.table.blocks.len()) + later > bm.num_available() {
                seq.draft.clear();
            }
            let drafts = seq.draft.len();
            let need = (seq.num_computed + n + drafts).saturating_sub(seq.table.num_tokens);
            if bm.grow(&mut seq.table, need).is_ok() {
                plan.chunks.push(ScheduledChunk {
                    id,
                    num_tokens: n + drafts,
                    drafts,
                });
                budget -= n + drafts;
                i += 1;
                continue;
            }
            // Out of blocks: preempt from the back until this sequence fits (or is itself
            // preempted). This sequence is not busy, so there is always a victim at or after it.
            let Some(&victim) = self.running.iter().rev().find(|r| !busy.contains(r)) else {
                break;
            };
            self.preempt(victim, seqs, bm, &mut plan);
            if victim == id {
                break;
            }
        }
        if !plan.preempted.is_empty() {
            return plan;
        }
        while budget > 0 && self.running.len() < self.config.max_num_seqs && plan.chunks.len() < max_seqs {
            let Some(&id) = self.waiting.front() else { break };
            let seq = seqs.get_mut(&id).expect("waiting sequence exists");
            let tokens = seq.tokens(0..seq.num_tokens());
            let Ok((table, cached)) = bm.allocate_prompt(&tokens) else {
                break;
            };
            seq.table = table;
            seq.num_computed = cached;
            if seq.preemptions == 0 {
                seq.cached_prompt_tokens = cached;
            }
            let n = seq.to_compute().min(budget);
            self.waiting.pop_front();
            self.running.push(id);
            plan.admitted.push(id);
            plan.chunks.push(ScheduledChunk {
                id,
                num_tokens: n,
                drafts: 0,
            });
            budget -= n;
        }
        plan
    }

    fn preempt(
        &mut self,
        id: SequenceId,
        seqs: &mut HashMap<SequenceId, Sequence>,
        bm: &mut BlockManager,
        plan: &mut StepPlan,
    ) {
        let seq = seqs.get_mut(&id).expect("preempted sequence exists");
        bm.free_table(&mut seq.table);
        seq.draft.clear();
        seq.num_computed = 0;
        seq.preemptions += 1;
        self.running.retain(|&r| r != id);
        self.waiting.push_front(id);
        plan.chunks.retain(|c| c.id != id);
        plan.preempted.push(id);
    }
}
