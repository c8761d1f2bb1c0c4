//! A step's inputs on their way to the GPU: the batch checked against the limits, laid out as one
//! i32 array (tokens, positions, slots, logits rows, sampling words, prompt tiles, block tables) in
//! pinned memory.

use strata_runtime::cuda::{prompt_tiles, CudaError, Event, Gpu, PinnedBuffer};

use crate::batch::{LogitsWanted, SeqChunk};
use crate::config::ModelConfig;
use crate::error::ModelError;

use super::kv_cache::GpuKvCache;

pub use strata_runtime::cuda::sampling_call::SAMPLING_WORDS;

/// The largest step the buffers are sized for.
#[derive(Debug, Clone, Copy)]
pub struct StepLimits {
    pub max_tokens: usize,
    pub max_seqs: usize,
    pub max_model_len: usize,
    /// Rows of logits computed at once (more are done in chunks).
    pub logit_rows: usize,
}

impl StepLimits {
    pub(super) fn max_blocks(&self, block_size: usize) -> usize {
        self.max_model_len.div_ceil(block_size)
    }

    /// Checks a batch against the model, the cache and these limits.
    pub(super) fn check(&self, batch: &[SeqChunk], config: &ModelConfig, kv: &GpuKvCache) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::BadBatch(m));
        let tokens: usize = batch.iter().map(|c| c.tokens.len()).sum();
        if tokens > self.max_tokens {
            return bad(format!(
                "{tokens} tokens in one step, the GPU buffers hold {}",
                self.max_tokens
            ));
        }
        if batch.len() > self.max_seqs {
            return bad(format!(
                "{} sequences in one step, at most {}",
                batch.len(),
                self.max_seqs
            ));
        }
        let bs = kv.block_size;
        for (i, ch) in batch.iter().enumerate() {
            if ch.end_pos() > self.max_model_len {
                return bad(format!(
                    "sequence {i} reaches {} positions, max {}",
                    ch.end_pos(),
                    self.max_model_len
                ));
            }
            if ch.block_table.len() * bs < ch.end_pos() {
                return bad(format!(
                    "sequence {i}: block table too short for {} positions",
                    ch.end_pos()
                ));
            }
            if let Some(b) = ch.block_table.iter().find(|&&b| b as usize >= kv.num_blocks) {
                return bad(format!(
                    "sequence {i}: block {b} outside the cache of {}",
                    kv.num_blocks
                ));
            }
            if let Some(t) = ch.tokens.iter().find(|&&t| t as usize >= config.vocab_size) {
                return bad(format!("token id {t} outside the vocabulary of {}", config.vocab_size));
            }
        }
        Ok(())
    }
}

/// Offsets (in i32 elements) of each input array in the staging buffer.
#[derive(Debug, Clone, Copy)]
pub(super) struct InputLayout {
    pub tokens: usize,
    pub positions: usize,
    pub token_seq: usize,
    pub slots: usize,
    pub rows: usize,
    /// Per logits row, SAMPLING_WORDS words (sampling.cu's): 1 / temperature (f32 bits, 0 for an
    /// argmax), the seed's two words, top_k, top_p and min_p (f32 bits).
    pub sampling: usize,
    /// `paged_attention_prefill_*`'s tiles (`prompt_tiles`), at most one a token.
    pub tiles: usize,
    pub tables: usize,
    pub len: usize,
}

impl InputLayout {
    /// The layout of a step of `tokens` (padded) tokens over `seqs` sequences: the arrays end to
    /// end, so a step copies only its own inputs. Offsets depend on `tokens` alone, so a graph
    /// captured for a bucket keeps pointing at the right arrays.
    fn for_step(tokens: usize, seqs: usize, max_blocks: usize) -> InputLayout {
        let t = tokens;
        InputLayout {
            tokens: 0,
            positions: t,
            token_seq: 2 * t,
            slots: 3 * t,
            rows: 4 * t,
            sampling: 5 * t,
            tiles: (5 + SAMPLING_WORDS) * t,
            tables: (6 + SAMPLING_WORDS) * t,
            len: (6 + SAMPLING_WORDS) * t + (seqs + 1) * max_blocks,
        }
    }

    /// The largest step's layout (the staging buffer's size).
    pub(super) fn largest(l: &StepLimits, block_size: usize) -> InputLayout {
        InputLayout::for_step(l.max_tokens, l.max_seqs, l.max_blocks(block_size))
    }
}

/// One logits row of a staged step.
#[derive(Debug, Clone, Copy)]
pub(super) struct LogitsRow {
    /// The batch index of its sequence, its position and its flat token index.
    pub seq: usize,
    pub pos: usize,
    pub token: usize,
    /// The whole row comes back; otherwise its argmax only.
    pub whole: bool,
}

/// What the host knows of a staged step.
pub(super) struct StagedStep {
    /// Real (unpadded) tokens.
    pub tokens: usize,
    pub rows: Vec<LogitsRow>,
    /// The longest context of its sequences.
    pub max_ctx: usize,
    /// Tiles in the layout's `tiles` array (0 unless staged with them).
    pub tiles: usize,
}

/// The host side of the inputs: two page-locked arrays, filled in turn, so that one is filled
/// while the upload of a started step from the other may still be queued.
pub(super) struct StepInputs {
    host: [PinnedBuffer<i32>; 2],
    /// The array the next step fills, and the mark after each one's last upload.
    pub slot: usize,
    uploaded: [Option<Event>; 2],
    /// The layout of the step staged last.
    pub layout: InputLayout,
}

impl StepInputs {
    pub(super) fn new(gpu: &Gpu, limits: &StepLimits, block_size: usize) -> Result<StepInputs, CudaError> {
        let layout = InputLayout::largest(limits, block_size);
        Ok(StepInputs {
            host: [
                gpu.alloc_pinned(layout.len, "step inputs")?,
                gpu.alloc_pinned(layout.len, "step inputs")?,
            ],
            slot: 0,
            uploaded: [None, None],
            layout,
        })
    }

    /// Lays out and fills the current array for `batch`, padded to `padded` tokens for a graph,
    /// once the array's previous upload is done; with the prompt tiles when `tiles` (steps that
    /// are not decode buckets, the only ones whose attention may take them).
    pub(super) fn stage(
        &mut self,
        batch: &[SeqChunk],
        padded: usize,
        max_blocks: usize,
        kv: &GpuKvCache,
        tiles: bool,
    ) -> Result<StagedStep, CudaError> {
        if let Some(mark) = self.uploaded[self.slot].take() {
            mark.synchronize()?;
        }
        let bs = kv.block_size;
        self.layout = InputLayout::for_step(padded, batch.len(), max_blocks);
        let l = self.layout;
        let pad_row = batch.len(); // a table row that points at the padding block
        let h = &mut self.host[self.slot];
        let mut t = 0;
        let mut rows = Vec::new();
        let mut max_ctx = 0;
        for (si, ch) in batch.iter().enumerate() {
            let table = &mut h[l.tables + si * max_blocks..l.tables + (si + 1) * max_blocks];
            for (d, &b) in table.iter_mut().zip(&ch.block_table) {
                *d = b as i32;
            }
            for (i, &tok) in ch.tokens.iter().enumerate() {
                let pos = ch.first_pos + i;
                h[l.tokens + t] = tok as i32;
                h[l.positions + t] = pos as i32;
                h[l.token_seq + t] = si as i32;
                h[l.slots + t] = (ch.block_table[pos / bs] as usize * bs + pos % bs) as i32;
                let last = i + 1 == ch.tokens.len();
                let whole = match ch.logits {
                    LogitsWanted::Last if last => Some(true),
                    w if last && w.wants_id_only() => Some(false),
                    LogitsWanted::All => Some(true),
                    LogitsWanted::AllArgmax => Some(false),
                    _ => None,
                };
                if let Some(whole) = whole {
                    let at = l.sampling + SAMPLING_WORDS * rows.len();
                    h[at..at + SAMPLING_WORDS].copy_from_slice(&sampling_words(ch.logits));
                    rows.push(LogitsRow {
                        seq: si,
                        pos,
                        token: t,
                        whole,
                    });
                }
                t += 1;
            }
            max_ctx = max_ctx.max(ch.end_pos());
        }
        let real = t;
        h[l.tables + pad_row * max_blocks] = kv.num_blocks as i32;
        while t < padded {
            h[l.tokens + t] = 0;
            h[l.positions + t] = 0;
            h[l.token_seq + t] = pad_row as i32;
            h[l.slots + t] = (kv.num_blocks * bs) as i32;
            t += 1;
        }
        for (j, row) in rows.iter().enumerate() {
            h[l.rows + j] = row.token as i32;
        }
        let tiles = if tiles {
            prompt_tiles(batch.iter().map(|c| (c.tokens.len(), c.first_pos)))
        } else {
            Vec::new()
        };
        h[l.tiles..l.tiles + tiles.len()].copy_from_slice(&tiles);
        // A captured decode step computes logits for every padded token, row j = token j: their
        // argmax, for rows no sequence reads.
        for j in rows.len()..padded {
            h[l.rows + j] = j as i32;
            h[l.sampling + SAMPLING_WORDS * j..l.sampling + SAMPLING_WORDS * (j + 1)].fill(0);
        }
        Ok(StagedStep {
            tokens: real,
            rows,
            max_ctx,
            tiles: tiles.len(),
        })
    }

    /// Overwrites the staged tokens of the first rows (tokens taken on the device: their source
    /// rows take the placeholders' place).
    pub(super) fn set_tokens(&mut self, tokens: &[usize]) {
        let l = self.layout;
        for (i, &v) in tokens.iter().enumerate() {
            self.host[self.slot][l.tokens + i] = v as i32;
        }
    }

    /// Copies the staged step into `device`, waiting for the copy.
    pub(super) fn upload(&self, gpu: &Gpu, device: &strata_runtime::cuda::DeviceBuffer) -> Result<(), CudaError> {
        gpu.write(device, 0, &self.host[self.slot][..self.layout.len])
    }

    /// Queues the copy of the staged step into `device` and marks it, then turns to the other
    /// array; returns the slot used.
    ///
    /// # Safety
    /// The array is not written again before the mark has passed (`stage` waits for it).
    pub(super) unsafe fn upload_async(
        &mut self,
        gpu: &Gpu,
        device: &strata_runtime::cuda::DeviceBuffer,
    ) -> Result<usize, CudaError> {
        let slot = self.slot;
        // SAFETY: the caller's promise, kept by `stage`.
        unsafe { gpu.write_async(device, 0, &self.host[slot], self.layout.len)? };
        self.uploaded[slot] = Some(gpu.mark()?);
        self.slot ^= 1;
        Ok(slot)
    }
}

/// A logits row's SAMPLING_WORDS parameters: zeros (the argmax) unless the row is sampled.
pub fn sampling_words(wanted: LogitsWanted) -> [i32; SAMPLING_WORDS] {
    let LogitsWanted::LastSampled(s) = wanted else {
        return [0; SAMPLING_WORDS];
    };
    [
        (1.0 / s.temperature).to_bits(),
        s.seed as u32,
        (s.seed >> 32) as u32,
        s.top_k,
        s.top_p.to_bits(),
        s.min_p.to_bits(),
    ]
    .map(|w| w as i32)
}
