//! A model's weights on one GPU in bf16 or f32 (`--dtype`; its shard under TP/PP): fused QKV and
//! gate/up matrices with the layers' RMSNorm weights folded into their columns, f32 biases and
//! output norm. Quantized GGUF matrices are dequantized at load.

use std::ops::Range;

use half::bf16;
use strata_formats::GgmlType;
use strata_runtime::cuda::{CudaError, DeviceBuffer, Gpu};

use crate::config::ModelConfig;
use crate::weights::{Linear, ModelWeights};

use super::shard::Shard;

pub use crate::compute_dtype::ComputeDtype;

/// One transformer block on the GPU.
pub struct GpuLayer {
    /// `[(n_heads + 2 * n_kv) * head_dim, hidden]`: q rows, then k, then v; column c scaled by
    /// the attention norm's weight c, so the forward pass normalises without it.
    pub wqkv: DeviceBuffer,
    /// f32 `[(n_heads + 2 * n_kv) * head_dim]` when the model has q/k/v biases.
    pub bqkv: Option<DeviceBuffer>,
    pub q_norm: Option<DeviceBuffer>,
    pub k_norm: Option<DeviceBuffer>,
    pub wo: DeviceBuffer,
    /// `[2 * intermediate, hidden]`: gate rows, then up; columns scaled by the MLP norm's weights.
    pub w_gate_up: DeviceBuffer,
    pub w_down: DeviceBuffer,
}

/// The weights one GPU holds (its [`Shard`]).
pub struct GpuWeights {
    /// This rank's vocabulary rows of the embedding (first stage only).
    pub token_embd: Option<DeviceBuffer>,
    pub output_norm: DeviceBuffer,
    /// This rank's vocabulary rows of the LM head (last stage only; `None` when tied to an
    /// embedding held here).
    pub lm_head: Option<DeviceBuffer>,
    /// This stage's layers.
    pub layers: Vec<GpuLayer>,
    /// Bytes of all matrices, what one decode step reads.
    pub matrix_bytes: u64,
    /// The matrices' element type.
    pub dtype: ComputeDtype,
}

/// Rows `rows` and columns `cols` of one matrix.
struct Part<'a> {
    m: &'a Linear,
    rows: Range<usize>,
    cols: Range<usize>,
}

impl<'a> Part<'a> {
    fn rows(m: &'a Linear, rows: Range<usize>) -> Self {
        Part {
            m,
            rows,
            cols: 0..m.cols,
        }
    }

    fn cols(m: &'a Linear, cols: Range<usize>) -> Self {
        Part {
            m,
            rows: 0..m.rows,
            cols,
        }
    }
}

impl GpuWeights {
    /// The LM head matrix (last stage only).
    pub fn lm_head(&self) -> Option<&DeviceBuffer> {
        self.lm_head.as_ref().or(self.token_embd.as_ref())
    }

    /// Uploads this shard's part of `w` as `dtype`: query/KV heads and MLP columns of its TP
    /// rank, its stage's layers, its vocabulary rows. `progress(done, total)` reports layers
    /// uploaded.
    pub fn upload(
        gpu: &Gpu,
        c: &ModelConfig,
        shard: &Shard,
        w: &ModelWeights,
        dtype: ComputeDtype,
        progress: &dyn Fn(u64, u64),
    ) -> Result<GpuWeights, CudaError> {
        let matrices = |parts: &[Part], col_scale: Option<&[f32]>, what: &str| {
            upload_matrices(gpu, w, parts, col_scale, dtype, what)
        };
        let total = (shard.layers.len() + 2) as u64;
        let vocab = shard.vocab(c);
        let tied = w.lm_head.info.name == w.token_embd.info.name;
        let token_embd = if shard.is_first_stage() || (tied && shard.is_last_stage()) {
            let part = Part::rows(&w.token_embd, vocab.clone());
            Some(matrices(&[part], None, "the token embeddings")?)
        } else {
            None
        };
        let lm_head = if shard.is_last_stage() && !tied {
            let part = Part::rows(&w.lm_head, vocab.clone());
            Some(matrices(&[part], None, "the LM head")?)
        } else {
            None
        };
        progress(1, total);
        let hd = c.head_dim;
        let (q, kv, mlp) = (shard.q_heads(c), shard.kv_heads(c), shard.mlp(c));
        let q_rows = q.start * hd..q.end * hd;
        let kv_rows = kv.start * hd..kv.end * hd;
        let mut layers = Vec::with_capacity(shard.layers.len());
        for (n, i) in shard.layers.clone().enumerate() {
            let l = &w.layers[i];
            let what = |s: &str| format!("layer {i} {s}");
            let bqkv = match (&l.bq, &l.bk, &l.bv) {
                (Some(bq), Some(bk), Some(bv)) => {
                    let all: Vec<f32> = bq[q_rows.clone()]
                        .iter()
                        .chain(&bk[kv_rows.clone()])
                        .chain(&bv[kv_rows.clone()])
                        .copied()
                        .collect();
                    Some(gpu.upload(&all, &what("qkv bias"))?)
                }
                _ => None,
            };
            let opt = |v: &Option<Vec<f32>>, s: &str| -> Result<Option<DeviceBuffer>, CudaError> {
                v.as_ref().map(|v| gpu.upload(v, &what(s))).transpose()
            };
            let qkv = [
                Part::rows(&l.wq, q_rows.clone()),
                Part::rows(&l.wk, kv_rows.clone()),
                Part::rows(&l.wv, kv_rows.clone()),
            ];
            let gate_up = [Part::rows(&l.w_gate, mlp.clone()), Part::rows(&l.w_up, mlp.clone())];
            layers.push(GpuLayer {
                wqkv: matrices(&qkv, Some(&l.attn_norm), &what("qkv"))?,
                bqkv,
                q_norm: opt(&l.q_norm, "q norm")?,
                k_norm: opt(&l.k_norm, "k norm")?,
                wo: matrices(&[Part::cols(&l.wo, q_rows.clone())], None, &what("attention output"))?,
                w_gate_up: matrices(&gate_up, Some(&l.ffn_norm), &what("gate/up"))?,
                w_down: matrices(&[Part::cols(&l.w_down, mlp.clone())], None, &what("down"))?,
            });
            progress(n as u64 + 2, total);
        }
        let local = shard.local_config(c);
        let h = c.hidden as u64;
        let per_layer = (local.q_dim() as u64 + 2 * local.kv_dim() as u64) * h
            + local.q_dim() as u64 * h
            + 3 * local.intermediate as u64 * h;
        let vocab_bytes = if shard.is_last_stage() {
            local.vocab_size as u64 * h
        } else {
            0
        };
        let matrix_bytes = dtype.bytes() as u64 * (per_layer * local.n_layers as u64 + vocab_bytes);
        let out = GpuWeights {
            token_embd,
            output_norm: gpu.upload(&w.output_norm, "the output norm")?,
            lm_head,
            layers,
            matrix_bytes,
            dtype,
        };
        progress(total, total);
        Ok(out)
    }
}

/// Stacks the parts (same column count) into one device matrix of `dtype`, column c of each
/// part's column range times `col_scale[c]` when given (an RMSNorm's weights, rounded once).
fn upload_matrices(
    gpu: &Gpu,
    w: &ModelWeights,
    parts: &[Part],
    col_scale: Option<&[f32]>,
    dtype: ComputeDtype,
    what: &str,
) -> Result<DeviceBuffer, CudaError> {
    match dtype {
        ComputeDtype::Bf16 => upload_matrices_as(gpu, w, parts, col_scale, what, bf16::from_f32),
        ComputeDtype::F32 => upload_matrices_as(gpu, w, parts, col_scale, what, |v| v),
    }
}

/// [`upload_matrices`] with each element converted by `convert`.
fn upload_matrices_as<T: Copy + Default>(
    gpu: &Gpu,
    w: &ModelWeights,
    parts: &[Part],
    col_scale: Option<&[f32]>,
    what: &str,
    convert: fn(f32) -> T,
) -> Result<DeviceBuffer, CudaError> {
    let cols = parts[0].cols.len();
    let rows: usize = parts.iter().map(|p| p.rows.len()).sum();
    let elem = std::mem::size_of::<T>();
    let buf = gpu.alloc(rows * cols * elem, what)?;
    // Converted in slabs of rows to bound host memory.
    let slab_rows = ((4 << 20) / cols.max(1)).max(1);
    let mut slab = vec![T::default(); slab_rows * cols];
    let mut offset = 0usize;
    for p in parts {
        let m = p.m;
        let bytes = w.arena.bytes(m);
        let row_bytes = bytes.len() / m.rows.max(1);
        let mut full = vec![0.0f32; m.cols];
        let unit = vec![1.0f32; cols];
        let scale = col_scale.map_or(&unit[..], |g| &g[p.cols.clone()]);
        let mut r = p.rows.start;
        while r < p.rows.end {
            let n = slab_rows.min(p.rows.end - r);
            for i in 0..n {
                let out = &mut slab[i * cols..(i + 1) * cols];
                if m.info.ty == GgmlType::BF16 {
                    let row = &bytes[(r + i) * row_bytes..(r + i + 1) * row_bytes];
                    let src = &row[p.cols.start * 2..p.cols.end * 2];
                    for ((d, s), g) in out.iter_mut().zip(src.chunks_exact(2)).zip(scale) {
                        *d = convert(bf16::from_le_bytes([s[0], s[1]]).to_f32() * g);
                    }
                } else {
                    w.row_f32(m, r + i, &mut full);
                    for ((d, s), g) in out.iter_mut().zip(&full[p.cols.clone()]).zip(scale) {
                        *d = convert(s * g);
                    }
                }
            }
            gpu.write(&buf, offset, &slab[..n * cols])?;
            offset += n * cols * elem;
            r += n;
        }
    }
    Ok(buf)
}
