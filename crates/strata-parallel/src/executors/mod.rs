//! Tensor- and pipeline-parallel execution over several GPUs of one process (feature `cuda`):
//! the executor, its worker threads (one per GPU) and the watchdog that bounds every step.
//!
//! Every step goes to every worker. A TP group's ranks run the same kernels on their heads and MLP
//! columns and all-reduce after attention and after the MLP; a pipeline stage receives the
//! residual stream from the stage before and sends it on. The last stage's ranks return logits of
//! their vocabulary slices, merged here. A step that does not finish within the collective
//! timeout (a rank stopped responding, a link hangs) aborts the communicators and fails with
//! [`ModelError::Unavailable`], naming the GPUs and the operation: strata never waits forever.

mod tensor_pipeline;
mod watchdog;
mod worker;

use strata_model::cuda::Shard;
use strata_model::{ModelConfig, ModelError};
use strata_runtime::cuda::CudaError;

use crate::layout::ParallelLayout;

pub use tensor_pipeline::ParallelExecutor;

impl ParallelLayout {
    /// Checks the layout against the model: the stages cover every layer in order, one GPU per
    /// worker, and the TP size divides the heads.
    pub fn check(&self, c: &ModelConfig) -> Result<(), String> {
        Shard::check_tp(c, self.tp)?;
        let mut next = 0;
        for r in &self.stages {
            if r.start != next || r.is_empty() {
                return Err(format!(
                    "pipeline stages {:?} must cover layers 0..{} in order, each non-empty",
                    self.stages, c.n_layers
                ));
            }
            next = r.end;
        }
        if next != c.n_layers {
            return Err(format!(
                "pipeline stages {:?} must cover layers 0..{} in order",
                self.stages, c.n_layers
            ));
        }
        if self.gpus.len() != self.tp * self.pp() {
            return Err(format!(
                "{} GPUs listed for TP {} x PP {}",
                self.gpus.len(),
                self.tp,
                self.pp()
            ));
        }
        let mut seen = self.gpus.clone();
        seen.sort_unstable();
        seen.dedup();
        if seen.len() != self.gpus.len() {
            return Err(format!("GPU listed twice in {:?}", self.gpus));
        }
        Ok(())
    }

    /// The shard of worker `w`.
    pub(crate) fn shard(&self, w: usize, n_layers: usize) -> Shard {
        Shard {
            tp_rank: w % self.tp,
            tp_size: self.tp,
            layers: self.stages[w / self.tp].clone(),
            n_layers,
        }
    }
}

fn device_error(e: CudaError) -> ModelError {
    ModelError::Device(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_are_checked_against_the_model() {
        // SmolLM2-135M: 30 layers, 9 query heads, 3 KV heads.
        let path = strata_model::loader::default_model_path();
        if !path.exists() {
            println!("skipped: {} is missing (make fetch)", path.display());
            return;
        }
        let file = strata_model::loader::open_gguf(&path).unwrap();
        let c = strata_model::architectures::config_from_gguf(&file).unwrap();
        assert!(ParallelLayout::even(30, 3, 1).check(&c).is_ok());
        let mut gaps = ParallelLayout::even(30, 1, 2);
        gaps.stages[1] = 16..30;
        assert!(gaps.check(&c).unwrap_err().contains("cover layers"));
        let mut twice = ParallelLayout::even(30, 3, 1);
        twice.gpus = vec![0, 1, 1];
        assert!(twice.check(&c).unwrap_err().contains("twice"));
        assert!(ParallelLayout::even(30, 2, 1)
            .check(&c)
            .unwrap_err()
            .contains("9 query heads"));
        assert!(ParallelLayout::even(32, 1, 2).check(&c).is_err());
    }

    #[test]
    fn workers_hold_their_stage_and_rank() {
        let l = ParallelLayout::even(80, 2, 2);
        assert_eq!(l.shard(3, 80).tp_rank, 1);
        assert_eq!(l.shard(3, 80).layers, 40..80);
        assert_eq!(l.shard(0, 80).layers, 0..40);
    }
}
