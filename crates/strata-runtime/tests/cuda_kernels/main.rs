//! strata's CUDA kernels and cuBLASLt, each against a reference, launched through their typed
//! calls: compile.rs builds every family with NVRTC (no GPU needed); the others need a GPU and
//! skip, saying why, without one. The model-level GPU tests are strata-model's tests/cuda.rs.
#![cfg(feature = "cuda")]

mod attention;
mod common;
mod compile;
mod fp8;
mod gemm;
mod quant;
mod rope;
mod sampling;
