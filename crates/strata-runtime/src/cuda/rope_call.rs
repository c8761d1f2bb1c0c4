//! One `qkv_rope_kv_write_*` call (rope.cu): bias, q/k norms and RoPE of the QKV projection and
//! the write of K and V into the paged cache; its arguments in the kernels' order and its shape.

use std::ffi::c_void;

use super::kernels::rope_block_threads;
use crate::kernel_args;

/// The twin for the activations' and the cache's types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeKernel {
    /// bf16 qkv and cache.
    Bf16,
    /// bf16 qkv, fp8 e4m3 cache with a scale per (token, head).
    Fp8,
    /// f32 qkv and cache (`--dtype float32`; no scales).
    F32,
}

impl RopeKernel {
    pub fn name(self) -> &'static str {
        match self {
            RopeKernel::Bf16 => "qkv_rope_kv_write_bf16",
            RopeKernel::Fp8 => "qkv_rope_kv_write_fp8",
            RopeKernel::F32 => "qkv_rope_kv_write_f32",
        }
    }
}

/// The device pointers and sizes of one call over `tokens` tokens.
#[derive(Debug, Clone, Copy)]
pub struct RopeCall {
    /// `[tokens, (n_heads + 2 * n_kv) * head_dim]`, rewritten in place.
    pub qkv: u64,
    /// The projection's k splits a quantized GEMM left unsummed (`[splits, tokens, width]` f32),
    /// summed and rounded here as `qgemm_reduce` would into `qkv`; `splits` 0 reads `qkv`.
    pub parts: u64,
    pub splits: i32,
    /// f32 of the row's width, or 0 (Qwen2 has one).
    pub bias: u64,
    /// f32 `[head_dim]` per-head norms of q and k, or 0 (Qwen3 has them).
    pub q_norm: u64,
    pub k_norm: u64,
    /// `[tokens]` i32 positions.
    pub positions: u64,
    /// `[position][rot_dim / 2]` (cos, sin) f32 pairs.
    pub rope_table: u64,
    pub n_heads: i32,
    pub n_kv: i32,
    pub head_dim: i32,
    pub rot_dim: i32,
    /// 1: rotate halves (NeoX); 0: adjacent pairs.
    pub neox: i32,
    /// The q/k norms' epsilon.
    pub eps: f32,
    /// `[tokens]` i32 cache slots, `block * block_size + slot`.
    pub slots: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    /// The fp8 cache's per-vector scales (0 for the others).
    pub k_scale: u64,
    pub v_scale: u64,
    pub block_size: i32,
    pub tokens: usize,
    pub kernel: RopeKernel,
}

impl RopeCall {
    pub fn name(&self) -> &'static str {
        self.kernel.name()
    }

    /// Grid (tokens, n_kv): a block a KV head, a warp for each query head of its group and one
    /// each for k and v.
    fn shape(&self) -> ((u32, u32, u32), u32, u32) {
        let group = (self.n_heads / self.n_kv) as usize;
        ((self.tokens as u32, self.n_kv as u32, 1), rope_block_threads(group), 0)
    }

    /// The kernel's arguments, pointing into `self`.
    fn args(&self) -> Vec<*mut c_void> {
        kernel_args!(
            self.qkv,
            self.parts,
            self.splits,
            self.bias,
            self.q_norm,
            self.k_norm,
            self.positions,
            self.rope_table,
            self.n_heads,
            self.n_kv,
            self.head_dim,
            self.rot_dim,
            self.neox,
            self.eps,
            self.slots,
            self.k_cache,
            self.v_cache,
            self.k_scale,
            self.v_scale,
            self.block_size
        )
        .to_vec()
    }

    one_kernel_launch!("rope.cu");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::arg_at as at;

    #[test]
    fn the_arguments_come_in_rope_cu_order() {
        let c = RopeCall {
            qkv: 1,
            parts: 20,
            splits: 21,
            bias: 2,
            q_norm: 3,
            k_norm: 4,
            positions: 5,
            rope_table: 6,
            n_heads: 32,
            n_kv: 8,
            head_dim: 9,
            rot_dim: 10,
            neox: 11,
            eps: 12.0,
            slots: 13,
            k_cache: 14,
            v_cache: 15,
            k_scale: 16,
            v_scale: 17,
            block_size: 18,
            tokens: 19,
            kernel: RopeKernel::Fp8,
        };
        let want = vec![
            at(&c.qkv),
            at(&c.parts),
            at(&c.splits),
            at(&c.bias),
            at(&c.q_norm),
            at(&c.k_norm),
            at(&c.positions),
            at(&c.rope_table),
            at(&c.n_heads),
            at(&c.n_kv),
            at(&c.head_dim),
            at(&c.rot_dim),
            at(&c.neox),
            at(&c.eps),
            at(&c.slots),
            at(&c.k_cache),
            at(&c.v_cache),
            at(&c.k_scale),
            at(&c.v_scale),
            at(&c.block_size),
        ];
        assert_eq!(c.args(), want);
        // Groups of 4 query heads: 4 + 2 warps a block.
        assert_eq!((c.name(), c.shape()), ("qkv_rope_kv_write_fp8", ((19, 8, 1), 192, 0)));
        let names = [RopeKernel::Bf16, RopeKernel::Fp8, RopeKernel::F32].map(RopeKernel::name);
        assert_eq!(
            names,
            [
                "qkv_rope_kv_write_bf16",
                "qkv_rope_kv_write_fp8",
                "qkv_rope_kv_write_f32"
            ]
        );
    }
}
