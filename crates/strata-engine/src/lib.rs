//! strata-engine: turns prompts into generated tokens on a loaded model.
//! Owns the KV block manager, sampling and the generation loop (the scheduler joins here).

pub mod block_manager;
pub mod generate;
pub mod sampler;

pub use generate::{generate, GenerateOptions, GenerateStats, StopReason};
pub use sampler::{Sampler, SamplingParams};
