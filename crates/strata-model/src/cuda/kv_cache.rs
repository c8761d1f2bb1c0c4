//! The paged KV cache in GPU memory: per layer `[block][kv_head][slot][head_dim]`, in the compute
//! dtype or fp8 e4m3 with one f32 scale per (slot, head) vector. One extra block takes padding writes.

use strata_runtime::cuda::{CudaError, DeviceBuffer, Gpu};

use crate::config::ModelConfig;
use crate::kv_cache::KvCacheDtype;

use super::weights::ComputeDtype;

/// K and V storage of every layer.
pub struct GpuKvCache {
    pub k: DeviceBuffer,
    pub v: DeviceBuffer,
    /// Scales (fp8 only).
    pub k_scale: Option<DeviceBuffer>,
    pub v_scale: Option<DeviceBuffer>,
    pub dtype: KvCacheDtype,
    /// The element type of a full-precision (`auto`) cache.
    pub compute: ComputeDtype,
    pub block_size: usize,
    /// Blocks usable by sequences; block `num_blocks` is the padding block.
    pub num_blocks: usize,
    n_kv: usize,
    head_dim: usize,
}

/// Bytes per token of cache over all layers, scales included.
pub fn bytes_per_token(c: &ModelConfig, dtype: KvCacheDtype, compute: ComputeDtype) -> usize {
    let per_layer = 2 * c.kv_dim() * dtype.gpu_value_bytes(compute)
        + match dtype {
            KvCacheDtype::Fp8E4m3 => 2 * c.n_kv_heads * 4,
            KvCacheDtype::Auto => 0,
        };
    per_layer * c.n_layers
}

impl GpuKvCache {
    /// Allocates `num_blocks` blocks (plus the padding block).
    pub fn new(
        gpu: &Gpu,
        c: &ModelConfig,
        (dtype, compute): (KvCacheDtype, ComputeDtype),
        block_size: usize,
        num_blocks: usize,
    ) -> Result<GpuKvCache, CudaError> {
        let vectors = c.n_layers * (num_blocks + 1) * c.n_kv_heads * block_size;
        let bytes = vectors * c.head_dim * dtype.gpu_value_bytes(compute);
        let k = gpu.alloc(bytes, "the KV cache (keys)")?;
        let v = gpu.alloc(bytes, "the KV cache (values)")?;
        let (k_scale, v_scale) = match dtype {
            KvCacheDtype::Fp8E4m3 => (
                Some(gpu.alloc(vectors * 4, "the KV cache scales")?),
                Some(gpu.alloc(vectors * 4, "the KV cache scales")?),
            ),
            KvCacheDtype::Auto => (None, None),
        };
        Ok(GpuKvCache {
            k,
            v,
            k_scale,
            v_scale,
            dtype,
            compute,
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

    /// Device addresses of layer `l`: (k, v, k_scale, v_scale); scales are 0 but for fp8.
    pub fn layer(&self, l: usize) -> (u64, u64, u64, u64) {
        let vecs = l * self.layer_vectors();
        let off = vecs * self.head_dim * self.dtype.gpu_value_bytes(self.compute);
        let scale = |b: &Option<DeviceBuffer>| b.as_ref().map(|b| b.at(vecs * 4)).unwrap_or(0);
        (
            self.k.at(off),
            self.v.at(off),
            scale(&self.k_scale),
            scale(&self.v_scale),
        )
    }

    /// What one value is (`bf16`, `f32` or `fp8_e4m3`).
    pub fn value_type(&self) -> &'static str {
        self.dtype.gpu_value_type(self.compute)
    }

    /// Bytes of device memory held.
    pub fn memory_bytes(&self) -> usize {
        self.k.bytes() * 2 + self.k_scale.as_ref().map(|b| b.bytes() * 2).unwrap_or(0)
    }
}
