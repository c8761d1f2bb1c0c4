//! The calls of gemm.cu: the decode GEMVs (plain, gate/up with SiLU, QKV with RoPE, residual),
//! the fixed-order GEMM of `--deterministic` and its sum over TP ranks; arguments and shapes.

use std::ffi::c_void;

use crate::kernel_args;

/// Threads of a GEMV block (gemm.cu's GEMV_THREADS), which computes two rows or a gate/up pair.
pub const GEMV_THREADS: u32 = 128;
/// Rows a `gemm_fixed_order` block computes, a warp each (gemm.cu's FO_WARPS).
pub const FO_WARPS: usize = 8;
/// Tokens a `gemm_fixed_order` warp computes (gemm.cu's FO_TOKENS).
pub const FO_TOKENS: usize = 8;
/// Most parts `gemm_fixed_order` cuts the reduction into, and most ranks `sum_ranks` adds
/// (gemm.cu's FO_MAX_CHUNKS): the largest TP size whose results equal one GPU's bit for bit.
pub const FO_MAX_CHUNKS: usize = 8;
/// Threads of a `sum_ranks` block, and its most blocks (it strides over the rest).
const SUM_THREADS: u32 = 256;
const SUM_MAX_BLOCKS: u64 = 65535;
/// Slots of {coarse, fine} u64 sums per token and norm (gemm.cu's NORM_SLOTS).
pub const NORM_SLOTS: usize = 32;

/// The decode GEMVs of gemm.cu compiled for steps of up to `tokens` tokens (`gemv_t{T}` and its
/// variants).
#[derive(Debug)]
pub struct GemvKernels {
    pub tokens: usize,
    /// `y = x · wᵀ` (bf16 or f32), optionally scaled by a norm carried in from the step before.
    pub plain: &'static str,
    /// The gate/up projection and SiLU.
    pub silu: &'static str,
    /// The QKV projection with RoPE and the cache write.
    pub qkv_rope: &'static str,
    /// The o or down projection added into the residual, with the next norm's sums.
    pub residual: &'static str,
}

/// Every compiled token count, smallest first.
pub const GEMV_KERNELS: [GemvKernels; 4] = [
    GemvKernels {
        tokens: 1,
        plain: "gemv_t1",
        silu: "gemv_silu_t1",
        qkv_rope: "gemv_qkv_rope_t1",
        residual: "gemv_residual_t1",
    },
    GemvKernels {
        tokens: 2,
        plain: "gemv_t2",
        silu: "gemv_silu_t2",
        qkv_rope: "gemv_qkv_rope_t2",
        residual: "gemv_residual_t2",
    },
    GemvKernels {
        tokens: 4,
        plain: "gemv_t4",
        silu: "gemv_silu_t4",
        qkv_rope: "gemv_qkv_rope_t4",
        residual: "gemv_residual_t4",
    },
    GemvKernels {
        tokens: 8,
        plain: "gemv_t8",
        silu: "gemv_silu_t8",
        qkv_rope: "gemv_qkv_rope_t8",
        residual: "gemv_residual_t8",
    },
];
/// The most tokens a GEMV kernel is compiled for.
pub const GEMV_KERNEL_TOKENS: usize = GEMV_KERNELS[GEMV_KERNELS.len() - 1].tokens;
/// Bytes of one norm's sums (`norm_in` / `norm_out`) for the most tokens a GEMV takes.
pub const NORM_SUMS_BYTES: usize = GEMV_KERNEL_TOKENS * NORM_SLOTS * 2 * 8;

/// The GEMVs for a step of `t` tokens: the smallest compiled for at least `t`; none for 0 or
/// more than [`GEMV_KERNEL_TOKENS`].
pub fn gemv_kernels(t: usize) -> Option<&'static GemvKernels> {
    if t == 0 {
        return None;
    }
    GEMV_KERNELS.iter().find(|g| g.tokens >= t)
}

/// The GEMVs of a call of `t` tokens.
///
/// # Panics
/// When `t` is not 1 to [`GEMV_KERNEL_TOKENS`]: no kernel is compiled for it, and the caller
/// was to use a GEMM.
fn compiled_for(t: i32) -> &'static GemvKernels {
    gemv_kernels(t.max(0) as usize)
        .unwrap_or_else(|| panic!("no GEMV is compiled for {t} tokens (1 to {GEMV_KERNEL_TOKENS})"))
}

/// `y[t, n] = x[t, k] · w[n, k]ᵀ` by `gemv_t{T}`, times the norm scale of `norm_in` when given.
#[derive(Debug, Clone, Copy)]
pub struct GemvCall {
    /// bf16 `[n, k]`.
    pub w: u64,
    /// bf16 `[t, k]`.
    pub x: u64,
    /// `[t, n]`: bf16, or f32 when `out_f32` is 1.
    pub y: u64,
    pub n: i32,
    /// A multiple of 8.
    pub k: i32,
    /// 1 to [`GEMV_KERNEL_TOKENS`]; picks the kernel.
    pub t: i32,
    pub out_f32: i32,
    /// The sums of the norm the dot products are scaled by ([`NORM_SUMS_BYTES`]), or 0.
    pub norm_in: u64,
    pub eps: f32,
}

impl GemvCall {
    /// `gemv_t{T}` for the call's tokens (see [`compiled_for`]'s panics).
    pub fn name(&self) -> &'static str {
        compiled_for(self.t).plain
    }

    /// A block every two rows.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        (((self.n as u32).div_ceil(2), 1, 1), GEMV_THREADS, 0)
    }

    /// The kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.w,
            self.x,
            self.y,
            self.n,
            self.k,
            self.t,
            self.out_f32,
            self.norm_in,
            self.eps
        )
        .to_vec()
    }

    one_kernel_launch!("gemm.cu");
}

/// `out[t, inter] = silu(gate) * up` of the fused gate/up weight `[gate; up]` by
/// `gemv_silu_t{T}`, its dot products times the norm scale of `norm_in` when given.
#[derive(Debug, Clone, Copy)]
pub struct GemvSiluCall {
    /// bf16 `[2 * inter, k]`, the gate's rows first.
    pub w: u64,
    /// bf16 `[t, k]`.
    pub x: u64,
    /// bf16 `[t, inter]`.
    pub out: u64,
    pub inter: i32,
    /// A multiple of 8.
    pub k: i32,
    /// 1 to [`GEMV_KERNEL_TOKENS`]; picks the kernel.
    pub t: i32,
    pub norm_in: u64,
    pub eps: f32,
}

impl GemvSiluCall {
    /// `gemv_silu_t{T}` for the call's tokens (see [`compiled_for`]'s panics).
    pub fn name(&self) -> &'static str {
        compiled_for(self.t).silu
    }

    /// A block every gate/up pair of rows.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        ((self.inter as u32, 1, 1), GEMV_THREADS, 0)
    }

    /// The kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.w,
            self.x,
            self.out,
            self.inter,
            self.k,
            self.t,
            self.norm_in,
            self.eps
        )
        .to_vec()
    }

    one_kernel_launch!("gemm.cu");
}

/// The QKV projection with rope.cu's work folded in (`gemv_qkv_rope_t{T}`): bf16 cache, no
/// per-head norms, even head and rotary widths.
#[derive(Debug, Clone, Copy)]
pub struct GemvQkvRopeCall {
    /// bf16 `[(n_heads + 2 * n_kv) * head_dim, k]`.
    pub w: u64,
    /// bf16 `[t, k]`.
    pub x: u64,
    /// bf16 `[t, (n_heads + 2 * n_kv) * head_dim]` out.
    pub qkv: u64,
    pub k: i32,
    /// 1 to [`GEMV_KERNEL_TOKENS`]; picks the kernel.
    pub t: i32,
    /// f32 of the row's width, or 0.
    pub bias: u64,
    pub positions: u64,
    /// `[position][rot_dim / 2]` (cos, sin) f32 pairs.
    pub rope_table: u64,
    pub n_heads: i32,
    pub n_kv: i32,
    pub head_dim: i32,
    pub rot_dim: i32,
    /// 1: rotate halves (NeoX); 0: adjacent pairs.
    pub neox: i32,
    pub slots: u64,
    /// bf16 caches.
    pub k_cache: u64,
    pub v_cache: u64,
    pub block_size: i32,
    pub norm_in: u64,
    pub eps: f32,
}

impl GemvQkvRopeCall {
    /// `gemv_qkv_rope_t{T}` for the call's tokens (see [`compiled_for`]'s panics).
    pub fn name(&self) -> &'static str {
        compiled_for(self.t).qkv_rope
    }

    /// A block every pair of rows RoPE rotates together: width / 2.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let width = (self.n_heads + 2 * self.n_kv) * self.head_dim;
        (((width / 2) as u32, 1, 1), GEMV_THREADS, 0)
    }

    /// The kernel's arguments, pointing into `self`.
    pub(crate) fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.w,
            self.x,
            self.qkv,
            self.k,
            self.t,
            self.bias,
            self.positions,
            self.rope_table,
            self.n_heads,
            self.n_kv,
            self.head_dim,
            self.rot_dim,
            self.neox,
            self.slots,
            self.k_cache,
            self.v_cache,
            self.block_size,
            self.norm_in,
            self.eps
        )
        .to_vec()
    }

    one_kernel_launch!("gemm.cu");
}

/// `res[t, n] += x · wᵀ` (f32), its bf16 copy into `res_bf16` and its squares into the next
/// norm's sums `norm_out` (`gemv_residual_t{T}`): the o and down projections on one GPU.
#[derive(Debug, Clone, Copy)]
pub struct GemvResidualCall {
    /// bf16 `[n, k]`.
    pub w: u64,
    /// bf16 `[t, k]`.
    pub x: u64,
    /// f32 `[t, n]` residual stream.
    pub res: u64,
    /// bf16 `[t, n]`.
    pub res_bf16: u64,
    /// [`NORM_SUMS_BYTES`] of sums, zeroed before the step.
    pub norm_out: u64,
    pub n: i32,
    /// A multiple of 8.
    pub k: i32,
    /// 1 to [`GEMV_KERNEL_TOKENS`]; picks the kernel.
    pub t: i32,
}

impl GemvResidualCall {
    /// `gemv_residual_t{T}` for the call's tokens (see [`compiled_for`]'s panics).
    pub fn name(&self) -> &'static str {
        compiled_for(self.t).residual
    }

    /// A block every two rows.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        (((self.n as u32).div_ceil(2), 1, 1), GEMV_THREADS, 0)
    }

    /// The kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.w,
            self.x,
            self.res,
            self.res_bf16,
            self.norm_out,
            self.n,
            self.k,
            self.t
        )
        .to_vec()
    }

    one_kernel_launch!("gemm.cu");
}

/// `y[t, n] = x[t, k] · w[n, k]ᵀ` by `gemm_fixed_order`: every element summed in one order
/// whatever the shape, its reduction cut into `chunks` parts.
#[derive(Debug, Clone, Copy)]
pub struct FixedOrderGemmCall {
    /// bf16 `[n, k]`.
    pub w: u64,
    /// bf16 `[t, k]`.
    pub x: u64,
    /// `[t, n]`: bf16, or f32 when `out_f32` is 1.
    pub y: u64,
    pub n: i32,
    pub k: i32,
    /// No tokens launch nothing.
    pub t: i32,
    /// A power of two, at most [`FO_MAX_CHUNKS`]; k / chunks a multiple of 8.
    pub chunks: i32,
    pub out_f32: i32,
}

impl FixedOrderGemmCall {
    pub fn name(&self) -> &'static str {
        "gemm_fixed_order"
    }

    /// Grid (ceil(n / FO_WARPS), ceil(t / FO_TOKENS)), a warp a row.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let grid = (
            (self.n as usize).div_ceil(FO_WARPS) as u32,
            (self.t as usize).div_ceil(FO_TOKENS) as u32,
            1,
        );
        (grid, (FO_WARPS * 32) as u32, 0)
    }

    /// The kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.w,
            self.x,
            self.y,
            self.n,
            self.k,
            self.t,
            self.chunks,
            self.out_f32
        )
        .to_vec()
    }

    one_kernel_launch!("gemm.cu");
}

/// `out[i]` = the pairwise tree over `ranks` of `parts[r * count + i]` (`sum_ranks`): the top
/// levels of `gemm_fixed_order`'s tree across TP ranks.
#[derive(Debug, Clone, Copy)]
pub struct SumRanksCall {
    /// f32 `[ranks, count]`, as all-gathered.
    pub parts: u64,
    /// f32 `[count]`.
    pub out: u64,
    pub count: i64,
    /// A power of two, at most [`FO_MAX_CHUNKS`].
    pub ranks: i32,
}

impl SumRanksCall {
    pub fn name(&self) -> &'static str {
        "sum_ranks"
    }

    /// A thread a value, at most SUM_MAX_BLOCKS blocks (the kernel strides over the rest).
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let blocks = (self.count.max(0) as u64)
            .div_ceil(SUM_THREADS as u64)
            .min(SUM_MAX_BLOCKS);
        ((blocks as u32, 1, 1), SUM_THREADS, 0)
    }

    /// The kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.parts, self.out, self.count, self.ranks).to_vec()
    }

    one_kernel_launch!("gemm.cu");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::arg_at as at;

    #[test]
    fn a_step_takes_the_smallest_gemv_compiled_for_it() {
        let tokens = |t| gemv_kernels(t).map(|g| g.tokens);
        assert_eq!((0..=9).map(tokens).collect::<Vec<_>>(), {
            let some = [1, 2, 4, 4, 8, 8, 8, 8].map(Some);
            [&[None][..], &some[..], &[None][..]].concat()
        });
        assert_eq!((GEMV_KERNEL_TOKENS, NORM_SUMS_BYTES), (8, 8 * 32 * 16));
    }

    #[test]
    #[should_panic(expected = "no GEMV is compiled for 9 tokens")]
    fn a_gemv_past_the_compiled_tokens_is_a_bug() {
        GemvCall {
            w: 0,
            x: 0,
            y: 0,
            n: 2,
            k: 8,
            t: 9,
            out_f32: 0,
            norm_in: 0,
            eps: 0.0,
        }
        .name();
    }

    #[test]
    fn the_gemv_arguments_come_in_gemm_cu_order() {
        let c = GemvCall {
            w: 1,
            x: 2,
            y: 3,
            n: 1001,
            k: 5,
            t: 3,
            out_f32: 7,
            norm_in: 8,
            eps: 9.0,
        };
        let want = vec![
            at(&c.w),
            at(&c.x),
            at(&c.y),
            at(&c.n),
            at(&c.k),
            at(&c.t),
            at(&c.out_f32),
            at(&c.norm_in),
            at(&c.eps),
        ];
        assert_eq!(c.args(), want);
        assert_eq!((c.name(), c.shape()), ("gemv_t4", ((501, 1, 1), 128, 0)));

        let c = GemvSiluCall {
            w: 1,
            x: 2,
            out: 3,
            inter: 1536,
            k: 5,
            t: 1,
            norm_in: 7,
            eps: 8.0,
        };
        let want = vec![
            at(&c.w),
            at(&c.x),
            at(&c.out),
            at(&c.inter),
            at(&c.k),
            at(&c.t),
            at(&c.norm_in),
            at(&c.eps),
        ];
        assert_eq!(c.args(), want);
        assert_eq!((c.name(), c.shape()), ("gemv_silu_t1", ((1536, 1, 1), 128, 0)));

        let c = GemvResidualCall {
            w: 1,
            x: 2,
            res: 3,
            res_bf16: 4,
            norm_out: 5,
            n: 576,
            k: 7,
            t: 8,
        };
        let want = vec![
            at(&c.w),
            at(&c.x),
            at(&c.res),
            at(&c.res_bf16),
            at(&c.norm_out),
            at(&c.n),
            at(&c.k),
            at(&c.t),
        ];
        assert_eq!(c.args(), want);
        assert_eq!((c.name(), c.shape()), ("gemv_residual_t8", ((288, 1, 1), 128, 0)));
    }

    #[test]
    fn the_qkv_rope_gemv_arguments_come_in_gemm_cu_order() {
        let c = GemvQkvRopeCall {
            w: 1,
            x: 2,
            qkv: 3,
            k: 4,
            t: 2,
            bias: 6,
            positions: 7,
            rope_table: 8,
            n_heads: 9,
            n_kv: 3,
            head_dim: 64,
            rot_dim: 12,
            neox: 13,
            slots: 14,
            k_cache: 15,
            v_cache: 16,
            block_size: 17,
            norm_in: 18,
            eps: 19.0,
        };
        let want = vec![
            at(&c.w),
            at(&c.x),
            at(&c.qkv),
            at(&c.k),
            at(&c.t),
            at(&c.bias),
            at(&c.positions),
            at(&c.rope_table),
            at(&c.n_heads),
            at(&c.n_kv),
            at(&c.head_dim),
            at(&c.rot_dim),
            at(&c.neox),
            at(&c.slots),
            at(&c.k_cache),
            at(&c.v_cache),
            at(&c.block_size),
            at(&c.norm_in),
            at(&c.eps),
        ];
        assert_eq!(c.args(), want);
        // SmolLM2: (9 + 2 * 3) heads of 64, a block every two of its 960 rows.
        assert_eq!((c.name(), c.shape()), ("gemv_qkv_rope_t2", ((480, 1, 1), 128, 0)));
    }

    #[test]
    fn the_fixed_order_arguments_come_in_gemm_cu_order() {
        let c = FixedOrderGemmCall {
            w: 1,
            x: 2,
            y: 3,
            n: 4097,
            k: 5,
            t: 17,
            chunks: 7,
            out_f32: 8,
        };
        let want = vec![
            at(&c.w),
            at(&c.x),
            at(&c.y),
            at(&c.n),
            at(&c.k),
            at(&c.t),
            at(&c.chunks),
            at(&c.out_f32),
        ];
        assert_eq!(c.args(), want);
        assert_eq!((c.name(), c.shape()), ("gemm_fixed_order", ((513, 3, 1), 256, 0)));
        // No tokens: an empty grid, nothing launched.
        let none = FixedOrderGemmCall { t: 0, ..c };
        assert_eq!(none.shape().0, (513, 0, 1));
        none.launch_with(|name, _, _, _, _| Err(name.to_string())).unwrap();

        let c = SumRanksCall {
            parts: 1,
            out: 2,
            count: 1000,
            ranks: 4,
        };
        assert_eq!(c.args(), vec![at(&c.parts), at(&c.out), at(&c.count), at(&c.ranks)]);
        assert_eq!((c.name(), c.shape()), ("sum_ranks", ((4, 1, 1), 256, 0)));
        let many = SumRanksCall { count: 1 << 40, ..c };
        assert_eq!(many.shape().0, (65535, 1, 1));
    }
}
