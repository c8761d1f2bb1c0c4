//! Logit bias and grammar masks on the GPU: the slots of a step's adjusted rows, staged in
//! page-locked memory, uploaded once the host's masks are in, and applied before tokens are chosen.

use std::sync::Arc;

use strata_runtime::cuda::{CudaError, DeviceBuffer, Event, Gpu, PinnedBuffer, RowAdjustCall, RowAdjustSlot};

use crate::batch::{AllowedTokens, SeqChunk, MAX_ROW_BIAS};

/// One step's staged adjustments, in page-locked memory.
struct Staged {
    row_slot: PinnedBuffer<i32>,
    slots: PinnedBuffer<u32>,
    /// Each slot's mask, to wait for at upload.
    masks: Vec<Option<Arc<dyn AllowedTokens>>>,
    /// Logits rows of the step (its row_slot entries).
    rows: usize,
    /// Marked after the upload: the buffers are not written again before it has passed.
    uploaded: Option<Event>,
}

/// The device buffers of row adjustments and two staging sets: a started step's adjustments wait
/// in one (its masks are not in yet) while the next step is staged in the other.
pub struct RowAdjusts {
    slot: RowAdjustSlot,
    /// `[rows]` i32: each logits row's slot, -1 for none.
    row_slot: DeviceBuffer,
    /// `[max_seqs]` slots (a sequence has at most one adjusted row a step).
    slots: DeviceBuffer,
    staged: [Staged; 2],
    next: usize,
}

impl RowAdjusts {
    /// Buffers for steps of up to `rows` logits rows over `max_seqs` sequences of a model of
    /// `vocab` tokens.
    pub fn new(gpu: &Gpu, vocab: usize, rows: usize, max_seqs: usize) -> Result<RowAdjusts, CudaError> {
        let slot = RowAdjustSlot::for_vocab(vocab, MAX_ROW_BIAS);
        let what = "logit bias and grammar masks";
        let staged = || -> Result<Staged, CudaError> {
            Ok(Staged {
                row_slot: gpu.alloc_pinned(rows, what)?,
                slots: gpu.alloc_pinned(max_seqs * slot.words(), what)?,
                masks: Vec::new(),
                rows: 0,
                uploaded: None,
            })
        };
        Ok(RowAdjusts {
            slot,
            row_slot: gpu.alloc(rows * 4, what)?,
            slots: gpu.alloc(max_seqs * slot.words() * 4, what)?,
            staged: [staged()?, staged()?],
            next: 0,
        })
    }

    /// Stages the adjusted rows of a step: `row_seqs` is the batch index of each of its logits
    /// rows, `rows` (at least as many) the rows the step computes. The staging set to upload, or
    /// `None` when no row is adjusted.
    pub fn stage(
        &mut self,
        batch: &[SeqChunk],
        row_seqs: impl Iterator<Item = usize>,
        rows: usize,
    ) -> Result<Option<usize>, CudaError> {
        if batch.iter().all(|c| c.adjust.is_none()) {
            return Ok(None);
        }
        let set = self.next;
        self.next ^= 1;
        let s = &mut self.staged[set];
        if let Some(mark) = s.uploaded.take() {
            mark.synchronize()?;
        }
        s.masks.clear();
        s.rows = rows;
        s.row_slot[..rows].fill(-1);
        let words = self.slot.words();
        for (row, seq) in row_seqs.enumerate() {
            let Some(adjust) = batch[seq].adjust.as_ref() else {
                continue;
            };
            let k = s.masks.len();
            self.slot
                .write_bias(&mut s.slots[k * words..(k + 1) * words], &adjust.bias);
            s.row_slot[row] = k as i32;
            s.masks.push(adjust.allowed.clone());
        }
        Ok(Some(set))
    }

    /// Waits for staging set `set`'s masks (computed on the host while the step's layers run)
    /// and queues its upload on the stream, ahead of the logits kernels.
    pub fn upload(&mut self, gpu: &Gpu, set: usize) -> Result<(), CudaError> {
        let words = self.slot.words();
        let s = &mut self.staged[set];
        for (k, mask) in s.masks.iter().enumerate() {
            let slot = &mut s.slots[k * words..(k + 1) * words];
            let masked = mask.as_ref().is_some_and(|m| m.copy_mask(self.slot.mask_mut(slot)));
            self.slot.set_masked(slot, masked);
        }
        // SAFETY: the set is written again only by a later `stage`, after `uploaded` has passed.
        unsafe {
            gpu.write_async(&self.row_slot, 0, &s.row_slot, s.rows)?;
            gpu.write_async(&self.slots, 0, &s.slots, s.masks.len() * words)?;
        }
        s.uploaded = Some(gpu.mark()?);
        Ok(())
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
