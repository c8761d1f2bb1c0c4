//! One SiLU-and-multiply call (activation.cu) of the fused gate/up output: its arguments in the
//! kernels' order and its launch shape, bf16 or (`--dtype float32`) f32, or between FP8 GEMMs.

use std::ffi::c_void;

use crate::kernel_args;

/// Threads of a `silu_mul` block; each thread does 8 values.
pub const SILU_THREADS: u32 = 256;

/// The device pointers and sizes of one call over `tokens` rows.
#[derive(Debug, Clone, Copy)]
pub struct SiluMulCall {
    /// `[tokens, 2 * inter]`, the gate first: bf16, or f32 under `float32`.
    pub gate_up: u64,
    /// `[tokens, inter]`, of the same type.
    pub out: u64,
    /// A multiple of 8.
    pub inter: i32,
    pub tokens: usize,
    /// `silu_mul_f32`: f32 in and out.
    pub float32: bool,
}

impl SiluMulCall {
    /// The kernel for the activations' type.
    pub fn name(&self) -> &'static str {
        if self.float32 {
            "silu_mul_f32"
        } else {
            "silu_mul"
        }
    }

    /// Grid (ceil(inter / 8 / SILU_THREADS), tokens).
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let blocks = (self.inter as u32 / 8).div_ceil(SILU_THREADS);
        ((blocks, self.tokens as u32, 1), SILU_THREADS, 0)
    }

    /// The kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(self.gate_up, self.out, self.inter).to_vec()
    }

    one_kernel_launch!("activation.cu");
}

/// Threads of a `silu_mul_fp8` block (a token row, 8 values a thread per piece).
pub const SILU_FP8_THREADS: u32 = 1024;
/// The widest `inter` one `silu_mul_fp8` block holds (activation.cu's SILU_FP8_PIECES = 4).
pub const SILU_FP8_MAX_INTER: usize = 8 * 4 * SILU_FP8_THREADS as usize;

/// SiLU-and-multiply between FP8 GEMMs (`silu_mul_fp8`): the gate/up GEMM's unscaled bf16 output
/// times its token and row scales, `silu(gate) * up` into bf16 `out`, and that row as E4M3 with a
/// scale into `q`/`q_scales` for the down GEMM; bit for bit `fp8_scale_output`, `silu_mul` and
/// `fp8_quantize_rows` in turn.
#[derive(Debug, Clone, Copy)]
pub struct SiluMulFp8Call {
    /// bf16 `[tokens, 2 * inter]`, the gate first, unscaled.
    pub gate_up: u64,
    /// f32 `[tokens]`: the gate/up GEMM's activation scales.
    pub tok_scales: u64,
    /// f32 `[2 * inter]`: the gate/up matrix's row scales.
    pub col_scales: u64,
    /// bf16 `[tokens, inter]`.
    pub out: u64,
    /// E4M3 `[tokens, inter]`.
    pub q: u64,
    /// f32 `[tokens]`; may be `tok_scales` (each row reads its own before it writes it).
    pub q_scales: u64,
    /// A multiple of 8, at most [`SILU_FP8_MAX_INTER`].
    pub inter: i32,
    pub tokens: usize,
}

impl SiluMulFp8Call {
    pub fn name(&self) -> &'static str {
        "silu_mul_fp8"
    }

    /// A block a token.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        ((self.tokens as u32, 1, 1), SILU_FP8_THREADS, 0)
    }

    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.gate_up,
            self.tok_scales,
            self.col_scales,
            self.out,
            self.q,
            self.q_scales,
            self.inter
        )
        .to_vec()
    }

    one_kernel_launch!("activation.cu");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::arg_at as at;

    #[test]
    fn the_arguments_come_in_activation_cu_order() {
        let c = SiluMulCall {
            gate_up: 1,
            out: 2,
            inter: 1536,
            tokens: 5,
            float32: false,
        };
        assert_eq!(c.args(), vec![at(&c.gate_up), at(&c.out), at(&c.inter)]);
        // 1536 / 8 = 192 threads' work: one block; 14336 / 8 = 1792: seven.
        assert_eq!((c.name(), c.shape()), ("silu_mul", ((1, 5, 1), 256, 0)));
        let wide = SiluMulCall {
            inter: 14336,
            float32: true,
            ..c
        };
        assert_eq!((wide.name(), wide.shape()), ("silu_mul_f32", ((7, 5, 1), 256, 0)));
    }

    #[test]
    fn the_fp8_call_passes_activation_cu_arguments_in_order() {
        let c = SiluMulFp8Call {
            gate_up: 1,
            tok_scales: 2,
            col_scales: 3,
            out: 4,
            q: 5,
            q_scales: 2,
            inter: 18944,
            tokens: 7,
        };
        let want = vec![
            at(&c.gate_up),
            at(&c.tok_scales),
            at(&c.col_scales),
            at(&c.out),
            at(&c.q),
            at(&c.q_scales),
            at(&c.inter),
        ];
        assert_eq!(c.args(), want);
        assert_eq!((c.name(), c.shape()), ("silu_mul_fp8", ((7, 1, 1), 1024, 0)));
        assert_eq!(
            SILU_FP8_MAX_INTER, 32768,
            "inter of a 7B (18944) to a 70B (28672) in one block"
        );
    }
}
