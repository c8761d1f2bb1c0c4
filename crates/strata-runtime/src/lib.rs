//! strata-runtime: compute backends for the forward pass.
//! Owns the CPU kernels today (quantized dot products); more backends and kernels join here.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
