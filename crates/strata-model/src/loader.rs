//! Opening a model: a GGUF file or an HF checkpoint directory; metadata, weights, tokenizer, template.
//! Files are memory-mapped; weights are copied into their arena with a progress report.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata_formats::gguf::GgufFile;

use crate::architectures::config_from_gguf;
use crate::chat_template::ChatTemplate;
use crate::error::ModelError;
use crate::hf_checkpoint::{is_hf_checkpoint, load_hf_text, load_hf_transformer};
use crate::tokenizer::Tokenizer;
use crate::transformer::Transformer;
use crate::weights::ModelWeights;

/// Where the fetch script puts pinned artifacts: `$STRATA_CACHE`, else `~/.cache/strata`.
pub fn cache_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("STRATA_CACHE").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("strata")
}

/// File name of the default model (SmolLM2-135M-Instruct, Q4_1).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Path of the default model inside the cache.
pub fn default_model_path() -> PathBuf {
    cache_dir().join("models").join(DEFAULT_MODEL_FILE)
}

/// Opens a GGUF file with errors that name the path and say what to do.
pub fn open_gguf(path: &Path) -> Result<Arc<GgufFile>, ModelError> {
    if !path.exists() {
        return Err(ModelError::NotFound {
            path: path.to_path_buf(),
        });
    }
    if path.is_dir() {
        return Err(ModelError::UnsupportedFormat {
            path: path.to_path_buf(),
        });
    }
    let file = GgufFile::open(path).map_err(|error| match error {
        strata_formats::gguf::GgufError::BadMagic(_) => ModelError::UnsupportedFormat {
            path: path.to_path_buf(),
        },
        error => ModelError::Gguf {
            path: path.to_path_buf(),
            error,
        },
    })?;
    Ok(Arc::new(file))
}

/// Everything needed to turn text into text with one model.
pub struct LoadedModel {
    pub path: PathBuf,
    pub transformer: Transformer,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
}

/// Opens `path` (a GGUF file, or an HF checkpoint directory or its `config.json`) and loads
/// weights, tokenizer and chat template.
pub fn load_model(path: &Path, progress: &dyn Fn(u64, u64)) -> Result<LoadedModel, ModelError> {
    let (tokenizer, chat_template, transformer) = if is_hf(path)? {
        let (tokenizer, template) = load_hf_text(path)?;
        (tokenizer, template, load_hf_transformer(path, progress)?)
    } else {
        let file = open_gguf(path)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let template = ChatTemplate::from_gguf(&file)?;
        (tokenizer, template, load_transformer(file, progress)?)
    };
    Ok(LoadedModel {
        path: path.to_path_buf(),
        transformer,
        tokenizer,
        chat_template,
    })
}

/// The tokenizer and chat template of the model at `path` (GGUF file or HF checkpoint), without its weights.
pub fn load_text(path: &Path) -> Result<(Tokenizer, ChatTemplate), ModelError> {
    if is_hf(path)? {
        return load_hf_text(path);
    }
    let file = open_gguf(path)?;
    Ok((Tokenizer::from_gguf(&file)?, ChatTemplate::from_gguf(&file)?))
}

/// A short name for the model at `path`: the file name without `.gguf`, or the checkpoint's directory name.
pub fn model_name(path: &Path) -> String {
    let named = match path.file_name() {
        Some(n) if n == crate::hf_checkpoint::CONFIG_FILE => path.parent().unwrap_or(path),
        _ => path,
    };
    named
        .file_name()
        .map(|n| n.to_string_lossy().trim_end_matches(".gguf").to_string())
        .unwrap_or_else(|| "model".into())
}

/// Whether `path` is an HF checkpoint rather than a GGUF file; an error when it does not exist.
fn is_hf(path: &Path) -> Result<bool, ModelError> {
    if !path.exists() {
        return Err(ModelError::NotFound {
            path: path.to_path_buf(),
        });
    }
    Ok(is_hf_checkpoint(path))
}

/// Loads the transformer of an opened GGUF file. `progress(done, total)` reports bytes paged in.
pub fn load_transformer(file: Arc<GgufFile>, progress: &dyn Fn(u64, u64)) -> Result<Transformer, ModelError> {
    let config = config_from_gguf(&file)?;
    let weights = ModelWeights::from_gguf(Arc::clone(&file), &config, progress)?;
    Ok(Transformer::new(config, weights))
}
