//! The input of one forward pass: many sequences' new tokens in one flat list.
//! Prefill chunks and single decode tokens mix freely; each sequence brings its block table.

/// Which positions of a sequence chunk need logits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the last).
    None,
    /// The last token only (decode, or the end of a prompt).
    Last,
    /// Only the argmax of the last token (greedy sampling with no penalties and no logprobs):
    /// an executor may return the id alone (in [`Logits::argmax`]) instead of the row.
    LastArgmax,
    /// A token of the last position drawn from softmax(logits / temperature) with the random
    /// stream `seed` (temperature sampling with nothing else: no top-k, top-p, min-p, penalties
    /// or logprobs): an executor that samples on its device ([`crate::Executor::samples_on_device`])
    /// returns the id alone (in [`Logits::argmax`]), any other the row, as for `Last`.
    LastSampled { temperature_bits: u32, seed: u64 },
    /// Every token of the chunk (scoring, tests).
    All,
}

/// One sequence's slice of the batch.
#[derive(Debug, Clone)]
pub struct SeqChunk {
    /// The new tokens, at positions `first_pos..first_pos + tokens.len()`.
    pub tokens: Vec<u32>,
    /// Position of the first new token (tokens before it are already in the cache).
    pub first_pos: usize,
    /// Cache block of each `block_size` positions, covering at least `first_pos + tokens.len()`.
    pub block_table: Vec<u32>,
    pub logits: LogitsWanted,
    /// Positions below this are prompt tokens, computed on the dense (GEMM) path; positions from
    /// here on were generated and are computed on the quantized decode path, also when they are
    /// recomputed in a chunk after a preemption. A token's numbers depend on its path only, never
    /// on the rest of the batch. `usize::MAX` makes every token a prompt token.
    pub prompt_len: usize,
}

impl SeqChunk {
    /// Context length after this chunk.
    pub fn end_pos(&self) -> usize {
        self.first_pos + self.tokens.len()
    }

    /// How many of the new tokens are prompt tokens (they come first).
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_len.saturating_sub(self.first_pos).min(self.tokens.len())
    }
}

/// Logits of the requested positions, one row of `vocab` values each.
#[derive(Debug, Clone, Default)]
pub struct Logits {
    /// `(sequence index in the batch, position)` of each row.
    pub rows: Vec<(usize, usize)>,
    pub vocab: usize,
    pub data: Vec<f32>,
    /// `(sequence index in the batch, token id)` for `LastArgmax` sequences whose row was not
    /// returned (ties go to the lowest id).
    pub argmax: Vec<(usize, u32)>,
}

impl Logits {
    /// Row `i`.
    pub fn row(&self, i: usize) -> &[f32] {
        &self.data[i * self.vocab..(i + 1) * self.vocab]
    }

    /// The greedy token of sequence `seq`, when only its argmax was returned (looked up at index
    /// `seq` first: a decode step returns one id a sequence, in batch order).
    pub fn argmax_of(&self, seq: usize) -> Option<u32> {
        match self.argmax.get(seq) {
            Some(&(s, t)) if s == seq => Some(t),
            _ => self.argmax.iter().find(|&&(s, _)| s == seq).map(|&(_, t)| t),
        }
    }

    /// The last row of sequence `seq`, if it asked for logits.
    pub fn last_of(&self, seq: usize) -> Option<&[f32]> {
        self.rows.iter().rposition(|&(s, _)| s == seq).map(|i| self.row(i))
    }
}
