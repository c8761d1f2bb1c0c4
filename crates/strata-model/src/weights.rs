//! Weights of a llama-family model: matrices in their file type (quantized) in one arena,
//! norms and biases widened to f32. The arena is anonymous memory on 2 MiB pages where the OS allows.

use std::sync::Arc;

use strata_formats::gguf::{GgufFile, TensorInfo};
use strata_formats::quant::dequantize;
use strata_formats::GgmlType;
use strata_runtime::cpu::WeightMatrix;

use crate::config::ModelConfig;
use crate::error::ModelError;

/// A matrix of `rows` outputs by `cols` inputs, in the file's storage type.
#[derive(Debug, Clone)]
pub struct Linear {
    pub info: TensorInfo,
    pub rows: usize,
    pub cols: usize,
    /// Where its bytes start in the weight arena.
    pub arena_offset: usize,
}

/// Alignment of each matrix in the arena (a cache line; pages for the first).
const ARENA_ALIGN: usize = 64;

/// The bytes of all matrices, copied out of the file once at load.
///
/// Decode streams every matrix once per step; on 4 KiB pages that costs a TLB miss per page,
/// which measurably limits bandwidth. Anonymous memory advised for transparent huge pages
/// avoids it (see bench/NOTES.md).
pub struct WeightArena {
    map: memmap2::MmapMut,
}

impl WeightArena {
    fn new(len: usize) -> Result<WeightArena, ModelError> {
        let map = memmap2::MmapOptions::new()
            .len(len.max(1))
            .map_anon()
            .map_err(|e| ModelError::BadMetadata(format!("cannot allocate {len} bytes for the weights: {e}")))?;
        #[cfg(target_os = "linux")]
        {
            // Best effort: without THP the weights simply stay on small pages.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        Ok(WeightArena { map })
    }

    /// The bytes of `l`.
    pub fn bytes(&self, l: &Linear) -> &[u8] {
        &self.map[l.arena_offset..l.arena_offset + l.info.n_bytes as usize]
    }
}

/// One transformer block.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: Vec<f32>,
    pub wq: Linear,
    pub wk: Linear,
    pub wv: Linear,
    pub wo: Linear,
    pub bq: Option<Vec<f32>>,
    pub bk: Option<Vec<f32>>,
    pub bv: Option<Vec<f32>>,
    pub q_norm: Option<Vec<f32>>,
    pub k_norm: Option<Vec<f32>>,
    pub ffn_norm: Vec<f32>,
    pub w_gate: Linear,
    pub w_up: Linear,
    pub w_down: Linear,
}

/// All weights of a model.
pub struct ModelWeights {
    pub arena: WeightArena,
    pub token_embd: Linear,
    pub output_norm: Vec<f32>,
    pub lm_head: Linear,
    pub layers: Vec<LayerWeights>,
}

impl ModelWeights {
    /// Finds and checks every tensor the architecture needs and copies the matrices into the
    /// arena; `progress(done, total)` reports bytes copied.
    pub fn from_gguf(
        file: Arc<GgufFile>,
        c: &ModelConfig,
        progress: &dyn Fn(u64, u64),
    ) -> Result<ModelWeights, ModelError> {
        let f = &*file;
        let token_embd = linear(f, "token_embd.weight", c.vocab_size, c.hidden)?;
        let lm_head = if c.tied_embeddings {
            token_embd.clone()
        } else {
            linear(f, "output.weight", c.vocab_size, c.hidden)?
        };
        let output_norm = vector(f, "output_norm.weight", c.hidden)?;
        let mut layers = Vec::with_capacity(c.n_layers);
        for i in 0..c.n_layers {
            let n = |s: &str| format!("blk.{i}.{s}");
            let opt_vec = |name: String, len: usize, present: bool| -> Result<Option<Vec<f32>>, ModelError> {
                if present {
                    vector(f, &name, len).map(Some)
                } else {
                    Ok(None)
                }
            };
            layers.push(LayerWeights {
                attn_norm: vector(f, &n("attn_norm.weight"), c.hidden)?,
                wq: linear(f, &n("attn_q.weight"), c.q_dim(), c.hidden)?,
                wk: linear(f, &n("attn_k.weight"), c.kv_dim(), c.hidden)?,
                wv: linear(f, &n("attn_v.weight"), c.kv_dim(), c.hidden)?,
                wo: linear(f, &n("attn_output.weight"), c.hidden, c.q_dim())?,
                bq: opt_vec(n("attn_q.bias"), c.q_dim(), c.qkv_bias)?,
                bk: opt_vec(n("attn_k.bias"), c.kv_dim(), c.qkv_bias)?,
                bv: opt_vec(n("attn_v.bias"), c.kv_dim(), c.qkv_bias)?,
                q_norm: opt_vec(n("attn_q_norm.weight"), c.head_dim, c.qk_norm)?,
                k_norm: opt_vec(n("attn_k_norm.weight"), c.head_dim, c.qk_norm)?,
                ffn_norm: vector(f, &n("ffn_norm.weight"), c.hidden)?,
                w_gate: linear(f, &n("ffn_gate.weight"), c.intermediate, c.hidden)?,
                w_up: linear(f, &n("ffn_up.weight"), c.intermediate, c.hidden)?,
                w_down: linear(f, &n("ffn_down.weight"), c.hidden, c.intermediate)?,
            });
        }
        let mut weights = ModelWeights {
            arena: WeightArena::new(0)?,
            token_embd,
            output_norm,
            lm_head,
            layers,
        };
        weights.fill_arena(f, progress)?;
        Ok(weights)
    }

    fn matrices_mut(&mut self) -> Vec<&mut Linear> {
        let mut all: Vec<&mut Linear> = vec![&mut self.token_embd, &mut self.lm_head];
        for l in &mut self.layers {
            all.extend([
                &mut l.wq,
                &mut l.wk,
                &mut l.wv,
                &mut l.wo,
                &mut l.w_gate,
                &mut l.w_up,
                &mut l.w_down,
            ]);
        }
        all
    }

    /// Lays the matrices out in a new arena and copies their bytes from the file.
    fn fill_arena(&mut self, f: &GgufFile, progress: &dyn Fn(u64, u64)) -> Result<(), ModelError> {
        let tied = self.lm_head.info.name == self.token_embd.info.name;
        let mut len = 0usize;
        let mut layout: Vec<usize> = Vec::new();
        for (i, m) in self.matrices_mut().into_iter().enumerate() {
            if i == 1 && tied {
                layout.push(layout[0]);
                continue;
            }
            layout.push(len);
            len += (m.info.n_bytes as usize).next_multiple_of(ARENA_ALIGN);
        }
        let mut arena = WeightArena::new(len)?;
        let total = len as u64;
        let mut done = 0u64;
        for (i, (m, off)) in self.matrices_mut().into_iter().zip(layout).enumerate() {
            m.arena_offset = off;
            if i == 1 && tied {
                continue;
            }
            let src = f.tensor_data(&m.info);
            arena.map[off..off + src.len()].copy_from_slice(src);
            done += src.len() as u64;
            progress(done, total);
        }
        self.arena = arena;
        Ok(())
    }

    /// The matrix ready for the CPU matmul.
    pub fn matrix(&self, l: &Linear) -> WeightMatrix<'_> {
        WeightMatrix::new(l.info.ty, l.rows, l.cols, self.arena.bytes(l))
            .expect("shape and kernel were checked when the weights were loaded")
    }

    /// Writes row `row` of `l` (e.g. a token's embedding) as f32 into `out`.
    pub fn row_f32(&self, l: &Linear, row: usize, out: &mut [f32]) {
        let bytes = self.arena.bytes(l);
        let rb = bytes.len() / l.rows;
        dequantize(l.info.ty, &bytes[row * rb..(row + 1) * rb], out)
            .expect("row size was checked when the weights were loaded");
    }

    /// Bytes of all matrices: what a decode step reads.
    pub fn matrix_bytes(&self) -> u64 {
        let mut total = self.lm_head.info.n_bytes;
        for l in &self.layers {
            for m in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                total += m.info.n_bytes;
            }
        }
        total
    }
}

fn find<'a>(f: &'a GgufFile, name: &str) -> Result<&'a TensorInfo, ModelError> {
    f.tensor(name).ok_or_else(|| ModelError::BadTensor {
        name: name.into(),
        reason: "missing from the file".into(),
    })
}

fn linear(f: &GgufFile, name: &str, rows: usize, cols: usize) -> Result<Linear, ModelError> {
    let t = find(f, name)?;
    let bad = |reason: String| ModelError::BadTensor {
        name: name.into(),
        reason,
    };
    if t.dims.len() != 2 || t.dims[0] != cols as u64 || t.dims[1] != rows as u64 {
        return Err(bad(format!("shape {:?}, expected [{cols}, {rows}]", t.dims)));
    }
    WeightMatrix::new(t.ty, rows, cols, f.tensor_data(t)).map_err(|e| bad(e.to_string()))?;
    if !t.ty.can_dequantize() {
        return Err(bad(format!("type {} cannot be dequantized", t.ty)));
    }
    Ok(Linear {
        info: t.clone(),
        rows,
        cols,
        arena_offset: 0,
    })
}

fn vector(f: &GgufFile, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let t = find(f, name)?;
    let bad = |reason: String| ModelError::BadTensor {
        name: name.into(),
        reason,
    };
    if t.n_elements != len as u64 {
        return Err(bad(format!("has {} values, expected {len}", t.n_elements)));
    }
    if !matches!(t.ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16) {
        return Err(bad(format!(
            "type {} for a norm or bias vector (expected F32, F16 or BF16)",
            t.ty
        )));
    }
    let mut out = vec![0.0; len];
    dequantize(t.ty, f.tensor_data(t), &mut out).map_err(|e| bad(e.to_string()))?;
    Ok(out)
}
