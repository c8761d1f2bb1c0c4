//! Hugging Face checkpoints: a directory of `config.json`, safetensors weights, `tokenizer.json` and
//! `tokenizer_config.json`. Reads the model shape from `config.json` for llama, mistral, qwen2 and qwen3.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};
use strata_formats::limits::{read_text_limited, MAX_JSON_FILE_BYTES, MAX_STOP_IDS};
use strata_formats::safetensors::SafetensorsSet;
use strata_runtime::cpu::ops::RopeLayout;

use crate::architectures::{Architecture, ARCHITECTURES};
use crate::chat_template::ChatTemplate;
use crate::config::{ModelConfig, RopeConfig, RopeScaling};
use crate::error::ModelError;
use crate::fp8::Fp8Checkpoint;
use crate::tokenizer::{SpecialIds, Tokenizer};
use crate::transformer::Transformer;
use crate::weights::{check_layer_count, ModelWeights};

/// The file that makes a directory an HF checkpoint.
pub const CONFIG_FILE: &str = "config.json";
/// The fast tokenizer.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// BOS/EOS strings and the chat template.
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";
/// The EOS ids generation stops at.
pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
/// The chat template, where newer checkpoints keep it instead of in `tokenizer_config.json`.
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

/// The checkpoint directory `path` names: the directory itself, or the folder of a `config.json`.
pub fn checkpoint_dir(path: &Path) -> Result<PathBuf, ModelError> {
    if path.is_dir() {
        if !path.join(CONFIG_FILE).is_file() {
            return Err(ModelError::BadCheckpoint {
                path: path.to_path_buf(),
                message: format!(
                    "directory has no {CONFIG_FILE}; pass a .gguf file or an HF checkpoint directory \
                     ({CONFIG_FILE}, *.safetensors, tokenizer.json)"
                ),
            });
        }
        return Ok(path.to_path_buf());
    }
    if path.file_name().is_some_and(|n| n == CONFIG_FILE) && path.is_file() {
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        return Ok(parent.to_path_buf());
    }
    Err(ModelError::UnsupportedFormat {
        path: path.to_path_buf(),
    })
}

/// Whether `path` looks like an HF checkpoint (a directory, or a file named `config.json`).
pub fn is_hf_checkpoint(path: &Path) -> bool {
    path.is_dir() || path.file_name().is_some_and(|n| n == CONFIG_FILE)
}

/// Reads a JSON object from `path`, with errors that name the file.
pub(crate) fn read_json_object(path: &Path) -> Result<Map<String, Value>, ModelError> {
    let bad = |message: String| ModelError::BadCheckpoint {
        path: path.to_path_buf(),
        message,
    };
    let text = read_text_limited(path, MAX_JSON_FILE_BYTES).map_err(|e| bad(format!("cannot read: {e}")))?;
    match serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))? {
        Value::Object(map) => Ok(map),
        other => Err(bad(format!("expected a JSON object, found {}", json_kind(&other)))),
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// What a checkpoint's `config.json` says: the model's shape and how its weights are stored.
#[derive(Debug, Clone, PartialEq)]
pub struct HfConfig {
    pub model: ModelConfig,
    /// `torch_dtype`, e.g. "bfloat16"; `None` when the file names none.
    pub torch_dtype: Option<String>,
    /// The layout of its FP8 matrices, when `quantization_config` says it has them.
    pub fp8: Option<Fp8Checkpoint>,
}

/// The `config.json` of a checkpoint (`dir_or_file`: the directory or the file). Reads nothing
/// else, so a planner can size a model without touching its weights.
pub fn read_hf_config(dir_or_file: &Path) -> Result<HfConfig, ModelError> {
    let path = checkpoint_dir(dir_or_file)?.join(CONFIG_FILE);
    let json = read_json_object(&path)?;
    let model = config_from_json(&json).map_err(|message| ModelError::BadCheckpoint {
        path: path.clone(),
        message,
    })?;
    let torch_dtype = Keys(&json).opt_str("torch_dtype").map(str::to_string);
    let fp8 = Fp8Checkpoint::from_config(&json).map_err(|message| ModelError::BadCheckpoint {
        path: path.clone(),
        message,
    })?;
    Ok(HfConfig {
        model,
        torch_dtype,
        fp8,
    })
}

/// Loads the transformer of the checkpoint at `path` (directory or `config.json`): shape from
/// `config.json`, weights from its safetensors files; `progress(done, total)` reports bytes copied.
pub fn load_hf_transformer(path: &Path, progress: &dyn Fn(u64, u64)) -> Result<Transformer, ModelError> {
    let dir = checkpoint_dir(path)?;
    let HfConfig { model: config, fp8, .. } = read_hf_config(&dir)?;
    let set = SafetensorsSet::open_dir(&dir)?;
    let names = set.files().iter().flat_map(|f| f.tensors()).map(|t| t.name.as_str());
    check_layer_count(config.n_layers, names, true, "num_hidden_layers").map_err(|message| {
        ModelError::BadCheckpoint {
            path: dir.join(CONFIG_FILE),
            message,
        }
    })?;
    let weights = ModelWeights::from_safetensors(&set, fp8.as_ref(), &config, progress)?;
    Ok(Transformer::new(config, weights))
}

/// The tokenizer (`tokenizer.json`, BOS/EOS from `tokenizer_config.json`, `generation_config.json`
/// and `config.json`) and chat template (`chat_template.jinja` or `tokenizer_config.json`) of a checkpoint.
pub fn load_hf_text(path: &Path) -> Result<(Tokenizer, ChatTemplate), ModelError> {
    let dir = checkpoint_dir(path)?;
    let tokenizer_json = dir.join(TOKENIZER_FILE);
    if !tokenizer_json.is_file() {
        return Err(ModelError::BadCheckpoint {
            path: dir,
            message: format!("has no {TOKENIZER_FILE}; strata needs the checkpoint's fast tokenizer file"),
        });
    }
    let tokenizer_config = dir.join(TOKENIZER_CONFIG_FILE);
    let tokenizer_config = tokenizer_config.is_file().then_some(tokenizer_config);
    let tokenizer = Tokenizer::from_hf_files(&tokenizer_json, tokenizer_config.as_deref(), &special_ids(&dir)?)?;
    let text_of = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or_default().to_string();
    let (bos, eos) = (text_of(tokenizer.bos_id()), text_of(tokenizer.eos_id()));
    let jinja = dir.join(CHAT_TEMPLATE_FILE);
    let template = if jinja.is_file() {
        let source = read_text_limited(&jinja, MAX_JSON_FILE_BYTES).map_err(|e| ModelError::BadCheckpoint {
            path: jinja.clone(),
            message: format!("cannot read: {e}"),
        })?;
        ChatTemplate::new(source, bos, eos)?
    } else if let Some(config) = &tokenizer_config {
        ChatTemplate::from_tokenizer_config(config)?
    } else {
        tracing::warn!(
            "checkpoint has no chat template; falling back to ChatML, which may not be the format it was trained on"
        );
        ChatTemplate::chatml(bos, eos)
    };
    Ok((tokenizer, template))
}

/// BOS and EOS ids of `generation_config.json` (first: generation stops where it says) and `config.json`.
fn special_ids(dir: &Path) -> Result<SpecialIds, ModelError> {
    let mut ids = SpecialIds::default();
    for file in [GENERATION_CONFIG_FILE, CONFIG_FILE] {
        let path = dir.join(file);
        if !path.is_file() {
            continue;
        }
        let json = read_json_object(&path)?;
        let k = Keys(&json);
        let bad = |message: String| ModelError::BadCheckpoint {
            path: path.clone(),
            message,
        };
        if ids.bos.is_none() {
            ids.bos = k.opt_token_ids("bos_token_id").map_err(bad)?.first().copied();
        }
        for id in k.opt_token_ids("eos_token_id").map_err(bad)? {
            if !ids.eos.contains(&id) {
                ids.eos.push(id);
            }
        }
    }
    Ok(ids)
}

/// Typed access to the keys of `config.json`; errors are messages naming the key.
struct Keys<'a>(&'a Map<String, Value>);

impl Keys<'_> {
    /// The value under `key`, treating an explicit `null` as absent.
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    /// The value under `key` read by `read`; an error saying it is not `what` when `read` fails.
    fn opt<T>(&self, key: &str, what: &str, read: impl Fn(&Value) -> Option<T>) -> Result<Option<T>, String> {
        self.get(key)
            .map(|v| read(v).ok_or_else(|| format!("{key} = {v} is not {what}")))
            .transpose()
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>, String> {
        self.opt(key, "a valid count", |v| {
            v.as_u64().filter(|&n| n <= 1 << 40).map(|n| n as usize)
        })
    }

    fn usize(&self, key: &str) -> Result<usize, String> {
        self.opt_usize(key)?.ok_or_else(|| format!("missing {key}"))
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>, String> {
        self.opt(key, "a number", |v| v.as_f64().map(|f| f as f32))
    }

    fn f32(&self, key: &str) -> Result<f32, String> {
        self.opt_f32(key)?.ok_or_else(|| format!("missing {key}"))
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>, String> {
        self.opt(key, "true or false", Value::as_bool)
    }

    /// A token id or a list of them (as `eos_token_id` may be); empty when absent.
    fn opt_token_ids(&self, key: &str) -> Result<Vec<u32>, String> {
        let one = |v: &Value| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| format!("{key} = {v} is not a token id or a list of them"))
        };
        match self.get(key) {
            None => Ok(vec![]),
            // Each id is checked against the others, so the list's length is bounded.
            Some(Value::Array(items)) if items.len() > MAX_STOP_IDS => Err(format!(
                "{key} lists {} token ids; strata reads at most {MAX_STOP_IDS}",
                items.len()
            )),
            Some(Value::Array(items)) => items.iter().map(one).collect(),
            Some(v) => one(v).map(|id| vec![id]),
        }
    }

    fn opt_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }
}

/// The architecture a `config.json` names, by `model_type` or else by its first `architectures` entry.
fn arch_of(k: &Keys) -> Result<&'static Architecture, String> {
    let model_type = k.opt_str("model_type");
    let class = k
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str);
    let found = match model_type {
        Some(t) => Architecture::named(t),
        None => class.and_then(Architecture::of_hf_class),
    };
    found.ok_or_else(|| {
        let named = match (model_type, class) {
            (Some(t), Some(c)) => format!("model_type '{t}' ({c})"),
            (Some(t), None) => format!("model_type '{t}'"),
            (None, Some(c)) => format!("architecture '{c}'"),
            (None, None) => "no model_type or architectures".to_string(),
        };
        let supported = ARCHITECTURES.map(|a| format!("{} ({})", a.hf_class, a.name));
        format!("{named} is not supported (supported: {})", supported.join(", "))
    })
}

/// `rope_scaling` of `config.json`: absent, `linear` or `llama3` (`type` or `rope_type`).
fn rope_scaling(k: &Keys) -> Result<RopeScaling, String> {
    // transformers 5 writes `rope_parameters` (with `rope_theta` inside) instead of `rope_scaling`.
    let Some(v) = k.get("rope_scaling").or_else(|| k.get("rope_parameters")) else {
        return Ok(RopeScaling::None);
    };
    let Some(obj) = v.as_object() else {
        return Err(format!("rope_scaling = {v} is not an object"));
    };
    let s = Keys(obj);
    let kind = s
        .opt_str("rope_type")
        .or_else(|| s.opt_str("type"))
        .unwrap_or("default");
    let positive = |key: &str| -> Result<f32, String> {
        let f = s.f32(key).map_err(|e| format!("rope_scaling: {e}"))?;
        if f > 0.0 && f.is_finite() {
            Ok(f)
        } else {
            Err(format!("rope_scaling: {key} = {f} must be positive"))
        }
    };
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear {
            factor: positive("factor")?,
        }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor: positive("factor")?,
            low_freq_factor: positive("low_freq_factor")?,
            high_freq_factor: positive("high_freq_factor")?,
            original_max_position: positive("original_max_position_embeddings")?,
        }),
        other => Err(format!(
            "rope_scaling type '{other}' is not supported (supported: linear, llama3)"
        )),
    }
}

/// `rope_theta`, top level (transformers 4) or inside `rope_parameters` (transformers 5).
fn rope_theta(k: &Keys) -> Result<f32, String> {
    if let Some(t) = k.opt_f32("rope_theta")? {
        return Ok(t);
    }
    match k.get("rope_parameters").and_then(Value::as_object) {
        Some(obj) => Ok(Keys(obj).opt_f32("rope_theta")?.unwrap_or(10000.0)),
        None => Ok(10000.0),
    }
}

/// The model shape described by the parsed contents of a `config.json`; errors say which key is wrong.
pub fn config_from_json_value(json: &Value) -> Result<ModelConfig, String> {
    match json {
        Value::Object(map) => config_from_json(map),
        other => Err(format!("expected a JSON object, found {}", json_kind(other))),
    }
}

/// The model shape described by a parsed `config.json`.
fn config_from_json(json: &Map<String, Value>) -> Result<ModelConfig, String> {
    let k = Keys(json);
    let arch = arch_of(&k)?;
    if let Some(act) = k.opt_str("hidden_act").filter(|a| *a != "silu") {
        return Err(format!("hidden_act '{act}' is not supported (strata runs silu)"));
    }
    if k.opt_bool("mlp_bias")? == Some(true) {
        return Err("mlp_bias = true is not supported".into());
    }
    // Architectures with Q/K/V biases always have them; elsewhere `attention_bias` also puts one
    // on the output projection, which the forward pass does not have.
    let attention_bias = k.opt_bool("attention_bias")?.unwrap_or(false);
    if attention_bias && !arch.qkv_bias {
        return Err("attention_bias = true (a bias on the output projection) is not supported".into());
    }
    let hidden = k.usize("hidden_size")?;
    let n_heads = k.usize("num_attention_heads")?;
    if n_heads == 0 {
        return Err("num_attention_heads is 0".into());
    }
    let n_kv_heads = k.opt_usize("num_key_value_heads")?.unwrap_or(n_heads);
    let head_dim = k.opt_usize("head_dim")?.unwrap_or(hidden / n_heads);
    let config = ModelConfig {
        arch,
        n_layers: k.usize("num_hidden_layers")?,
        hidden,
        intermediate: k.usize("intermediate_size")?,
        n_heads,
        n_kv_heads,
        head_dim,
        vocab_size: k.usize("vocab_size")?,
        rms_eps: k.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
        rope: RopeConfig {
            theta: rope_theta(&k)?,
            dim: head_dim,
            // HF keeps Q/K rows in their original order and rotates halves ("rotate_half") in
            // every one of these architectures; only GGUF llama files permute rows for pairs.
            layout: RopeLayout::Neox,
            scaling: rope_scaling(&k)?,
        },
        max_position: k.opt_usize("max_position_embeddings")?.unwrap_or(4096),
        tied_embeddings: k.opt_bool("tie_word_embeddings")?.unwrap_or(false),
    };
    config.validate()?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transformers_5_rope_parameters_give_theta_and_llama3_scaling() {
        let c = parse(
            r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 100,
                "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}"#,
        )
        .unwrap();
        assert_eq!(c.rope.theta, 500000.0);
        assert!(matches!(c.rope.scaling, RopeScaling::Llama3 { factor, .. } if factor == 8.0));
        let plain = parse(
            r#"{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "vocab_size": 100,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}"#,
        )
        .unwrap();
        assert_eq!(plain.rope.theta, 1000000.0);
        assert_eq!(plain.rope.scaling, RopeScaling::None);
    }

    fn parse(text: &str) -> Result<ModelConfig, String> {
        config_from_json_value(&serde_json::from_str(text).unwrap())
    }

    const LLAMA3: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
        "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 131072,
        "tie_word_embeddings": false, "attention_bias": false, "mlp_bias": false,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"
    }"#;

    #[test]
    fn llama3_config_reads_every_field() {
        let c = parse(LLAMA3).unwrap();
        assert_eq!(c.arch.name, "llama");
        assert_eq!(
            (
                c.n_layers,
                c.hidden,
                c.intermediate,
                c.n_heads,
                c.n_kv_heads,
                c.head_dim
            ),
            (32, 4096, 14336, 32, 8, 128)
        );
        assert_eq!((c.vocab_size, c.max_position), (128256, 131072));
        assert_eq!(c.rope.layout, RopeLayout::Neox);
        assert_eq!(c.rope.theta, 500000.0);
        assert_eq!(
            c.rope.scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 8192.0
            }
        );
        assert!(!c.arch.qkv_bias && !c.arch.qk_norm && !c.tied_embeddings);
        assert_eq!(c.rms_eps, 1e-5);
    }

    #[test]
    fn qwen2_has_biases_and_qwen3_has_qk_norm_and_explicit_head_dim() {
        let qwen2 = r#"{"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
            "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
            "num_key_value_heads": 2, "vocab_size": 151936, "rope_theta": 1000000.0,
            "tie_word_embeddings": true, "rope_scaling": null, "max_position_embeddings": 32768}"#;
        let c = parse(qwen2).unwrap();
        assert_eq!((c.arch.name, c.head_dim, c.rms_eps), ("qwen2", 64, 1e-6));
        assert!(c.arch.qkv_bias && !c.arch.qk_norm && c.tied_embeddings);
        assert_eq!(c.rope.scaling, RopeScaling::None);

        let qwen3 = r#"{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
            "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "head_dim": 128,
            "num_key_value_heads": 8, "vocab_size": 151936, "attention_bias": false}"#;
        let c = parse(qwen3).unwrap();
        assert_eq!((c.arch.name, c.head_dim, c.q_dim()), ("qwen3", 128, 2048));
        assert!(!c.arch.qkv_bias && c.arch.qk_norm);

        let mistral = r#"{"architectures": ["MistralForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 32768, "head_dim": null,
            "rope_scaling": {"type": "linear", "factor": 2.0}}"#;
        let c = parse(mistral).unwrap();
        assert_eq!((c.arch.name, c.head_dim, c.n_kv_heads), ("mistral", 128, 8));
        assert_eq!(c.rope.scaling, RopeScaling::Linear { factor: 2.0 });
    }

    #[test]
    fn unsupported_or_malformed_configs_say_what_is_wrong() {
        let with = |key: &str, value: &str| {
            let mut m: Map<String, Value> = serde_json::from_str(LLAMA3).unwrap();
            m.insert(key.into(), serde_json::from_str(value).unwrap());
            config_from_json(&m).unwrap_err()
        };
        let e = with("model_type", r#""gpt2""#);
        assert!(
            e.contains("'gpt2'") && e.contains("LlamaForCausalLM") && e.contains("Qwen3ForCausalLM"),
            "{e}"
        );
        assert!(with("hidden_size", r#""big""#).contains("hidden_size"));
        assert!(with("num_attention_heads", "0").contains("num_attention_heads is 0"));
        assert!(with("rope_scaling", r#"{"rope_type": "yarn", "factor": 4.0}"#).contains("'yarn'"));
        assert!(with("rope_scaling", r#"{"rope_type": "llama3", "factor": 8.0}"#).contains("low_freq_factor"));
        assert!(with("hidden_act", r#""gelu""#).contains("gelu"));
        assert!(with("attention_bias", "true").contains("attention_bias"));
        assert!(with("num_key_value_heads", "5").contains("not a multiple"));
        let mut m: Map<String, Value> = serde_json::from_str(LLAMA3).unwrap();
        m.remove("intermediate_size");
        assert!(config_from_json(&m).unwrap_err().contains("missing intermediate_size"));
    }

    #[test]
    fn read_hf_config_takes_the_directory_or_the_file_and_names_it_in_errors() {
        let dir = std::env::temp_dir().join(format!("strata-hf-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let err = read_hf_config(&dir).unwrap_err().to_string();
        assert!(err.contains("has no config.json"), "{err}");
        std::fs::write(dir.join(CONFIG_FILE), LLAMA3).unwrap();
        let read = read_hf_config(&dir).unwrap();
        assert_eq!(
            (read.model.n_layers, read.torch_dtype.as_deref()),
            (32, Some("bfloat16"))
        );
        assert_eq!(read_hf_config(&dir.join(CONFIG_FILE)).unwrap().model.hidden, 4096);
        std::fs::write(dir.join(CONFIG_FILE), "[1, 2]").unwrap();
        let err = read_hf_config(&dir).unwrap_err().to_string();
        assert!(
            err.contains("config.json") && err.contains("expected a JSON object"),
            "{err}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
