//! The device buffers a step reads and writes between kernels, each sized once for the largest
//! step ([`StepLimits`]): inputs, activations, logits, argmax and sampling scratch, norm sums.

use strata_runtime::cuda::{CudaError, DeviceBuffer, Gpu};

use crate::config::ModelConfig;

use strata_runtime::cuda::gemm_call::NORM_SUMS_BYTES;
use strata_runtime::cuda::sampling_call::ARGMAX_SLICES;

use super::layers::{MAX_PARTS, SPLIT_MAX_TOKENS};
use super::step_inputs::StepLimits;

/// f32 values of quant.cu's GEMM's partial sums (16 MiB): k splits that fill the GPU twice need
/// up to 2 x multiprocessors x its 128 x 64 tile (4.3 M values on 132); where they would not
/// fit, k splits fewer ways.
pub const QGEMM_PARTS_VALUES: usize = 4 << 20;

pub(super) struct StepBuffers {
    /// The staged inputs ([`super::step_inputs::InputLayout`]).
    pub inputs: DeviceBuffer,
    /// The f32 residual stream.
    pub x: DeviceBuffer,
    /// The normed residual, the products' input.
    pub xn: DeviceBuffer,
    pub qkv: DeviceBuffer,
    pub attn: DeviceBuffer,
    /// f32 output of the o and down products.
    pub proj: DeviceBuffer,
    pub gate_up: DeviceBuffer,
    pub act: DeviceBuffer,
    /// The normed rows the LM head reads.
    pub normed: DeviceBuffer,
    pub logits: DeviceBuffer,
    /// Each logits row's argmax (u32, from 0) and, from `logit_rows` on, its logit (f32: to merge
    /// the vocabulary slices of TP ranks); one buffer so that one copy brings both back.
    pub argmax: DeviceBuffer,
    /// The best logit and its id of each slice of each row (`argmax_slices`), values first.
    pub argmax_parts: DeviceBuffer,
    /// Each sampled row's best logit and the limit of top-k / top-p / min-p (`sampling_limits`).
    pub sampling_limits: DeviceBuffer,
    pub part_acc: DeviceBuffer,
    pub part_ml: DeviceBuffer,
    /// Every TP rank's row-parallel partial sums, under `--deterministic`.
    pub gathered: Option<DeviceBuffer>,
    /// The sums of squares each norm of a step carries between GEMVs (gemm.cu's NormIn):
    /// `2 * layers + 1` norms of NORM_SUMS_BYTES.
    pub norm_sums: DeviceBuffer,
    /// bf16 scratch a quantized matrix is dequantized into before a cuBLASLt product (the
    /// largest quantized layer matrix); `None` without quantized matrices.
    pub dequant: Option<DeviceBuffer>,
    /// The input of a quantized GEMV as int8 blocks (quant.cu's quantize_q8), and their scales;
    /// `None` without quantized matrices.
    pub x_q8: Option<DeviceBuffer>,
    pub x_q8_scales: Option<DeviceBuffer>,
    /// f32 partial sums of quant.cu's GEMM when it splits k ([`QGEMM_PARTS_VALUES`]); `None`
    /// without quantized matrices or with the GEMM off.
    pub qgemm_parts: Option<DeviceBuffer>,
    /// E4M3 activations of the FP8 GEMM (`max_tokens` rows of the widest product input), then
    /// their f32 per-token scales; `None` without FP8 matrices or FP8 tensor cores.
    pub fp8_act: Option<DeviceBuffer>,
}

impl StepBuffers {
    /// The buffers of this GPU's shapes `c`, `input_words` i32 of inputs, activations of
    /// `element_bytes` between kernels (the residual stream is f32 either way).
    pub(super) fn new(
        gpu: &Gpu,
        c: &ModelConfig,
        limits: &StepLimits,
        input_words: usize,
        element_bytes: usize,
    ) -> Result<StepBuffers, CudaError> {
        let t = limits.max_tokens;
        let rows = limits.logit_rows;
        let e = element_bytes;
        let width = c.q_dim() + 2 * c.kv_dim();
        let split_t = SPLIT_MAX_TOKENS.min(t);
        Ok(StepBuffers {
            inputs: gpu.alloc(input_words * 4, "step inputs")?,
            x: gpu.alloc(t * c.hidden * 4, "activations")?,
            xn: gpu.alloc(t * c.hidden * e, "activations")?,
            qkv: gpu.alloc(t * width * e, "activations")?,
            attn: gpu.alloc(t * c.q_dim() * e, "activations")?,
            proj: gpu.alloc(t * c.hidden * 4, "activations")?,
            gate_up: gpu.alloc(t * 2 * c.intermediate * e, "activations")?,
            act: gpu.alloc(t * c.intermediate * e, "activations")?,
            normed: gpu.alloc(rows * c.hidden * e, "activations")?,
            logits: gpu.alloc(rows * c.vocab_size * 4, "logits")?,
            argmax: gpu.alloc(2 * rows * 4, "greedy token ids")?,
            argmax_parts: gpu.alloc(2 * rows * ARGMAX_SLICES * 4, "greedy token ids")?,
            sampling_limits: gpu.alloc(2 * rows * 4, "sampling limits")?,
            part_acc: gpu.alloc(split_t * c.n_heads * MAX_PARTS * c.head_dim * 4, "attention partials")?,
            part_ml: gpu.alloc(split_t * c.n_heads * MAX_PARTS * 2 * 4, "attention partials")?,
            gathered: None,
            norm_sums: gpu.alloc((2 * c.n_layers + 1) * NORM_SUMS_BYTES, "norm sums")?,
            dequant: None,
            x_q8: None,
            qgemm_parts: None,
            x_q8_scales: None,
            fp8_act: None,
        })
    }
}
