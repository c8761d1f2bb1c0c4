//! The paged KV cache: fixed-size blocks of key and value vectors, addressed by block tables.
//! Layout per layer is `[block][kv_head][slot][head_dim]`, so one head's keys in a block are contiguous.

use crate::config::ModelConfig;

/// Default number of token slots per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Key and value storage for `num_blocks` blocks of `block_size` tokens, for every layer.
pub struct PagedKvCache {
    pub block_size: usize,
    pub num_blocks: usize,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    k: Vec<f32>,
    v: Vec<f32>,
}

impl std::fmt::Debug for PagedKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PagedKvCache({} blocks x {} tokens)",
            self.num_blocks, self.block_size
        )
    }
}

impl PagedKvCache {
    /// A zeroed cache of `num_blocks` blocks for the model `c`.
    pub fn new(c: &ModelConfig, block_size: usize, num_blocks: usize) -> PagedKvCache {
        let block_size = block_size.max(1);
        let len = c.n_layers * num_blocks * c.n_kv_heads * block_size * c.head_dim;
        PagedKvCache {
            block_size,
            num_blocks,
            n_layers: c.n_layers,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            k: vec![0.0; len],
            v: vec![0.0; len],
        }
    }

    /// Bytes one token takes across all layers (K and V).
    pub fn bytes_per_token(c: &ModelConfig) -> usize {
        2 * c.n_layers * c.kv_dim() * std::mem::size_of::<f32>()
    }

    /// How many blocks fit in `bytes`.
    pub fn blocks_for_bytes(c: &ModelConfig, block_size: usize, bytes: usize) -> usize {
        bytes / (Self::bytes_per_token(c) * block_size.max(1)).max(1)
    }

    fn block_stride(&self) -> usize {
        self.n_kv_heads * self.block_size * self.head_dim
    }

    /// Offset of (layer, block, head, slot=0) in the K or V array.
    #[inline]
    pub fn head_offset(&self, layer: usize, block: usize, head: usize) -> usize {
        ((layer * self.num_blocks + block) * self.n_kv_heads + head) * self.block_size * self.head_dim
    }

    /// Writes one token's K and V (`n_kv_heads * head_dim` each) into `slot` of `block`.
    pub fn write(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        for h in 0..self.n_kv_heads {
            let o = self.head_offset(layer, block, h) + slot * hd;
            self.k[o..o + hd].copy_from_slice(&k[h * hd..(h + 1) * hd]);
            self.v[o..o + hd].copy_from_slice(&v[h * hd..(h + 1) * hd]);
        }
    }

    /// The keys of one head in one block: `block_size * head_dim` values.
    #[inline]
    pub fn k_block(&self, layer: usize, block: usize, head: usize) -> &[f32] {
        let o = self.head_offset(layer, block, head);
        &self.k[o..o + self.block_size * self.head_dim]
    }

    /// The values of one head in one block: `block_size * head_dim` values.
    #[inline]
    pub fn v_block(&self, layer: usize, block: usize, head: usize) -> &[f32] {
        let o = self.head_offset(layer, block, head);
        &self.v[o..o + self.block_size * self.head_dim]
    }

    /// Copies block `src` into block `dst` in every layer (copy-on-write of shared prefixes).
    pub fn copy_block(&mut self, src: usize, dst: usize) {
        let stride = self.block_stride();
        for layer in 0..self.n_layers {
            let s = (layer * self.num_blocks + src) * stride;
            let d = (layer * self.num_blocks + dst) * stride;
            self.k.copy_within(s..s + stride, d);
            self.v.copy_within(s..s + stride, d);
        }
    }

    /// Bytes held by the cache.
    pub fn memory_bytes(&self) -> usize {
        (self.k.len() + self.v.len()) * std::mem::size_of::<f32>()
    }
}
