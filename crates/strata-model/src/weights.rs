//! Weights of a llama-family model: matrices in their file type (quantized) in one arena,
//! norms and biases widened to f32. The arena is anonymous memory on 2 MiB pages where the OS allows.

use std::collections::BTreeSet;
use std::sync::Arc;

use strata_formats::gguf::{GgufFile, TensorInfo};
use strata_formats::quant::dequantize;
use strata_formats::safetensors::{Dtype, SafetensorsSet};
use strata_formats::GgmlType;
use strata_runtime::cpu::quant_dot::{cpu_layout, WeightLayout};
use strata_runtime::cpu::WeightMatrix;

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::fp8::{scale_values, Fp8Checkpoint, Fp8Scales};

thread_local! {
    /// Row-grouped rows unpacked to the file's layout, for [`ModelWeights::with_file_rows`].
    static UNPACKED_ROWS: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A matrix of `rows` outputs by `cols` inputs, in the file's storage type.
#[derive(Debug, Clone)]
pub struct Linear {
    pub info: TensorInfo,
    pub rows: usize,
    pub cols: usize,
    /// Where its bytes start in the weight arena.
    pub arena_offset: usize,
    /// The file stored it as FP8 E4M3 (the arena holds it as bf16): with these per-row scales,
    /// with which the bf16 values re-encode to the file's bytes, or none (empty) for block
    /// scales, re-encoded per row; `None` for matrices not stored as FP8.
    pub fp8_scales: Option<Vec<f32>>,
    /// How its bytes sit in the arena: the layout the CPU's kernel for its type reads.
    pub layout: WeightLayout,
}

impl Linear {
    /// Bytes the matrix takes in its file: its arena bytes, or a byte a weight for FP8 (held
    /// as bf16 in the arena).
    pub fn file_bytes(&self) -> u64 {
        match self.fp8_scales {
            Some(_) => (self.rows * self.cols) as u64,
            None => self.info.n_bytes,
        }
    }

    /// Bytes the matrix takes in the arena (its layout's padding included).
    pub fn arena_bytes(&self) -> usize {
        self.layout.matrix_bytes(self.info.ty, self.rows, self.cols)
    }
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

    /// The bytes of `l`, in `l.layout`.
    pub fn bytes(&self, l: &Linear) -> &[u8] {
        &self.map[l.arena_offset..l.arena_offset + l.arena_bytes()]
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

/// A tensor of the model, whatever a file format calls it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    TokenEmbd,
    Output,
    OutputNorm,
    AttnNorm,
    Q,
    K,
    V,
    O,
    QBias,
    KBias,
    VBias,
    QNorm,
    KNorm,
    FfnNorm,
    Gate,
    Up,
    Down,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 17] = [
        Role::TokenEmbd,
        Role::Output,
        Role::OutputNorm,
        Role::AttnNorm,
        Role::Q,
        Role::K,
        Role::V,
        Role::O,
        Role::QBias,
        Role::KBias,
        Role::VBias,
        Role::QNorm,
        Role::KNorm,
        Role::FfnNorm,
        Role::Gate,
        Role::Up,
        Role::Down,
    ];

    /// Its names in GGUF and in HF checkpoints, and whether it is one per layer.
    fn names(self) -> (&'static str, &'static str, bool) {
        match self {
            Role::TokenEmbd => ("token_embd.weight", "model.embed_tokens.weight", false),
            Role::Output => ("output.weight", "lm_head.weight", false),
            Role::OutputNorm => ("output_norm.weight", "model.norm.weight", false),
            Role::AttnNorm => ("attn_norm.weight", "input_layernorm.weight", true),
            Role::Q => ("attn_q.weight", "self_attn.q_proj.weight", true),
            Role::K => ("attn_k.weight", "self_attn.k_proj.weight", true),
            Role::V => ("attn_v.weight", "self_attn.v_proj.weight", true),
            Role::O => ("attn_output.weight", "self_attn.o_proj.weight", true),
            Role::QBias => ("attn_q.bias", "self_attn.q_proj.bias", true),
            Role::KBias => ("attn_k.bias", "self_attn.k_proj.bias", true),
            Role::VBias => ("attn_v.bias", "self_attn.v_proj.bias", true),
            Role::QNorm => ("attn_q_norm.weight", "self_attn.q_norm.weight", true),
            Role::KNorm => ("attn_k_norm.weight", "self_attn.k_norm.weight", true),
            Role::FfnNorm => ("ffn_norm.weight", "post_attention_layernorm.weight", true),
            Role::Gate => ("ffn_gate.weight", "mlp.gate_proj.weight", true),
            Role::Up => ("ffn_up.weight", "mlp.up_proj.weight", true),
            Role::Down => ("ffn_down.weight", "mlp.down_proj.weight", true),
        }
    }

    /// Its name in a GGUF file (`layer` counts for per-layer tensors only).
    pub fn gguf_name(self, layer: usize) -> String {
        self.name_in(false, layer)
    }

    /// Its name in an HF checkpoint of the llama family (`layer` counts for per-layer tensors only).
    pub fn hf_name(self, layer: usize) -> String {
        self.name_in(true, layer)
    }

    /// The layer a per-layer tensor name belongs to (`blk.N.*` in GGUF, `model.layers.N.*` in HF).
    pub fn layer_of(name: &str, hf: bool) -> Option<usize> {
        name.strip_prefix(layer_prefix(hf))?.split('.').next()?.parse().ok()
    }

    fn name_in(self, hf: bool, layer: usize) -> String {
        let (gguf_name, hf_name, per_layer) = self.names();
        let name = if hf { hf_name } else { gguf_name };
        if per_layer {
            format!("{}{layer}.{name}", layer_prefix(hf))
        } else {
            name.to_string()
        }
    }
}

/// What every per-layer tensor name starts with, before the layer number.
fn layer_prefix(hf: bool) -> &'static str {
    if hf {
        "model.layers."
    } else {
        "blk."
    }
}

/// Where weights come from: a file format's tensor names and the bytes behind them.
pub trait TensorSource {
    /// The name of `role` (of layer `layer`, for per-layer tensors) in this format.
    fn name(&self, role: Role, layer: usize) -> String;
    /// The descriptor and bytes of the tensor `name`; `Ok(None)` when there is none, an error
    /// when it exists in a form strata cannot use.
    fn tensor(&self, name: &str) -> Result<Option<(TensorInfo, &[u8])>, ModelError>;
    /// The matrix `name` when the file stores it as FP8 E4M3 with scales; `None` otherwise.
    fn fp8(&self, _name: &str) -> Result<Option<Fp8Matrix<'_>>, ModelError> {
        Ok(None)
    }
}

/// An FP8 matrix of a file: its E4M3 bytes (rows x columns) and their scales; `info` describes
/// it as the bf16 matrix it is dequantized to.
pub struct Fp8Matrix<'a> {
    pub info: TensorInfo,
    pub bytes: &'a [u8],
    pub scales: Fp8Scales,
}

/// A GGUF file's tensors.
struct GgufSource<'a>(&'a GgufFile);

impl TensorSource for GgufSource<'_> {
    fn name(&self, role: Role, layer: usize) -> String {
        role.gguf_name(layer)
    }

    fn tensor(&self, name: &str) -> Result<Option<(TensorInfo, &[u8])>, ModelError> {
        Ok(self.0.tensor(name).map(|t| (t.clone(), self.0.tensor_data(t))))
    }
}

/// The safetensors files of an HF checkpoint, and its FP8 layout when config.json has one.
struct SafetensorsSource<'a> {
    set: &'a SafetensorsSet,
    fp8: Option<&'a Fp8Checkpoint>,
}

impl TensorSource for SafetensorsSource<'_> {
    fn name(&self, role: Role, layer: usize) -> String {
        role.hf_name(layer)
    }

    fn tensor(&self, name: &str) -> Result<Option<(TensorInfo, &[u8])>, ModelError> {
        match self.set.get(name) {
            None => Ok(None),
            Some((file, t)) => Ok(Some((t.tensor_info()?, file.data(t)))),
        }
    }

    fn fp8(&self, name: &str) -> Result<Option<Fp8Matrix<'_>>, ModelError> {
        let Some((file, t)) = self.set.get(name).filter(|(_, t)| t.dtype == Dtype::F8E4M3) else {
            return Ok(None);
        };
        let bad = |reason: String| ModelError::BadTensor {
            name: name.into(),
            reason,
        };
        let Some(layout) = self.fp8 else {
            return Err(bad(
                "is F8_E4M3 but config.json has no quantization_config saying how it is scaled".into(),
            ));
        };
        let &[rows, cols] = &t.shape[..] else {
            return Err(bad(format!(
                "is an F8_E4M3 tensor of shape {:?}, not a matrix",
                t.shape
            )));
        };
        let scale_name = layout.scale_name(name);
        let (sf, st) = self
            .set
            .get(&scale_name)
            .ok_or_else(|| bad(format!("is F8_E4M3 without its scale tensor {scale_name}")))?;
        let sinfo = st.tensor_info()?;
        let scales = scale_values(sinfo.ty, sinfo.n_elements as usize, sf.data(st))
            .and_then(|v| layout.scales(&st.shape, v, rows as usize, cols as usize))
            .map_err(|e| bad(format!("scale tensor {scale_name} {e}")))?;
        let info = TensorInfo {
            name: name.into(),
            dims: vec![cols, rows],
            ty: GgmlType::BF16,
            offset: 0,
            n_elements: rows * cols,
            n_bytes: 2 * rows * cols,
        };
        Ok(Some(Fp8Matrix {
            info,
            bytes: file.data(t),
            scales,
        }))
    }
}

impl ModelWeights {
    /// Finds and checks every tensor the architecture needs in a GGUF file and copies the
    /// matrices into the arena; `progress(done, total)` reports bytes copied.
    pub fn from_gguf(
        file: Arc<GgufFile>,
        c: &ModelConfig,
        progress: &dyn Fn(u64, u64),
    ) -> Result<ModelWeights, ModelError> {
        Self::from_source(&GgufSource(&file), c, progress)
    }

    /// Like [`Self::from_gguf`] for the safetensors files of an HF checkpoint. Matrices keep
    /// their dtype (BF16, F16 or F32) in the arena; FP8 ones (laid out as `fp8` says) are
    /// dequantized to BF16, keeping their per-row scales.
    pub fn from_safetensors(
        set: &SafetensorsSet,
        fp8: Option<&Fp8Checkpoint>,
        c: &ModelConfig,
        progress: &dyn Fn(u64, u64),
    ) -> Result<ModelWeights, ModelError> {
        Self::from_source(&SafetensorsSource { set, fp8 }, c, progress)
    }

    /// The one list of the tensors a llama-family model is made of.
    pub fn from_source(
        src: &dyn TensorSource,
        c: &ModelConfig,
        progress: &dyn Fn(u64, u64),
    ) -> Result<ModelWeights, ModelError> {
        let token_embd = linear(src, &src.name(Role::TokenEmbd, 0), c.vocab_size, c.hidden)?;
        let lm_head = if c.tied_embeddings {
            token_embd.clone()
        } else {
            linear(src, &src.name(Role::Output, 0), c.vocab_size, c.hidden)?
        };
        let output_norm = vector(src, &src.name(Role::OutputNorm, 0), c.hidden)?;
        // Grown as layers are found, not reserved from the metadata's count.
        let mut layers = Vec::new();
        for i in 0..c.n_layers {
            let mat = |role: Role, rows: usize, cols: usize| linear(src, &src.name(role, i), rows, cols);
            let vec = |role: Role, len: usize| vector(src, &src.name(role, i), len);
            let opt_vec = |role: Role, len: usize, present: bool| present.then(|| vec(role, len)).transpose();
            layers.push(LayerWeights {
                attn_norm: vec(Role::AttnNorm, c.hidden)?,
                wq: mat(Role::Q, c.q_dim(), c.hidden)?,
                wk: mat(Role::K, c.kv_dim(), c.hidden)?,
                wv: mat(Role::V, c.kv_dim(), c.hidden)?,
                wo: mat(Role::O, c.hidden, c.q_dim())?,
                bq: opt_vec(Role::QBias, c.q_dim(), c.arch.qkv_bias)?,
                bk: opt_vec(Role::KBias, c.kv_dim(), c.arch.qkv_bias)?,
                bv: opt_vec(Role::VBias, c.kv_dim(), c.arch.qkv_bias)?,
                q_norm: opt_vec(Role::QNorm, c.head_dim, c.arch.qk_norm)?,
                k_norm: opt_vec(Role::KNorm, c.head_dim, c.arch.qk_norm)?,
                ffn_norm: vec(Role::FfnNorm, c.hidden)?,
                w_gate: mat(Role::Gate, c.intermediate, c.hidden)?,
                w_up: mat(Role::Up, c.intermediate, c.hidden)?,
                w_down: mat(Role::Down, c.hidden, c.intermediate)?,
            });
        }
        let mut weights = ModelWeights {
            arena: WeightArena::new(0)?,
            token_embd,
            output_norm,
            lm_head,
            layers,
        };
        weights.fill_arena(src, progress)?;
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

    /// Lays the matrices out in a new arena and copies their bytes from the file, a matrix at a
    /// time on every core: packing into the CPU's layout and faulting in the arena's pages are
    /// the whole load of a large file (one core took 3.5 s for an 852 MB Q4_K_M here).
    fn fill_arena(&mut self, src: &dyn TensorSource, progress: &dyn Fn(u64, u64)) -> Result<(), ModelError> {
        let tied = self.lm_head.info.name == self.token_embd.info.name;
        let mut len = 0usize;
        let mut offsets: Vec<usize> = Vec::new();
        for (i, m) in self.matrices_mut().into_iter().enumerate() {
            if m.fp8_scales.is_none() {
                m.layout = cpu_layout(m.info.ty);
            }
            if i == 1 && tied {
                offsets.push(offsets[0]);
                continue;
            }
            offsets.push(len);
            len += m.arena_bytes().next_multiple_of(ARENA_ALIGN);
        }
        let mut arena = WeightArena::new(len)?;
        // Each stored matrix with its source and its own slice of the arena (in offset order).
        let mut jobs: Vec<(ArenaSource, &Linear, &mut [u8])> = Vec::new();
        let mut rest: &mut [u8] = &mut arena.map[..];
        let mut at = 0usize;
        for (i, (m, off)) in self.matrices_mut().into_iter().zip(offsets).enumerate() {
            m.arena_offset = off;
            if i == 1 && tied {
                continue;
            }
            let source = match src.fp8(&m.info.name)? {
                Some(f) => ArenaSource::Fp8(f),
                None => ArenaSource::File(find(src, &m.info.name)?.1),
            };
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(off - at);
            let (dst, tail) = tail.split_at_mut(m.arena_bytes());
            rest = tail;
            at = off + m.arena_bytes();
            jobs.push((source, &*m, dst));
        }
        let total = len as u64;
        let done = std::sync::atomic::AtomicU64::new(0);
        let next = std::sync::Mutex::new(jobs.into_iter());
        // Takes the next matrix and fills its slice; false when none is left.
        let fill_next = || {
            let job = next.lock().unwrap_or_else(|e| e.into_inner()).next();
            let Some((source, m, dst)) = job else { return false };
            match source {
                ArenaSource::Fp8(f) => f.scales.dequantize_to_bf16(f.bytes, m.cols, dst),
                ArenaSource::File(bytes) => m.layout.pack(m.info.ty, m.rows, m.cols, bytes, dst),
            }
            done.fetch_add(dst.len() as u64, std::sync::atomic::Ordering::Relaxed);
            true
        };
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::thread::scope(|scope| {
            for _ in 1..threads {
                scope.spawn(|| while fill_next() {});
            }
            // This thread fills too, and reports after each matrix it finishes.
            while fill_next() {
                progress(done.load(std::sync::atomic::Ordering::Relaxed), total);
            }
        });
        progress(total, total);
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
        self.with_file_rows(l, row..row + 1, |bytes| dequantize(l.info.ty, bytes, out))
            .expect("row size was checked when the weights were loaded");
    }

    /// `f` of the file's bytes of rows `rows` of `l` (what the GPU uploads, an embedding
    /// lookup): borrowed from the arena, or unpacked from the CPU's row groups into this thread's
    /// buffer (no allocation a token; the buffer keeps its largest size, at most a GPU upload's
    /// slab of a few MiB). `f` must not call it again.
    pub fn with_file_rows<R>(&self, l: &Linear, rows: std::ops::Range<usize>, f: impl FnOnce(&[u8]) -> R) -> R {
        let bytes = self.arena.bytes(l);
        let rb = l.arena_bytes() / l.layout.stored_rows(l.rows);
        match l.layout {
            WeightLayout::File => f(&bytes[rows.start * rb..rows.end * rb]),
            grouped => UNPACKED_ROWS.with_borrow_mut(|buf| {
                buf.resize(rows.len() * rb, 0);
                grouped.unpack_rows(l.info.ty, l.cols, bytes, rows, buf);
                f(buf)
            }),
        }
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

/// Errors unless the tensors named `names` belong to every one of the `n_layers` layers the
/// metadata key `key` declares, so that nothing is sized by a layer count the file cannot back.
pub fn check_layer_count<'a>(
    n_layers: usize,
    names: impl Iterator<Item = &'a str>,
    hf: bool,
    key: &str,
) -> Result<(), String> {
    let found: BTreeSet<usize> = names
        .filter_map(|n| Role::layer_of(n, hf))
        .filter(|&l| l < n_layers)
        .collect();
    let Some(missing) = (0..n_layers).find(|l| !found.contains(l)) else {
        return Ok(());
    };
    Err(format!(
        "{key} = {n_layers}, but the model's tensors cover {} of those layers (there is no {}{missing}.*); \
         the file is corrupt or not what its metadata says",
        found.len(),
        layer_prefix(hf)
    ))
}

/// Where a matrix's arena bytes come from: the file's FP8 matrix (dequantized to bf16) or its
/// bytes (packed into the CPU's layout).
enum ArenaSource<'a> {
    Fp8(Fp8Matrix<'a>),
    File(&'a [u8]),
}

fn find<'a>(src: &'a dyn TensorSource, name: &str) -> Result<(TensorInfo, &'a [u8]), ModelError> {
    src.tensor(name)?.ok_or_else(|| ModelError::BadTensor {
        name: name.into(),
        reason: "missing from the model's files".into(),
    })
}

fn linear(src: &dyn TensorSource, name: &str, rows: usize, cols: usize) -> Result<Linear, ModelError> {
    let bad = |reason: String| ModelError::BadTensor {
        name: name.into(),
        reason,
    };
    if let Some(f) = src.fp8(name)? {
        if f.info.dims != [cols as u64, rows as u64] {
            return Err(bad(format!(
                "shape [{}, {}] (rows x columns), expected [{rows}, {cols}]",
                f.info.dims[1], f.info.dims[0]
            )));
        }
        return Ok(Linear {
            info: f.info,
            rows,
            cols,
            arena_offset: 0,
            fp8_scales: Some(f.scales.per_row().unwrap_or_default()),
            layout: WeightLayout::File,
        });
    }
    let (t, data) = find(src, name)?;
    if t.dims.len() != 2 || t.dims[0] != cols as u64 || t.dims[1] != rows as u64 {
        let shape: Vec<u64> = t.dims.iter().rev().copied().collect();
        return Err(bad(format!(
            "shape {shape:?} (rows x columns), expected [{rows}, {cols}]"
        )));
    }
    WeightMatrix::check_size(t.ty, rows, cols, WeightLayout::File, data.len()).map_err(|e| bad(e.to_string()))?;
    if !t.ty.can_dequantize() {
        return Err(bad(format!("type {} cannot be dequantized", t.ty)));
    }
    Ok(Linear {
        info: t,
        rows,
        cols,
        arena_offset: 0,
        fp8_scales: None,
        layout: WeightLayout::File,
    })
}

fn vector(src: &dyn TensorSource, name: &str, len: usize) -> Result<Vec<f32>, ModelError> {
    let (t, data) = find(src, name)?;
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
    dequantize(t.ty, data, &mut out).map_err(|e| bad(e.to_string()))?;
    Ok(out)
}
