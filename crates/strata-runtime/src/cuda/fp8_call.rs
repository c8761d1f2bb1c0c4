//! The calls of fp8.cu over FP8 E4M3 matrices (a byte a weight, an f32 scale a row): decode
//! GEMVs, dequantization to bf16, and the activation quantization and output scaling around the FP8 GEMM.

use std::ffi::c_void;

use super::gemm_call::{gemv_kernels, GemvQkvRopeCall, GEMV_KERNEL_TOKENS, GEMV_THREADS};
use super::kernels::FAMILIES;
use super::norm_call::ROW_THREADS;
use crate::kernel_args;

/// Rows an FP8 GEMV block computes (fp8.cu's FP8_ROWS), its warps splitting k.
const FP8_BLOCK_ROWS: u32 = 2;
/// Rows an `fp8_gemv_residual_t{T}` block computes (fp8.cu's FP8_RES_ROWS(T)): 4 at one token,
/// pairs past it.
fn residual_block_rows(t: i32) -> u32 {
    if t == 1 {
        4
    } else {
        FP8_BLOCK_ROWS
    }
}
/// Gate/up row pairs an `fp8_gemv_silu_*` block computes.
const FP8_SILU_BLOCK_ROWS: u32 = 1;
/// RoPE row pairs an `fp8_gemv_qkv_rope_t{T}` block computes (fp8.cu's FP8_QKV_PAIRS(T)): 3 at
/// one token, one past it.
fn qkv_block_pairs(t: i32) -> u32 {
    if t == 1 {
        3
    } else {
        1
    }
}
/// Threads of a tensor-core GEMV block (fp8.cu's FP8M_WARPS warps).
const FP8_MMA_THREADS: u32 = 8 * 32;
/// Rows a tensor-core GEMV block computes (FP8M_ROWS: two tiles of 16).
const FP8_MMA_BLOCK_ROWS: u32 = 32;
/// Gate/up row pairs a tensor-core SiLU GEMV block computes (a tile of gate rows, one of up rows).
const FP8_MMA_SILU_BLOCK_ROWS: u32 = 16;
/// Threads of the element-wise kernels' blocks.
const ELEMENT_THREADS: u32 = 256;
/// Values an `fp8_dequant` thread decodes (one 16-byte load).
const DEQUANT_VALUES: u64 = 16;

/// The GEMV of `form` (0 plain, 1 SiLU, 2 residual, 3 QKV with RoPE: lanes only) compiled for
/// `t` tokens, on tensor cores when `mma`: fp8.cu's list in [`FAMILIES`] starts with each form's
/// GEMVs for 1, 2, 4 and 8 tokens, then the same for the tensor-core GEMVs, then the QKV ones.
///
/// # Panics
/// When `t` is 0 or more than [`GEMV_KERNEL_TOKENS`]: the caller was to use a GEMM.
fn gemv_name(form: usize, t: i32, mma: bool) -> &'static str {
    let g = gemv_kernels(t.max(0) as usize)
        .unwrap_or_else(|| panic!("no FP8 GEMV is compiled for {t} tokens (1 to {GEMV_KERNEL_TOKENS})"));
    let names = FAMILIES
        .iter()
        .find(|(family, _, _)| *family == "fp8")
        .map(|(_, _, names)| *names)
        .unwrap_or_default();
    let first = if form == 3 { 24 } else { 12 * mma as usize + 4 * form };
    names[first + g.tokens.trailing_zeros() as usize]
}

/// Which decode GEMVs run an FP8 matrix's products of up to [`GEMV_KERNEL_TOKENS`] tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Fp8Gemv {
    /// Each thread's dot products on CUDA cores, a block a row pair, weights converted to f32 (the default).
    #[default]
    Lanes,
    /// The products on tensor cores (mma.sync, f16 operands, f32 sums): `STRATA_FP8_GEMV=mma`,
    /// until an H200 run shows which is faster.
    Mma,
}

/// `y[j * ld + row] = (x[j] · w[row]) * scales[row]` (`fp8_gemv_t{T}`, `fp8_mma_gemv_t{T}`),
/// times the norm scale of `norm_in` when given.
#[derive(Debug, Clone, Copy)]
pub struct Fp8GemvCall {
    /// E4M3 `[n, k]`.
    pub w: u64,
    /// f32 `[n]`.
    pub scales: u64,
    /// bf16 `[t, k]`.
    pub x: u64,
    /// `[t, ld]`: bf16, or f32 when `out_f32` is 1.
    pub y: u64,
    pub n: i32,
    /// A multiple of 16.
    pub k: i32,
    /// 1 to [`GEMV_KERNEL_TOKENS`]; picks the kernel.
    pub t: i32,
    pub ld: i32,
    pub out_f32: i32,
    /// The sums of the norm the dot products are scaled by, or 0.
    pub norm_in: u64,
    pub eps: f32,
    pub kind: Fp8Gemv,
}

/// The GEMV forms whose blocks differ in shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GemvForm {
    Plain,
    /// Over gate/up row pairs.
    Silu,
    /// Into the residual, over `t` tokens.
    Residual(i32),
}

/// The grid and block of a GEMV over `rows` (row pairs for SiLU), by kind.
fn gemv_shape(rows: i32, kind: Fp8Gemv, form: GemvForm) -> ((u32, u32, u32), u32, u32) {
    let (per_block, threads) = match (kind, form) {
        (Fp8Gemv::Lanes, GemvForm::Plain) => (FP8_BLOCK_ROWS, GEMV_THREADS),
        (Fp8Gemv::Lanes, GemvForm::Residual(t)) => (residual_block_rows(t), GEMV_THREADS),
        (Fp8Gemv::Lanes, GemvForm::Silu) => (FP8_SILU_BLOCK_ROWS, GEMV_THREADS),
        (Fp8Gemv::Mma, GemvForm::Plain | GemvForm::Residual(_)) => (FP8_MMA_BLOCK_ROWS, FP8_MMA_THREADS),
        (Fp8Gemv::Mma, GemvForm::Silu) => (FP8_MMA_SILU_BLOCK_ROWS, FP8_MMA_THREADS),
    };
    (((rows.max(0) as u32).div_ceil(per_block), 1, 1), threads, 0)
}

impl Fp8GemvCall {
    pub fn name(&self) -> &'static str {
        gemv_name(0, self.t, self.kind == Fp8Gemv::Mma)
    }

    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        gemv_shape(self.n, self.kind, GemvForm::Plain)
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.w,
            self.scales,
            self.x,
            self.y,
            self.n,
            self.k,
            self.t,
            self.ld,
            self.out_f32,
            self.norm_in,
            self.eps
        )
        .to_vec()
    }

    one_kernel_launch!("fp8.cu");
}

/// `out[t, inter] = silu(gate) * up` of an FP8 `[gate; up]` matrix (`fp8_gemv_silu_t{T}`).
#[derive(Debug, Clone, Copy)]
pub struct Fp8GemvSiluCall {
    /// E4M3 `[2 * inter, k]`, the gate's rows first.
    pub w: u64,
    /// f32 `[2 * inter]`.
    pub scales: u64,
    pub x: u64,
    /// bf16 `[t, inter]`.
    pub out: u64,
    pub inter: i32,
    pub k: i32,
    pub t: i32,
    pub norm_in: u64,
    pub eps: f32,
    pub kind: Fp8Gemv,
}

impl Fp8GemvSiluCall {
    pub fn name(&self) -> &'static str {
        gemv_name(1, self.t, self.kind == Fp8Gemv::Mma)
    }

    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        gemv_shape(self.inter, self.kind, GemvForm::Silu)
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.w,
            self.scales,
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

    one_kernel_launch!("fp8.cu");
}

/// `res[t, n] += x · wᵀ` over an FP8 matrix, `res_bf16` = the new rows times `next_norm` (the
/// next norm's weights, or 0: none), their squares into `norm_out` (`fp8_gemv_residual_t{T}`).
#[derive(Debug, Clone, Copy)]
pub struct Fp8GemvResidualCall {
    pub w: u64,
    pub scales: u64,
    pub x: u64,
    /// f32 `[t, n]`.
    pub res: u64,
    /// bf16 `[t, n]`.
    pub res_bf16: u64,
    pub norm_out: u64,
    /// f32 `[n]` or 0.
    pub next_norm: u64,
    pub n: i32,
    pub k: i32,
    pub t: i32,
    pub kind: Fp8Gemv,
}

impl Fp8GemvResidualCall {
    pub fn name(&self) -> &'static str {
        gemv_name(2, self.t, self.kind == Fp8Gemv::Mma)
    }

    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        gemv_shape(self.n, self.kind, GemvForm::Residual(self.t))
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.w,
            self.scales,
            self.x,
            self.res,
            self.res_bf16,
            self.norm_out,
            self.next_norm,
            self.n,
            self.k,
            self.t
        )
        .to_vec()
    }

    one_kernel_launch!("fp8.cu");
}

/// The QKV product of an FP8 matrix with RoPE and the cache write folded in
/// (`fp8_gemv_qkv_rope_t{T}`, gemm.cu's `gemv_qkv_rope` over FP8 rows): `rope`'s fields, its `w`
/// the E4M3 bytes `[(n_heads + 2 * n_kv) * head_dim, k]`, and their row scales.
#[derive(Debug, Clone, Copy)]
pub struct Fp8GemvQkvRopeCall {
    pub rope: GemvQkvRopeCall,
    /// f32, a row each.
    pub scales: u64,
}

impl Fp8GemvQkvRopeCall {
    pub fn name(&self) -> &'static str {
        gemv_name(3, self.rope.t, false)
    }

    /// A block every [`qkv_block_pairs`] pairs of rows RoPE rotates together.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let r = &self.rope;
        let pairs = ((r.n_heads + 2 * r.n_kv) * r.head_dim / 2).max(0) as u32;
        ((pairs.div_ceil(qkv_block_pairs(r.t)), 1, 1), GEMV_THREADS, 0)
    }

    /// `rope`'s arguments with the scales after the weights.
    fn args(&self) -> Vec<*mut c_void> {
        let mut args = self.rope.args();
        args.insert(1, kernel_args!(self.scales)[0]);
        args
    }

    one_kernel_launch!("fp8.cu");
}

/// An FP8 matrix as bf16 `[n, k]` at `out` (`fp8_dequant`): weight-only products, the
/// fixed-order GEMM.
#[derive(Debug, Clone, Copy)]
pub struct Fp8DequantCall {
    pub w: u64,
    pub scales: u64,
    pub out: u64,
    pub n: i32,
    /// A multiple of 16.
    pub k: i32,
}

impl Fp8DequantCall {
    pub fn name(&self) -> &'static str {
        "fp8_dequant"
    }

    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let threads = self.n as u64 * (self.k as u64 / DEQUANT_VALUES);
        (
            (threads.div_ceil(ELEMENT_THREADS as u64) as u32, 1, 1),
            ELEMENT_THREADS,
            0,
        )
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.w, self.scales, self.out, self.n, self.k).to_vec()
    }

    one_kernel_launch!("fp8.cu");
}

/// Rows of bf16 activations as E4M3 with a scale each, max |x| / 448 (`fp8_quantize_rows`): the
/// FP8 GEMM's input.
#[derive(Debug, Clone, Copy)]
pub struct Fp8QuantizeRowsCall {
    /// bf16 `[rows, k]`.
    pub x: u64,
    /// E4M3 `[rows, k]`.
    pub out: u64,
    /// f32 `[rows]`.
    pub scales: u64,
    pub k: i32,
    pub rows: usize,
}

impl Fp8QuantizeRowsCall {
    pub fn name(&self) -> &'static str {
        "fp8_quantize_rows"
    }

    /// A block a row.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        ((self.rows as u32, 1, 1), ROW_THREADS, 0)
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.x, self.out, self.scales, self.k).to_vec()
    }

    one_kernel_launch!("fp8.cu");
}

/// `y[j, col] *= row_scales[j] * col_scales[col]` in place after the FP8 GEMM (`fp8_scale_output`).
#[derive(Debug, Clone, Copy)]
pub struct Fp8ScaleOutputCall {
    /// `[t, n]`: bf16, or f32 when `out_f32` is 1.
    pub y: u64,
    pub out_f32: i32,
    /// f32 `[t]`: the activations' scales.
    pub row_scales: u64,
    /// f32 `[n]`: the weights' scales.
    pub col_scales: u64,
    /// A multiple of 8.
    pub n: i32,
    pub t: i32,
}

impl Fp8ScaleOutputCall {
    pub fn name(&self) -> &'static str {
        "fp8_scale_output"
    }

    /// Grid (ceil(n / 8 / ELEMENT_THREADS), t): 8 values a thread.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let chunks = (self.n.max(0) as u32).div_ceil(8);
        (
            (chunks.div_ceil(ELEMENT_THREADS), self.t.max(0) as u32, 1),
            ELEMENT_THREADS,
            0,
        )
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.y, self.out_f32, self.row_scales, self.col_scales, self.n, self.t).to_vec()
    }

    one_kernel_launch!("fp8.cu");
}

/// Every kernel the calls above launch, by the calls' own naming (the family test's list).
#[cfg(test)]
pub(crate) fn called_kernels() -> Vec<&'static str> {
    let mut names = Vec::new();
    for t in [1, 2, 4, 8] {
        for mma in [false, true] {
            names.extend([gemv_name(0, t, mma), gemv_name(1, t, mma), gemv_name(2, t, mma)]);
        }
        names.push(gemv_name(3, t, false));
    }
    let d = Fp8DequantCall {
        w: 1,
        scales: 1,
        out: 1,
        n: 1,
        k: 16,
    };
    let q = Fp8QuantizeRowsCall {
        x: 1,
        out: 1,
        scales: 1,
        k: 16,
        rows: 1,
    };
    let s = Fp8ScaleOutputCall {
        y: 1,
        out_f32: 0,
        row_scales: 1,
        col_scales: 1,
        n: 1,
        t: 1,
    };
    names.extend([d.name(), q.name(), s.name()]);
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::arg_at as at;

    #[test]
    fn the_fp8_calls_pass_fp8_cu_arguments_in_order_and_pick_their_kernels() {
        let g = Fp8GemvCall {
            w: 1,
            scales: 2,
            x: 3,
            y: 4,
            n: 9,
            k: 64,
            t: 3,
            ld: 9,
            out_f32: 1,
            norm_in: 5,
            eps: 0.5,
            kind: Fp8Gemv::Lanes,
        };
        let want = vec![
            at(&g.w),
            at(&g.scales),
            at(&g.x),
            at(&g.y),
            at(&g.n),
            at(&g.k),
            at(&g.t),
            at(&g.ld),
            at(&g.out_f32),
            at(&g.norm_in),
            at(&g.eps),
        ];
        assert_eq!(g.args(), want);
        // A block a row pair.
        assert_eq!((g.name(), g.shape()), ("fp8_gemv_t4", ((5, 1, 1), 128, 0)));
        // Tensor cores: 32 rows a block of 8 warps.
        let g = Fp8GemvCall {
            n: 33,
            kind: Fp8Gemv::Mma,
            ..g
        };
        assert_eq!((g.name(), g.shape()), ("fp8_mma_gemv_t4", ((2, 1, 1), 256, 0)));
        let s = Fp8GemvSiluCall {
            w: 1,
            scales: 2,
            x: 3,
            out: 4,
            inter: 9,
            k: 64,
            t: 1,
            norm_in: 0,
            eps: 0.1,
            kind: Fp8Gemv::Lanes,
        };
        assert_eq!(s.args()[1], at(&s.scales));
        assert_eq!((s.name(), s.shape()), ("fp8_gemv_silu_t1", ((9, 1, 1), 128, 0)));
        // A tile of 16 gate rows and one of their up rows a block.
        let s = Fp8GemvSiluCall {
            inter: 17,
            t: 2,
            kind: Fp8Gemv::Mma,
            ..s
        };
        assert_eq!((s.name(), s.shape()), ("fp8_mma_gemv_silu_t2", ((2, 1, 1), 256, 0)));
        let r = Fp8GemvResidualCall {
            w: 1,
            scales: 2,
            x: 3,
            res: 4,
            res_bf16: 5,
            norm_out: 6,
            next_norm: 7,
            n: 17,
            k: 32,
            t: 8,
            kind: Fp8Gemv::Lanes,
        };
        let want = vec![
            at(&r.w),
            at(&r.scales),
            at(&r.x),
            at(&r.res),
            at(&r.res_bf16),
            at(&r.norm_out),
            at(&r.next_norm),
            at(&r.n),
            at(&r.k),
            at(&r.t),
        ];
        assert_eq!(r.args(), want);
        assert_eq!((r.name(), r.shape()), ("fp8_gemv_residual_t8", ((9, 1, 1), 128, 0)));
        // One token: blocks of 4 rows.
        let one = Fp8GemvResidualCall { t: 1, ..r };
        assert_eq!((one.name(), one.shape()), ("fp8_gemv_residual_t1", ((5, 1, 1), 128, 0)));
        let r = Fp8GemvResidualCall {
            kind: Fp8Gemv::Mma,
            ..r
        };
        assert_eq!((r.name(), r.shape()), ("fp8_mma_gemv_residual_t8", ((1, 1, 1), 256, 0)));
        let d = Fp8DequantCall {
            w: 1,
            scales: 2,
            out: 3,
            n: 100,
            k: 64,
        };
        assert_eq!(d.shape(), ((2, 1, 1), 256, 0));
        let o = Fp8ScaleOutputCall {
            y: 1,
            out_f32: 0,
            row_scales: 2,
            col_scales: 3,
            n: 4104,
            t: 4,
        };
        // 513 chunks of 8 values, 256 a block, a row of blocks a token.
        assert_eq!(o.shape(), ((3, 4, 1), 256, 0));
        let o = Fp8ScaleOutputCall { n: 0, ..o };
        let mut launched = false;
        o.launch_with(|_, _, _, _, _| {
            launched = true;
            Ok::<(), ()>(())
        })
        .unwrap();
        assert!(!launched, "an empty product launches nothing");
    }

    #[test]
    fn the_fp8_qkv_rope_call_passes_the_bf16_one_s_arguments_after_the_scales() {
        let rope = GemvQkvRopeCall {
            w: 1,
            x: 3,
            qkv: 4,
            k: 3584,
            t: 3,
            bias: 5,
            positions: 6,
            rope_table: 7,
            n_heads: 28,
            n_kv: 4,
            head_dim: 128,
            rot_dim: 128,
            neox: 1,
            slots: 8,
            k_cache: 9,
            v_cache: 10,
            block_size: 16,
            norm_in: 11,
            eps: 1e-6,
        };
        let c = Fp8GemvQkvRopeCall { rope, scales: 2 };
        let mut want = c.rope.args();
        want.insert(1, at(&c.scales));
        assert_eq!(c.args(), want);
        assert_eq!(c.args()[..3], [at(&c.rope.w), at(&c.scales), at(&c.rope.x)]);
        // 3 tokens take the 4-token kernel; 4608 rows are 2304 pairs, a block each.
        assert_eq!((c.name(), c.shape()), ("fp8_gemv_qkv_rope_t4", ((2304, 1, 1), 128, 0)));
        let one = Fp8GemvQkvRopeCall {
            rope: GemvQkvRopeCall { t: 1, ..rope },
            ..c
        };
        // One token: 3 pairs a block, 768 blocks.
        assert_eq!(
            (one.name(), one.shape()),
            ("fp8_gemv_qkv_rope_t1", ((768, 1, 1), 128, 0))
        );
    }

    #[test]
    #[should_panic(expected = "no FP8 GEMV is compiled for 9 tokens")]
    fn an_fp8_gemv_past_the_compiled_tokens_is_a_bug() {
        gemv_name(0, 9, false);
    }
}
