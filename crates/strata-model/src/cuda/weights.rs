//! A model's weights on one GPU in bf16: fused QKV and gate/up matrices, f32 norms and biases.
//! Quantized GGUF matrices are dequantized to bf16 at load (native quantized kernels come later).

use half::bf16;
use strata_formats::GgmlType;
use strata_runtime::cuda::{CudaError, DeviceBuffer, Gpu};

use crate::config::ModelConfig;
use crate::weights::{Linear, ModelWeights};

/// One transformer block on the GPU.
pub struct GpuLayer {
    pub attn_norm: DeviceBuffer,
    /// `[(n_heads + 2 * n_kv) * head_dim, hidden]`: q rows, then k, then v.
    pub wqkv: DeviceBuffer,
    /// f32 `[(n_heads + 2 * n_kv) * head_dim]` when the model has q/k/v biases.
    pub bqkv: Option<DeviceBuffer>,
    pub q_norm: Option<DeviceBuffer>,
    pub k_norm: Option<DeviceBuffer>,
    pub wo: DeviceBuffer,
    pub ffn_norm: DeviceBuffer,
    /// `[2 * intermediate, hidden]`: gate rows, then up.
    pub w_gate_up: DeviceBuffer,
    pub w_down: DeviceBuffer,
}

/// All weights on the GPU.
pub struct GpuWeights {
    pub token_embd: DeviceBuffer,
    pub output_norm: DeviceBuffer,
    /// Shares the embedding's buffer when tied (then `None`).
    pub lm_head: Option<DeviceBuffer>,
    pub layers: Vec<GpuLayer>,
    /// Bytes of all matrices, what one decode step reads.
    pub matrix_bytes: u64,
}

impl GpuWeights {
    /// The LM head matrix.
    pub fn lm_head(&self) -> &DeviceBuffer {
        self.lm_head.as_ref().unwrap_or(&self.token_embd)
    }

    /// Uploads `w`; `progress(done, total)` reports matrices uploaded.
    pub fn upload(
        gpu: &Gpu,
        c: &ModelConfig,
        w: &ModelWeights,
        progress: &dyn Fn(u64, u64),
    ) -> Result<GpuWeights, CudaError> {
        let total = (w.layers.len() + 2) as u64;
        let token_embd = upload_matrices(gpu, w, &[&w.token_embd], "the token embeddings")?;
        let tied = w.lm_head.info.name == w.token_embd.info.name;
        let lm_head = if tied {
            None
        } else {
            Some(upload_matrices(gpu, w, &[&w.lm_head], "the LM head")?)
        };
        progress(1, total);
        let mut layers = Vec::with_capacity(w.layers.len());
        for (i, l) in w.layers.iter().enumerate() {
            let what = |s: &str| format!("layer {i} {s}");
            let bqkv = match (&l.bq, &l.bk, &l.bv) {
                (Some(q), Some(k), Some(v)) => {
                    let all: Vec<f32> = q.iter().chain(k).chain(v).copied().collect();
                    Some(gpu.upload(&all, &what("qkv bias"))?)
                }
                _ => None,
            };
            let opt = |v: &Option<Vec<f32>>, s: &str| -> Result<Option<DeviceBuffer>, CudaError> {
                v.as_ref().map(|v| gpu.upload(v, &what(s))).transpose()
            };
            layers.push(GpuLayer {
                attn_norm: gpu.upload(&l.attn_norm, &what("attention norm"))?,
                wqkv: upload_matrices(gpu, w, &[&l.wq, &l.wk, &l.wv], &what("qkv"))?,
                bqkv,
                q_norm: opt(&l.q_norm, "q norm")?,
                k_norm: opt(&l.k_norm, "k norm")?,
                wo: upload_matrices(gpu, w, &[&l.wo], &what("attention output"))?,
                ffn_norm: gpu.upload(&l.ffn_norm, &what("MLP norm"))?,
                w_gate_up: upload_matrices(gpu, w, &[&l.w_gate, &l.w_up], &what("gate/up"))?,
                w_down: upload_matrices(gpu, w, &[&l.w_down], &what("down"))?,
            });
            progress(i as u64 + 2, total);
        }
        let h = c.hidden as u64;
        let per_layer =
            (c.q_dim() as u64 + 2 * c.kv_dim() as u64) * h + c.q_dim() as u64 * h + 3 * c.intermediate as u64 * h;
        let matrix_bytes = 2 * (per_layer * c.n_layers as u64 + c.vocab_size as u64 * h);
        let out = GpuWeights {
            token_embd,
            output_norm: gpu.upload(&w.output_norm, "the output norm")?,
            lm_head,
            layers,
            matrix_bytes,
        };
        progress(total, total);
        Ok(out)
    }
}

/// Stacks the rows of `mats` (same column count) into one bf16 device matrix.
fn upload_matrices(gpu: &Gpu, w: &ModelWeights, mats: &[&Linear], what: &str) -> Result<DeviceBuffer, CudaError> {
    let cols = mats[0].cols;
    let rows: usize = mats.iter().map(|m| m.rows).sum();
    let buf = gpu.alloc(rows * cols * 2, what)?;
    let mut offset = 0usize;
    for m in mats {
        let bytes = w.arena.bytes(m);
        if m.info.ty == GgmlType::BF16 {
            gpu.write(&buf, offset, bytes)?;
        } else {
            // Dequantize in slabs of rows to bound host memory.
            let slab_rows = (4 << 20) / cols.max(1);
            let slab_rows = slab_rows.clamp(1, m.rows);
            let mut f = vec![0.0f32; slab_rows * cols];
            let mut h = vec![bf16::ZERO; slab_rows * cols];
            let mut r = 0;
            while r < m.rows {
                let n = slab_rows.min(m.rows - r);
                for i in 0..n {
                    w.row_f32(m, r + i, &mut f[i * cols..(i + 1) * cols]);
                }
                for (d, s) in h[..n * cols].iter_mut().zip(&f[..n * cols]) {
                    *d = bf16::from_f32(*s);
                }
                gpu.write(&buf, offset + r * cols * 2, &h[..n * cols])?;
                r += n;
            }
        }
        offset += m.rows * cols * 2;
    }
    Ok(buf)
}
