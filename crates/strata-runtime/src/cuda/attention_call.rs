//! One paged-attention call (attention.cu): its arguments in the one order its kernels take them,
//! and its launch shape; the forward pass, the CUDA tests and `bench-gpu --attention` launch from it.

use std::ffi::c_void;

use super::device::Gpu;
use super::kernels::{staged_attention_shared_bytes, Kernels, ATTENTION_WARPS, PREFILL_ATTENTION_TOKENS};
use super::CudaError;
use crate::kernel_args;

/// The device pointers and sizes of one attention call over `tokens` query tokens.
#[derive(Debug, Clone, Copy)]
pub struct AttentionCall {
    /// bf16 queries, `q_stride` elements a token (heads at `h * head_dim`).
    pub q: u64,
    pub q_stride: i32,
    pub k_cache: u64,
    pub v_cache: u64,
    /// fp8 caches' per-vector scales (0 for bf16).
    pub k_scale: u64,
    pub v_scale: u64,
    /// `[seqs, max_blocks]` block tables; `token_seq[t]` is token t's row, `positions[t]` its
    /// position (it attends keys 0..=position).
    pub block_tables: u64,
    pub max_blocks: i32,
    pub token_seq: u64,
    pub positions: u64,
    /// bf16 output `[tokens, n_heads * head_dim]`.
    pub out: u64,
    /// f32 partial sums and (max, denominator) pairs of the context parts (parts > 1).
    pub part_acc: u64,
    pub part_ml: u64,
    pub n_kv: i32,
    pub block_size: i32,
    /// Softmax scale, 1 / sqrt(head_dim).
    pub scale: f32,
    /// Shared-memory stages a warp for the `paged_attention_staged_*` kernels; 0 for the
    /// others, which take one argument fewer.
    pub stages: i32,
    pub tokens: usize,
    /// Context parts per token (a second kernel merges them when > 1).
    pub parts: i32,
    pub n_heads: usize,
    pub head_dim: usize,
    pub fp8: bool,
}

impl AttentionCall {
    /// Grid, threads a block and dynamic shared bytes of the attention kernel.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let shared = staged_attention_shared_bytes(self.head_dim, self.fp8, self.stages as usize);
        (
            (self.tokens as u32, self.n_kv as u32, self.parts as u32),
            (ATTENTION_WARPS * 32) as u32,
            shared as u32,
        )
    }

    /// The attention kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        let mut args = kernel_args!(
            self.q,
            self.q_stride,
            self.k_cache,
            self.v_cache,
            self.k_scale,
            self.v_scale,
            self.block_tables,
            self.max_blocks,
            self.token_seq,
            self.positions,
            self.out,
            self.part_acc,
            self.part_ml,
            self.n_kv,
            self.block_size,
            self.scale,
            self.stages
        )
        .to_vec();
        if self.stages == 0 {
            args.pop();
        }
        args
    }

    /// Grid and threads of `attention_reduce`, which merges the context parts.
    fn reduce_shape(&self) -> ((u32, u32, u32), u32) {
        ((self.tokens as u32, self.n_heads as u32, 1), self.head_dim as u32)
    }

    /// `attention_reduce`'s arguments, pointing into `self`.
    fn reduce_args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.part_acc, self.part_ml, self.out, self.parts).to_vec()
    }

    /// Launches `kernel` (an attention.cu kernel that fits the call: staged when `stages` > 0,
    /// fp8 when `fp8`) and the merge of its parts, each through `launch(name, grid, threads a
    /// block, dynamic shared bytes, arguments)`: the forward pass's launcher profiles and ablates.
    pub fn launch_with<E>(
        &self,
        kernel: &str,
        mut launch: impl FnMut(&str, (u32, u32, u32), u32, u32, &mut [*mut c_void]) -> Result<(), E>,
    ) -> Result<(), E> {
        let (grid, threads, shared) = self.shape();
        launch(kernel, grid, threads, shared, &mut self.args())?;
        if self.parts > 1 {
            let (grid, threads) = self.reduce_shape();
            // The merge's twin has the attention kernel's element type.
            let reduce = if kernel.ends_with("_f32") {
                "attention_reduce_f32"
            } else {
                "attention_reduce"
            };
            launch(reduce, grid, threads, 0, &mut self.reduce_args())?;
        }
        Ok(())
    }

    /// [`Self::launch_with`] straight on `gpu`'s stream.
    ///
    /// # Safety
    /// The pointers must be device buffers sized for the call (see attention.cu).
    pub unsafe fn launch(&self, gpu: &Gpu, kernels: &Kernels, kernel: &str) -> Result<(), CudaError> {
        self.launch_with(kernel, |name, grid, threads, shared, args| {
            // SAFETY: the caller's promise; the arguments are the kernel's, in attention.cu's order.
            unsafe { kernels.launch(gpu, name, grid, threads, shared, args) }
        })
    }
}

/// One prompt-attention call (`paged_attention_prefill_bf16`, or `_fp8` over an fp8 cache): a
/// block for each tile of up to [`PREFILL_ATTENTION_TOKENS`] consecutive query tokens of one
/// sequence and each KV head (the other fields as in [`AttentionCall`], whose parts it ignores).
#[derive(Debug, Clone, Copy)]
pub struct PrefillAttentionCall {
    pub attention: AttentionCall,
    /// `[n_tiles]` i32: a tile's first token << 5 | its token count ([`prompt_tiles`]).
    pub tiles: u64,
    pub n_tiles: usize,
}

impl PrefillAttentionCall {
    /// The kernel for the cache's type.
    pub fn kernel(&self) -> &'static str {
        if self.attention.fp8 {
            "paged_attention_prefill_fp8"
        } else {
            "paged_attention_prefill_bf16"
        }
    }

    /// Grid (tiles, KV heads), a warp for each query head of a KV head's group.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let a = &self.attention;
        let group = a.n_heads / a.n_kv as usize;
        ((self.n_tiles as u32, a.n_kv as u32, 1), (group * 32) as u32, 0)
    }

    /// The kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        let a = &self.attention;
        kernel_args!(
            a.q,
            a.q_stride,
            a.k_cache,
            a.v_cache,
            a.k_scale,
            a.v_scale,
            a.block_tables,
            a.max_blocks,
            a.token_seq,
            a.positions,
            a.out,
            a.n_kv,
            a.block_size,
            a.scale,
            self.tiles
        )
        .to_vec()
    }

    /// Launches the kernel through `launch(name, grid, threads a block, dynamic shared bytes,
    /// arguments)`, as [`AttentionCall::launch_with`] does.
    pub fn launch_with<E>(
        &self,
        mut launch: impl FnMut(&str, (u32, u32, u32), u32, u32, &mut [*mut c_void]) -> Result<(), E>,
    ) -> Result<(), E> {
        let (grid, threads, shared) = self.shape();
        launch(self.kernel(), grid, threads, shared, &mut self.args())
    }

    /// [`Self::launch_with`] straight on `gpu`'s stream.
    ///
    /// # Safety
    /// The pointers must be device buffers sized for the call (see attention.cu), and `tiles`
    /// must cover tokens of one sequence each, with consecutive positions.
    pub unsafe fn launch(&self, gpu: &Gpu, kernels: &Kernels) -> Result<(), CudaError> {
        self.launch_with(|name, grid, threads, shared, args| {
            // SAFETY: the caller's promise; the arguments are the kernel's, in attention.cu's order.
            unsafe { kernels.launch(gpu, name, grid, threads, shared, args) }
        })
    }
}

/// The tiles of `paged_attention_prefill_*` for sequences whose query tokens lie end to end
/// (`(tokens, first position)` each, in order): each sequence's tokens in runs of up to
/// [`PREFILL_ATTENTION_TOKENS`], encoded first token << 5 | count. Tiles that see more keys come
/// first, so the last wave holds the shortest.
pub fn prompt_tiles(chunks: impl IntoIterator<Item = (usize, usize)>) -> Vec<i32> {
    let mut tiles = Vec::new();
    let mut first = 0;
    for (len, first_pos) in chunks {
        for at in (0..len).step_by(PREFILL_ATTENTION_TOKENS) {
            let count = PREFILL_ATTENTION_TOKENS.min(len - at);
            tiles.push((first_pos + at + count, ((first + at) << 5 | count) as i32));
        }
        first += len;
    }
    tiles.sort_by_key(|&(keys, _)| std::cmp::Reverse(keys));
    tiles.into_iter().map(|(_, tile)| tile).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(stages: i32, parts: i32) -> AttentionCall {
        AttentionCall {
            q: 1,
            q_stride: 2,
            k_cache: 3,
            v_cache: 4,
            k_scale: 5,
            v_scale: 6,
            block_tables: 7,
            max_blocks: 8,
            token_seq: 9,
            positions: 10,
            out: 11,
            part_acc: 12,
            part_ml: 13,
            n_kv: 14,
            block_size: 15,
            scale: 16.0,
            stages,
            tokens: 17,
            parts,
            n_heads: 56,
            head_dim: 128,
            fp8: false,
        }
    }

    fn at<T>(field: &T) -> *mut c_void {
        field as *const T as *mut c_void
    }

    #[test]
    fn the_arguments_come_in_attention_cu_order() {
        let c = call(3, 1);
        let want = vec![
            at(&c.q),
            at(&c.q_stride),
            at(&c.k_cache),
            at(&c.v_cache),
            at(&c.k_scale),
            at(&c.v_scale),
            at(&c.block_tables),
            at(&c.max_blocks),
            at(&c.token_seq),
            at(&c.positions),
            at(&c.out),
            at(&c.part_acc),
            at(&c.part_ml),
            at(&c.n_kv),
            at(&c.block_size),
            at(&c.scale),
            at(&c.stages),
        ];
        assert_eq!(c.args(), want);
        // The unstaged kernels stop before the stage count.
        let unstaged = call(0, 4);
        let args = unstaged.args();
        assert_eq!((args.len(), args[15]), (16, at(&unstaged.scale)));
        assert_eq!(
            c.shape(),
            ((17, 14, 1), 128, staged_attention_shared_bytes(128, false, 3) as u32)
        );
        assert_eq!(unstaged.shape().2, 0);
        assert_eq!(unstaged.reduce_shape(), ((17, 56, 1), 128));
        assert_eq!(
            unstaged.reduce_args(),
            vec![
                at(&unstaged.part_acc),
                at(&unstaged.part_ml),
                at(&unstaged.out),
                at(&unstaged.parts)
            ]
        );
    }

    #[test]
    fn prompt_tiles_cut_each_sequence_and_put_long_contexts_first() {
        // A decode at position 900, a 40-token chunk from 0, a 16-token chunk from 100.
        let tiles = prompt_tiles([(1, 900), (40, 0), (16, 100)]);
        let decoded: Vec<(i32, i32)> = tiles.iter().map(|t| (t >> 5, t & 31)).collect();
        assert_eq!(decoded, [(0, 1), (41, 16), (33, 8), (17, 16), (1, 16)]);
        let p = PrefillAttentionCall {
            attention: call(0, 1),
            tiles: 99,
            n_tiles: 5,
        };
        // 56 query heads over 14 KV heads: 4 warps a block.
        assert_eq!(p.shape(), ((5, 14, 1), 128, 0));
        let a = &p.attention;
        let want = vec![
            at(&a.q),
            at(&a.q_stride),
            at(&a.k_cache),
            at(&a.v_cache),
            at(&a.k_scale),
            at(&a.v_scale),
            at(&a.block_tables),
            at(&a.max_blocks),
            at(&a.token_seq),
            at(&a.positions),
            at(&a.out),
            at(&a.n_kv),
            at(&a.block_size),
            at(&a.scale),
            at(&p.tiles),
        ];
        assert_eq!(p.args(), want);
        assert_eq!(p.kernel(), "paged_attention_prefill_bf16");
        let fp8 = PrefillAttentionCall {
            attention: AttentionCall {
                fp8: true,
                ..call(0, 1)
            },
            ..p
        };
        assert_eq!(fp8.kernel(), "paged_attention_prefill_fp8");
    }

    #[test]
    fn the_parts_merge_in_the_kernels_element_type() {
        let launched = |kernel: &str, parts: i32| {
            let mut names = Vec::new();
            call(0, parts)
                .launch_with(kernel, |name, _, _, _, _| {
                    names.push(name.to_string());
                    Ok::<(), ()>(())
                })
                .unwrap();
            names
        };
        assert_eq!(launched("paged_attention_mma_bf16", 1), ["paged_attention_mma_bf16"]);
        assert_eq!(
            launched("paged_attention_bf16", 4),
            ["paged_attention_bf16", "attention_reduce"]
        );
        assert_eq!(
            launched("paged_attention_f32", 4),
            ["paged_attention_f32", "attention_reduce_f32"]
        );
    }
}
