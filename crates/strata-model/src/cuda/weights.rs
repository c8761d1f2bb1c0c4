//! A model's weights on one GPU (its shard under TP/PP): GGUF matrices in their quantized blocks
//! (quant.cu reads them), FP8 E4M3 rows with a scale each (fp8.cu), others in bf16 or f32
//! (`--dtype`) with the RMSNorm weights folded into their columns; fused QKV and gate/up
//! matrices, f32 biases and norms.

use std::ops::Range;

use half::bf16;
use strata_formats::GgmlType;
use strata_runtime::cuda::{CudaError, DeviceBuffer, Gpu, QuantFormat};

use crate::config::ModelConfig;
use crate::fp8::encode_row;
use crate::weights::{Linear, ModelWeights};

use super::shard::Shard;

pub use crate::compute_dtype::ComputeDtype;

/// One matrix on the GPU: dense (`--dtype`, the norm before it folded into its columns), the
/// file's quantized blocks, in segments of rows of one block format each (quant.cu's layout), or
/// FP8 E4M3 rows (fp8.cu's layout: `[n, k]` bytes) with an f32 scale each.
pub enum GpuMatrix {
    Dense(DeviceBuffer),
    Quant(Vec<QuantSegment>),
    Fp8 {
        weights: DeviceBuffer,
        scales: DeviceBuffer,
    },
}

/// Rows of a quantized matrix in one block format.
pub struct QuantSegment {
    pub format: QuantFormat,
    pub buf: DeviceBuffer,
    /// The segment's first row in the matrix.
    pub first_row: usize,
    pub rows: usize,
}

/// The dequantization scratch a quantized LM head needs at least (bf16 values: 64 MiB), when the
/// layer matrices ask for less.
const LM_HEAD_SLAB_ELEMS: usize = 32 << 20;

/// Most segments a matrix is made of (the QKV matrix: q, k and v of three formats).
pub const MAX_SEGMENTS: usize = 3;

/// A [`GpuMatrix`] by its device addresses, to launch products with.
#[derive(Debug, Clone, Copy)]
pub enum MatrixView {
    Dense(u64),
    Quant([Option<SegmentView>; MAX_SEGMENTS]),
    Fp8(Fp8View),
}

/// An FP8 matrix by the device addresses of its bytes and its per-row scales.
#[derive(Debug, Clone, Copy)]
pub struct Fp8View {
    pub w: u64,
    pub scales: u64,
}

/// A [`QuantSegment`] by its device address.
#[derive(Debug, Clone, Copy)]
pub struct SegmentView {
    pub format: QuantFormat,
    pub ptr: u64,
    pub first_row: usize,
    pub rows: usize,
}

impl GpuMatrix {
    pub fn view(&self) -> MatrixView {
        match self {
            GpuMatrix::Dense(b) => MatrixView::Dense(b.ptr()),
            GpuMatrix::Quant(segs) => {
                let mut v = [None; MAX_SEGMENTS];
                for (slot, s) in v.iter_mut().zip(segs) {
                    *slot = Some(SegmentView {
                        format: s.format,
                        ptr: s.buf.ptr(),
                        first_row: s.first_row,
                        rows: s.rows,
                    });
                }
                MatrixView::Quant(v)
            }
            GpuMatrix::Fp8 { weights, scales } => MatrixView::Fp8(Fp8View {
                w: weights.ptr(),
                scales: scales.ptr(),
            }),
        }
    }

    /// Device bytes of the matrix.
    pub fn bytes(&self) -> u64 {
        match self {
            GpuMatrix::Dense(b) => b.bytes() as u64,
            GpuMatrix::Quant(segs) => segs.iter().map(|s| s.buf.bytes() as u64).sum(),
            GpuMatrix::Fp8 { weights, scales } => (weights.bytes() + scales.bytes()) as u64,
        }
    }

    /// Not dense (GGUF blocks or FP8): the norm before it applies its weights to x, and its
    /// bf16 cuBLASLt products read the scratch it is dequantized into.
    pub fn is_quantized(&self) -> bool {
        !matches!(self, GpuMatrix::Dense(_))
    }

    /// The dense matrix's address; a quantized one's products read `scratch`, where it is
    /// dequantized first.
    pub fn gemm_ptr(&self, scratch: u64) -> u64 {
        match self {
            GpuMatrix::Dense(b) => b.ptr(),
            GpuMatrix::Quant(_) | GpuMatrix::Fp8 { .. } => scratch,
        }
    }
}

impl MatrixView {
    /// The quantized segments, in row order.
    pub fn segments(&self) -> impl Iterator<Item = SegmentView> + '_ {
        let segs: &[Option<SegmentView>] = match self {
            MatrixView::Dense(_) | MatrixView::Fp8(_) => &[],
            MatrixView::Quant(s) => s,
        };
        segs.iter().flatten().copied()
    }
}

/// One transformer block on the GPU.
pub struct GpuLayer {
    /// `[(n_heads + 2 * n_kv) * head_dim, hidden]`: q rows, then k, then v; dense, column c is
    /// scaled by the attention norm's weight c, so the forward pass normalises without it.
    pub wqkv: GpuMatrix,
    /// f32 `[(n_heads + 2 * n_kv) * head_dim]` when the model has q/k/v biases.
    pub bqkv: Option<DeviceBuffer>,
    pub q_norm: Option<DeviceBuffer>,
    pub k_norm: Option<DeviceBuffer>,
    pub wo: GpuMatrix,
    /// `[2 * intermediate, hidden]`: gate rows, then up; dense, columns scaled by the MLP norm's weights.
    pub w_gate_up: GpuMatrix,
    pub w_down: GpuMatrix,
    /// The attention and MLP norms' weights (f32 `[hidden]`) when the matrix reading that norm
    /// is quantized: the norm applies them to x instead.
    pub attn_norm: Option<DeviceBuffer>,
    pub ffn_norm: Option<DeviceBuffer>,
}

/// The weights one GPU holds (its [`Shard`]).
pub struct GpuWeights {
    /// This rank's vocabulary rows of the embedding (first stage only).
    pub token_embd: Option<GpuMatrix>,
    pub output_norm: DeviceBuffer,
    /// This rank's vocabulary rows of the LM head (last stage only; `None` when tied to an
    /// embedding held here).
    pub lm_head: Option<GpuMatrix>,
    /// This stage's layers.
    pub layers: Vec<GpuLayer>,
    /// Device bytes of all matrices, what one decode step reads.
    pub matrix_bytes: u64,
    /// Bytes the same matrices (this shard's part of them) take in the file.
    pub file_bytes: u64,
    /// The dense matrices' element type, and the activations'.
    pub dtype: ComputeDtype,
    /// Elements of the bf16 scratch quantized matrices are dequantized into for their GEMMs: the
    /// largest quantized layer matrix, or a slab of a quantized LM head; 0 if none.
    pub dequant_elems: usize,
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

    /// The part's GPU block format when it can stay quantized: a type quant.cu reads, and
    /// columns on whole blocks. Otherwise why not, when its type is quantized (`None`: dense type).
    fn quant_format(&self) -> Result<QuantFormat, Option<String>> {
        let ty = self.m.info.ty;
        let Some(f) = QuantFormat::of(ty) else {
            return Err(ty.is_quantized().then(|| format!("no GPU kernel reads {}", ty.name())));
        };
        let b = f.block_len();
        if !self.cols.start.is_multiple_of(b) || !self.cols.len().is_multiple_of(b) {
            return Err(Some(format!(
                "its columns {}..{} on this GPU split {} blocks of {b}",
                self.cols.start,
                self.cols.end,
                ty.name()
            )));
        }
        Ok(f)
    }
}

/// What the layer matrices are on the GPU: as shipped (`--quantization auto`: GGUF blocks stay
/// quantized, FP8 checkpoints stay FP8), `--dtype` (`none`), or FP8 E4M3 with a scale per
/// row converted at load (`fp8`; embeddings and the LM head as `auto` leaves them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GpuQuantization {
    #[default]
    Auto,
    None,
    Fp8,
}

impl GpuWeights {
    /// The LM head matrix (last stage only).
    pub fn lm_head(&self) -> Option<&GpuMatrix> {
        self.lm_head.as_ref().or(self.token_embd.as_ref())
    }

    /// Whether any layer matrix is FP8.
    pub fn has_fp8(&self) -> bool {
        self.layers
            .iter()
            .flat_map(|l| [&l.wqkv, &l.wo, &l.w_gate_up, &l.w_down])
            .any(|m| matches!(m, GpuMatrix::Fp8 { .. }))
    }

    /// Whether every layer matrix is dense, or every one quantized: where a norm's weights go
    /// (folded, or on x) is then the same for each product, as norms carried between GEMVs need.
    pub fn layer_matrices_uniform(&self) -> bool {
        let mut all = self
            .layers
            .iter()
            .flat_map(|l| [&l.wqkv, &l.wo, &l.w_gate_up, &l.w_down]);
        let Some(first) = all.next() else {
            return true;
        };
        all.all(|m| m.is_quantized() == first.is_quantized())
    }

    /// Uploads this shard's part of `w`: query/KV heads and MLP columns of its TP rank, its
    /// stage's layers, its vocabulary rows; quantized GGUF matrices stay quantized (unless
    /// `quant` is `None`, or `dtype` is f32), the rest as `dtype`. `progress(done, total)`
    /// reports layers uploaded.
    pub fn upload(
        gpu: &Gpu,
        c: &ModelConfig,
        shard: &Shard,
        w: &ModelWeights,
        dtype: ComputeDtype,
        quant: GpuQuantization,
        progress: &dyn Fn(u64, u64),
    ) -> Result<GpuWeights, CudaError> {
        let matrices = |parts: &[Part], col_scale: Option<&[f32]>, what: &str| {
            upload_matrix(gpu, w, parts, col_scale, dtype, (quant, true), what)
        };
        let head_matrix = |part: Part, what: &str| upload_matrix(gpu, w, &[part], None, dtype, (quant, false), what);
        let total = (shard.layers.len() + 2) as u64;
        let vocab = shard.vocab(c);
        let tied = w.lm_head.info.name == w.token_embd.info.name;
        let token_embd = if shard.is_first_stage() || (tied && shard.is_last_stage()) {
            let part = Part::rows(&w.token_embd, vocab.clone());
            Some(head_matrix(part, "the token embeddings")?)
        } else {
            None
        };
        let lm_head = if shard.is_last_stage() && !tied {
            let part = Part::rows(&w.lm_head, vocab.clone());
            Some(head_matrix(part, "the LM head")?)
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
            let wqkv = matrices(&qkv, Some(&l.attn_norm), &what("qkv"))?;
            let w_gate_up = matrices(&gate_up, Some(&l.ffn_norm), &what("gate/up"))?;
            let norm_on_x = |m: &GpuMatrix, g: &[f32], s: &str| -> Result<Option<DeviceBuffer>, CudaError> {
                m.is_quantized().then(|| gpu.upload(g, &what(s))).transpose()
            };
            layers.push(GpuLayer {
                attn_norm: norm_on_x(&wqkv, &l.attn_norm, "attention norm")?,
                ffn_norm: norm_on_x(&w_gate_up, &l.ffn_norm, "MLP norm")?,
                wqkv,
                bqkv,
                q_norm: opt(&l.q_norm, "q norm")?,
                k_norm: opt(&l.k_norm, "k norm")?,
                wo: matrices(&[Part::cols(&l.wo, q_rows.clone())], None, &what("attention output"))?,
                w_gate_up,
                w_down: matrices(&[Part::cols(&l.w_down, mlp.clone())], None, &what("down"))?,
            });
            progress(n as u64 + 2, total);
        }
        let local = shard.local_config(c);
        let h = c.hidden;
        let mut dequant_elems = 0;
        let mut matrix_bytes = 0;
        for l in &layers {
            let shapes = [
                (&l.wqkv, local.q_dim() + 2 * local.kv_dim(), h),
                (&l.wo, h, local.q_dim()),
                (&l.w_gate_up, 2 * local.intermediate, h),
                (&l.w_down, h, local.intermediate),
            ];
            for (m, rows, cols) in shapes {
                matrix_bytes += m.bytes();
                if m.is_quantized() {
                    dequant_elems = dequant_elems.max(rows * cols);
                }
            }
        }
        let head = lm_head
            .as_ref()
            .or(token_embd.as_ref().filter(|_| shard.is_last_stage()));
        matrix_bytes += head.map_or(0, GpuMatrix::bytes);
        // A quantized LM head larger than the scratch runs a slab of rows at a time.
        if head.is_some_and(GpuMatrix::is_quantized) {
            dequant_elems = dequant_elems.max((local.vocab_size * h).min(LM_HEAD_SLAB_ELEMS));
        }
        let part_bytes = |m: &Linear, rows: usize, cols: usize| {
            (m.file_bytes() as f64 * (rows * cols) as f64 / (m.rows * m.cols).max(1) as f64) as u64
        };
        let (q_dim, kv_dim, mlp_cols) = (local.q_dim(), local.kv_dim(), local.intermediate);
        let mut file_bytes: u64 = shard
            .layers
            .clone()
            .map(|i| {
                let l = &w.layers[i];
                part_bytes(&l.wq, q_dim, h)
                    + part_bytes(&l.wk, kv_dim, h)
                    + part_bytes(&l.wv, kv_dim, h)
                    + part_bytes(&l.wo, h, q_dim)
                    + part_bytes(&l.w_gate, mlp_cols, h)
                    + part_bytes(&l.w_up, mlp_cols, h)
                    + part_bytes(&l.w_down, h, mlp_cols)
            })
            .sum();
        if shard.is_last_stage() {
            file_bytes += part_bytes(&w.lm_head, local.vocab_size, h);
        }
        let out = GpuWeights {
            token_embd,
            output_norm: gpu.upload(&w.output_norm, "the output norm")?,
            lm_head,
            layers,
            matrix_bytes,
            file_bytes,
            dtype,
            dequant_elems,
        };
        progress(total, total);
        Ok(out)
    }
}

/// One matrix of the stacked parts (same column count) under `quant`: a layer matrix (`layer`)
/// is FP8 for `fp8`, or for `auto` when every part came from an FP8 checkpoint; otherwise
/// quantized segments unless `none`, when every part can stay quantized; else dense (with a
/// warning naming a quantized tensor that could not stay so). Only bf16 computes with FP8 or
/// quantized matrices; the embeddings and LM head are never FP8.
fn upload_matrix(
    gpu: &Gpu,
    w: &ModelWeights,
    parts: &[Part],
    col_scale: Option<&[f32]>,
    dtype: ComputeDtype,
    (quant, layer): (GpuQuantization, bool),
    what: &str,
) -> Result<GpuMatrix, CudaError> {
    let bf16 = dtype == ComputeDtype::Bf16;
    let from_fp8 = parts.iter().all(|p| p.m.fp8_scales.is_some());
    let fp8 = layer && bf16 && (quant == GpuQuantization::Fp8 || (quant == GpuQuantization::Auto && from_fp8));
    if fp8 {
        let cols = parts[0].cols.len();
        if cols.is_multiple_of(FP8_COLUMNS) {
            return upload_fp8(gpu, w, parts, what);
        }
        tracing::warn!(
            "{what} stays {} on the GPU: FP8 matrices need a multiple of {FP8_COLUMNS} columns, not {cols}",
            dtype.as_str()
        );
    }
    if quant != GpuQuantization::None && bf16 {
        let formats: Result<Vec<QuantFormat>, Option<String>> = parts.iter().map(Part::quant_format).collect();
        match formats {
            Ok(formats) => return upload_quantized(gpu, w, parts, &formats, what).map(GpuMatrix::Quant),
            Err(Some(why)) => {
                let names: Vec<&str> = parts.iter().map(|p| p.m.info.name.as_str()).collect();
                tracing::warn!(
                    "{} is dequantized to {} on the GPU: {why}",
                    names.join(" + "),
                    dtype.as_str()
                );
            }
            Err(None) => {}
        }
    }
    upload_matrices(gpu, w, parts, col_scale, dtype, what).map(GpuMatrix::Dense)
}

/// Columns of an FP8 matrix are a multiple of this (fp8.cu's 16-byte loads, cuBLASLt's FP8).
const FP8_COLUMNS: usize = 16;

/// The stacked parts as FP8 E4M3 rows with a scale each: an FP8 checkpoint's own scale and bytes
/// (its bf16 values re-encode exactly), else max |value| / 448 of the row.
fn upload_fp8(gpu: &Gpu, w: &ModelWeights, parts: &[Part], what: &str) -> Result<GpuMatrix, CudaError> {
    let cols = parts[0].cols.len();
    let rows: usize = parts.iter().map(|p| p.rows.len()).sum();
    let weights = gpu.alloc(rows * cols, what)?;
    let mut scales = Vec::with_capacity(rows);
    // Converted in slabs of rows to bound host memory.
    let slab_rows = ((4 << 20) / cols.max(1)).max(1);
    let mut slab = vec![0u8; slab_rows * cols];
    let mut values = vec![0.0f32; cols];
    let mut offset = 0;
    for p in parts {
        let mut full = vec![0.0f32; p.m.cols];
        let checkpoint = p.m.fp8_scales.as_deref().filter(|s| !s.is_empty());
        let mut r = p.rows.start;
        while r < p.rows.end {
            let n = slab_rows.min(p.rows.end - r);
            for (i, out) in slab.chunks_exact_mut(cols).take(n).enumerate() {
                part_row(w, p, r + i, &mut full, &mut values);
                scales.push(encode_row(&values, checkpoint.map(|s| s[r + i]), out));
            }
            gpu.write(&weights, offset, &slab[..n * cols])?;
            offset += n * cols;
            r += n;
        }
    }
    let scales = gpu.upload(&scales, what)?;
    Ok(GpuMatrix::Fp8 { weights, scales })
}

/// Row `r` of part `p` (its columns) as f32 into `out`; `full` holds a whole row of the matrix.
fn part_row(w: &ModelWeights, p: &Part, r: usize, full: &mut [f32], out: &mut [f32]) {
    let m = p.m;
    if m.info.ty == GgmlType::BF16 {
        w.with_file_rows(m, r..r + 1, |row| {
            let src = &row[p.cols.start * 2..p.cols.end * 2];
            for (d, s) in out.iter_mut().zip(src.chunks_exact(2)) {
                *d = bf16::from_le_bytes([s[0], s[1]]).to_f32();
            }
        });
    } else {
        w.row_f32(m, r, full);
        out.copy_from_slice(&full[p.cols.clone()]);
    }
}

/// The parts' file blocks in quant.cu's layout, consecutive parts of one format in one segment.
fn upload_quantized(
    gpu: &Gpu,
    w: &ModelWeights,
    parts: &[Part],
    formats: &[QuantFormat],
    what: &str,
) -> Result<Vec<QuantSegment>, CudaError> {
    let mut segments: Vec<QuantSegment> = Vec::new();
    let mut first_row = 0;
    let mut i = 0;
    while i < parts.len() {
        let format = formats[i];
        let mut j = i;
        while j < parts.len() && formats[j] == format {
            j += 1;
        }
        let group = &parts[i..j];
        let rows: usize = group.iter().map(|p| p.rows.len()).sum();
        let cols = group[0].cols.len();
        let (bl, bb) = (format.block_len(), format.block_bytes());
        let row_blocks = cols / bl;
        let buf = gpu.alloc(rows * row_blocks * bb, what)?;
        let mut err = None;
        let mut put = |at: usize, bytes: &[u8]| {
            if err.is_none() {
                err = gpu.write(&buf, at, bytes).err();
            }
        };
        let mut row = 0;
        for p in group {
            let file_row = (p.m.cols / bl) * bb;
            let (c0, c1) = (p.cols.start / bl * bb, p.cols.end / bl * bb);
            // In slabs of rows to bound host memory.
            let slab_rows = ((4 << 20) / (row_blocks * bb).max(1)).max(1);
            let mut r = p.rows.start;
            while r < p.rows.end {
                let n = slab_rows.min(p.rows.end - r);
                let slab: Vec<u8> = w.with_file_rows(p.m, r..r + n, |bytes| {
                    bytes
                        .chunks_exact(file_row)
                        .flat_map(|row| &row[c0..c1])
                        .copied()
                        .collect()
                });
                format.place_rows(&slab, row_blocks, row, rows, &mut put);
                row += n;
                r += n;
            }
        }
        if let Some(e) = err {
            return Err(e);
        }
        segments.push(QuantSegment {
            format,
            buf,
            first_row,
            rows,
        });
        first_row += rows;
        i = j;
    }
    Ok(segments)
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
    let mut values = vec![0.0f32; cols];
    for p in parts {
        let mut full = vec![0.0f32; p.m.cols];
        let unit = vec![1.0f32; cols];
        let scale = col_scale.map_or(&unit[..], |g| &g[p.cols.clone()]);
        let mut r = p.rows.start;
        while r < p.rows.end {
            let n = slab_rows.min(p.rows.end - r);
            for i in 0..n {
                let out = &mut slab[i * cols..(i + 1) * cols];
                part_row(w, p, r + i, &mut full, &mut values);
                for ((d, s), g) in out.iter_mut().zip(&values).zip(scale) {
                    *d = convert(s * g);
                }
            }
            gpu.write(&buf, offset, &slab[..n * cols])?;
            offset += n * cols * elem;
            r += n;
        }
    }
    Ok(buf)
}
