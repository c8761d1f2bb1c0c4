//! What the planner needs to know about a model: layer count, widths, and the bytes of each layer and the embeddings.
//! Built from a GGUF file (exact tensor bytes), a HF `config.json` (strata-model's reader) or a named preset.

use std::path::Path;

use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};
use strata_model::hf_checkpoint::{checkpoint_dir, config_from_json_value, read_hf_config, HfConfig};
use strata_model::ModelConfig;

/// Why a model's shape could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ModelShapeError {
    #[error(transparent)]
    Model(#[from] strata_model::ModelError),
    #[error("{path}: {reason}")]
    BadConfig { path: String, reason: String },
    #[error(
        "unknown model {name:?}: pass a GGUF file, a folder with config.json, a config.json, or one of: {presets}"
    )]
    Unknown { name: String, presets: String },
}

/// Parameters of one decoder layer: attention, gated MLP, two norms, optional QKV bias.
fn layer_params(c: &ModelConfig) -> u64 {
    let (h, q, kv) = (c.hidden as u64, c.q_dim() as u64, c.kv_dim() as u64);
    let attention = h * q + 2 * h * kv + q * h;
    let bias = if c.arch.qkv_bias { q + 2 * kv } else { 0 };
    attention + bias + 3 * h * c.intermediate as u64 + 2 * h
}

/// Parameters of the token embedding (and of an untied LM head).
fn embedding_params(c: &ModelConfig) -> u64 {
    (c.vocab_size * c.hidden) as u64
}

/// Writes the widths the planner reads as the plan's `dims` object.
fn serialize_dims<S: Serializer>(c: &ModelConfig, serializer: S) -> Result<S::Ok, S::Error> {
    let mut dims = serializer.serialize_struct("dims", 9)?;
    dims.serialize_field("n_layers", &c.n_layers)?;
    dims.serialize_field("hidden", &c.hidden)?;
    dims.serialize_field("intermediate", &c.intermediate)?;
    dims.serialize_field("n_heads", &c.n_heads)?;
    dims.serialize_field("n_kv_heads", &c.n_kv_heads)?;
    dims.serialize_field("head_dim", &c.head_dim)?;
    dims.serialize_field("vocab_size", &c.vocab_size)?;
    dims.serialize_field("tied_embeddings", &c.tied_embeddings)?;
    dims.serialize_field("qkv_bias", &c.arch.qkv_bias)?;
    dims.end()
}

/// A model as the planner sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelShape {
    pub name: String,
    /// How the weights are stored, e.g. "bf16" or "GGUF 4.85 bits/weight".
    pub weight_format: String,
    /// The model's shape, written out as its `dims`: the widths the planner reads.
    #[serde(rename = "dims", serialize_with = "serialize_dims")]
    pub config: ModelConfig,
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
    pub fn dense(name: &str, weight_format: &str, config: ModelConfig, bits_per_weight: f64) -> Self {
        let bytes = |params: u64| (params as f64 * bits_per_weight / 8.0).round() as u64;
        let embedding_bytes = bytes(embedding_params(&config));
        let lm_head = bytes(embedding_params(&config) + config.hidden as u64);
        ModelShape {
            name: name.to_string(),
            weight_format: weight_format.to_string(),
            layer_bytes: vec![bytes(layer_params(&config)); config.n_layers],
            embedding_bytes,
            lm_head_bytes: lm_head,
            config,
        }
    }

    /// Parameters of the whole model (the LM head counted once when tied).
    pub fn total_params(&self) -> u64 {
        let c = &self.config;
        let heads = if c.tied_embeddings { 1 } else { 2 };
        layer_params(c) * c.n_layers as u64 + heads * embedding_params(c) + c.hidden as u64
    }

    /// The same model quantized to `bits_per_weight` (what a GGUF of that type would weigh).
    pub fn requantized(&self, format: &str, bits_per_weight: f64) -> Self {
        ModelShape::dense(&self.name, format, self.config.clone(), bits_per_weight)
    }

    /// All weight bytes (the LM head counted once even when tied).
    pub fn weight_bytes(&self) -> u64 {
        let head = if self.config.tied_embeddings {
            0
        } else {
            self.lm_head_bytes
        };
        self.layer_bytes.iter().sum::<u64>() + self.embedding_bytes + head
    }

    /// KV-cache bytes per token per layer: K and V, `n_kv_heads * head_dim` values each.
    pub fn kv_bytes_per_token_layer(&self, kv_element_bytes: u64) -> u64 {
        2 * self.config.kv_dim() as u64 * kv_element_bytes
    }

    /// Reads a GGUF file: the shape from its metadata, the bytes from its tensor table (no weights are read).
    pub fn from_gguf(path: &Path) -> Result<Self, ModelShapeError> {
        Self::from_gguf_sized(path, |t| t.n_bytes)
    }

    /// A GGUF file as the GPU executors hold it: the blocks they keep (Q4_0, Q4_1, Q8_0, Q4_K,
    /// Q5_K, Q6_K) at the file's bytes, every other tensor in bf16.
    pub fn from_gguf_on_gpu(path: &Path) -> Result<Self, ModelShapeError> {
        use strata_formats::GgmlType::*;
        Self::from_gguf_sized(path, |t| match t.ty {
            Q4_0 | Q4_1 | Q8_0 | Q4K | Q5K | Q6K => t.n_bytes,
            _ => 2 * t.n_elements,
        })
    }

    /// A dense model whose layer matrices are FP8 (a byte a weight, as `--quantization fp8` holds
    /// them on a GPU) and whose embeddings and LM head stay bf16.
    pub fn fp8_layers(name: &str, config: ModelConfig) -> Self {
        let bf16 = ModelShape::dense(name, "bf16", config.clone(), 16.0);
        ModelShape {
            embedding_bytes: bf16.embedding_bytes,
            lm_head_bytes: bf16.lm_head_bytes,
            ..ModelShape::dense(name, "fp8 e4m3 layers", config, 8.0)
        }
    }

    /// [`Self::from_gguf`] with each tensor's bytes as `bytes` counts them.
    fn from_gguf_sized(
        path: &Path,
        bytes: impl Fn(&strata_formats::gguf::TensorInfo) -> u64,
    ) -> Result<Self, ModelShapeError> {
        let file = strata_model::loader::open_gguf(path)?;
        let config = strata_model::architectures::config_from_gguf(&file)?;
        let mut layer_bytes = vec![0u64; config.n_layers];
        let (mut embedding_bytes, mut lm_head_bytes, mut total_bytes, mut total_elements) = (0, 0, 0u64, 0u64);
        for tensor in file.tensors() {
            let n_bytes = bytes(tensor);
            total_bytes += n_bytes;
            total_elements += tensor.n_elements;
            let layer = tensor
                .name
                .strip_prefix("blk.")
                .and_then(|rest| rest.split('.').next())
                .and_then(|n| n.parse::<usize>().ok());
            match (layer, tensor.name.as_str()) {
                (Some(i), _) if i < layer_bytes.len() => layer_bytes[i] += n_bytes,
                (_, "token_embd.weight") => embedding_bytes += n_bytes,
                (_, "output.weight") | (_, "output_norm.weight") => lm_head_bytes += n_bytes,
                _ => {}
            }
        }
        if config.tied_embeddings {
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
            config,
            layer_bytes,
            embedding_bytes,
            lm_head_bytes,
        })
    }

    /// Reads a HF `config.json` (or the folder holding it) with strata-model's reader; sizes the
    /// weights by its `torch_dtype` (bf16 when absent), or at a byte each for FP8 checkpoints.
    pub fn from_hf_config(path: &Path) -> Result<Self, ModelShapeError> {
        let dir = checkpoint_dir(path)?;
        let HfConfig {
            model,
            torch_dtype,
            fp8,
            ..
        } = read_hf_config(&dir)?;
        let dtype = match fp8 {
            // FP8 checkpoints' layer matrices stay FP8 on a GPU (a byte a weight).
            Some(_) => "float8_e4m3fn",
            None => torch_dtype.as_deref().unwrap_or("bfloat16"),
        };
        let (format, bits) = match dtype {
            "float8_e4m3fn" => ("fp8 e4m3", 8.0),
            "float32" => ("f32", 32.0),
            "float16" => ("f16", 16.0),
            "bfloat16" => ("bf16", 16.0),
            other => {
                return Err(ModelShapeError::BadConfig {
                    path: path.display().to_string(),
                    reason: format!("torch_dtype {other:?} is not one the planner sizes"),
                })
            }
        };
        let name = dir
            .file_name()
            .map_or("model".into(), |s| s.to_string_lossy().to_string());
        Ok(ModelShape::dense(&name, format, model, bits))
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

/// Published architectures: the shape keys of the models' own `config.json`, all bf16.
const PRESETS: [(&str, &str); 4] = [
    (
        "llama-3-8b",
        r#"{"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": false}"#,
    ),
    (
        "llama-3-70b",
        r#"{"model_type": "llama", "num_hidden_layers": 80, "hidden_size": 8192, "intermediate_size": 28672,
            "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": false}"#,
    ),
    (
        "qwen2.5-7b",
        r#"{"model_type": "qwen2", "num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944,
            "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": false}"#,
    ),
    (
        "qwen2.5-32b",
        r#"{"model_type": "qwen2", "num_hidden_layers": 64, "hidden_size": 5120, "intermediate_size": 27648,
            "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 152064, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0, "max_position_embeddings": 32768, "tie_word_embeddings": false}"#,
    ),
];

/// A preset by name (case-insensitive), in bf16.
pub fn preset(name: &str) -> Option<ModelShape> {
    let (name, json) = PRESETS.iter().find(|(n, _)| n.eq_ignore_ascii_case(name))?;
    // The texts are constants; `every_preset_is_a_config_strata_model_reads` reads each.
    let config = serde_json::from_str(json)
        .map_err(|e| e.to_string())
        .and_then(|v| config_from_json_value(&v))
        .expect("a preset's config.json is valid");
    Some(ModelShape::dense(name, "bf16", config, 16.0))
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
        let billions = |name: &str| preset(name).unwrap().total_params() as f64 / 1e9;
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
    fn every_preset_is_a_config_strata_model_reads() {
        for name in preset_names() {
            let shape = preset(name).unwrap();
            assert!(
                shape.config.validate().is_ok() && shape.weight_format == "bf16",
                "{name}"
            );
        }
        let json = serde_json::to_value(preset("qwen2.5-7b").unwrap()).unwrap();
        assert_eq!(
            json["dims"],
            serde_json::json!({"n_layers": 28, "hidden": 3584, "intermediate": 18944, "n_heads": 28,
                "n_kv_heads": 4, "head_dim": 128, "vocab_size": 152064, "tied_embeddings": false, "qkv_bias": true})
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
                "rms_norm_eps":1e-5,"rope_theta":500000.0,"max_position_embeddings":8192,
                "tie_word_embeddings":false,"torch_dtype":"bfloat16"}"#,
        )
        .unwrap();
        let shape = ModelShape::resolve(dir.to_str().unwrap()).unwrap();
        assert_eq!(shape.config, preset("llama-3-8b").unwrap().config);
        assert_eq!(shape.weight_bytes(), preset("llama-3-8b").unwrap().weight_bytes());
        std::fs::write(dir.join("config.json"), r#"{"model_type":"llama","hidden_size":4096}"#).unwrap();
        let err = ModelShape::resolve(dir.to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("config.json: missing num_attention_heads"), "{err}");
        std::fs::write(
            dir.join("config.json"),
            r#"{"model_type":"llama","num_hidden_layers":2,"hidden_size":64,"intermediate_size":128,
                "num_attention_heads":4,"vocab_size":100,"torch_dtype":"int8"}"#,
        )
        .unwrap();
        let err = ModelShape::resolve(dir.to_str().unwrap()).unwrap_err().to_string();
        assert!(
            err.contains("torch_dtype \"int8\" is not one the planner sizes"),
            "{err}"
        );
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
        assert!(shape.config.tied_embeddings && shape.lm_head_bytes >= shape.embedding_bytes);
        let file_len = std::fs::metadata(&path).unwrap().len();
        assert!(shape.weight_bytes() <= file_len && shape.weight_bytes() > file_len / 2);
    }

    #[test]
    fn unknown_names_list_the_presets() {
        let err = ModelShape::resolve("no-such-model").unwrap_err().to_string();
        assert!(err.contains("llama-3-70b") && err.contains("qwen2.5-32b"), "{err}");
    }
}
