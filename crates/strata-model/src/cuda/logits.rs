//! The end of a step on the last stage: final norm and LM head of the logits rows, bias and
//! grammar masks, the device's choice of each token, and the copy of what the host asked for.

use strata_runtime::cuda::{CudaError, GemmOut};
use strata_runtime::kernel_args;

use crate::batch::Logits;

use super::forward::{GpuTransformer, ShardLogits};
use super::layers::ROW_THREADS;
use super::step_inputs::{StagedStep, SAMPLING_WORDS};

/// Blocks a row's argmax is split over (sampling.cu's ARGMAX_SLICES).
pub(super) const ARGMAX_SLICES: usize = 32;
/// Threads of sampling.cu's `sampling_limits` (its LIMIT_THREADS).
const LIMIT_THREADS: u32 = 512;

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
        let (h, eps) = (c.hidden as i32, c.rms_eps);
        let (vocab, hidden) = (c.vocab_size, c.hidden);
        self.launch(
            "rms_norm_rows",
            (n as u32, 1, 1),
            ROW_THREADS,
            0,
            &mut kernel_args!(x, rows, norm, normed, h, eps),
        )?;
        let lm = match self.weights.lm_head() {
            Some(b) => b.ptr(),
            None => {
                return Err(CudaError::NoDevice(
                    "logits asked of a stage without the LM head".into(),
                ))
            }
        };
        // The LM head runs on the path of a step of its n rows (GEMVs for a few).
        let path = self.step_path(n);
        self.matmul(lm, normed, logits, (vocab, hidden, n), GemmOut::F32, &path, 0)?;
        let (ids, vals, v) = (
            self.bufs.argmax.ptr(),
            self.bufs.argmax.at(self.limits.logit_rows * 4),
            vocab as i32,
        );
        let (part_vals, part_ids) = (
            self.bufs.argmax_parts.ptr(),
            self.bufs.argmax_parts.at(self.limits.logit_rows * ARGMAX_SLICES * 4),
        );
        let sampling = self.bufs.inputs.at((l.sampling + SAMPLING_WORDS * first) * 4);
        let sampling_limits = self.bufs.sampling_limits.ptr();
        let vocab_start = self.shard.vocab(&self.config).start as i32;
        if adjust {
            let call = self.adjusts.call(logits, vocab, vocab_start as usize, first, n);
            call.launch_with(|name, grid, threads, shared, args| self.launch(name, grid, threads, shared, args))?;
        }
        self.launch(
            "sampling_limits",
            (n as u32, 1, 1),
            LIMIT_THREADS,
            0,
            &mut kernel_args!(logits, v, sampling, sampling_limits),
        )?;
        self.launch(
            "argmax_slices",
            (n as u32, ARGMAX_SLICES as u32, 1),
            256,
            0,
            &mut kernel_args!(logits, v, part_vals, part_ids, sampling, sampling_limits, vocab_start),
        )?;
        self.launch(
            "argmax_merge",
            (n as u32, 1, 1),
            32,
            0,
            &mut kernel_args!(part_vals, part_ids, ids, vals),
        )
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
