//! strata-model: model architectures, weights, the paged KV cache layout, tokenizer and chat templates.
//! One small file per architecture under `architectures/`; one forward pass for the llama family.

pub mod architectures;
pub mod batch;
pub mod chat_template;
pub mod compute_dtype;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod executor;
pub mod fp8;
pub mod hf_checkpoint;
pub mod kv_cache;
pub mod loader;
mod prompt_attention;
pub mod tokenizer;
pub mod transformer;
pub mod weights;

pub use architectures::Architecture;
pub use batch::{AllowedTokens, DeviceSampling, Logits, LogitsWanted, RowAdjust, SeqChunk, MAX_ROW_BIAS};
pub use compute_dtype::ComputeDtype;
pub use config::ModelConfig;
pub use error::ModelError;
pub use executor::{CpuExecutor, Executor, KvLayout};
pub use kv_cache::PagedKvCache;
pub use transformer::{ForwardScratch, Transformer};
