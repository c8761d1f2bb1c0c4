//! What the planner needs to know about a model: layer count, widths, and the bytes of each layer and the embeddings.
//! Built from a GGUF file (exact tensor bytes), a HF `config.json` (the few keys the planner reads) or a named preset.

use std::path::Path;

use serde::{Deserialize, Serialize};
use strata_formats::limits::{
    read_text_limited, MAX_HEADS, MAX_HEAD_DIM, MAX_HIDDEN, MAX_INTERMEDIATE, MAX_JSON_FILE_BYTES, MAX_LAYERS,
    MAX_VOCAB,
};
use strata_model::ModelConfig;

/// Why a model's shape could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ModelShapeError {
    #[error(transparent)]
    Model(#[from] strata_model::ModelError),
    #[error("cannot read {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("{path}: {reason}")]
    BadConfig { path: String, reason: String },
    #[error(
        "unknown model {name:?}: pass a GGUF file, a folder with config.json, a config.json, or one of: {presets}"
    )]
    Unknown { name: String, presets: String },
}

/// The widths of a llama-family decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelDims {
    pub n_layers: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub tied_embeddings: bool,
    /// Q, K and V projections carry a bias (Qwen2).
    pub qkv_bias: bool,
}

impl ModelDims {
    /// The dims of a model strata-model already understands.
    pub fn from_config(config: &ModelConfig) -> Self {
        ModelDims {
            n_layers: config.n_layers,
            hidden: config.hidden,
            intermediate: config.intermediate,
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            head_dim: config.head_dim,
            vocab_size: config.vocab_size,
            tied_embeddings: config.tied_embeddings,
            qkv_bias: config.arch.qkv_bias,
        }
    }

    /// Parameters of one decoder layer: attention, gated MLP, two norms, optional QKV bias.
    pub fn layer_params(&self) -> u64 {
        let (h, q, kv) = (
            self.hidden as u64,
            (self.n_heads * self.head_dim) as u64,
            (self.n_kv_heads * self.head_dim) as u64,
        );
        let attention = h * q + 2 * h * kv + q * h;
        let bias = if self.qkv_bias { q + 2 * kv } else { 0 };
        attention + bias + 3 * h * self.intermediate as u64 + 2 * h
    }

    /// Parameters of the token embedding (and of an untied LM head).
    pub fn embedding_params(&self) -> u64 {
        (self.vocab_size * self.hidden) as u64
    }

    pub fn total_params(&self) -> u64 {
        let heads = if self.tied_embeddings { 1 } else { 2 };
        self.layer_params() * self.n_layers as u64 + heads * self.embedding_params() + self.hidden as u64
    }
}

/// A model as the planner sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelShape {
    pub name: String,
    /// How the weights are stored, e.g. "bf16" or "GGUF 4.85 bits/weight".
    pub weight_format: String,
    pub dims: ModelDims,
    /// Bytes of each decoder layer's weights, in order.
    pub layer_bytes: Vec<u64>,
    pub embedding_bytes: u64,
    /// The LM head (and final norm); with tied embeddings the last stage holds a copy of the embedding.
    pub lm_head_bytes: u64,
}

/// Bits per weight of common GGUF quantizations (whole-file averages, as llama.cpp reports them).
pub const QUANTIZED_FORMATS: [(&str, f64); 3] = [("Q8_0", 8.5), ("Q5_K_M", 5.69), ("Q4_K_M", 4.85)];

impl ModelShape {
    /// A dense model whose every weight takes `bits_per_weight` bits.
    pub fn dense(name: &str, weight_format: &str, dims: ModelDims, bits_per_weight: f64) -> Self {
        let bytes = |params: u64| (params as f64 * bits_per_weight / 8.0).round() as u64;
        let embedding_bytes = bytes(dims.embedding_params());
        let lm_head = bytes(dims.embedding_params() + dims.hidden as u64);
        ModelShape {
            name: name.to_string(),
            weight_format: weight_format.to_string(),
            layer_bytes: vec![bytes(dims.layer_params()); dims.n_layers],
            embedding_bytes,
            lm_head_bytes: lm_head,
            dims,
        }
    }

    /// The same model quantized to `bits_per_weight` (what a GGUF of that type would weigh).
    pub fn requantized(&self, format: &str, bits_per_weight: f64) -> Self {
        ModelShape::dense(&self.name, format, self.dims.clone(), bits_per_weight)
    }

    /// All weight bytes (the LM head counted once even when tied).
    pub fn weight_bytes(&self) -> u64 {
        let head = if self.dims.tied_embeddings {
            0
        } else {
            self.lm_head_bytes
        };
        self.layer_bytes.iter().sum::<u64>() + self.embedding_bytes + head
    }

    /// KV-cache bytes per token per layer: K and V, `n_kv_heads * head_dim` values each.
    pub fn kv_bytes_per_token_layer(&self, kv_element_bytes: u64) -> u64 {
        2 * (self.dims.n_kv_heads * self.dims.head_dim) as u64 * kv_element_bytes
    }

    /// Reads a GGUF file: the shape from its metadata, the bytes from its tensor table (no weights are read).
    pub fn from_gguf(path: &Path) -> Result<Self, ModelShapeError> {
        let file = strata_model::loader::open_gguf(path)?;
        let config = strata_model::architectures::config_from_gguf(&file)?;
        let dims = ModelDims::from_config(&config);
        let mut layer_bytes = vec![0u64; dims.n_layers];
        let (mut embedding_bytes, mut lm_head_bytes, mut total_bytes, mut total_elements) = (0, 0, 0u64, 0u64);
        for tensor in file.tensors() {
            total_bytes += tensor.n_bytes;
            total_elements += tensor.n_elements;
            let layer = tensor
                .name
                .strip_prefix("blk.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|n| n.parse::<usize>().ok());
            match (layer, tensor.name.as_str()) {
                (Some(i), _) if i < layer_bytes.len() => layer_bytes[i] += tensor.n_bytes,
                (_, "token_embd.weight") => embedding_bytes += tensor.n_bytes,
                (_, "output.weight") | (_, "output_norm.weight") => lm_head_bytes += tensor.n_bytes,
                _ => {}
            }
        }
        if dims.tied_embeddings {
            lm_head_bytes += embedding_bytes;
        }
        let bits = if total_elements > 0 {
            total_bytes as f64 * 8.0 / total_elements as f64
        } else {
            0.0
        };
        let name = path
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().to_string());
        Ok(ModelShape {
            name,
            weight_format: format!("GGUF {bits:.2} bits/weight"),
            dims,
            layer_bytes,
            embedding_bytes,
            lm_head_bytes,
        })
    }

    /// Reads the planner's keys from a HF `config.json` (or the folder holding it).
    pub fn from_hf_config(path: &Path) -> Result<Self, ModelShapeError> {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let shown = file.display().to_string();
        let text = read_text_limited(&file, MAX_JSON_FILE_BYTES).map_err(|error| ModelShapeError::Read {
            path: shown.clone(),
            error,
        })?;
        let bad = |reason: String| ModelShapeError::BadConfig {
            path: shown.clone(),
            reason,
        };
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
        // Bounded by the loaders' limits: the plan sizes per-layer tables by these numbers.
        let key = |name: &str, limit: usize| -> Result<usize, ModelShapeError> {
            json.get(name)
                .and_then(|v| v.as_u64())
                .filter(|&n| n > 0 && n <= limit as u64)
                .map(|n| n as usize)
                .ok_or_else(|| bad(format!("missing or invalid {name} (strata reads 1 to {limit})")))
        };
        let n_heads = key("num_attention_heads", MAX_HEADS)?;
        let hidden = key("hidden_size", MAX_HIDDEN)?;
        let dims = ModelDims {
            n_layers: key("num_hidden_layers", MAX_LAYERS)?,
            hidden,
            intermediate: key("intermediate_size", MAX_INTERMEDIATE)?,
            n_heads,
            n_kv_heads: key("num_key_value_heads", MAX_HEADS).unwrap_or(n_heads),
            head_dim: key("head_dim", MAX_HEAD_DIM).unwrap_or(hidden / n_heads),
            vocab_size: key("vocab_size", MAX_VOCAB)?,
            tied_embeddings: json
                .get("tie_word_embeddings")
                .and_then(|v| v.as_bool())
                .unwrap_or(false),
            qkv_bias: json.get("model_type").and_then(|v| v.as_str()) == Some("qwen2"),
        };
        if dims.head_dim == 0 || !dims.n_heads.is_multiple_of(dims.n_kv_heads) {
            return Err(bad(format!(
                "{} heads, {} KV heads, head_dim {}: inconsistent",
                dims.n_heads, dims.n_kv_heads, dims.head_dim
            )));
        }
        let dtype = json.get("torch_dtype").and_then(|v| v.as_str()).unwrap_or("bfloat16");
        let (format, bits) = match dtype {
            "float32" => ("f32", 32.0),
            "float16" => ("f16", 16.0),
            "bfloat16" => ("bf16", 16.0),
            other => return Err(bad(format!("torch_dtype {other:?} is not one the planner sizes"))),
        };
        let name = file
            .parent()
            .and_then(|p| p.file_name())
            .map_or("model".into(), |s| s.to_string_lossy().to_string());
        Ok(ModelShape::dense(&name, format, dims, bits))
    }

    /// A GGUF file, a folder or `config.json`, or a preset name.
    pub fn resolve(model: &str) -> Result<Self, ModelShapeError> {
        if let Some(shape) = preset(model) {
            return Ok(shape);
        }
        let path = Path::new(model);
        if path.is_dir() || path.file_name().is_some_and(|n| n == "config.json") {
            return Self::from_hf_config(path);
        }
        if path.extension().is_some_and(|e| e == "gguf") || path.exists() {
            return Self::from_gguf(path);
        }
        Err(ModelShapeError::Unknown {
            name: model.to_string(),
            presets: PRESETS.iter().map(|p| p.0).collect::<Vec<_>>().join(", "),
        })
    }
}

/// Published architectures (the models' own `config.json`), all bf16.
const PRESETS: [(&str, ModelDims); 4] = [
    (
        "llama-3-8b",
        ModelDims {
            n_layers: 32,
            hidden: 4096,
            intermediate: 14336,
            n_heads: 32,
            n_kv_heads: 8,
            head_dim: 128,
            vocab_size: 128256,
            tied_embeddings: false,
            qkv_bias: false,
        },
    ),
    (
        "llama-3-70b",
        ModelDims {
            n_layers: 80,
            hidden: 8192,
            intermediate: 28672,
            n_heads: 64,
            n_kv_heads: 8,
            head_dim: 128,
            vocab_size: 128256,
            tied_embeddings: false,
            qkv_bias: false,
        },
    ),
    (
        "qwen2.5-7b",
        ModelDims {
            n_layers: 28,
            hidden: 3584,
            intermediate: 18944,
            n_heads: 28,
            n_kv_heads: 4,
            head_dim: 128,
            vocab_size: 152064,
            tied_embeddings: false,
            qkv_bias: true,
        },
    ),
    (
        "qwen2.5-32b",
        ModelDims {
            n_layers: 64,
            hidden: 5120,
            intermediate: 27648,
            n_heads: 40,
            n_kv_heads: 8,
            head_dim: 128,
            vocab_size: 152064,
            tied_embeddings: false,
            qkv_bias: true,
        },
    ),
];

/// A preset by name (case-insensitive), in bf16.
pub fn preset(name: &str) -> Option<ModelShape> {
    let (name, dims) = PRESETS.iter().find(|(n, _)| n.eq_ignore_ascii_case(name))?;
    Some(ModelShape::dense(name, "bf16", dims.clone(), 16.0))
}

/// The preset names, for help texts.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_their_published_parameter_counts() {
        let billions = |name: &str| preset(name).unwrap().dims.total_params() as f64 / 1e9;
        assert!(
            (billions("llama-3-8b") - 8.03).abs() < 0.01,
            "{}",
            billions("llama-3-8b")
        );
        assert!(
            (billions("llama-3-70b") - 70.55).abs() < 0.05,
            "{}",
            billions("llama-3-70b")
        );
        assert!(
            (billions("qwen2.5-7b") - 7.62).abs() < 0.01,
            "{}",
            billions("qwen2.5-7b")
        );
        assert!(
            (billions("qwen2.5-32b") - 32.76).abs() < 0.01,
            "{}",
            billions("qwen2.5-32b")
        );
    }

    #[test]
    fn a_q4_k_m_32b_weighs_about_twenty_gigabytes() {
        let q4 = preset("qwen2.5-32b").unwrap().requantized("Q4_K_M", 4.85);
        let gb = q4.weight_bytes() as f64 / 1e9;
        assert!((gb - 19.9).abs() < 0.1, "{gb}");
    }

    #[test]
    fn config_json_gives_the_same_shape_as_the_preset() {
        let dir = std::env::temp_dir().join(format!("strata-plan-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(
            dir.join("config.json"),
            r#"{"model_type":"llama","num_hidden_layers":32,"hidden_size":4096,"intermediate_size":14336,
                "num_attention_heads":32,"num_key_value_heads":8,"vocab_size":128256,
                "tie_word_embeddings":false,"torch_dtype":"bfloat16"}"#,
        )
        .unwrap();
        let shape = ModelShape::resolve(dir.to_str().unwrap()).unwrap();
        assert_eq!(shape.dims, preset("llama-3-8b").unwrap().dims);
        assert_eq!(shape.weight_bytes(), preset("llama-3-8b").unwrap().weight_bytes());
        std::fs::write(dir.join("config.json"), r#"{"hidden_size":4096}"#).unwrap();
        let err = ModelShape::resolve(dir.to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("missing or invalid num_attention_heads"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn gguf_bytes_come_from_the_tensor_table() {
        let path = strata_model::loader::default_model_path();
        if !path.exists() {
            println!("skipped: {} is missing (make fetch)", path.display());
            return;
        }
        let shape = ModelShape::from_gguf(&path).unwrap();
        assert_eq!(shape.layer_bytes.len(), 30);
        assert!(shape.layer_bytes.iter().all(|&b| b > 0));
        assert!(shape.dims.tied_embeddings && shape.lm_head_bytes >= shape.embedding_bytes);
        let file_len = std::fs::metadata(&path).unwrap().len();
        assert!(shape.weight_bytes() <= file_len && shape.weight_bytes() > file_len / 2);
    }

    #[test]
    fn unknown_names_list_the_presets() {
        let err = ModelShape::resolve("no-such-model").unwrap_err().to_string();
        assert!(err.contains("llama-3-70b") && err.contains("qwen2.5-32b"), "{err}");
    }
}
