//! The paged KV cache in GPU memory: per layer `[block][kv_head][slot][head_dim]`, bf16 or fp8
//! e4m3 with one f32 scale per (slot, head) vector. One extra block takes padding writes.

use strata_runtime::cuda::{CudaError, DeviceBuffer, Gpu};

use crate::config::ModelConfig;
use crate::kv_cache::KvCacheDtype;

/// K and V storage of every layer.
pub struct GpuKvCache {
    pub k: DeviceBuffer,
    pub v: DeviceBuffer,
    /// Scales (fp8 only).
    pub k_scale: Option<DeviceBuffer>,
    pub v_scale: Option<DeviceBuffer>,
    pub dtype: KvCacheDtype,
    pub block_size: usize,
    /// Blocks usable by sequences; block `num_blocks` is the padding block.
    pub num_blocks: usize,
    n_kv: usize,
    head_dim: usize,
}

/// Bytes one value takes on the GPU (the CPU's `auto` is f32; on the GPU it is bf16).
pub fn value_bytes(dtype: KvCacheDtype) -> usize {
    match dtype {
        KvCacheDtype::F32 => 2,
        KvCacheDtype::Fp8E4m3 => 1,
    }
}

/// The name of what one value is on the GPU: `auto` (the CPU's f32) is bf16 there.
pub fn value_type_name(dtype: KvCacheDtype) -> &'static str {
    match dtype {
        KvCacheDtype::F32 => "bf16",
        KvCacheDtype::Fp8E4m3 => "fp8_e4m3",
    }
}

/// Bytes per token of cache over all layers, scales included.
pub fn bytes_per_token(c: &ModelConfig, dtype: KvCacheDtype) -> usize {
    let per_layer = 2 * c.kv_dim() * value_bytes(dtype)
        + match dtype {
            KvCacheDtype::Fp8E4m3 => 2 * c.n_kv_heads * 4,
            KvCacheDtype::F32 => 0,
        };
    per_layer * c.n_layers
}

impl GpuKvCache {
    /// Allocates `num_blocks` blocks (plus the padding block).
    pub fn new(
        gpu: &Gpu,
        c: &ModelConfig,
        dtype: KvCacheDtype,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<GpuKvCache, CudaError> {
        let vectors = c.n_layers * (num_blocks + 1) * c.n_kv_heads * block_size;
        let bytes = vectors * c.head_dim * value_bytes(dtype);
        let k = gpu.alloc(bytes, "the KV cache (keys)")?;
        let v = gpu.alloc(bytes, "the KV cache (values)")?;
        let (k_scale, v_scale) = match dtype {
            KvCacheDtype::Fp8E4m3 => (
                Some(gpu.alloc(vectors * 4, "the KV cache scales")?),
                Some(gpu.alloc(vectors * 4, "the KV cache scales")?),
            ),
            KvCacheDtype::F32 => (None, None),
        };
        Ok(GpuKvCache {
            k,
            v,
            k_scale,
            v_scale,
            dtype,
            block_size,
            num_blocks,
            n_kv: c.n_kv_heads,
            head_dim: c.head_dim,
        })
    }

    /// Vectors (one head of one slot) per layer.
    fn layer_vectors(&self) -> usize {
        (self.num_blocks + 1) * self.n_kv * self.block_size
    }

    /// Device addresses of layer `l`: (k, v, k_scale, v_scale); scales are 0 for bf16.
    pub fn layer(&self, l: usize) -> (u64, u64, u64, u64) {
        let vecs = l * self.layer_vectors();
        let off = vecs * self.head_dim * value_bytes(self.dtype);
        let scale = |b: &Option<DeviceBuffer>| b.as_ref().map(|b| b.at(vecs * 4)).unwrap_or(0);
        (
            self.k.at(off),
            self.v.at(off),
            scale(&self.k_scale),
            scale(&self.v_scale),
        )
    }

    /// Bytes of device memory held.
    pub fn memory_bytes(&self) -> usize {
        self.k.bytes() * 2 + self.k_scale.as_ref().map(|b| b.bytes() * 2).unwrap_or(0)
    }
}
