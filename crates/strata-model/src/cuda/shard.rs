//! Which part of a model one GPU holds under tensor and pipeline parallelism: its query and KV
//! heads, MLP columns and vocabulary rows (its rank in a TP group) and its layer range (its stage).

use std::ops::Range;

use crate::config::ModelConfig;

/// One GPU's part of the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    pub tp_rank: usize,
    pub tp_size: usize,
    /// The layers of this GPU's pipeline stage.
    pub layers: Range<usize>,
    /// Layers of the whole model.
    pub n_layers: usize,
}

impl Shard {
    /// The whole model on one GPU.
    pub fn whole(c: &ModelConfig) -> Shard {
        Shard {
            tp_rank: 0,
            tp_size: 1,
            layers: 0..c.n_layers,
            n_layers: c.n_layers,
        }
    }

    /// Whether `c` splits over `tp` GPUs: query heads and MLP width divide evenly, and KV heads
    /// either divide evenly or are fewer than the GPUs (then each GPU keeps the one its queries use).
    pub fn check_tp(c: &ModelConfig, tp: usize) -> Result<(), String> {
        let kv_ok = tp > 0 && (c.n_kv_heads.is_multiple_of(tp) || tp.is_multiple_of(c.n_kv_heads));
        if !kv_ok || !c.n_heads.is_multiple_of(tp) || !c.intermediate.is_multiple_of(tp) {
            return Err(format!(
                "tensor parallel size {tp} does not divide the model: {} query heads, {} KV heads, MLP width {}; pick a size that divides the query heads (or use --pipeline-parallel-size)",
                c.n_heads, c.n_kv_heads, c.intermediate
            ));
        }
        Ok(())
    }

    /// Takes the embedding (and the step's token ids).
    pub fn is_first_stage(&self) -> bool {
        self.layers.start == 0
    }

    /// Holds the final norm and the LM head.
    pub fn is_last_stage(&self) -> bool {
        self.layers.end == self.n_layers
    }

    /// Query heads of this rank.
    pub fn q_heads(&self, c: &ModelConfig) -> Range<usize> {
        let n = c.n_heads / self.tp_size;
        self.tp_rank * n..(self.tp_rank + 1) * n
    }

    /// KV heads of this rank: its share, or the single head its query heads use when there are
    /// fewer KV heads than ranks (replicated).
    pub fn kv_heads(&self, c: &ModelConfig) -> Range<usize> {
        if c.n_kv_heads >= self.tp_size {
            let n = c.n_kv_heads / self.tp_size;
            self.tp_rank * n..(self.tp_rank + 1) * n
        } else {
            let h = self.tp_rank * c.n_kv_heads / self.tp_size;
            h..h + 1
        }
    }

    /// MLP columns (rows of gate and up, columns of down) of this rank.
    pub fn mlp(&self, c: &ModelConfig) -> Range<usize> {
        let n = c.intermediate / self.tp_size;
        self.tp_rank * n..(self.tp_rank + 1) * n
    }

    /// Vocabulary rows (of the embedding and the LM head) of this rank; the last may be shorter.
    pub fn vocab(&self, c: &ModelConfig) -> Range<usize> {
        let n = c.vocab_size.div_ceil(self.tp_size);
        (self.tp_rank * n).min(c.vocab_size)..((self.tp_rank + 1) * n).min(c.vocab_size)
    }

    /// The shapes this GPU computes with: its heads, MLP width, vocabulary rows and layer count.
    pub fn local_config(&self, c: &ModelConfig) -> ModelConfig {
        ModelConfig {
            n_layers: self.layers.len(),
            intermediate: self.mlp(c).len(),
            n_heads: self.q_heads(c).len(),
            n_kv_heads: self.kv_heads(c).len(),
            vocab_size: self.vocab(c).len(),
            ..c.clone()
        }
    }
}

/// Model shapes for the tests of this module.
#[cfg(test)]
pub(crate) mod tests_support {
    use crate::architectures::LLAMA;
    use crate::config::{ModelConfig, RopeConfig, RopeScaling};
    use strata_runtime::cpu::ops::RopeLayout;

    pub fn llama(n_heads: usize, n_kv: usize) -> ModelConfig {
        ModelConfig {
            arch: &LLAMA,
            n_layers: 32,
            hidden: 4096,
            intermediate: 14336,
            n_heads,
            n_kv_heads: n_kv,
            head_dim: 128,
            vocab_size: 128_257,
            rms_eps: 1e-5,
            rope: RopeConfig {
                theta: 500_000.0,
                dim: 128,
                layout: RopeLayout::Neox,
                scaling: RopeScaling::None,
            },
            max_position: 8192,
            tied_embeddings: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::llama;
    use super::*;

    fn rank(r: usize, tp: usize) -> Shard {
        Shard {
            tp_rank: r,
            tp_size: tp,
            layers: 0..32,
            n_layers: 32,
        }
    }

    #[test]
    fn heads_mlp_and_vocabulary_split_evenly() {
        let c = llama(32, 8);
        let s = rank(1, 2);
        assert_eq!(s.q_heads(&c), 16..32);
        assert_eq!(s.kv_heads(&c), 4..8);
        assert_eq!(s.mlp(&c), 7168..14336);
        // 128257 rows: 64129 and 64128.
        assert_eq!(rank(0, 2).vocab(&c), 0..64129);
        assert_eq!(s.vocab(&c), 64129..128_257);
        let l = s.local_config(&c);
        assert_eq!(
            (l.n_heads, l.n_kv_heads, l.intermediate, l.vocab_size),
            (16, 4, 7168, 64128)
        );
    }

    #[test]
    fn fewer_kv_heads_than_ranks_are_replicated() {
        // 8 query heads in groups of 4 over 2 KV heads, on 4 GPUs: ranks 0,1 use KV head 0.
        let c = llama(8, 2);
        let heads: Vec<_> = (0..4).map(|r| rank(r, 4).kv_heads(&c)).collect();
        assert_eq!(heads, vec![0..1, 0..1, 1..2, 1..2]);
        for r in 0..4 {
            let s = rank(r, 4);
            let group = c.n_heads / c.n_kv_heads;
            assert!(s.q_heads(&c).all(|q| s.kv_heads(&c).contains(&(q / group))));
        }
    }

    #[test]
    fn sizes_that_do_not_divide_are_refused() {
        let c = llama(32, 8);
        assert!(Shard::check_tp(&c, 2).is_ok());
        assert!(Shard::check_tp(&c, 16).is_ok(), "16 ranks, 8 KV heads replicated");
        let err = Shard::check_tp(&c, 3).unwrap_err();
        assert!(err.contains("32 query heads"), "{err}");
    }

    #[test]
    fn stages_know_their_ends() {
        let c = llama(32, 8);
        let first = Shard {
            layers: 0..20,
            ..Shard::whole(&c)
        };
        let last = Shard {
            layers: 20..32,
            ..Shard::whole(&c)
        };
        assert!(first.is_first_stage() && !first.is_last_stage());
        assert!(!last.is_first_stage() && last.is_last_stage());
        assert_eq!(last.local_config(&c).n_layers, 12);
    }
}
