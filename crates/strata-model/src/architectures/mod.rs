//! The architectures strata runs, one small file each saying how it differs from the llama-family
//! decoder (biases, QK-norm, RoPE layout): the one description GGUF and config.json readers and both backends use.

mod llama;
mod mistral;
mod qwen2;
mod qwen3;

use strata_formats::gguf::GgufFile;
use strata_formats::GgmlType;
use strata_runtime::cpu::ops::RopeLayout;

use crate::config::{ModelConfig, RopeConfig, RopeScaling};
use crate::error::ModelError;
use crate::weights::check_layer_count;

pub use llama::LLAMA;
pub use mistral::MISTRAL;
pub use qwen2::QWEN2;
pub use qwen3::QWEN3;

/// How one architecture differs from the llama-family decoder: pre-norm RMSNorm blocks,
/// attention with RoPE, a SiLU-gated MLP. Adding an architecture is a file with one of these,
/// its entry in [`ARCHITECTURES`], and tests.
#[derive(Debug, PartialEq, Eq)]
pub struct Architecture {
    /// `general.architecture` in GGUF files and `model_type` in config.json.
    pub name: &'static str,
    /// The class config.json names in `architectures`.
    pub hf_class: &'static str,
    /// Q, K and V projections carry a bias.
    pub qkv_bias: bool,
    /// Each head of Q and K is RMS-normed before RoPE.
    pub qk_norm: bool,
    /// The pairs RoPE rotates in GGUF files: llama.cpp permutes the Q/K rows of llama-layout
    /// models for adjacent pairs (`Interleaved`); others keep HF's row order and rotate halves
    /// (`Neox`), as every HF checkpoint does.
    pub gguf_rope: RopeLayout,
}

/// Every architecture strata runs.
pub const ARCHITECTURES: [&Architecture; 4] = [&LLAMA, &MISTRAL, &QWEN2, &QWEN3];

impl Architecture {
    /// The architecture of this GGUF / config.json name.
    pub fn named(name: &str) -> Option<&'static Architecture> {
        ARCHITECTURES.into_iter().find(|a| a.name == name)
    }

    /// The architecture of this config.json class.
    pub fn of_hf_class(class: &str) -> Option<&'static Architecture> {
        ARCHITECTURES.into_iter().find(|a| a.hf_class == class)
    }
}

/// The model shape described by a GGUF file's metadata.
pub fn config_from_gguf(file: &GgufFile) -> Result<ModelConfig, ModelError> {
    let name = file
        .get_str("general.architecture")
        .ok_or_else(|| ModelError::BadMetadata("missing general.architecture".into()))?;
    let arch = Architecture::named(name).ok_or_else(|| ModelError::UnsupportedArch {
        arch: name.to_string(),
        supported: ARCHITECTURES.map(|a| a.name).join(", "),
    })?;
    let h = Hparams { file, prefix: name };
    let mut config = h.base(arch)?;
    if let Some(factors) = h.rope_freq_factors(config.rope.dim)? {
        config.rope.scaling = RopeScaling::FreqFactors(factors);
    }
    config.validate().map_err(ModelError::BadMetadata)?;
    let names = file.tensors().iter().map(|t| t.name.as_str());
    check_layer_count(config.n_layers, names, false, &format!("{name}.block_count"))
        .map_err(ModelError::BadMetadata)?;
    Ok(config)
}

/// Typed access to `<arch>.*` metadata keys.
struct Hparams<'a> {
    file: &'a GgufFile,
    prefix: &'a str,
}

impl Hparams<'_> {
    fn key(&self, suffix: &str) -> String {
        format!("{}.{}", self.prefix, suffix)
    }

    fn usize(&self, suffix: &str) -> Result<usize, ModelError> {
        self.opt_usize(suffix)?
            .ok_or_else(|| ModelError::BadMetadata(format!("missing {}", self.key(suffix))))
    }

    fn opt_usize(&self, suffix: &str) -> Result<Option<usize>, ModelError> {
        let key = self.key(suffix);
        match self.file.get(&key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .filter(|&n| n <= 1 << 40)
                .map(|n| Some(n as usize))
                .ok_or_else(|| ModelError::BadMetadata(format!("{key} = {v} is not a valid count"))),
        }
    }

    fn opt_f32(&self, suffix: &str) -> Option<f32> {
        self.file.get_f64(&self.key(suffix)).map(|v| v as f32)
    }

    fn opt_str(&self, suffix: &str) -> Option<&str> {
        self.file.get_str(&self.key(suffix))
    }

    /// The hyper-parameters every llama-family model shares.
    fn base(&self, arch: &'static Architecture) -> Result<ModelConfig, ModelError> {
        let hidden = self.usize("embedding_length")?;
        let n_heads = self.usize("attention.head_count")?;
        let n_kv_heads = self.opt_usize("attention.head_count_kv")?.unwrap_or(n_heads);
        if n_heads == 0 {
            return Err(ModelError::BadMetadata(format!(
                "{} is 0",
                self.key("attention.head_count")
            )));
        }
        let head_dim = self.opt_usize("attention.key_length")?.unwrap_or(hidden / n_heads);
        let vocab_size = match self.opt_usize("vocab_size")? {
            Some(v) => v,
            None => self
                .file
                .get_array("tokenizer.ggml.tokens")
                .map(|a| a.len())
                .or_else(|| self.file.tensor("token_embd.weight").map(|t| t.n_rows() as usize))
                .ok_or_else(|| ModelError::BadMetadata("cannot tell the vocabulary size".into()))?,
        };
        let rope_dim = self.opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
        let scaling = match (self.opt_str("rope.scaling.type"), self.opt_f32("rope.scaling.factor")) {
            (Some("linear"), Some(factor)) if factor > 0.0 => RopeScaling::Linear { factor },
            _ => RopeScaling::None,
        };
        Ok(ModelConfig {
            arch,
            n_layers: self.usize("block_count")?,
            hidden,
            intermediate: self.usize("feed_forward_length")?,
            n_heads,
            n_kv_heads,
            head_dim,
            vocab_size,
            rms_eps: self.opt_f32("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
            rope: RopeConfig {
                theta: self.opt_f32("rope.freq_base").unwrap_or(10000.0),
                dim: rope_dim,
                layout: arch.gguf_rope,
                scaling,
            },
            max_position: self.opt_usize("context_length")?.unwrap_or(4096),
            tied_embeddings: self.file.tensor("output.weight").is_none(),
        })
    }

    /// Llama-3.1 frequency factors from the `rope_freqs.weight` tensor, when present.
    fn rope_freq_factors(&self, rope_dim: usize) -> Result<Option<Vec<f32>>, ModelError> {
        let Some(t) = self.file.tensor("rope_freqs.weight") else {
            return Ok(None);
        };
        if t.ty != GgmlType::F32 || t.n_elements != (rope_dim / 2) as u64 {
            return Err(ModelError::BadMetadata(format!(
                "rope_freqs.weight should be {} F32 values, found {} {}",
                rope_dim / 2,
                t.n_elements,
                t.ty
            )));
        }
        let bytes = self.file.tensor_data(t);
        Ok(Some(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_architecture_is_found_by_its_names_and_only_by_them() {
        for arch in ARCHITECTURES {
            assert_eq!(Architecture::named(arch.name), Some(arch));
            assert_eq!(Architecture::of_hf_class(arch.hf_class), Some(arch));
        }
        let mut names = ARCHITECTURES.map(|a| a.name).to_vec();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ARCHITECTURES.len());
        assert_eq!(Architecture::named("gpt2"), None);
        assert_eq!(Architecture::of_hf_class("llama"), None);
        // What sets them apart.
        let flags = ARCHITECTURES.map(|a| (a.name, a.qkv_bias, a.qk_norm, a.gguf_rope));
        assert_eq!(
            flags,
            [
                ("llama", false, false, RopeLayout::Interleaved),
                ("mistral", false, false, RopeLayout::Interleaved),
                ("qwen2", true, false, RopeLayout::Neox),
                ("qwen3", false, true, RopeLayout::Neox),
            ]
        );
    }
}
