//! The end of a step on the last stage: final norm and LM head of the logits rows, bias and
//! grammar masks, the device's choice of each token, and the copy of what the host asked for.

use strata_runtime::cuda::sampling_call::ARGMAX_SLICES;
use strata_runtime::cuda::{ChooseTokensCall, CudaError, GemmOut, NormCall, NormOp};

use crate::batch::Logits;

use super::forward::{GpuTransformer, ShardLogits};
use super::step_inputs::{StagedStep, SAMPLING_WORDS};

impl GpuTransformer {
    /// Final norm and LM head of logits rows `first..first + n` (at most `logit_rows`), into the
    /// logits buffer, then the rows' bias and masks when `adjust` (uploaded), then their argmax.
    pub(super) fn logits_chunk(&mut self, first: usize, n: usize, adjust: bool) -> Result<(), CudaError> {
        let c = &self.local;
        let l = self.inputs.layout;
        let rows = self.bufs.inputs.at((l.rows + first) * 4);
        let (x, norm, normed, logits) = (
            self.bufs.x.ptr(),
            self.weights.output_norm.ptr(),
            self.bufs.normed.ptr(),
            self.bufs.logits.ptr(),
        );
        let (vocab, hidden) = (c.vocab_size, c.hidden);
        NormCall {
            op: NormOp::Gather { row_ids: rows },
            x,
            weight: norm,
            out: normed,
            n: hidden as i32,
            eps: c.rms_eps,
            rows: n,
            float32: self.float32(),
            fp8: None,
        }
        .launch_with(self.launcher())?;
        let lm = match self.weights.lm_head() {
            Some(m) => m.view(),
            None => {
                return Err(CudaError::NoDevice(
                    "logits asked of a stage without the LM head".into(),
                ))
            }
        };
        // The LM head runs on the path of a step of its n rows (GEMVs for a few).
        let path = self.step_path(n);
        self.matmul(lm, normed, logits, (vocab, hidden, n), GemmOut::F32, &path, 0)?;
        let lr = self.limits.logit_rows;
        let vocab_start = self.shard.vocab(&self.config).start;
        if adjust {
            let call = self.adjusts.call(logits, vocab, vocab_start, first, n);
            call.launch_with(self.launcher())?;
        }
        ChooseTokensCall {
            logits,
            vocab: vocab as i32,
            sampling: self.bufs.inputs.at((l.sampling + SAMPLING_WORDS * first) * 4),
            limits: self.bufs.sampling_limits.ptr(),
            part_vals: self.bufs.argmax_parts.ptr(),
            part_ids: self.bufs.argmax_parts.at(lr * ARGMAX_SLICES * 4),
            ids: self.bufs.argmax.ptr(),
            vals: self.bufs.argmax.at(lr * 4),
            vocab_start: vocab_start as i32,
            rows: n,
        }
        .launch_with(self.launcher())
    }

    /// Empty logits of this shard's vocabulary width.
    pub(super) fn no_logits(&self) -> ShardLogits {
        ShardLogits {
            logits: Logits {
                vocab: self.local.vocab_size,
                ..Default::default()
            },
            argmax_values: Vec::new(),
        }
    }

    /// Copies the wanted results to the host: the argmax of argmax-only rows, whole rows of the
    /// others (running the LM head in chunks unless a captured step already did). Stages other
    /// than the last only wait for their work.
    pub(super) fn collect_logits(
        &mut self,
        step: &StagedStep,
        computed: bool,
        adjusted: Option<usize>,
    ) -> Result<ShardLogits, CudaError> {
        let mut out = self.no_logits();
        if !self.shard.is_last_stage() {
            self.gpu.sync()?;
            return Ok(out);
        }
        let vocab = self.local.vocab_size;
        let vocab_start = self.shard.vocab(&self.config).start as u32;
        let r = step.rows.len();
        let lr = self.limits.logit_rows;
        let mut words = vec![0u32; 2 * lr];
        // A captured decode step computed one row per (padded) token, row j = token j, with the
        // real tokens first.
        let chunk = if computed { r.max(1) } else { self.limits.logit_rows };
        let mut first = 0;
        while first < r {
            let n = chunk.min(r - first);
            if !computed {
                if let (Some(set), 0) = (adjusted, first) {
                    self.adjusts.upload(&self.gpu, set)?;
                }
                self.logits_chunk(first, n, adjusted.is_some())?;
            }
            // The ids and the logits of this chunk's rows: [0, n) and [lr, lr + n).
            self.gpu.read(&self.bufs.argmax, 0, &mut words[..lr + n])?;
            for (j, row) in step.rows.iter().enumerate().skip(first).take(n) {
                if row.whole {
                    let start = out.logits.data.len();
                    out.logits.data.resize(start + vocab, 0.0);
                    self.gpu.read(
                        &self.bufs.logits,
                        (j - first) * vocab * 4,
                        &mut out.logits.data[start..],
                    )?;
                    out.logits.rows.push((row.seq, row.pos));
                } else {
                    out.logits.argmax.push((row.seq, vocab_start + words[j - first]));
                    out.argmax_values.push(f32::from_bits(words[lr + j - first]));
                }
            }
            first += n;
        }
        Ok(out)
    }
}
