//! The forward pass through a shard's layers on the GPU: embedding (or the previous stage's
//! residual), then per layer an attention block and an MLP block, each product on the path chosen once per step.

use strata_runtime::cpu::ops::RopeLayout;
use strata_runtime::cuda::gemm_call::{FO_MAX_CHUNKS, GEMV_KERNEL_TOKENS};
use strata_runtime::cuda::{
    gemv_kernels, prefill_attention_fits, AttentionCall, Communicator, CudaError, DequantCall, DeviceBuffer,
    EmbeddingCall, FixedOrderGemmCall, Fp8Gemv, Fp8GemvQkvRopeCall, GemmOut, GemvCall, GemvQkvRopeCall,
    GemvResidualCall, GemvSiluCall, Gpu, NormCall, NormOp, PrefillAttentionCall, QuantEmbeddingCall, QuantFormat,
    QuantGemmCall, QuantGemmPairCall, QuantGemmReduceCall, QuantGemmTile, QuantGemvCall, QuantGemvResidualCall,
    QuantGemvSiluCall, QuantizeQ8Call, RopeCall, RopeKernel, SiluMulCall, SumRanksCall, TmaMap, QGEMM_K,
};

use crate::config::ModelConfig;
use crate::kv_cache::KvCacheDtype;

use super::forward::{GpuTransformer, SplitSums};
use super::knobs::GpuKnobs;
use super::weights::{ComputeDtype, GpuMatrix, MatrixView, SegmentView};
use strata_runtime::cuda::gemm_call::NORM_SUMS_BYTES;

/// Most parts one token's attention context is split into (flash-decoding style).
pub(super) const MAX_PARTS: usize = 16;
/// Batches of at most this many tokens may split attention over the context (few blocks otherwise).
pub(super) const SPLIT_MAX_TOKENS: usize = 64;
/// Parts the reduction of every GEMM is cut into under `--deterministic`: the largest TP size
/// whose results equal one GPU's bit for bit.
pub(super) const DETERMINISTIC_CHUNKS: usize = FO_MAX_CHUNKS;
/// The attention kernels of this model, cache type, dtype and GPU.
pub(super) struct AttentionKernels {
    /// On tensor cores (`paged_attention_mma_*`: head sizes 64 and 128; bf16 from sm_80, fp8
    /// from sm_89) unless `STRATA_ATTENTION=simt` asks for the CUDA-core kernel (measurements)
    /// or the dtype is float32 (`paged_attention_f32`).
    kernel: &'static str,
    /// Decode steps of more than [`SPLIT_MAX_TOKENS`] tokens run the tensor-core kernel with its
    /// tiles staged through shared memory (`paged_attention_staged_*`), this many stages a warp.
    staged: Option<(&'static str, usize)>,
    /// Prompt steps may take `paged_attention_prefill_bf16` or `_fp8` (tiles of query tokens:
    /// mma.sync, ldmatrix and cp.async, sm_80 on; head_dim a multiple of 16 up to 128).
    prompt_tiles: bool,
}

impl AttentionKernels {
    pub(super) fn choose(gpu: &Gpu, c: &ModelConfig, bf16: bool, fp8: bool, knobs: &GpuKnobs) -> AttentionKernels {
        let cc = gpu.info.compute_capability;
        let mma =
            bf16 && matches!(c.head_dim, 64 | 128) && cc >= if fp8 { (8, 9) } else { (8, 0) } && !knobs.simt_attention;
        let kernel = match (fp8, mma) {
            _ if !bf16 => "paged_attention_f32",
            (true, true) => "paged_attention_mma_fp8",
            (true, false) => "paged_attention_fp8",
            (false, true) => "paged_attention_mma_bf16",
            (false, false) => "paged_attention_bf16",
        };
        let staged = (mma && knobs.attention_stages > 0).then(|| {
            let name = if fp8 {
                "paged_attention_staged_fp8"
            } else {
                "paged_attention_staged_bf16"
            };
            (name, knobs.attention_stages)
        });
        let prompt_tiles = bf16
            && cc >= (8, 0)
            && prefill_attention_fits(c.head_dim)
            && knobs.prefill_attention
            && !knobs.simt_attention;
        AttentionKernels {
            kernel,
            staged,
            prompt_tiles,
        }
    }
}

/// How a step's products run, chosen once per step from its size.
#[derive(Clone, Copy)]
pub(super) struct StepPath {
    /// The products are gemm.cu's decode GEMVs (compiled for the step's token count); otherwise
    /// cuBLASLt, or the fixed-order GEMM under `--deterministic`.
    gemv: bool,
    /// The QKV GEMV also applies RoPE and writes the cache (`gemv_qkv_rope_t*`).
    qkv_rope: bool,
    /// The RMSNorms ride the GEMVs (each writes the sums the next one scales by) instead of
    /// running as norm kernels.
    carried_norms: bool,
}

impl StepPath {
    /// Whether a product over `k` inputs runs as a GEMV (their loads need k a multiple of 8).
    pub(super) fn gemv_for(&self, k: usize) -> bool {
        self.gemv && k.is_multiple_of(8)
    }

    /// Whether a product over `k` inputs runs as cuBLASLt (what `tune_decode_gemms` times).
    pub(super) fn uses_cublaslt(&self, k: usize) -> bool {
        !self.gemv_for(k)
    }
}

impl GpuTransformer {
    /// The path of a step of `t` tokens.
    pub(super) fn step_path(&self, t: usize) -> StepPath {
        let c = &self.local;
        let gemv = !self.deterministic
            && self.weights.dtype == ComputeDtype::Bf16
            && t <= self.knobs.gemv_max_tokens
            && gemv_kernels(t).is_some();
        let path = StepPath {
            gemv,
            qkv_rope: false,
            carried_norms: false,
        };
        // RoPE and the cache write fit the QKV GEMV with a bf16 cache, no per-head q/k norm
        // (Qwen3), even head and rotary widths, over bf16 or FP8 rows.
        let qkv_rope = self.knobs.fuse_rope
            && self.kv.dtype != KvCacheDtype::Fp8E4m3
            && !c.arch.qk_norm
            && c.head_dim.is_multiple_of(2)
            && c.rope.dim.is_multiple_of(2)
            && c.rope.dim <= c.head_dim
            && path.gemv_for(c.hidden)
            && self.weights.layers.iter().all(|l| match l.wqkv.view() {
                MatrixView::Dense(_) => true,
                MatrixView::Fp8(_) => self.knobs.fp8_qkv_rope && self.knobs.fp8_gemv == Fp8Gemv::Lanes,
                MatrixView::Quant(_) => false,
            });
        // Norms ride the GEMVs when every product of the layer is one and the o and down outputs
        // are whole on this GPU (no TP all-reduce before the residual).
        let carried_norms = self.knobs.fuse_norm
            && self.comms.tp.is_none()
            && self.weights.layer_matrices_uniform()
            && [c.hidden, c.q_dim(), c.intermediate].iter().all(|&k| path.gemv_for(k));
        StepPath {
            qkv_rope,
            carried_norms,
            ..path
        }
    }

    /// Embedding (first stage) or the previous stage's residual, then this shard's layers for the
    /// first `t` staged tokens; leaves the residual in `x` and hands it to the next stage.
    pub(super) fn layers(&mut self, t: usize, parts: usize) -> Result<(), CudaError> {
        let path = self.step_path(t);
        // Sums a failed step left pending belong to no reader.
        self.split_sums = None;
        self.embed_or_receive(t)?;
        if path.carried_norms {
            self.gpu.zero(&self.bufs.norm_sums, 0, self.bufs.norm_sums.bytes())?;
        }
        for li in 0..self.local.n_layers {
            self.attention_block(li, t, parts, &path)?;
            self.mlp_block(li, t, &path)?;
        }
        if !path.carried_norms {
            // The last block's output into the residual.
            let (delta, splits) = self.take_proj();
            self.norm_call(NormOp::Add { delta, splits }, t, 0)
                .launch_with(self.launcher())?;
        }
        if !self.shard.is_last_stage() {
            let stage = self.shard_stage();
            self.pp_comm()?
                .send_f32(&self.gpu, &self.bufs.x, t * self.local.hidden, stage + 1)?;
        }
        Ok(())
    }

    /// The token embeddings of this GPU's vocabulary slice (summed over the TP group), or the
    /// residual the previous pipeline stage sends.
    fn embed_or_receive(&mut self, t: usize) -> Result<(), CudaError> {
        let h = self.local.hidden;
        match (
            self.weights.token_embd.as_ref().map(GpuMatrix::view),
            self.shard.is_first_stage(),
        ) {
            (Some(embd), true) => {
                let vocab = self.shard.vocab(&self.config);
                let tokens = self.bufs.inputs.at(self.inputs.layout.tokens * 4);
                match embd {
                    MatrixView::Dense(table) => EmbeddingCall {
                        table,
                        tokens,
                        out: self.bufs.x.ptr(),
                        hidden: h as i32,
                        vocab_start: vocab.start as i32,
                        vocab_rows: vocab.len() as i32,
                        rows: t,
                        float32: self.float32(),
                    }
                    .launch_with(self.launcher())?,
                    MatrixView::Fp8(_) => {
                        return Err(CudaError::NoDevice(
                            "an FP8 embedding table has no lookup kernel (weights.rs keeps it as shipped)".into(),
                        ))
                    }
                    // One segment: the table is one tensor.
                    MatrixView::Quant(_) => {
                        for seg in embd.segments() {
                            QuantEmbeddingCall {
                                format: seg.format,
                                table: seg.ptr,
                                tokens,
                                out: self.bufs.x.ptr(),
                                hidden: h as i32,
                                vocab_start: vocab.start as i32,
                                vocab_rows: vocab.len() as i32,
                                rows: t,
                            }
                            .launch_with(self.launcher())?;
                        }
                    }
                }
                self.all_reduce(&self.bufs.x, t * h)
            }
            _ => {
                let stage = self.shard_stage();
                self.pp_comm()?.recv_f32(&self.gpu, &self.bufs.x, t * h, stage - 1)
            }
        }
    }

    /// Attention block of layer `li`: norm, QKV with RoPE and the cache write, paged attention,
    /// output projection.
    fn attention_block(&mut self, li: usize, t: usize, parts: usize, path: &StepPath) -> Result<(), CudaError> {
        let norm_in = self.block_norm(2 * li, t, path)?;
        self.qkv_rope_cache_write(li, t, path, norm_in)?;
        self.paged_attention(li, t, parts)?;
        let (wo, attn) = (self.weights.layers[li].wo.view(), self.bufs.attn.ptr());
        let shape = (self.local.hidden, self.local.q_dim(), t);
        self.block_output(2 * li, wo, attn, shape, path)
    }

    /// MLP block of layer `li`: norm, gate/up with SiLU, down projection.
    fn mlp_block(&mut self, li: usize, t: usize, path: &StepPath) -> Result<(), CudaError> {
        let (hidden, inter) = (self.local.hidden, self.local.intermediate);
        let norm_in = self.block_norm(2 * li + 1, t, path)?;
        let lw = &self.weights.layers[li];
        let (wgu, wdown) = (lw.w_gate_up.view(), lw.w_down.view());
        let (xn, gate_up, act) = (self.bufs.xn.ptr(), self.bufs.gate_up.ptr(), self.bufs.act.ptr());
        let one_segment = match wgu {
            MatrixView::Quant([Some(seg), None, None]) => Some(seg),
            _ => None,
        };
        let eps = self.local.rms_eps;
        if let (MatrixView::Dense(w), true) = (wgu, path.gemv_for(hidden)) {
            GemvSiluCall {
                w,
                x: xn,
                out: act,
                inter: inter as i32,
                k: hidden as i32,
                t: t as i32,
                norm_in,
                eps,
            }
            .launch_with(self.launcher())?;
        } else if let (Some(seg), true) = (one_segment, path.gemv_for(hidden) && !self.deterministic) {
            let (x, x_scales) = self.quantize_activations(xn, hidden, t)?;
            QuantGemvSiluCall {
                format: seg.format,
                w: seg.ptr,
                x,
                x_scales,
                two_pass: self.two_pass_activations as i32,
                out: act,
                inter: inter as i32,
                k: hidden as i32,
                t: t as i32,
                norm_in,
                eps,
            }
            .launch_with(self.launcher())?;
        } else if let (MatrixView::Fp8(f), true) = (wgu, path.gemv_for(hidden) && !self.deterministic) {
            self.fp8_gemv_silu(f, (xn, act), (inter, hidden, t), norm_in)?;
        } else {
            // FP8 on tensor cores: the product, its scales, SiLU and the down product's input in two launches.
            let fused = match wgu {
                MatrixView::Fp8(f) => self.fp8_gate_up_silu(f, (xn, gate_up, act), (inter, hidden, t), path)?,
                _ => false,
            };
            if !fused {
                self.matmul(wgu, xn, gate_up, (2 * inter, hidden, t), GemmOut::Bf16, path, 0)?;
                SiluMulCall {
                    gate_up,
                    out: act,
                    inter: inter as i32,
                    tokens: t,
                    float32: self.float32(),
                }
                .launch_with(self.launcher())?;
            }
        }
        self.block_output(2 * li + 1, wdown, act, (hidden, inter, t), path)
    }

    /// The input norm of block `i` (2 * layer: attention, 2 * layer + 1: MLP), into `xn`. The
    /// first norms the embeddings; the others first add the previous block's output into the
    /// residual. With carried norms, the GEMVs that read `xn` scale by the norm's sums, which
    /// this returns (0: none).
    /// Where the FP8 matrix after it runs on FP8 tensor cores, the norm also writes its rows as
    /// E4M3 for that product.
    fn block_norm(&mut self, i: usize, t: usize, path: &StepPath) -> Result<u64, CudaError> {
        self.fp8_rows_ready = None;
        if path.carried_norms && i > 0 {
            return Ok(self.norm_sums(i));
        }
        let op = match i {
            0 => NormOp::Norm,
            _ => {
                let (delta, splits) = self.take_proj();
                NormOp::AddNorm { delta, splits }
            }
        };
        let fp8 = self.fp8_norm_output(i, path);
        let call = NormCall {
            fp8,
            ..self.norm_call(op, t, self.norm_weight(i))
        };
        call.launch_with(self.launcher())?;
        if fp8.is_some() {
            self.fp8_rows_ready = Some((call.out, self.local.hidden, t));
        }
        Ok(0)
    }

    /// The FP8 tensor-core input of block `i`'s first matrix (QKV, or gate/up) when it is FP8
    /// and runs there, for its norm to write.
    fn fp8_norm_output(&self, i: usize, path: &StepPath) -> Option<(u64, u64)> {
        let fused = self.knobs.fuse_fp8 && !self.float32();
        let layer = self.weights.layers.get(i / 2).filter(|_| fused)?;
        let c = &self.local;
        let (w, n) = match i % 2 {
            0 => (layer.wqkv.view(), c.q_dim() + 2 * c.kv_dim()),
            _ => (layer.w_gate_up.view(), 2 * c.intermediate),
        };
        match w {
            MatrixView::Fp8(_) => self.fp8_tensor_core_input(n, c.hidden, path),
            _ => None,
        }
    }

    /// The weights of block norm `i` where x takes them (the matrix after it is quantized), or 0:
    /// folded into a dense matrix (weights.rs), or past the last block.
    fn norm_weight(&self, i: usize) -> u64 {
        let layer = self.weights.layers.get(i / 2);
        let norm = layer.and_then(|l| {
            if i.is_multiple_of(2) {
                l.attn_norm.as_ref()
            } else {
                l.ffn_norm.as_ref()
            }
        });
        norm.map_or(0, DeviceBuffer::ptr)
    }

    /// The previous block's output for the residual add: `proj`, or the unsummed partial sums
    /// the quantized GEMM left in its parts buffer (`split_sums`), with their count.
    fn take_proj(&mut self) -> (u64, i32) {
        let proj = self.bufs.proj.ptr();
        self.take_split_sums(proj).unwrap_or((proj, 1))
    }

    /// The parts buffer and count of the k splits a quantized GEMM left unsummed for output `y`,
    /// if it did.
    fn take_split_sums(&mut self, y: u64) -> Option<(u64, i32)> {
        match self.split_sums.take() {
            Some(s) if s.y == y => Some((s.parts, s.splits)),
            other => {
                self.split_sums = other;
                None
            }
        }
    }

    /// A norm.cu call over the residual `x` of `t` tokens into `xn`, with `weight` (0: none).
    fn norm_call(&self, op: NormOp, t: usize, weight: u64) -> NormCall {
        NormCall {
            op,
            x: self.bufs.x.ptr(),
            weight,
            out: self.bufs.xn.ptr(),
            n: self.local.hidden as i32,
            eps: self.local.rms_eps,
            rows: t,
            float32: self.float32(),
            fp8: None,
        }
    }

    /// The sums of norm `i` carried between GEMVs.
    fn norm_sums(&self, i: usize) -> u64 {
        self.bufs.norm_sums.ptr() + (i * NORM_SUMS_BYTES) as u64
    }

    /// Block `i`'s output projection `a · wᵀ`: into `proj` (summed over the TP group), which the
    /// next block's norm adds to the residual; or, with carried norms, added into the residual
    /// by the GEMV itself, which also writes the next norm's sums.
    fn block_output(
        &mut self,
        i: usize,
        w: MatrixView,
        a: u64,
        (n, k, t): (usize, usize, usize),
        path: &StepPath,
    ) -> Result<(), CudaError> {
        if !path.carried_norms {
            return self.row_parallel(w, a, (n, k, t), path);
        }
        let (res, res_bf16, norm_out) = (self.bufs.x.ptr(), self.bufs.xn.ptr(), self.norm_sums(i + 1));
        match w {
            MatrixView::Dense(w) => GemvResidualCall {
                w,
                x: a,
                res,
                res_bf16,
                norm_out,
                n: n as i32,
                k: k as i32,
                t: t as i32,
            }
            .launch_with(self.launcher()),
            // One segment: o and down are one tensor each.
            MatrixView::Quant(_) => {
                let (x, x_scales) = self.quantize_activations(a, k, t)?;
                for seg in w.segments() {
                    QuantGemvResidualCall {
                        format: seg.format,
                        w: seg.ptr,
                        x,
                        x_scales,
                        two_pass: self.two_pass_activations as i32,
                        res,
                        res_bf16,
                        norm_out,
                        next_norm: self.norm_weight(i + 1),
                        n: n as i32,
                        k: k as i32,
                        t: t as i32,
                    }
                    .launch_with(self.launcher())?;
                }
                Ok(())
            }
            MatrixView::Fp8(f) => {
                let next_norm = self.norm_weight(i + 1);
                self.fp8_gemv_residual(f, a, (res, res_bf16), (norm_out, next_norm), (n, k, t))
            }
        }
    }

    /// The QKV product of layer `li` (its bias added), RoPE (after Qwen3's per-head norms) and
    /// the K/V cache write: one GEMV when the path allows, a product and rope.cu's kernel otherwise.
    fn qkv_rope_cache_write(&mut self, li: usize, t: usize, path: &StepPath, norm_in: u64) -> Result<(), CudaError> {
        let c = &self.local;
        let l = self.inputs.layout;
        let (positions, slots) = (self.bufs.inputs.at(l.positions * 4), self.bufs.inputs.at(l.slots * 4));
        let (xn, qkv) = (self.bufs.xn.ptr(), self.bufs.qkv.ptr());
        let lw = &self.weights.layers[li];
        let wqkv = lw.wqkv.view();
        let bias = lw.bqkv.as_ref().map_or(0, |b| b.ptr());
        let (k_cache, v_cache, k_scale, v_scale) = self.kv.layer(li);
        let width = c.q_dim() + 2 * c.kv_dim();
        let (n_heads, n_kv, head_dim, rot_dim) = (
            c.n_heads as i32,
            c.n_kv_heads as i32,
            c.head_dim as i32,
            c.rope.dim as i32,
        );
        let neox = matches!(c.rope.layout, RopeLayout::Neox) as i32;
        let (rope_table, block_size, eps) = (self.rope_table.ptr(), self.kv.block_size as i32, c.rms_eps);
        if path.qkv_rope {
            let rope = |w| GemvQkvRopeCall {
                w,
                x: xn,
                qkv,
                k: c.hidden as i32,
                t: t as i32,
                bias,
                positions,
                rope_table,
                n_heads,
                n_kv,
                head_dim,
                rot_dim,
                neox,
                slots,
                k_cache,
                v_cache,
                block_size,
                norm_in,
                eps,
            };
            match wqkv {
                MatrixView::Dense(w) => return rope(w).launch_with(self.launcher()),
                MatrixView::Fp8(f) => {
                    let call = Fp8GemvQkvRopeCall {
                        rope: rope(f.w),
                        scales: f.scales,
                    };
                    return call.launch_with(self.launcher());
                }
                // step_path takes the fused RoPE only for bf16 and FP8 rows.
                MatrixView::Quant(_) => {}
            }
        }
        let shape = (width, c.hidden, t);
        self.matmul(wqkv, xn, qkv, shape, GemmOut::Bf16, path, norm_in)?;
        // rope.cu sums QKV's k splits when the GEMM left them (splits 0: it reads qkv).
        let (parts, splits) = self.take_split_sums(qkv).unwrap_or((0, 0));
        let lw = &self.weights.layers[li];
        let rope = RopeCall {
            qkv,
            parts,
            splits,
            bias,
            q_norm: lw.q_norm.as_ref().map_or(0, |b| b.ptr()),
            k_norm: lw.k_norm.as_ref().map_or(0, |b| b.ptr()),
            positions,
            rope_table,
            n_heads,
            n_kv,
            head_dim,
            rot_dim,
            neox,
            eps,
            slots,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            block_size,
            tokens: t,
            kernel: match (self.float32(), self.kv.dtype) {
                (true, _) => RopeKernel::F32,
                (false, KvCacheDtype::Fp8E4m3) => RopeKernel::Fp8,
                (false, _) => RopeKernel::Bf16,
            },
        };
        rope.launch_with(self.launcher())
    }

    /// Paged attention of the step's `t` queries over layer `li`'s cache, each context split in
    /// `parts`.
    fn paged_attention(&mut self, li: usize, t: usize, parts: usize) -> Result<(), CudaError> {
        let c = &self.local;
        let l = self.inputs.layout;
        let inp = |off: usize| self.bufs.inputs.at(off * 4);
        let (kc, vc, ks, vs) = self.kv.layer(li);
        // Prompt chunks re-read their context from L2, where more resident blocks beat
        // deeper staging (1,198 vs 902 us a 4096-token chunk on an H200).
        let (kernel, stages) = match self.attention.staged {
            Some(staged) if t > SPLIT_MAX_TOKENS && self.decode_bucket.is_some() => staged,
            _ => (self.attention.kernel, 0),
        };
        // Prompt steps (tiles of 4 tokens or more on average) by tiles of query tokens, which
        // read each context slice once a tile. Up to SPLIT_MAX_TOKENS tokens, the per-token
        // kernels' context parts keep more blocks busy (a short chunk late in a long prompt).
        let by_tiles = self.attention.prompt_tiles
            && self.decode_bucket.is_none()
            && t > SPLIT_MAX_TOKENS
            && self.prompt_tiles > 0
            && self.prompt_tiles * 4 <= t;
        let call = AttentionCall {
            q: self.bufs.qkv.ptr(),
            q_stride: (c.q_dim() + 2 * c.kv_dim()) as i32,
            k_cache: kc,
            v_cache: vc,
            k_scale: ks,
            v_scale: vs,
            block_tables: inp(l.tables),
            max_blocks: self.limits.max_blocks(self.kv.block_size) as i32,
            token_seq: inp(l.token_seq),
            positions: inp(l.positions),
            out: self.bufs.attn.ptr(),
            part_acc: self.bufs.part_acc.ptr(),
            part_ml: self.bufs.part_ml.ptr(),
            n_kv: c.n_kv_heads as i32,
            block_size: self.kv.block_size as i32,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            stages: stages as i32,
            tokens: t,
            parts: parts as i32,
            n_heads: c.n_heads,
            head_dim: c.head_dim,
            fp8: self.kv.dtype == KvCacheDtype::Fp8E4m3,
        };
        if by_tiles {
            let tiles = PrefillAttentionCall {
                attention: call,
                tiles: inp(l.tiles),
                n_tiles: self.prompt_tiles,
            };
            return tiles.launch_with(self.launcher());
        }
        call.launch_with(kernel, self.launcher())
    }

    /// Context parts per token for a step of `t` tokens: enough attention blocks to fill the
    /// GPU about four times over when the batch alone does not.
    pub(super) fn attention_parts(&self, t: usize) -> usize {
        if t > SPLIT_MAX_TOKENS {
            return 1;
        }
        // Deterministic: the same split whatever share of the heads this GPU holds.
        let kv_heads = if self.deterministic {
            self.config.n_kv_heads
        } else {
            self.local.n_kv_heads
        };
        let blocks = t * kv_heads;
        (4 * self.gpu.info.multiprocessors)
            .div_ceil(blocks.max(1))
            .clamp(1, MAX_PARTS)
    }

    /// This shard's pipeline stage (its rank in the pipeline communicator).
    pub(super) fn shard_stage(&self) -> usize {
        self.comms.pp.as_ref().map(|c| c.rank).unwrap_or(0)
    }

    fn pp_comm(&self) -> Result<&Communicator, CudaError> {
        self.comms
            .pp
            .as_ref()
            .ok_or_else(|| CudaError::NoDevice("a pipeline stage without its communicator".into()))
    }

    /// Sums `count` f32 values of `buf` over the TP group (nothing on one GPU).
    fn all_reduce(&self, buf: &DeviceBuffer, count: usize) -> Result<(), CudaError> {
        match &self.comms.tp {
            Some(comm) => {
                let t = self.profile_start()?;
                comm.all_reduce_sum_f32(&self.gpu, buf, count)?;
                self.profile_end(t, || "nccl all-reduce".to_string())
            }
            None => Ok(()),
        }
    }

    /// `proj = x · wᵀ` of a row-parallel weight (attention output, MLP down), summed over the TP
    /// group: NCCL's all-reduce, or under `--deterministic` a gather and the fixed-order tree.
    fn row_parallel(
        &mut self,
        w: MatrixView,
        x: u64,
        (n, k, t): (usize, usize, usize),
        path: &StepPath,
    ) -> Result<(), CudaError> {
        let proj = self.bufs.proj.ptr();
        let tp = self.shard.tp_size;
        if !self.deterministic {
            self.matmul(w, x, proj, (n, k, t), GemmOut::F32, path, 0)?;
            return self.all_reduce(&self.bufs.proj, t * n);
        }
        let w = self.dense_weights(w, (n, k))?;
        self.gemm_fixed_order(w, x, proj, (n, k, t), DETERMINISTIC_CHUNKS / tp, GemmOut::F32)?;
        let (Some(comm), Some(gathered)) = (&self.comms.tp, &self.bufs.gathered) else {
            return Ok(());
        };
        let timer = self.profile_start()?;
        comm.all_gather_f32(&self.gpu, &self.bufs.proj, gathered, t * n)?;
        self.profile_end(timer, || "nccl all-gather".to_string())?;
        SumRanksCall {
            parts: gathered.ptr(),
            out: proj,
            count: (t * n) as i64,
            ranks: tp as i32,
        }
        .launch_with(self.launcher())
    }

    /// `y = x · wᵀ` by `gemm_fixed_order`, its reduction cut into `chunks` parts.
    fn gemm_fixed_order(
        &self,
        w: u64,
        x: u64,
        y: u64,
        (n, k, t): (usize, usize, usize),
        chunks: usize,
        out: GemmOut,
    ) -> Result<(), CudaError> {
        FixedOrderGemmCall {
            w,
            x,
            y,
            n: n as i32,
            k: k as i32,
            t: t as i32,
            chunks: chunks as i32,
            out_f32: (out == GemmOut::F32) as i32,
        }
        .launch_with(self.launcher())
    }

    /// `y = x · wᵀ` of `shape` (n, k, t) on the step's path: the fixed-order GEMM, a GEMV (its
    /// dot products scaled by the carried norm at `norm_in`, 0: none) or cuBLASLt; `out` is the
    /// output's type with bf16 weights (f32 is f32 throughout).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn matmul(
        &mut self,
        w: MatrixView,
        x: u64,
        y: u64,
        shape: (usize, usize, usize),
        out: GemmOut,
        path: &StepPath,
        norm_in: u64,
    ) -> Result<(), CudaError> {
        let out = match self.weights.dtype {
            ComputeDtype::Bf16 => out,
            ComputeDtype::F32 => GemmOut::F32,
        };
        let w = match w {
            MatrixView::Dense(w) => w,
            MatrixView::Quant(_) => return self.quantized_matmul(w, x, y, shape, out, path, norm_in),
            MatrixView::Fp8(f) => return self.fp8_matmul(f, x, y, shape, out, path, norm_in),
        };
        if self.deterministic {
            return self.gemm_fixed_order(w, x, y, shape, DETERMINISTIC_CHUNKS, out);
        }
        let (n, k, t) = shape;
        if path.gemv_for(k) {
            return GemvCall {
                w,
                x,
                y,
                n: n as i32,
                k: k as i32,
                t: t as i32,
                out_f32: (out == GemmOut::F32) as i32,
                norm_in,
                eps: self.local.rms_eps,
            }
            .launch_with(self.launcher());
        }
        if !self.ablate.is_empty() && self.ablated(&format!("gemm {n}x{k}")) {
            return Ok(());
        }
        let timer = self.profile_start()?;
        // SAFETY: the weight and activation buffers hold the shapes given (see `new`).
        unsafe { self.gemm.matmul(&self.gpu, w, x, y, shape, out) }?;
        let bucket = if t <= 8 {
            "t<=8"
        } else if t <= 256 {
            "t<=256"
        } else {
            "t>256"
        };
        self.profile_end(timer, || format!("gemm {n}x{k} {bucket}"))
    }
}

impl GpuTransformer {
    /// [`Self::matmul`] of a quantized matrix: quant.cu's GEMVs over its segments, a few tokens
    /// at a time, for a step on the GEMV path, for steps of up to `STRATA_QUANT_GEMV_MAX_TOKENS`
    /// (a pass over the matrix per 8 tokens can cost less than dequantizing it), and under
    /// `--deterministic` for a matrix larger than the scratch (a row's result then never
    /// depends on the batch); for steps of up to `STRATA_QUANT_GEMM_MAX_TOKENS` (of up to
    /// `STRATA_QUANT_WIDE_MAX_TOKENS` where every segment has wide tiles), quant.cu's
    /// tensor-core GEMM over the blocks; otherwise the matrix dequantized into the scratch, slab
    /// by slab when it is larger (an LM head), and dense products of it.
    #[allow(clippy::too_many_arguments)]
    fn quantized_matmul(
        &mut self,
        w: MatrixView,
        x: u64,
        y: u64,
        (n, k, t): (usize, usize, usize),
        out: GemmOut,
        path: &StepPath,
        norm_in: u64,
    ) -> Result<(), CudaError> {
        let passes =
            self.weights.dtype == ComputeDtype::Bf16 && k.is_multiple_of(8) && t <= self.knobs.quant_gemv_max_tokens;
        let gemv = !self.deterministic && (path.gemv_for(k) || passes);
        let larger = n * k > self.weights.dequant_elems;
        if gemv || (larger && self.deterministic) {
            let y_elem = out.bytes();
            let step = GEMV_KERNEL_TOKENS;
            for first in (0..t).step_by(step) {
                let tokens = step.min(t - first);
                let (xq, x_scales) = self.quantize_activations(x + (first * k * 2) as u64, k, tokens)?;
                for seg in w.segments() {
                    QuantGemvCall {
                        format: seg.format,
                        w: seg.ptr,
                        x: xq,
                        x_scales,
                        two_pass: self.two_pass_activations as i32,
                        y: y + ((first * n + seg.first_row) * y_elem) as u64,
                        n: seg.rows as i32,
                        k: k as i32,
                        t: tokens as i32,
                        ld: n as i32,
                        out_f32: (out == GemmOut::F32) as i32,
                        norm_in,
                        eps: self.local.rms_eps,
                    }
                    .launch_with(self.launcher())?;
                }
            }
            return Ok(());
        }
        // Products of only wide-tiled formats stay on the tiles longer (NOTES v44).
        let wide_only = w.segments().all(|seg| self.runs_wide(seg.format));
        let most = match wide_only && self.knobs.quant_gemm_max_tokens > 0 {
            true => self.knobs.quant_gemm_max_tokens.max(self.knobs.quant_wide_max_tokens),
            false => self.knobs.quant_gemm_max_tokens,
        };
        let tensor_cores =
            !self.deterministic && self.weights.dtype == ComputeDtype::Bf16 && k.is_multiple_of(QGEMM_K) && t <= most;
        if tensor_cores {
            return self.quantized_gemm(w, x, y, (n, k, t), out);
        }
        if larger {
            return self.slab_matmul(w, x, y, (n, k, t), out);
        }
        let scratch = self.dense_weights(w, (n, k))?;
        self.matmul(MatrixView::Dense(scratch), x, y, (n, k, t), out, path, norm_in)
    }

    /// [`Self::quantized_matmul`] on one of quant.cu's tensor-core GEMMs (the shared-memory tiles
    /// from `quant_gemm_tile_min_tokens` on, the wide ones of 64, 128, 192 or 256 tokens unless
    /// `STRATA_QUANT_WIDE=0`), segment by segment, k split
    /// (and the splits summed) where the segment's tiles would not fill the GPU twice.
    fn quantized_gemm(
        &mut self,
        w: MatrixView,
        x: u64,
        y: u64,
        (n, k, t): (usize, usize, usize),
        out: GemmOut,
    ) -> Result<(), CudaError> {
        let y_elem = out.bytes();
        let (parts, capacity) = self
            .bufs
            .qgemm_parts
            .as_ref()
            .map_or((0, 0), |b| (b.ptr(), b.bytes() / 4));
        let sms = self.gpu.info.multiprocessors;
        let min_tile = self.knobs.quant_gemm_tile_min_tokens;
        let tile = if min_tile > 0 && t >= min_tile {
            self.kernels.shared_tile()
        } else {
            QuantGemmTile::Registers
        };
        // The formats with wide tiles take the one for t (NOTES v49).
        let wide = tile.wide_choice(t, self.knobs.quant_wide_narrow);
        // A product whose next reader sums its k splits leaves them to it: QKV's (rope.cu), and a
        // row-parallel one into `proj` with nothing but the GEMM before the next norm (no TP
        // all-reduce).
        let reader_sums_splits = self.knobs.fold_split_sums
            && (y == self.bufs.qkv.ptr()
                || (y == self.bufs.proj.ptr() && out == GemmOut::F32 && self.comms.tp.is_none()));
        let segment_call = |seg: &SegmentView| -> Result<QuantGemmCall, CudaError> {
            let tile = match wide {
                Some(wide) if self.runs_wide(seg.format) => wide,
                _ => tile,
            };
            let mut call = QuantGemmCall {
                format: seg.format,
                tile,
                w: seg.ptr,
                x,
                y: y + (seg.first_row * y_elem) as u64,
                parts,
                n: seg.rows as i32,
                k: k as i32,
                t: t as i32,
                ld: n as i32,
                out_f32: (out == GemmOut::F32) as i32,
                steps_per_split: tile.steps_per_split_for(seg.rows, k, t, sms, capacity),
                x_map: TmaMap::NONE,
                w_maps: [TmaMap::NONE; 3],
                tail: 0,
                tail_splits: 1,
            }
            .with_maps(&self.kernels)?;
            if self.knobs.quant_wide_tail {
                (call.tail, call.tail_splits) =
                    tile.wide_tail_for((seg.rows, k, t), call.grid_splits() as usize, sms, capacity);
            }
            Ok(call)
        };
        let calls = w
            .segments()
            .map(|seg| segment_call(&seg))
            .collect::<Result<Vec<QuantGemmCall>, CudaError>>()?;
        // Two segments with a wide pair kernel (QKV whose v rows are Q6_K) run as one launch,
        // k split as one product of all n rows.
        if let ([first, second], true) = (&calls[..], self.knobs.quant_wide_pairs) {
            let first = QuantGemmCall {
                steps_per_split: first.tile.steps_per_split_for(n, k, t, sms, capacity),
                ..*first
            };
            if let Some(pair) = QuantGemmPairCall::of(first, *second) {
                pair.launch_with(self.shaped_launcher((n, k)))?;
                if let Some(reduce) = pair.reduce() {
                    self.sum_splits(reduce, y, n, reader_sums_splits, (n, k))?;
                }
                return Ok(());
            }
        }
        for call in calls {
            call.launch_with(self.shaped_launcher((call.n as usize, k)))?;
            if let Some(reduce) = call.reduce() {
                self.sum_splits(reduce, y, n, reader_sums_splits, (call.n as usize, k))?;
            }
        }
        Ok(())
    }

    /// A quantized GEMM's k splits into `y` (`n` rows): left to the next reader where
    /// `reader_sums` and the reduce covers all n rows, else summed by `reduce` now (a segment of
    /// part of the rows, whose parts the next segment reuses, or a tail's).
    fn sum_splits(
        &mut self,
        reduce: QuantGemmReduceCall,
        y: u64,
        n: usize,
        reader_sums: bool,
        shape: (usize, usize),
    ) -> Result<(), CudaError> {
        if reader_sums && reduce.n as usize == n {
            self.split_sums = Some(SplitSums {
                y,
                parts: reduce.parts,
                splits: reduce.splits,
            });
            Ok(())
        } else {
            reduce.launch_with(self.shaped_launcher(shape))
        }
    }

    /// Whether `format`'s products past one 128-token tile run on the wide tiles here: the format
    /// has them, quant.cu was compiled with them, and `STRATA_QUANT_WIDE` leaves them on.
    fn runs_wide(&self, format: QuantFormat) -> bool {
        self.knobs.quant_wide && self.kernels.wide_tiles() && format.has_wide_tiles()
    }

    /// `x` (bf16 `[t, k]`, t at most GEMV_KERNEL_TOKENS) as the int8 blocks the quantized GEMVs
    /// read: the addresses of the values and of their scales.
    fn quantize_activations(&self, x: u64, k: usize, t: usize) -> Result<(u64, u64), CudaError> {
        let (Some(xq), Some(xs)) = (&self.bufs.x_q8, &self.bufs.x_q8_scales) else {
            return Err(CudaError::NoDevice(
                "quantized GEMVs without their activation buffers".into(),
            ));
        };
        QuantizeQ8Call {
            x,
            xq: xq.ptr(),
            xs: xs.ptr(),
            k: k as i32,
            t: t as i32,
            two_pass: self.two_pass_activations as i32,
        }
        .launch_with(self.launcher())?;
        Ok((xq.ptr(), xs.ptr()))
    }

    /// [`Self::quantized_matmul`] of a matrix larger than the scratch: each segment's rows a
    /// scratch-full at a time, dequantized and multiplied by cuBLASLt into their columns of `y`.
    fn slab_matmul(
        &mut self,
        w: MatrixView,
        x: u64,
        y: u64,
        (n, k, t): (usize, usize, usize),
        out: GemmOut,
    ) -> Result<(), CudaError> {
        // As many rows as the scratch holds, at least one.
        let slab = (self.weights.dequant_elems / k).max(1);
        let scratch = self.dequant_scratch((slab, k), "a quantized")?;
        let y_elem = out.bytes();
        for seg in w.segments() {
            for first in (0..seg.rows).step_by(slab) {
                let rows = slab.min(seg.rows - first);
                DequantCall {
                    format: seg.format,
                    w: seg.ptr,
                    out: scratch,
                    n: seg.rows as i32,
                    k: k as i32,
                    first: first as i32,
                    rows: rows as i32,
                }
                .launch_with(self.launcher())?;
                let timer = self.profile_start()?;
                let y_slab = y + ((seg.first_row + first) * y_elem) as u64;
                // SAFETY: the scratch holds rows x k bf16, x t x k, y t rows of n from the slab's column.
                unsafe {
                    self.gemm
                        .matmul_into_rows(&self.gpu, scratch, x, y_slab, (rows, k, t), out, n)
                }?;
                self.profile_end(timer, || format!("gemm slab {rows}x{k}"))?;
            }
        }
        Ok(())
    }

    /// The dequantization scratch, if it holds `rows` rows of `k` values (a whole matrix, or a
    /// slab of one); `what` names the matrix's kind in the error.
    pub(super) fn dequant_scratch(&self, (rows, k): (usize, usize), what: &str) -> Result<u64, CudaError> {
        match &self.bufs.dequant {
            Some(b) if rows * k <= self.weights.dequant_elems => Ok(b.ptr()),
            _ => Err(CudaError::NoDevice(format!(
                "{what} {rows}x{k} matrix is larger than the dequantization scratch ({} values)",
                self.weights.dequant_elems
            ))),
        }
    }

    /// A dense address of `w` (`[n, k]`, no larger than the scratch): its own, or the scratch it
    /// is dequantized into.
    fn dense_weights(&self, w: MatrixView, (n, k): (usize, usize)) -> Result<u64, CudaError> {
        if let MatrixView::Dense(p) = w {
            return Ok(p);
        }
        if let MatrixView::Fp8(f) = w {
            return self.fp8_dense_weights(f, (n, k));
        }
        let scratch = self.dequant_scratch((n, k), "a quantized")?;
        for seg in w.segments() {
            DequantCall {
                format: seg.format,
                w: seg.ptr,
                out: scratch + (seg.first_row * k * 2) as u64,
                n: seg.rows as i32,
                k: k as i32,
                first: 0,
                rows: seg.rows as i32,
            }
            .launch_with(self.shaped_launcher((seg.rows, k)))?;
        }
        Ok(scratch)
    }
}
