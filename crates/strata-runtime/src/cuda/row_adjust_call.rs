//! One `apply_row_adjust` call (sampling.cu): logit bias and grammar masks of a step's adjusted
//! rows, its arguments in the kernel's order and the layout of the slots it reads.

use std::ffi::c_void;

use crate::kernel_args;

/// Blocks a row is split over (each a slice of the vocabulary).
const ADJUST_SLICES: u32 = 8;
/// Words of a slot before its mask (sampling.cu's ADJUST_HEADER): has_mask, n_bias.
const ADJUST_HEADER: usize = 2;

/// The shape of one row's slot: `header | mask_words mask words | max_bias (id, bias) pairs`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RowAdjustSlot {
    /// Words of allowed-token bits: the whole vocabulary's ids, 32 a word.
    pub mask_words: usize,
    pub max_bias: usize,
}

impl RowAdjustSlot {
    /// The slot of a model of `vocab` tokens.
    pub fn for_vocab(vocab: usize, max_bias: usize) -> RowAdjustSlot {
        RowAdjustSlot {
            mask_words: vocab.div_ceil(32),
            max_bias,
        }
    }

    /// Words of one slot.
    pub fn words(&self) -> usize {
        ADJUST_HEADER + self.mask_words + 2 * self.max_bias
    }

    /// Writes the bias of a slot (`slot`: its `words()` words), at most `max_bias` entries, and
    /// marks it unmasked (a mask is added with [`Self::mask_mut`] and [`Self::set_masked`]).
    pub fn write_bias(&self, slot: &mut [u32], bias: &[(u32, f32)]) {
        let n = bias.len().min(self.max_bias);
        slot[0] = 0;
        slot[1] = n as u32;
        let pairs = &mut slot[ADJUST_HEADER + self.mask_words..];
        for (k, &(id, b)) in bias[..n].iter().enumerate() {
            pairs[2 * k] = id;
            pairs[2 * k + 1] = b.to_bits();
        }
    }

    /// The mask words of a slot.
    pub fn mask_mut<'a>(&self, slot: &'a mut [u32]) -> &'a mut [u32] {
        &mut slot[ADJUST_HEADER..ADJUST_HEADER + self.mask_words]
    }

    /// Whether the kernel applies the slot's mask.
    pub fn set_masked(&self, slot: &mut [u32], masked: bool) {
        slot[0] = u32::from(masked);
    }
}

/// The device pointers and sizes of one call over `rows` f32 logits rows.
#[derive(Debug, Clone, Copy)]
pub struct RowAdjustCall {
    /// `[rows, vocab]` f32 logits, this GPU's vocabulary slice.
    pub logits: u64,
    pub vocab: i32,
    /// `[rows]` i32: each row's slot, -1 for none.
    pub row_slot: u64,
    /// The slots, `slot.words()` u32 each.
    pub slots: u64,
    pub mask_words: i32,
    pub max_bias: i32,
    /// The first id of this GPU's vocabulary slice (TP shards the LM head).
    pub vocab_start: i32,
    pub rows: usize,
}

impl RowAdjustCall {
    pub fn name(&self) -> &'static str {
        "apply_row_adjust"
    }

    /// Grid (rows, ADJUST_SLICES).
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        ((self.rows as u32, ADJUST_SLICES, 1), 256, 0)
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.logits,
            self.vocab,
            self.row_slot,
            self.slots,
            self.mask_words,
            self.max_bias,
            self.vocab_start
        )
        .to_vec()
    }

    one_kernel_launch!("sampling.cu");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::arg_at as at;

    #[test]
    fn the_arguments_come_in_sampling_cu_order() {
        let c = RowAdjustCall {
            logits: 1,
            vocab: 2,
            row_slot: 3,
            slots: 4,
            mask_words: 5,
            max_bias: 6,
            vocab_start: 7,
            rows: 9,
        };
        let want = vec![
            at(&c.logits),
            at(&c.vocab),
            at(&c.row_slot),
            at(&c.slots),
            at(&c.mask_words),
            at(&c.max_bias),
            at(&c.vocab_start),
        ];
        assert_eq!(c.args(), want);
        assert_eq!(
            (c.name(), c.shape()),
            ("apply_row_adjust", ((9, ADJUST_SLICES, 1), 256, 0))
        );
    }

    #[test]
    fn a_slot_holds_its_header_mask_and_bias() {
        let s = RowAdjustSlot::for_vocab(70, 3);
        assert_eq!((s.mask_words, s.words()), (3, 2 + 3 + 6));
        let mut slot = vec![9u32; s.words()];
        s.write_bias(&mut slot, &[(5, 1.5), (69, -2.0), (1, 0.0), (2, 9.0)]);
        s.mask_mut(&mut slot).copy_from_slice(&[1, 2, 3]);
        s.set_masked(&mut slot, true);
        assert_eq!(
            slot,
            vec![1, 3, 1, 2, 3, 5, 1.5f32.to_bits(), 69, (-2.0f32).to_bits(), 1, 0]
        );
    }
}
