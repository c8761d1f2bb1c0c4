//! `strata bench`: a load generator for any OpenAI-compatible server (strata, vLLM, llama.cpp, Ollama, SGLang).
//! Owns the public API: `BenchArgs`/`run` for the CLI, `run_bench(&BenchConfig) -> BenchReport` for code and tests.

pub mod client;
pub mod config;
pub mod sse;

pub use client::ErrorKind;
pub use config::{Arrival, BenchConfig, Endpoint, InputSource, LoadShape};
