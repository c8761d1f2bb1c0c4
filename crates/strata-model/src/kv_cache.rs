//! The paged KV cache: fixed-size blocks of key and value vectors, addressed by block tables.
//! Layout per layer is `[block][kv_head][slot][head_dim]`, so one head's keys in a block are contiguous.

use serde::Serialize;

use crate::compute_dtype::ComputeDtype;
use crate::config::ModelConfig;

/// Default number of token slots per block.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Element type of the cache (`--kv-cache-dtype`). What a value is on a device depends on the
/// device too: see [`KvCacheDtype::cpu_value_type`] and [`KvCacheDtype::gpu_value_type`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum KvCacheDtype {
    /// Full precision: f32 on the CPU backend, the compute dtype (`--dtype`) on a GPU.
    #[serde(rename = "auto")]
    Auto,
    /// FP8 E4M3 with one f32 scale per (token, KV head) vector: ~3.8x smaller than f32.
    #[serde(rename = "fp8")]
    Fp8E4m3,
}

impl KvCacheDtype {
    /// Parses a `--kv-cache-dtype` value ("f32" and "float32" name `auto`, what the CPU stores).
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "f32" | "float32" => Ok(KvCacheDtype::Auto),
            "fp8" | "fp8_e4m3" => Ok(KvCacheDtype::Fp8E4m3),
            other => Err(format!(
                "unknown --kv-cache-dtype {other:?}; use auto (full precision) or fp8 (e4m3 with scales)"
            )),
        }
    }

    /// What one value is in the CPU backend's cache: `auto` stores f32.
    pub fn cpu_value_type(self) -> &'static str {
        match self {
            KvCacheDtype::Auto => "f32",
            KvCacheDtype::Fp8E4m3 => "fp8_e4m3",
        }
    }

    /// Bytes one value takes on a GPU computing in `compute`: `auto` is the compute dtype there.
    pub fn gpu_value_bytes(self, compute: ComputeDtype) -> usize {
        match self {
            KvCacheDtype::Auto => compute.bytes(),
            KvCacheDtype::Fp8E4m3 => 1,
        }
    }

    /// What one value is on a GPU computing in `compute`: `auto` is the compute dtype there.
    pub fn gpu_value_type(self, compute: ComputeDtype) -> &'static str {
        match self {
            KvCacheDtype::Auto => compute.as_str(),
            KvCacheDtype::Fp8E4m3 => "fp8_e4m3",
        }
    }
}

/// Largest finite E4M3 value.
const E4M3_MAX: f32 = 448.0;

/// Rounds `x` to the nearest FP8 E4M3 (OCP "fn" variant: no infinities), ties to even;
/// magnitudes beyond 448 saturate.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let sign = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7F;
    }
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    if a < 1.0 / 64.0 {
        // Subnormals are multiples of 2^-9; 8 * 2^-9 rounds up into the smallest normal (0x08).
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let bits = a.to_bits();
    let mut exp = (bits >> 23) + 7 - 127;
    let mant = bits & 0x7F_FFFF;
    let mut m3 = mant >> 20;
    let rem = mant & 0xF_FFFF;
    if rem > 0x8_0000 || (rem == 0x8_0000 && m3 & 1 == 1) {
        m3 += 1;
        if m3 == 8 {
            m3 = 0;
            exp += 1;
        }
    }
    sign | ((exp as u8) << 3) | m3 as u8
}

/// The value of an FP8 E4M3 byte.
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 7) as f32;
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    if e == 0 {
        sign * m / 512.0
    } else {
        sign * (1.0 + m / 8.0) * 2f32.powi(e - 7)
    }
}

/// Decoding table of all 256 E4M3 bytes.
fn e4m3_table() -> &'static [f32; 256] {
    static TABLE: std::sync::OnceLock<[f32; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| std::array::from_fn(|b| e4m3_to_f32(b as u8)))
}

enum Storage {
    F32 {
        k: Vec<f32>,
        v: Vec<f32>,
    },
    /// One byte per value and one scale per (layer, block, head, slot) vector.
    Fp8 {
        k: Vec<u8>,
        v: Vec<u8>,
        k_scale: Vec<f32>,
        v_scale: Vec<f32>,
    },
}

/// Key and value storage for `num_blocks` blocks of `block_size` tokens, for every layer.
pub struct PagedKvCache {
    pub block_size: usize,
    pub num_blocks: usize,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    store: Storage,
}

impl std::fmt::Debug for PagedKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PagedKvCache({} blocks x {} tokens, {})",
            self.num_blocks,
            self.block_size,
            self.value_type()
        )
    }
}

impl PagedKvCache {
    /// A zeroed cache of `num_blocks` blocks for the model `c`.
    pub fn new(c: &ModelConfig, dtype: KvCacheDtype, block_size: usize, num_blocks: usize) -> PagedKvCache {
        let block_size = block_size.max(1);
        let len = c.n_layers * num_blocks * c.n_kv_heads * block_size * c.head_dim;
        let store = match dtype {
            KvCacheDtype::Auto => Storage::F32 {
                k: vec![0.0; len],
                v: vec![0.0; len],
            },
            KvCacheDtype::Fp8E4m3 => Storage::Fp8 {
                k: vec![0; len],
                v: vec![0; len],
                k_scale: vec![1.0; len / c.head_dim.max(1)],
                v_scale: vec![1.0; len / c.head_dim.max(1)],
            },
        };
        PagedKvCache {
            block_size,
            num_blocks,
            n_layers: c.n_layers,
            n_kv_heads: c.n_kv_heads,
            head_dim: c.head_dim,
            store,
        }
    }

    pub fn dtype(&self) -> KvCacheDtype {
        match self.store {
            Storage::F32 { .. } => KvCacheDtype::Auto,
            Storage::Fp8 { .. } => KvCacheDtype::Fp8E4m3,
        }
    }

    /// What one value is in this cache's storage ("f32" or "fp8_e4m3").
    pub fn value_type(&self) -> &'static str {
        self.dtype().cpu_value_type()
    }

    /// Bytes one token takes across all layers (K and V).
    pub fn bytes_per_token(c: &ModelConfig, dtype: KvCacheDtype) -> usize {
        let per_layer = match dtype {
            KvCacheDtype::Auto => c.kv_dim() * std::mem::size_of::<f32>(),
            KvCacheDtype::Fp8E4m3 => c.kv_dim() + c.n_kv_heads * std::mem::size_of::<f32>(),
        };
        2 * c.n_layers * per_layer
    }

    /// How many blocks fit in `bytes`.
    pub fn blocks_for_bytes(c: &ModelConfig, dtype: KvCacheDtype, block_size: usize, bytes: usize) -> usize {
        bytes / (Self::bytes_per_token(c, dtype) * block_size.max(1)).max(1)
    }

    /// Offset of (layer, block, head, slot=0) in the K or V array.
    #[inline]
    fn head_offset(&self, layer: usize, block: usize, head: usize) -> usize {
        ((layer * self.num_blocks + block) * self.n_kv_heads + head) * self.block_size * self.head_dim
    }

    /// Writes one token's K and V (`n_kv_heads * head_dim` each) into `slot` of `block`.
    pub fn write(&mut self, layer: usize, block: usize, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        for h in 0..self.n_kv_heads {
            let o = self.head_offset(layer, block, h) + slot * hd;
            let (kh, vh) = (&k[h * hd..(h + 1) * hd], &v[h * hd..(h + 1) * hd]);
            match &mut self.store {
                Storage::F32 { k, v } => {
                    k[o..o + hd].copy_from_slice(kh);
                    v[o..o + hd].copy_from_slice(vh);
                }
                Storage::Fp8 { k, v, k_scale, v_scale } => {
                    k_scale[o / hd] = encode_fp8(kh, &mut k[o..o + hd]);
                    v_scale[o / hd] = encode_fp8(vh, &mut v[o..o + hd]);
                }
            }
        }
    }

    /// The keys of one head in one block (`block_size * head_dim` values), decoded into `buf`
    /// when the cache is not f32.
    #[inline]
    pub fn k_block<'a>(&'a self, layer: usize, block: usize, head: usize, buf: &'a mut [f32]) -> &'a [f32] {
        let o = self.head_offset(layer, block, head);
        let n = self.block_size * self.head_dim;
        match &self.store {
            Storage::F32 { k, .. } => &k[o..o + n],
            Storage::Fp8 { k, k_scale, .. } => self.decode(&k[o..o + n], &k_scale[o / self.head_dim..], buf),
        }
    }

    /// The values of one head in one block, as [`Self::k_block`].
    #[inline]
    pub fn v_block<'a>(&'a self, layer: usize, block: usize, head: usize, buf: &'a mut [f32]) -> &'a [f32] {
        let o = self.head_offset(layer, block, head);
        let n = self.block_size * self.head_dim;
        match &self.store {
            Storage::F32 { v, .. } => &v[o..o + n],
            Storage::Fp8 { v, v_scale, .. } => self.decode(&v[o..o + n], &v_scale[o / self.head_dim..], buf),
        }
    }

    /// Asks the CPU to bring the keys (`values` false) or values of one head in one block into
    /// its caches: blocks of a sequence lie anywhere in the cache, so the hardware prefetcher
    /// cannot see the next one coming.
    #[inline]
    pub fn prefetch_block(&self, layer: usize, block: usize, head: usize, values: bool) {
        let o = self.head_offset(layer, block, head);
        let n = self.block_size * self.head_dim;
        match &self.store {
            Storage::F32 { k, v, .. } => prefetch_lines(&(if values { v } else { k })[o..o + n]),
            Storage::Fp8 { k, v, .. } => prefetch_lines(&(if values { v } else { k })[o..o + n]),
        }
    }

    fn decode<'a>(&self, bytes: &[u8], scales: &[f32], buf: &'a mut [f32]) -> &'a [f32] {
        let table = e4m3_table();
        let hd = self.head_dim;
        let out = &mut buf[..bytes.len()];
        for ((o, b), s) in out.chunks_exact_mut(hd).zip(bytes.chunks_exact(hd)).zip(scales) {
            for (o, &b) in o.iter_mut().zip(b) {
                *o = table[b as usize] * s;
            }
        }
        out
    }

    /// Bytes held by the cache.
    pub fn memory_bytes(&self) -> usize {
        match &self.store {
            Storage::F32 { k, v } => (k.len() + v.len()) * std::mem::size_of::<f32>(),
            Storage::Fp8 { k, v, k_scale, v_scale } => {
                k.len() + v.len() + (k_scale.len() + v_scale.len()) * std::mem::size_of::<f32>()
            }
        }
    }
}

/// Prefetches every 64-byte line of `x` into all cache levels (a no-op off x86_64).
#[inline]
fn prefetch_lines<T>(x: &[T]) {
    #[cfg(target_arch = "x86_64")]
    for line in x.chunks((64 / std::mem::size_of::<T>()).max(1)) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: SSE is part of x86_64; a prefetch is only a hint, it never faults and changes
        // no memory, and the address is inside `x`.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Quantizes one vector to E4M3 with a shared scale (its max magnitude maps to 448); returns the scale.
pub(crate) fn encode_fp8(x: &[f32], out: &mut [u8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let scale = if amax > 0.0 && amax.is_finite() {
        amax / E4M3_MAX
    } else {
        1.0
    };
    let inv = 1.0 / scale;
    for (o, &v) in out.iter_mut().zip(x) {
        *o = f32_to_e4m3(v * inv);
    }
    scale
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_is_f32_on_the_cpu_and_the_compute_dtype_on_a_gpu() {
        let auto = KvCacheDtype::Auto;
        assert_eq!(auto.cpu_value_type(), "f32");
        assert_eq!(auto.gpu_value_type(ComputeDtype::Bf16), "bf16");
        assert_eq!(auto.gpu_value_type(ComputeDtype::F32), "f32");
        assert_eq!(auto.gpu_value_bytes(ComputeDtype::Bf16), 2);
        assert_eq!(auto.gpu_value_bytes(ComputeDtype::F32), 4);
        let fp8 = KvCacheDtype::Fp8E4m3;
        assert_eq!(
            (fp8.cpu_value_type(), fp8.gpu_value_type(ComputeDtype::Bf16)),
            ("fp8_e4m3", "fp8_e4m3")
        );
        assert_eq!(fp8.gpu_value_bytes(ComputeDtype::F32), 1);
        for (flag, dtype) in [
            ("auto", auto),
            ("f32", auto),
            ("float32", auto),
            ("fp8", fp8),
            ("fp8_e4m3", fp8),
        ] {
            assert_eq!(KvCacheDtype::parse(flag), Ok(dtype), "{flag}");
        }
        assert!(KvCacheDtype::parse("bf16").unwrap_err().contains("use auto"));
        let json = serde_json::to_string(&[auto, fp8]).unwrap();
        assert_eq!(json, r#"["auto","fp8"]"#);
    }

    #[test]
    fn e4m3_encodes_every_representable_value_exactly_and_rounds_to_nearest() {
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                continue;
            }
            // -0.0 encodes to 0x80 and +0.0 to 0x00: both exact.
            assert_eq!(f32_to_e4m3(v), b, "byte {b:#04x} value {v}");
        }
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 1.0 / 512.0);
        assert_eq!(f32_to_e4m3(1000.0), 0x7E, "saturates");
        // Halfway between 1.0 (0x38) and 1.125 (0x39) goes to the even mantissa.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
        assert_eq!(f32_to_e4m3(1.1875), 0x3A);
        // Every value within half a step of its code.
        for i in 0..10_000 {
            let x = (i as f32 - 5000.0) / 11.3;
            let back = e4m3_to_f32(f32_to_e4m3(x));
            assert!((back - x).abs() <= x.abs() / 16.0 + 1.0 / 1024.0, "{x} -> {back}");
        }
    }

    #[test]
    fn an_fp8_cache_reads_back_within_e4m3_precision_and_is_smaller() {
        let c = ModelConfig {
            arch: &crate::architectures::LLAMA,
            n_layers: 2,
            hidden: 32,
            intermediate: 64,
            n_heads: 4,
            n_kv_heads: 2,
            head_dim: 8,
            vocab_size: 10,
            rms_eps: 1e-5,
            rope: crate::config::RopeConfig {
                theta: 10000.0,
                dim: 8,
                layout: strata_runtime::cpu::ops::RopeLayout::Neox,
                scaling: crate::config::RopeScaling::None,
            },
            max_position: 64,
            tied_embeddings: false,
        };
        let mut f = PagedKvCache::new(&c, KvCacheDtype::Auto, 4, 3);
        let mut q = PagedKvCache::new(&c, KvCacheDtype::Fp8E4m3, 4, 3);
        let kvd = c.kv_dim();
        let k: Vec<f32> = (0..kvd).map(|i| ((i * 37) % 23) as f32 - 11.0).collect();
        let v: Vec<f32> = (0..kvd).map(|i| ((i * 11) % 7) as f32 * 0.01).collect();
        f.write(1, 2, 3, &k, &v);
        q.write(1, 2, 3, &k, &v);
        let hd = c.head_dim;
        let mut buf = vec![0.0; 4 * hd];
        for h in 0..c.n_kv_heads {
            let want = f.k_block(1, 2, h, &mut []).to_vec();
            let got = q.k_block(1, 2, h, &mut buf);
            for (a, b) in want[3 * hd..].iter().zip(&got[3 * hd..]) {
                let amax = want[3 * hd..].iter().fold(0.0f32, |m, x| m.max(x.abs()));
                assert!((a - b).abs() <= a.abs() / 16.0 + amax / 448.0 / 64.0, "{a} vs {b}");
            }
        }
        assert!(q.memory_bytes() * 2 < f.memory_bytes());
        for (cache, dtype) in [(&f, KvCacheDtype::Auto), (&q, KvCacheDtype::Fp8E4m3)] {
            assert_eq!(cache.memory_bytes(), PagedKvCache::bytes_per_token(&c, dtype) * 4 * 3);
        }
    }
}
