//! The layout the multi-GPU executors run: the TP size, each pipeline stage's layers and each
//! worker's GPU, as a [`Plan`] chooses it or a test spells it out.

use std::ops::Range;

use crate::planner::{Candidate, Plan};

/// How the model is spread: `tp` GPUs per stage, one layer range per pipeline stage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParallelLayout {
    pub tp: usize,
    /// Layers of each pipeline stage, in order, covering the model.
    pub stages: Vec<Range<usize>>,
    /// GPU ordinal of each worker: stage by stage, TP ranks within a stage.
    pub gpus: Vec<usize>,
}

impl ParallelLayout {
    /// `pp` stages of near-equal layer counts (earlier stages take the remainder) over GPUs
    /// `0..tp * pp`.
    pub fn even(n_layers: usize, tp: usize, pp: usize) -> ParallelLayout {
        let pp = pp.max(1);
        let mut stages = Vec::with_capacity(pp);
        let mut start = 0;
        for s in 0..pp {
            let n = n_layers / pp + usize::from(s < n_layers % pp);
            stages.push(start..start + n);
            start += n;
        }
        ParallelLayout {
            tp: tp.max(1),
            stages,
            gpus: (0..tp.max(1) * pp).collect(),
        }
    }

    pub fn pp(&self) -> usize {
        self.stages.len()
    }

    /// "TP 2 x PP 1 on GPUs 0,1".
    pub fn describe(&self) -> String {
        format!("TP {} x PP {} on GPUs {}", self.tp, self.pp(), gpu_list(&self.gpus))
    }
}

pub(crate) fn gpu_list(gpus: &[usize]) -> String {
    gpus.iter().map(|g| g.to_string()).collect::<Vec<_>>().join(",")
}

impl From<&Candidate> for ParallelLayout {
    /// The candidate's TP size, its stages' layer ranges and their GPUs, stage by stage.
    fn from(c: &Candidate) -> ParallelLayout {
        ParallelLayout {
            tp: c.tp,
            stages: c
                .stages
                .iter()
                .map(|s| s.first_layer..s.first_layer + s.n_layers)
                .collect(),
            gpus: c.stages.iter().flat_map(|s| s.gpus.iter().copied()).collect(),
        }
    }
}

impl Plan {
    /// The layout the executors run for the chosen candidate.
    pub fn layout(&self) -> ParallelLayout {
        ParallelLayout::from(&self.chosen)
    }

    /// Sets the NCCL environment the plan lists, where the user has not set it (before the
    /// executors create their communicators).
    pub fn set_nccl_env(&self) {
        for s in &self.nccl_env {
            if std::env::var_os(&s.name).is_none() {
                std::env::set_var(&s.name, &s.value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_layouts_cover_the_layers() {
        let l = ParallelLayout::even(32, 1, 3);
        assert_eq!(l.stages, vec![0..11, 11..22, 22..32]);
        assert_eq!(l.gpus, vec![0, 1, 2]);
        let l = ParallelLayout::even(80, 2, 2);
        assert_eq!(l.stages, vec![0..40, 40..80]);
        assert_eq!(l.describe(), "TP 2 x PP 2 on GPUs 0,1,2,3");
    }
}
