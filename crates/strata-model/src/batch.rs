//! The input of one forward pass: many sequences' new tokens in one flat list.
//! Prefill chunks and single decode tokens mix freely; each sequence brings its block table.

use std::sync::Arc;

/// Which positions of a sequence chunk need logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LogitsWanted {
    /// None (a prefill chunk that is not the last).
    None,
    /// The last token only (decode, or the end of a prompt).
    Last,
    /// Only the argmax of the last token (greedy sampling with no penalties and no logprobs):
    /// an executor may return the id alone (in [`Logits::argmax`]) instead of the row.
    LastArgmax,
    /// A token of the last position drawn as [`DeviceSampling`] says (sampling without penalties
    /// or logprobs): an executor that samples on its device ([`crate::Executor::samples_on_device`])
    /// returns the id alone (in [`Logits::argmax`]), any other the row, as for `Last`.
    LastSampled(DeviceSampling),
    /// Every token of the chunk: speculative verification (the last computed token and each
    /// draft token, every row choosing the token after it), scoring, tests.
    All,
    /// Every token of the chunk, for greedy verification (no penalties, logprobs, bias or mask):
    /// an executor may return each row's argmax alone (in [`Logits::argmax`], in position
    /// order) instead of the rows.
    AllArgmax,
}

impl LogitsWanted {
    /// Only the last token's id is wanted, chosen by the executor (`LastArgmax`, `LastSampled`).
    pub fn wants_id_only(self) -> bool {
        matches!(self, LogitsWanted::LastArgmax | LogitsWanted::LastSampled(_))
    }
}

/// A token drawn on the device: from softmax(logits / temperature) over the `top_k` best tokens
/// (0 = all), then those with at least `min_p` of the best one's probability, then the fewest best
/// ones that hold `top_p` of what is left (the host sampler's rule), with the random stream `seed`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceSampling {
    pub temperature: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub seed: u64,
}

/// Temperature 1 over the whole vocabulary (the OpenAI API's default), seed 0.
impl Default for DeviceSampling {
    fn default() -> Self {
        DeviceSampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

impl DeviceSampling {
    /// The ids this draws from in `row`, best first, by the host sampler's rule: the `top_k`
    /// best (ties to the lower id), then those with at least `min_p` of the best one's
    /// probability, then the fewest best ones holding `top_p` of what is left (top_p 1 and min_p
    /// 0 are off). Weights are summed in f64: this is the reference the samplers approximate.
    pub fn kept_tokens(&self, row: &[f32]) -> Vec<u32> {
        let inv_t = 1.0 / self.temperature;
        let mut kept: Vec<u32> = (0..row.len() as u32).collect();
        kept.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]).then(a.cmp(&b)));
        if self.top_k > 0 {
            kept.truncate(self.top_k as usize);
        }
        let best = row[kept[0] as usize];
        let weight = |i: u32| (((row[i as usize] - best) * inv_t) as f64).exp();
        if self.min_p > 0.0 {
            kept.retain(|&i| weight(i) >= self.min_p as f64);
        }
        if self.top_p < 1.0 {
            let total: f64 = kept.iter().map(|&i| weight(i)).sum();
            let mut acc = 0.0;
            let holding_top_p = kept.iter().position(|&i| {
                acc += weight(i);
                acc >= self.top_p as f64 * total
            });
            kept.truncate(holding_top_p.map_or(kept.len(), |p| p + 1));
        }
        kept
    }
}

/// The tokens a constrained row may take, computed on the host while the row's step runs.
pub trait AllowedTokens: Send + Sync {
    /// Waits for the mask and copies it into `out` (bit `id % 32` of word `id / 32` set = `id`
    /// allowed; words past the mask are zeroed). False when no mask applies: the sequence ends
    /// at this step and its token is not used.
    fn copy_mask(&self, out: &mut [u32]) -> bool;
}

/// Most `logit_bias` entries of one row (the API's limit).
pub const MAX_ROW_BIAS: usize = 1024;

/// What a row's logits get before an executor that samples on its device chooses its token:
/// the request's logit bias (at most [`MAX_ROW_BIAS`] entries), then its grammar's mask, as the
/// host sampler does.
#[derive(Clone, Default)]
pub struct RowAdjust {
    pub bias: Arc<[(u32, f32)]>,
    pub allowed: Option<Arc<dyn AllowedTokens>>,
}

impl std::fmt::Debug for RowAdjust {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowAdjust")
            .field("bias", &self.bias.len())
            .field("masked", &self.allowed.is_some())
            .finish()
    }
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
    /// Positions below this are prompt tokens, computed on the dense (GEMM) path (on the
    /// integer path at `standard` precision when every layer matrix is row-grouped); positions
    /// from here on were generated and are computed on the quantized decode path, also when they
    /// are recomputed in a chunk after a preemption. A token's numbers depend on its path only, never
    /// on the rest of the batch. `usize::MAX` makes every token a prompt token.
    pub prompt_len: usize,
    /// Bias and mask of the last token's logits, for `LastArgmax` / `LastSampled` rows on
    /// executors that sample on their device (the host applies them itself otherwise).
    pub adjust: Option<RowAdjust>,
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
    /// `(sequence index in the batch, token id)` for `LastArgmax` (ties go to the lowest id) and
    /// `LastSampled` sequences whose row was not returned, and for each row of an `AllArgmax`
    /// sequence whose rows were not returned (one entry a position, in position order).
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

    /// Every argmax returned for sequence `seq`, in order: an `AllArgmax` chunk's positions.
    pub fn argmaxes_of(&self, seq: usize) -> Vec<u32> {
        self.argmax
            .iter()
            .filter(|&&(s, _)| s == seq)
            .map(|&(_, t)| t)
            .collect()
    }

    /// The row of sequence `seq` at position `pos`, if it was asked for.
    pub fn row_at(&self, seq: usize, pos: usize) -> Option<&[f32]> {
        self.rows.iter().position(|&r| r == (seq, pos)).map(|i| self.row(i))
    }

    /// The last row of sequence `seq`, if it asked for logits.
    pub fn last_of(&self, seq: usize) -> Option<&[f32]> {
        self.rows.iter().rposition(|&(s, _)| s == seq).map(|i| self.row(i))
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceSampling;

    #[test]
    fn kept_tokens_follow_top_k_then_min_p_then_top_p() {
        // Weights relative to the best (id 2): 1, e^-1, e^-1 (a tie: ids 0 and 4), e^-2, e^-3.
        let row = [2.0f32, 0.0, 3.0, 1.0, 2.0];
        let plain = DeviceSampling::default();
        assert_eq!(plain.kept_tokens(&row), [2, 0, 4, 3, 1]);
        // Off is off, also over a vocabulary whose f32 weight sum stops growing before its tail.
        let wide: Vec<f32> = (0..150_000).map(|i| -(i as f32) * 0.001).collect();
        assert_eq!(plain.kept_tokens(&wide).len(), wide.len());
        assert_eq!(DeviceSampling { top_k: 2, ..plain }.kept_tokens(&row), [2, 0]);
        assert_eq!(DeviceSampling { min_p: 0.3, ..plain }.kept_tokens(&row), [2, 0, 4]);
        // Weights 1 + 2 e^-1 = 1.736 of 1.921 in all: 0.9 of it (1.729) is in the first three,
        // 0.95 (1.825) needs the fourth.
        assert_eq!(DeviceSampling { top_p: 0.9, ..plain }.kept_tokens(&row), [2, 0, 4]);
        assert_eq!(DeviceSampling { top_p: 0.95, ..plain }.kept_tokens(&row), [2, 0, 4, 3]);
        assert_eq!(DeviceSampling { top_p: 0.5, ..plain }.kept_tokens(&row), [2]);
        // At temperature 2 the weights flatten: min_p 0.3 keeps down to e^-1 (logit 1).
        let hot = DeviceSampling {
            temperature: 2.0,
            ..plain
        };
        assert_eq!(DeviceSampling { min_p: 0.3, ..hot }.kept_tokens(&row), [2, 0, 4, 3]);
        // top_k first: top_p then counts only the two kept.
        assert_eq!(
            DeviceSampling {
                top_k: 2,
                top_p: 0.7,
                ..plain
            }
            .kept_tokens(&row),
            [2]
        );
        assert_eq!(
            DeviceSampling {
                top_k: 2,
                top_p: 0.75,
                ..plain
            }
            .kept_tokens(&row),
            [2, 0]
        );
    }
}
