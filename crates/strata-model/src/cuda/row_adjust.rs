//! Logit bias and grammar masks on the GPU: the slots of a step's adjusted rows, staged in
//! page-locked memory, uploaded once the host's masks are in, and applied before tokens are chosen.

use std::sync::Arc;

use strata_runtime::cuda::{CudaError, DeviceBuffer, Gpu, PinnedBuffer, RowAdjustCall, RowAdjustSlot};

use crate::batch::{AllowedTokens, SeqChunk, MAX_ROW_BIAS};

/// The device and staging buffers of row adjustments, and what the staged step needs.
pub struct RowAdjusts {
    slot: RowAdjustSlot,
    /// `[logit_rows]` i32: each logits row's slot, -1 for none.
    row_slot: DeviceBuffer,
    /// `[max_seqs]` slots (a sequence has at most one adjusted row a step).
    slots: DeviceBuffer,
    host_row_slot: PinnedBuffer<i32>,
    host_slots: PinnedBuffer<u32>,
    /// The staged step's mask of each slot, to wait for at upload.
    masks: Vec<Option<Arc<dyn AllowedTokens>>>,
    /// Logits rows of the staged step (its row_slot entries).
    rows: usize,
}

impl RowAdjusts {
    /// Buffers for steps of up to `logit_rows` logits rows over `max_seqs` sequences of a model
    /// of `vocab` tokens.
    pub fn new(gpu: &Gpu, vocab: usize, logit_rows: usize, max_seqs: usize) -> Result<RowAdjusts, CudaError> {
        let slot = RowAdjustSlot::for_vocab(vocab, MAX_ROW_BIAS);
        Ok(RowAdjusts {
            slot,
            row_slot: gpu.alloc(logit_rows * 4, "logit bias and grammar masks")?,
            slots: gpu.alloc(max_seqs * slot.words() * 4, "logit bias and grammar masks")?,
            host_row_slot: gpu.alloc_pinned(logit_rows, "logit bias and grammar masks")?,
            host_slots: gpu.alloc_pinned(max_seqs * slot.words(), "logit bias and grammar masks")?,
            masks: Vec::new(),
            rows: 0,
        })
    }

    /// Stages the adjusted rows of a step: `row_seqs` is the batch index of each of its logits
    /// rows, `rows` (at least as many) the rows the step computes. False when no row is adjusted.
    pub fn stage(&mut self, batch: &[SeqChunk], row_seqs: impl Iterator<Item = usize>, rows: usize) -> bool {
        self.masks.clear();
        self.rows = rows;
        self.host_row_slot[..rows].fill(-1);
        let words = self.slot.words();
        for (row, seq) in row_seqs.enumerate() {
            let Some(adjust) = batch[seq].adjust.as_ref() else {
                continue;
            };
            let s = self.masks.len();
            let slot = &mut self.host_slots[s * words..(s + 1) * words];
            self.slot.write_bias(slot, &adjust.bias);
            self.host_row_slot[row] = s as i32;
            self.masks.push(adjust.allowed.clone());
        }
        !self.masks.is_empty()
    }

    /// Waits for the staged step's masks (computed on the host while its layers run) and queues
    /// the slots' upload on the stream, ahead of the logits kernels.
    pub fn upload(&mut self, gpu: &Gpu) -> Result<(), CudaError> {
        let words = self.slot.words();
        for (s, mask) in self.masks.iter().enumerate() {
            let slot = &mut self.host_slots[s * words..(s + 1) * words];
            let masked = mask.as_ref().is_some_and(|m| m.copy_mask(self.slot.mask_mut(slot)));
            self.slot.set_masked(slot, masked);
        }
        // SAFETY: the staging buffers are written again only by the next step's `stage`, after
        // this step's results were read back (which waits for the stream).
        unsafe {
            gpu.write_async(&self.row_slot, 0, &self.host_row_slot, self.rows)?;
            gpu.write_async(&self.slots, 0, &self.host_slots, self.masks.len() * words)
        }
    }

    /// The call over logits rows `first..first + n` of `logits` (a vocabulary slice of `vocab`
    /// ids from `vocab_start`).
    pub fn call(&self, logits: u64, vocab: usize, vocab_start: usize, first: usize, n: usize) -> RowAdjustCall {
        RowAdjustCall {
            logits,
            vocab: vocab as i32,
            row_slot: self.row_slot.at(first * 4),
            slots: self.slots.ptr(),
            mask_words: self.slot.mask_words as i32,
            max_bias: self.slot.max_bias as i32,
            vocab_start: vocab_start as i32,
            rows: n,
        }
    }
}
