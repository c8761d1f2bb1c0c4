//! strata-engine: turns prompts into generated tokens on a loaded model.
//! Owns sampling and the generation loop over the paged KV cache (scheduler and block manager join here).

pub mod generate;
pub mod sampler;

pub use generate::{generate, GenerateOptions, GenerateStats, StopReason};
pub use sampler::{Sampler, SamplingParams};
