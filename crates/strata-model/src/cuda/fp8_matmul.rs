//! Products of FP8 E4M3 matrices on the GPU: fp8.cu's decode GEMVs for a few tokens; otherwise
//! FP8 tensor cores (sm_89+: activations to E4M3 per token, cuBLASLt, the scales) or, weight-only, bf16.

use strata_runtime::cuda::gemm_call::GEMV_KERNEL_TOKENS;
use strata_runtime::cuda::{
    CudaError, Fp8DequantCall, Fp8GemvCall, Fp8GemvResidualCall, Fp8GemvSiluCall, Fp8QuantizeRowsCall,
    Fp8ScaleOutputCall, GemmOut, SiluMulFp8Call, SILU_FP8_MAX_INTER,
};

use super::forward::GpuTransformer;
use super::layers::StepPath;
use super::weights::{Fp8View, MatrixView};

/// Where the FP8 activations' per-token scales start in the step's FP8 activation buffer, after
/// `tokens * width` bytes of E4M3 values (16-byte aligned for cuBLASLt).
pub(super) fn fp8_act_scales_offset(tokens: usize, width: usize) -> usize {
    (tokens * width).next_multiple_of(16)
}

impl GpuTransformer {
    /// [`Self::matmul`] of an FP8 matrix `[n, k]`: fp8.cu's GEMVs over the tokens a few at a time
    /// on a GEMV path; on FP8 tensor cores where the GPU has them; otherwise (sm_80/86, and
    /// `--deterministic`) dequantized into the bf16 scratch and a dense product of it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fp8_matmul(
        &mut self,
        w: Fp8View,
        x: u64,
        y: u64,
        (n, k, t): (usize, usize, usize),
        out: GemmOut,
        path: &StepPath,
        norm_in: u64,
    ) -> Result<(), CudaError> {
        let out_f32 = (out == GemmOut::F32) as i32;
        let ready = self.fp8_rows_ready.take();
        if !self.deterministic && path.gemv_for(k) {
            let y_elem = out.bytes();
            for first in (0..t).step_by(GEMV_KERNEL_TOKENS) {
                Fp8GemvCall {
                    w: w.w,
                    scales: w.scales,
                    x: x + (first * k * 2) as u64,
                    y: y + (first * n * y_elem) as u64,
                    n: n as i32,
                    k: k as i32,
                    t: GEMV_KERNEL_TOKENS.min(t - first) as i32,
                    ld: n as i32,
                    out_f32,
                    norm_in,
                    eps: self.local.rms_eps,
                    kind: self.knobs.fp8_gemv,
                }
                .launch_with(self.launcher())?;
            }
            return Ok(());
        }
        let Some((act, scales)) = self.fp8_tensor_core_input(n, k, path) else {
            let scratch = self.fp8_dense_weights(w, (n, k))?;
            return self.matmul(MatrixView::Dense(scratch), x, y, (n, k, t), out, path, norm_in);
        };
        self.fp8_quantize_unless_ready(ready, x, (act, scales), (k, t))?;
        if self.fp8_outer_scales {
            let timer = self.profile_start()?;
            if let Some(gemm) = self.fp8_gemm.as_mut() {
                // SAFETY: as in fp8_gemm_unscaled, and w's n row scales, the t token scales.
                let scaled = unsafe { gemm.matmul_scaled(&self.gpu, w.w, act, y, (n, k, t), out, (w.scales, scales)) };
                match scaled {
                    Ok(()) => return self.profile_end(timer, || format!("gemm fp8 scaled {n}x{k}")),
                    // Refused before anything was queued: scale with fp8.cu's kernel from now on.
                    Err(e) => {
                        tracing::warn!("cuBLASLt does not scale FP8 products here ({e}); fp8.cu scales them");
                        self.fp8_outer_scales = false;
                    }
                }
            }
        }
        self.fp8_gemm_unscaled(w, act, y, (n, k, t), out)?;
        Fp8ScaleOutputCall {
            y,
            out_f32,
            row_scales: scales,
            col_scales: w.scales,
            n: n as i32,
            t: t as i32,
        }
        .launch_with(self.launcher())
    }

    /// The FP8 activation buffer and where its token scales start, when an FP8 matrix's `[n, k]`
    /// product over the step runs on FP8 tensor cores; `None` for the GEMVs (few tokens) and for
    /// bf16 weight-only products (no FP8 tensor cores, `--deterministic`).
    pub(super) fn fp8_tensor_core_input(&self, n: usize, k: usize, path: &StepPath) -> Option<(u64, u64)> {
        // cuBLASLt's FP8 GEMM wants 16-byte aligned output rows (k is a multiple of 16: weights.rs).
        let tensor_cores = !self.deterministic && !path.gemv_for(k) && self.fp8_gemm.is_some() && n.is_multiple_of(16);
        let act = self.bufs.fp8_act.as_ref().filter(|_| tensor_cores)?.ptr();
        let width = self.local.widest_product_input();
        Some((act, act + fp8_act_scales_offset(self.limits.max_tokens, width) as u64))
    }

    /// x's t rows of k into the FP8 activation buffer (`act`, `scales`) as E4M3, unless `ready`
    /// (the taken `fp8_rows_ready`) says the kernel before wrote them there.
    fn fp8_quantize_unless_ready(
        &self,
        ready: Option<(u64, usize, usize)>,
        x: u64,
        (act, scales): (u64, u64),
        (k, t): (usize, usize),
    ) -> Result<(), CudaError> {
        if ready == Some((x, k, t)) {
            return Ok(());
        }
        Fp8QuantizeRowsCall {
            x,
            out: act,
            scales,
            k: k as i32,
            rows: t,
        }
        .launch_with(self.launcher())
    }

    /// cuBLASLt's E4M3 product of `w` and the quantized activations `act` into `y`, unscaled.
    fn fp8_gemm_unscaled(
        &mut self,
        w: Fp8View,
        act: u64,
        y: u64,
        (n, k, t): (usize, usize, usize),
        out: GemmOut,
    ) -> Result<(), CudaError> {
        if !self.ablate.is_empty() && self.ablated(&format!("gemm {n}x{k}")) {
            return Ok(());
        }
        let timer = self.profile_start()?;
        if let Some(gemm) = self.fp8_gemm.as_mut() {
            // SAFETY: w holds n x k E4M3 bytes (weights.rs), act the t x k quantized activations
            // (the FP8 activation buffer holds max_tokens rows of the widest k), y t x n outputs.
            unsafe { gemm.matmul(&self.gpu, w.w, act, y, (n, k, t), out) }?;
        }
        self.profile_end(timer, || format!("gemm fp8 {n}x{k}"))
    }

    /// The MLP's gate/up product of an FP8 `[gate; up]` matrix on FP8 tensor cores, then
    /// `silu_mul_fp8`: its scales, SiLU-and-multiply into `act`, and `act` as E4M3 in the FP8
    /// activation buffer for the down product (which then quantizes nothing). Returns false,
    /// launching nothing, where that does not apply (GEMV steps, no FP8 tensor cores, cuBLASLt
    /// scaling, an intermediate width past one block's, `STRATA_FUSE_FP8=0`).
    pub(super) fn fp8_gate_up_silu(
        &mut self,
        w: Fp8View,
        (xn, gate_up, act): (u64, u64, u64),
        (inter, k, t): (usize, usize, usize),
        path: &StepPath,
    ) -> Result<bool, CudaError> {
        let input = self.fp8_tensor_core_input(2 * inter, k, path);
        let fits = self.knobs.fuse_fp8 && inter.is_multiple_of(8) && inter <= SILU_FP8_MAX_INTER && !self.float32();
        let Some((q, scales)) = input.filter(|_| fits && !self.fp8_outer_scales) else {
            return Ok(false);
        };
        let ready = self.fp8_rows_ready.take();
        self.fp8_quantize_unless_ready(ready, xn, (q, scales), (k, t))?;
        self.fp8_gemm_unscaled(w, q, gate_up, (2 * inter, k, t), GemmOut::Bf16)?;
        SiluMulFp8Call {
            gate_up,
            tok_scales: scales,
            col_scales: w.scales,
            out: act,
            q,
            q_scales: scales,
            inter: inter as i32,
            tokens: t,
        }
        .launch_with(self.launcher())?;
        self.fp8_rows_ready = Some((act, inter, t));
        Ok(true)
    }

    /// The gate/up product with SiLU of an FP8 `[gate; up]` matrix, as one fp8.cu GEMV per
    /// GEMV_KERNEL_TOKENS tokens (the caller checked the step's path).
    pub(super) fn fp8_gemv_silu(
        &self,
        w: Fp8View,
        (x, out): (u64, u64),
        (inter, k, t): (usize, usize, usize),
        norm_in: u64,
    ) -> Result<(), CudaError> {
        Fp8GemvSiluCall {
            w: w.w,
            scales: w.scales,
            x,
            out,
            inter: inter as i32,
            k: k as i32,
            t: t as i32,
            norm_in,
            eps: self.local.rms_eps,
            kind: self.knobs.fp8_gemv,
        }
        .launch_with(self.launcher())
    }

    /// The o or down projection of an FP8 matrix added into the residual with carried norms (as
    /// quant.cu's residual GEMV): `res` f32 and `res_bf16` times `next_norm`, sums into `norm_out`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn fp8_gemv_residual(
        &self,
        w: Fp8View,
        x: u64,
        (res, res_bf16): (u64, u64),
        (norm_out, next_norm): (u64, u64),
        (n, k, t): (usize, usize, usize),
    ) -> Result<(), CudaError> {
        Fp8GemvResidualCall {
            w: w.w,
            scales: w.scales,
            x,
            res,
            res_bf16,
            norm_out,
            next_norm,
            n: n as i32,
            k: k as i32,
            t: t as i32,
            kind: self.knobs.fp8_gemv,
        }
        .launch_with(self.launcher())
    }

    /// The bf16 scratch holding FP8 matrix `w` (`[n, k]`) dequantized.
    pub(super) fn fp8_dense_weights(&self, w: Fp8View, (n, k): (usize, usize)) -> Result<u64, CudaError> {
        let scratch = self.dequant_scratch((n, k), "an FP8")?;
        Fp8DequantCall {
            w: w.w,
            scales: w.scales,
            out: scratch,
            n: n as i32,
            k: k as i32,
        }
        .launch_with(self.launcher())?;
        Ok(scratch)
    }
}
