//! One SiLU-and-multiply call (activation.cu) of the fused gate/up output: its arguments in the
//! kernels' order and its launch shape, bf16 or (`--dtype float32`) f32.

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
}
