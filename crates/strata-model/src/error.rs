//! Errors of loading and running a model, with messages that say what to do.
//! Library code returns these; the CLI and server turn them into user-facing text.

use std::path::PathBuf;

/// Why a model could not be loaded or run. A variant that shows an inner error's text does not
/// also return it as its `source()`, so a printed error chain says each thing once.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model file {path} not found; pass --model with the path of a .gguf file or an HF checkpoint directory (or run `make fetch` for the default model)")]
    NotFound { path: PathBuf },
    #[error("cannot read model file {path}: {error}")]
    Gguf {
        path: PathBuf,
        error: strata_formats::gguf::GgufError,
    },
    #[error("{path}: unsupported model format; strata loads GGUF files (.gguf) and HF checkpoint directories (config.json + *.safetensors)")]
    UnsupportedFormat { path: PathBuf },
    #[error("architecture '{arch}' is not supported (supported: {supported})")]
    UnsupportedArch { arch: String, supported: String },
    #[error("{path}: {message}")]
    BadCheckpoint { path: PathBuf, message: String },
    #[error("bad model metadata: {0}")]
    BadMetadata(String),
    #[error("tensor {name}: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("invalid forward batch: {0}")]
    BadBatch(String),
    #[error("GPU error: {0}")]
    Device(String),
    /// The devices can no longer run the model (a collective or stage hand-off timed out and was
    /// aborted, a GPU was lost). Fatal: the executor refuses every later call.
    #[error("{0}")]
    Unavailable(String),
    #[error(transparent)]
    Safetensors(#[from] strata_formats::safetensors::SafetensorsError),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
    #[error(transparent)]
    Template(#[from] crate::chat_template::TemplateError),
}
