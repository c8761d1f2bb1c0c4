//! Overlapped decode steps: a step of ids chosen on the GPU starts before the host has read the
//! one before it, may take its tokens from that one on the device, and is read back later.

use strata_runtime::cuda::{CudaError, Event, Gpu, PinnedBuffer, TokensFromArgmaxCall};

use crate::batch::{Logits, SeqChunk};
use crate::error::ModelError;

use super::forward::GpuTransformer;
use super::graphs::graph_bucket;
use super::step_inputs::StepLimits;

/// A decode step started by [`GpuTransformer::start_decode`], not yet read back.
pub struct StartedDecode {
    /// The batch index of the sequence of each argmax row.
    seqs: Vec<usize>,
    /// Its staging slot, where its ids come back.
    slot: usize,
    /// Marked after the ids' copy back; `None` while its logits wait for the host's masks
    /// ([`GpuTransformer::launch_deferred`] marks it then).
    done: Option<Event>,
}

/// A started decode step whose logits wait for the host's masks.
struct DeferredLogits {
    bucket: usize,
    /// Its row adjustments' staging set, and its staging slot and logits rows.
    set: usize,
    slot: usize,
    rows: usize,
}

/// The started steps of a GPU.
pub(super) struct OverlapState {
    /// The chosen ids of a started step come back into the buffer of its staging slot.
    ids: [PinnedBuffer<u32>; 2],
    /// Steps started and not yet finished (at most two).
    started: usize,
    /// The rows of the last step started while the argmax buffer still holds its ids (the next
    /// may take its tokens there).
    pub argmax_rows_of_started: Option<usize>,
    /// The started step whose logits wait for its masks, and the marks of such steps' ids.
    deferred: Option<DeferredLogits>,
    deferred_done: [Option<Event>; 2],
}

impl OverlapState {
    pub(super) fn new(gpu: &Gpu, limits: &StepLimits) -> Result<OverlapState, CudaError> {
        Ok(OverlapState {
            ids: [
                gpu.alloc_pinned(limits.logit_rows, "greedy token ids")?,
                gpu.alloc_pinned(limits.logit_rows, "greedy token ids")?,
            ],
            started: 0,
            argmax_rows_of_started: None,
            deferred: None,
            deferred_done: [None, None],
        })
    }
}

impl GpuTransformer {
    /// The logits of a decode step of bucket `b` whose layers are queued: waits for its masks
    /// (staging set `set`), uploads them, then the norm, LM head, bias and mask, and the choice.
    pub(super) fn adjusted_logits(&mut self, b: usize, set: usize) -> Result<(), CudaError> {
        self.adjusts.upload(&self.gpu, set)?;
        self.profile_phase("wait for the host's grammar masks");
        self.logits_chunk(0, b, true)
    }

    /// Launches the logits of the started step that waits for its masks, if any, and queues its
    /// ids' copy back.
    fn launch_deferred(&mut self) -> Result<(), CudaError> {
        let Some(d) = self.overlap.deferred.take() else {
            return Ok(());
        };
        self.adjusted_logits(d.bucket, d.set)?;
        // SAFETY: as in `start_decode`: the ids of slot `d.slot` are read only after this mark.
        unsafe {
            self.gpu
                .read_async(&self.bufs.argmax, 0, &mut self.overlap.ids[d.slot], d.rows)?;
        }
        self.overlap.deferred_done[d.slot] = Some(self.gpu.mark()?);
        Ok(())
    }

    /// Whether decode steps of ids chosen on the GPU may be started before the host has read the
    /// previous one ([`Self::start_decode`]): the whole model on this GPU, not profiled, not
    /// turned off by `STRATA_OVERLAP=0`.
    pub fn overlaps_steps(&self) -> bool {
        self.knobs.overlap
            && self.profile.is_none()
            && self.comms.tp.is_none()
            && self.comms.pp.is_none()
            && self.shard.is_first_stage()
            && self.shard.is_last_stage()
    }

    /// Starts a decode step whose tokens are chosen on the GPU (one each, `LogitsWanted::LastArgmax`
    /// or `LastSampled`) without waiting for it: inputs uploaded from pinned memory, the step
    /// queued, its chosen ids queued to come back. With `tokens_from`, chunk i's token is not
    /// known on the host yet: it is the id chosen for row `tokens_from[i]` of the decode step
    /// started just before, taken on the device (sampling.cu's `tokens_from_argmax`), and the
    /// chunk's own token is a placeholder (any id of the vocabulary). At most two steps are
    /// started and not finished; [`Self::finish_decode`] returns each.
    pub fn start_decode(
        &mut self,
        batch: &[SeqChunk],
        tokens_from: Option<&[usize]>,
    ) -> Result<StartedDecode, ModelError> {
        let bad = |m: &str| Err(ModelError::BadBatch(m.to_string()));
        if !self.overlaps_steps() {
            return bad(
                "this GPU runs one step at a time here (several GPUs, profiling or STRATA_OVERLAP=0); call forward",
            );
        }
        if self.overlap.started >= 2 {
            return bad("two decode steps are started already; finish one first");
        }
        let tokens_on_device = batch.iter().all(|c| c.tokens.len() == 1 && c.logits.wants_id_only());
        if batch.is_empty() || !tokens_on_device {
            return bad(
                "only steps of decodes whose token is chosen on the GPU (argmax or sampled) start without waiting",
            );
        }
        let Some(b) = graph_bucket(batch.len(), self.limits.max_seqs) else {
            return bad("more sequences than --max-num-seqs in one decode step");
        };
        if let Some(from) = tokens_from {
            let rows = self.overlap.argmax_rows_of_started.unwrap_or(0);
            if from.len() != batch.len() || from.iter().any(|&r| r >= rows) {
                return bad("tokens taken from rows the decode step started before does not have");
            }
        }
        let gpu_err = |e: CudaError| ModelError::Device(e.to_string());
        self.gpu.bind().map_err(gpu_err)?;
        self.limits.check(batch, &self.config, &self.kv)?;
        // The step before may wait for its masks (begun once the one before it was read): its
        // logits go first, as this step may take its tokens.
        self.launch_deferred().map_err(gpu_err)?;
        self.decode_bucket = Some(b);
        let max_blocks = self.limits.max_blocks(self.kv.block_size);
        let step = self
            .inputs
            .stage(batch, b, max_blocks, &self.kv, false)
            .map_err(gpu_err)?;
        let adjusted = self
            .adjusts
            .stage(batch, step.rows.iter().map(|r| r.seq), b)
            .map_err(gpu_err)?;
        // Tokens that come from the device: their rows take the placeholders' place.
        if let Some(from) = tokens_from {
            self.inputs.set_tokens(from);
        }
        let tokens_at = self.inputs.layout.tokens;
        // SAFETY: the staging array is not written again before its upload has passed (`stage`
        // waits for it); the ids of `slot` are read only after `done`, and no other step starts
        // in this slot before this one is finished (at most two started, slots in turn).
        let slot = unsafe { self.inputs.upload_async(&self.gpu, &self.bufs.inputs) }.map_err(gpu_err)?;
        if tokens_from.is_some() {
            TokensFromArgmaxCall {
                tokens: self.bufs.inputs.at(tokens_at * 4),
                ids: self.bufs.argmax.ptr(),
                n: batch.len() as i32,
            }
            .launch_with(self.launcher())
            .map_err(gpu_err)?;
        }
        self.run_decode(b, adjusted.is_some()).map_err(gpu_err)?;
        let rows = step.rows.len();
        // Adjusted rows: the logits wait for the masks, which the host begins once it has read
        // the step before (at the next start or at the finish).
        let done = match adjusted {
            Some(set) => {
                self.overlap.deferred = Some(DeferredLogits {
                    bucket: b,
                    set,
                    slot,
                    rows,
                });
                None
            }
            None => {
                // SAFETY: as above.
                unsafe {
                    self.gpu
                        .read_async(&self.bufs.argmax, 0, &mut self.overlap.ids[slot], rows)
                        .map_err(gpu_err)?;
                }
                Some(self.gpu.mark().map_err(gpu_err)?)
            }
        };
        self.overlap.started += 1;
        self.overlap.argmax_rows_of_started = Some(rows);
        Ok(StartedDecode {
            seqs: step.rows.iter().map(|r| r.seq).collect(),
            slot,
            done,
        })
    }

    /// Waits for a step of [`Self::start_decode`] and returns its chosen tokens.
    pub fn finish_decode(&mut self, step: StartedDecode) -> Result<Logits, ModelError> {
        let gpu_err = |e: CudaError| ModelError::Device(e.to_string());
        self.overlap.started = self.overlap.started.saturating_sub(1);
        let done = match step.done {
            Some(done) => done,
            None => {
                if self.overlap.deferred.as_ref().is_some_and(|d| d.slot == step.slot) {
                    self.launch_deferred().map_err(gpu_err)?;
                }
                self.overlap.deferred_done[step.slot]
                    .take()
                    .ok_or_else(|| ModelError::BadBatch("a started step's logits were never launched".into()))?
            }
        };
        done.synchronize().map_err(gpu_err)?;
        let ids = &self.overlap.ids[step.slot];
        Ok(Logits {
            vocab: self.local.vocab_size,
            argmax: step.seqs.iter().enumerate().map(|(j, &seq)| (seq, ids[j])).collect(),
            ..Default::default()
        })
    }
}
