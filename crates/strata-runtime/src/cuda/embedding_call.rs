//! One token-embedding call (embedding.cu): its arguments in the kernels' order and its launch
//! shape, bf16 table or (`--dtype float32`) f32.

use std::ffi::c_void;

use super::norm_call::ROW_THREADS;
use crate::kernel_args;

/// The device pointers and sizes of one lookup of `rows` tokens.
#[derive(Debug, Clone, Copy)]
pub struct EmbeddingCall {
    /// `[vocab_rows, hidden]` table: bf16, or f32 under `float32`.
    pub table: u64,
    /// `[rows]` u32 token ids.
    pub tokens: u64,
    /// `[rows, hidden]` f32 residual stream.
    pub out: u64,
    pub hidden: i32,
    /// This GPU's rows of the table are ids `vocab_start..vocab_start + vocab_rows` (TP shards
    /// the table); other ids get zeros, which the all-reduce fills in.
    pub vocab_start: i32,
    pub vocab_rows: i32,
    pub rows: usize,
    /// `embedding_lookup_f32`: an f32 table.
    pub float32: bool,
}

impl EmbeddingCall {
    /// The kernel for the table's type.
    pub fn name(&self) -> &'static str {
        if self.float32 {
            "embedding_lookup_f32"
        } else {
            "embedding_lookup"
        }
    }

    /// One block a token.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        ((self.rows as u32, 1, 1), ROW_THREADS, 0)
    }

    /// The kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.table,
            self.tokens,
            self.out,
            self.hidden,
            self.vocab_start,
            self.vocab_rows
        )
        .to_vec()
    }

    one_kernel_launch!("embedding.cu");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::arg_at as at;

    #[test]
    fn the_arguments_come_in_embedding_cu_order() {
        let c = EmbeddingCall {
            table: 1,
            tokens: 2,
            out: 3,
            hidden: 4,
            vocab_start: 5,
            vocab_rows: 6,
            rows: 7,
            float32: false,
        };
        let want = vec![
            at(&c.table),
            at(&c.tokens),
            at(&c.out),
            at(&c.hidden),
            at(&c.vocab_start),
            at(&c.vocab_rows),
        ];
        assert_eq!(c.args(), want);
        assert_eq!((c.name(), c.shape()), ("embedding_lookup", ((7, 1, 1), 1024, 0)));
        let f32_table = EmbeddingCall { float32: true, ..c };
        assert_eq!(f32_table.name(), "embedding_lookup_f32");
    }
}
