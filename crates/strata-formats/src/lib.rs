//! strata-formats: the bytes of model files, and nothing that computes with them.
//! Owns the GGUF reader, safetensors, and the quantized block layouts with their dequantization.

pub mod gguf;
pub mod quant;
pub mod safetensors;

pub use quant::GgmlType;
