//! strata-formats: the bytes of model files, and nothing that computes with them.
//! Owns the GGUF reader, safetensors, quantized block layouts and the limits loaders check files by.

pub mod gguf;
pub mod limits;
pub mod quant;
pub mod safetensors;
mod storage;

pub use quant::GgmlType;
