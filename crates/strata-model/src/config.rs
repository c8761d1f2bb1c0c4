//! The shape of a decoder-only transformer of the llama family, independent of file format.
//! Readers fill a `ModelConfig` (its architecture's description included); the forward passes and the KV cache read only this.

use strata_formats::limits::{
    MAX_CONTEXT, MAX_HEADS, MAX_HEAD_DIM, MAX_HIDDEN, MAX_INTERMEDIATE, MAX_LAYERS, MAX_VOCAB,
};
use strata_runtime::cpu::ops::RopeLayout;

use crate::architectures::Architecture;

/// How positions are scaled before the rotary embedding.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama-3.1 frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: f32,
    },
    /// Per-frequency divisors, as GGUF stores Llama-3 scaling (`rope_freqs.weight`).
    FreqFactors(Vec<f32>),
}

/// Rotary position embedding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    /// Rotated dimensions per head (usually `head_dim`).
    pub dim: usize,
    pub layout: RopeLayout,
    pub scaling: RopeScaling,
}

impl RopeConfig {
    /// The inverse frequency of each rotated pair, scaling applied.
    pub fn inv_freq(&self) -> Vec<f32> {
        let half = self.dim / 2;
        (0..half)
            .map(|i| {
                let base = (self.theta as f64).powf(-2.0 * i as f64 / self.dim as f64);
                let f = match &self.scaling {
                    RopeScaling::None => base,
                    RopeScaling::Linear { factor } => base / *factor as f64,
                    RopeScaling::FreqFactors(ff) => base / ff.get(i).copied().unwrap_or(1.0) as f64,
                    RopeScaling::Llama3 {
                        factor,
                        low_freq_factor,
                        high_freq_factor,
                        original_max_position,
                    } => {
                        let (factor, lo, hi, orig) = (
                            *factor as f64,
                            *low_freq_factor as f64,
                            *high_freq_factor as f64,
                            *original_max_position as f64,
                        );
                        let wavelen = 2.0 * std::f64::consts::PI / base;
                        let low_freq_wavelen = orig / lo;
                        let high_freq_wavelen = orig / hi;
                        if wavelen < high_freq_wavelen {
                            base
                        } else if wavelen > low_freq_wavelen {
                            base / factor
                        } else {
                            let smooth = (orig / wavelen - lo) / (hi - lo);
                            (1.0 - smooth) * base / factor + smooth * base
                        }
                    }
                };
                f as f32
            })
            .collect()
    }
}

/// The cosine and sine of each rotated pair's angle at `pos` (position times inverse frequency,
/// in f64, then rounded to f32): the one rule the CPU backend's rotation and the CUDA kernels'
/// table ([`rope_cos_sin_table`]) follow.
pub fn rope_cos_sin(inv_freq: &[f32], pos: usize) -> impl Iterator<Item = (f32, f32)> + '_ {
    inv_freq.iter().map(move |&f| {
        let angle = pos as f64 * f as f64;
        (angle.cos() as f32, angle.sin() as f32)
    })
}

/// [`rope_cos_sin`] of every position below `positions`, as `[position][pair][cos, sin]`: what
/// the CUDA kernels rotate by (one lookup a pair instead of a `sincosf`).
pub fn rope_cos_sin_table(inv_freq: &[f32], positions: usize) -> Vec<f32> {
    let mut table = Vec::with_capacity(positions * inv_freq.len() * 2);
    for pos in 0..positions {
        for (c, s) in rope_cos_sin(inv_freq, pos) {
            table.push(c);
            table.push(s);
        }
    }
    table
}

/// Everything the forward pass needs to know about a model's shape.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// How the architecture differs from the llama family's decoder (biases, QK-norm).
    pub arch: &'static Architecture,
    pub n_layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_eps: f32,
    pub rope: RopeConfig,
    /// Longest context the model was trained for.
    pub max_position: usize,
    /// The LM head reuses the token embedding.
    pub tied_embeddings: bool,
}

impl ModelConfig {
    /// A one-layer Llama-shaped config with `n_kv_heads` KV heads of `head_dim` and `group`
    /// query heads per KV head, for tests of the attention loops.
    #[cfg(test)]
    pub(crate) fn tiny_attention(n_kv_heads: usize, group: usize, head_dim: usize) -> ModelConfig {
        ModelConfig {
            arch: &crate::architectures::LLAMA,
            n_layers: 1,
            hidden: n_kv_heads * group * head_dim,
            intermediate: 64,
            n_heads: n_kv_heads * group,
            n_kv_heads,
            head_dim,
            vocab_size: 10,
            rms_eps: 1e-5,
            rope: RopeConfig {
                theta: 10000.0,
                dim: head_dim,
                layout: RopeLayout::Neox,
                scaling: RopeScaling::None,
            },
            max_position: 64,
            tied_embeddings: false,
        }
    }

    /// Values stored per token per layer in K (and again in V).
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }

    /// Query width.
    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }

    /// The widest input of a layer's products (QKV and gate/up read `hidden`, o `q_dim`, down
    /// `intermediate`): what a buffer of quantized activations is sized by.
    pub fn widest_product_input(&self) -> usize {
        self.hidden.max(self.q_dim()).max(self.intermediate)
    }

    /// Checks the numbers are consistent, so the forward pass can index without surprises, and
    /// within strata's [limits](strata_formats::limits), so that nothing sized by them is absurd.
    pub fn validate(&self) -> Result<(), String> {
        let over = |what: &str, value: usize, limit: usize| {
            format!("{what} {value} is over strata's limit of {limit}; the file is corrupt")
        };
        let checks = [
            (self.n_layers > 0, "block count is 0".to_string()),
            (
                self.n_layers <= MAX_LAYERS,
                over("block count", self.n_layers, MAX_LAYERS),
            ),
            (
                self.hidden > 0 && self.intermediate > 0,
                "embedding or feed-forward length is 0".into(),
            ),
            (
                self.hidden <= MAX_HIDDEN,
                over("embedding length", self.hidden, MAX_HIDDEN),
            ),
            (
                self.intermediate <= MAX_INTERMEDIATE,
                over("feed-forward length", self.intermediate, MAX_INTERMEDIATE),
            ),
            (self.n_heads > 0 && self.n_kv_heads > 0, "head count is 0".into()),
            (self.n_heads <= MAX_HEADS, over("head count", self.n_heads, MAX_HEADS)),
            (
                self.n_heads.is_multiple_of(self.n_kv_heads),
                format!(
                    "{} heads are not a multiple of {} KV heads",
                    self.n_heads, self.n_kv_heads
                ),
            ),
            (
                self.head_dim > 0 && self.head_dim <= MAX_HEAD_DIM,
                format!("head dimension {} is out of range 1..={MAX_HEAD_DIM}", self.head_dim),
            ),
            (
                self.rope.dim.is_multiple_of(2) && self.rope.dim <= self.head_dim,
                format!(
                    "RoPE dimension {} must be even and at most the head dimension {}",
                    self.rope.dim, self.head_dim
                ),
            ),
            (self.vocab_size > 0, "vocabulary is empty".into()),
            (
                self.vocab_size <= MAX_VOCAB,
                over("vocabulary size", self.vocab_size, MAX_VOCAB),
            ),
            (self.max_position > 0, "context length is 0".into()),
            (
                self.max_position <= MAX_CONTEXT,
                over("context length", self.max_position, MAX_CONTEXT),
            ),
            (
                self.rms_eps > 0.0 && self.rms_eps.is_finite(),
                format!("RMSNorm epsilon {} is invalid", self.rms_eps),
            ),
            (
                self.rope.theta > 0.0 && self.rope.theta.is_finite(),
                format!(
                    "RoPE base {} is invalid (it must be a positive number)",
                    self.rope.theta
                ),
            ),
        ];
        match checks.into_iter().find(|(ok, _)| !ok) {
            Some((_, why)) => Err(why),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let rope = RopeConfig {
            theta: 500000.0,
            dim: 128,
            layout: RopeLayout::Neox,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192.0,
            },
        };
        let plain = RopeConfig {
            scaling: RopeScaling::None,
            ..rope.clone()
        }
        .inv_freq();
        let scaled = rope.inv_freq();
        assert_eq!(scaled[0], plain[0]);
        assert!((scaled[63] - plain[63] / 8.0).abs() < 1e-12);
        assert!(scaled[40] <= plain[40] && scaled[40] >= plain[40] / 8.0);
    }
}
