//! How a GPU's products are chosen: cuBLASLt's algorithms timed per decode batch size, and the
//! `--deterministic` mode of fixed-order GEMMs and reductions.

use strata_runtime::cuda::{CudaError, GemmOut};

use super::forward::GpuTransformer;
use super::fp8_matmul::fp8_act_scales_offset;
use super::graphs::graph_bucket;
use super::layers::DETERMINISTIC_CHUNKS;
use super::weights::{ComputeDtype, GpuLayer, GpuMatrix, MatrixView};

/// A product of every layer: its matrix, input, output, (n, k) and output type.
type ProductKind = (fn(&GpuLayer) -> &GpuMatrix, u64, u64, (usize, usize), GemmOut);

impl GpuTransformer {
    /// `--deterministic`: every GEMM sums in one fixed order whatever its shape (gemm.cu), TP
    /// ranks gather their row-parallel partial sums and add them in that order's tree instead of
    /// NCCL's, and attention splits contexts by the whole model's KV heads. Greedy output is then
    /// the same bit for bit on one GPU, under TP (up to 8 ranks) and under PP; slower than cuBLAS.
    pub fn set_deterministic(&mut self, on: bool) -> Result<(), CudaError> {
        if on {
            let c = &self.config;
            let tp = self.shard.tp_size;
            let step = 8 * DETERMINISTIC_CHUNKS;
            for (what, k) in [
                ("hidden size", c.hidden),
                ("attention width", c.q_dim()),
                ("intermediate size", c.intermediate),
            ] {
                if !k.is_multiple_of(step) {
                    return Err(CudaError::NoDevice(format!(
                        "--deterministic needs the {what} to be a multiple of {step} (this model's is {k}); run without --deterministic"
                    )));
                }
            }
            if !tp.is_power_of_two() || tp > DETERMINISTIC_CHUNKS {
                return Err(CudaError::NoDevice(format!(
                    "--deterministic works with a tensor-parallel size of 1, 2, 4 or 8, not {tp}"
                )));
            }
            if tp > 1 && self.bufs.gathered.is_none() {
                let bytes = tp * self.limits.max_tokens * self.local.hidden * 4;
                self.bufs.gathered = Some(self.gpu.alloc(bytes, "gathered partial sums")?);
            }
        }
        self.graphs.clear();
        self.deterministic = on;
        Ok(())
    }

    /// Times cuBLASLt's candidate algorithms (gemm.rs's `tune`) for the products of every
    /// decode batch size that does not run as GEMVs, each over this shard's layers, and keeps
    /// the fastest; `STRATA_GEMM_TUNE=0` keeps the heuristic's first choices. Under
    /// `--deterministic` cuBLASLt is not used; under `--dtype float32`, a reference path, the
    /// heuristic's choices are kept.
    pub fn tune_decode_gemms(&mut self) -> Result<(), CudaError> {
        if self.deterministic || self.weights.dtype == ComputeDtype::F32 || !self.knobs.tune_gemms {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let c = &self.local;
        let b = &self.bufs;
        // Quantized matrices' products read the scratch they are dequantized into.
        let scratch = b.dequant.as_ref().map_or(0, |d| d.ptr());
        let of_layers = |f: fn(&GpuLayer) -> &GpuMatrix| -> Vec<u64> {
            self.weights.layers.iter().map(|l| f(l).gemm_ptr(scratch)).collect()
        };
        let width = c.q_dim() + 2 * c.kv_dim();
        let kinds: [ProductKind; 4] = [
            (|l| &l.wqkv, b.xn.ptr(), b.qkv.ptr(), (width, c.hidden), GemmOut::Bf16),
            (
                |l| &l.wo,
                b.attn.ptr(),
                b.proj.ptr(),
                (c.hidden, c.q_dim()),
                GemmOut::F32,
            ),
            (
                |l| &l.w_gate_up,
                b.xn.ptr(),
                b.gate_up.ptr(),
                (2 * c.intermediate, c.hidden),
                GemmOut::Bf16,
            ),
            (
                |l| &l.w_down,
                b.act.ptr(),
                b.proj.ptr(),
                (c.hidden, c.intermediate),
                GemmOut::F32,
            ),
        ];
        // FP8 matrices' products run on the FP8 GEMM (fp8_matmul.rs), from the FP8 activations.
        let fp8_act = b.fp8_act.as_ref().map(|a| a.ptr()).filter(|_| self.fp8_gemm.is_some());
        let on_fp8 = |f: fn(&GpuLayer) -> &GpuMatrix| {
            fp8_act.is_some()
                && self
                    .weights
                    .layers
                    .iter()
                    .all(|l| matches!(f(l), GpuMatrix::Fp8 { .. }))
        };
        let (fp8_kinds, dense_kinds): (Vec<&ProductKind>, Vec<&ProductKind>) =
            kinds.iter().partition(|(f, ..)| on_fp8(*f));
        let products: Vec<_> = dense_kinds
            .iter()
            .map(|&&(f, x, y, shape, out)| (of_layers(f), x, y, shape, out))
            .collect();
        // The FP8 products, with the first layer's weight scales and the activations' scales
        // when cuBLASLt applies them (the values do not change the timing).
        let fp8_products: Vec<_> = fp8_act.map_or_else(Vec::new, |act| {
            let act_scales = act + fp8_act_scales_offset(self.limits.max_tokens, c.widest_product_input()) as u64;
            let ptrs = |m: &GpuMatrix| match m.view() {
                MatrixView::Fp8(v) => (v.w, v.scales),
                _ => (0, 0),
            };
            fp8_kinds
                .iter()
                .map(|&&(f, _, y, (n, k), out)| {
                    let weights: Vec<u64> = self.weights.layers.iter().map(|l| ptrs(f(l)).0).collect();
                    let scales = self
                        .fp8_outer_scales
                        .then(|| (ptrs(f(&self.weights.layers[0])).1, act_scales));
                    (weights, act, y, (n, k), out, scales)
                })
                .collect()
        });
        let dense_head = |w: &&GpuMatrix| !w.is_quantized();
        let lm_head = self
            .weights
            .lm_head()
            .filter(|_| self.shard.is_last_stage())
            .filter(dense_head)
            .map(|w| {
                (
                    vec![w.gemm_ptr(0)],
                    b.normed.ptr(),
                    b.logits.ptr(),
                    (c.vocab_size, c.hidden),
                    GemmOut::F32,
                )
            });
        let mut buckets: Vec<usize> = (1..=self.limits.max_seqs)
            .filter_map(|n| graph_bucket(n, self.limits.max_seqs))
            .filter(|&t| t <= self.limits.max_tokens && self.step_path(t).uses_cublaslt(c.hidden))
            .collect();
        buckets.dedup();
        let mut summary = None;
        for &t in &buckets {
            let head = lm_head.iter().filter(|_| t <= self.limits.logit_rows);
            let (mut first, mut best) = (0.0f32, 0.0f32);
            for (weights, x, y, (n, k), out) in products.iter().chain(head) {
                // SAFETY: the weights are this shard's matrices of shape n x k; x and y are the
                // step buffers these products read and write, sized for the step limits, which
                // hold `t` tokens (t <= max_tokens, and t <= logit_rows for the LM head).
                let (f, b) = unsafe { self.gemm.tune(&self.gpu, weights, *x, *y, (*n, *k, t), *out, None) }?;
                first += f;
                best += b;
            }
            for (weights, x, y, (n, k), out, scales) in &fp8_products {
                let Some(gemm) = self.fp8_gemm.as_mut() else { break };
                // SAFETY: as above, with n x k E4M3 weights, the FP8 activation buffer (max_tokens
                // rows of the widest input) and scales of n and t f32.
                let (f, b) = unsafe { gemm.tune(&self.gpu, weights, *x, *y, (*n, *k, t), *out, *scales) }?;
                first += f;
                best += b;
            }
            tracing::debug!(
                "decode GEMMs at {t} tokens: {first:.2} ms a step with cuBLASLt's first choices, {best:.2} ms tuned"
            );
            summary = Some((t, first, best));
        }
        if let Some((t, first, best)) = summary {
            tracing::info!(
                "tuned the GEMMs of {} decode batch sizes in {:.1} s; at {t} tokens {first:.2} -> {best:.2} ms a step",
                buckets.len(),
                started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }
}
