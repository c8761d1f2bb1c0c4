//! Reading a model's shape from GGUF metadata, one small file per architecture.
//! Each architecture says how it differs from the common llama-family hyper-parameters.

mod llama;
mod mistral;
mod qwen2;
mod qwen3;

use strata_formats::gguf::GgufFile;
use strata_runtime::cpu::ops::RopeLayout;

use crate::config::{Arch, ModelConfig, RopeConfig, RopeScaling};
use crate::error::ModelError;
use crate::weights::check_layer_count;

/// The model shape described by a GGUF file's metadata.
pub fn config_from_gguf(file: &GgufFile) -> Result<ModelConfig, ModelError> {
    let name = file
        .get_str("general.architecture")
        .ok_or_else(|| ModelError::BadMetadata("missing general.architecture".into()))?;
    let h = Hparams { file, prefix: name };
    let config = match name {
        "llama" => llama::config(&h)?,
        "mistral" => mistral::config(&h)?,
        "qwen2" => qwen2::config(&h)?,
        "qwen3" => qwen3::config(&h)?,
        other => {
            return Err(ModelError::UnsupportedArch {
                arch: other.to_string(),
                supported: Arch::ALL.iter().map(|a| a.gguf_name()).collect::<Vec<_>>().join(", "),
            })
        }
    };
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
    fn base(&self, arch: Arch, layout: RopeLayout) -> Result<ModelConfig, ModelError> {
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
                layout,
                scaling,
            },
            max_position: self.opt_usize("context_length")?.unwrap_or(4096),
            qkv_bias: false,
            qk_norm: false,
            tied_embeddings: self.file.tensor("output.weight").is_none(),
        })
    }
}
