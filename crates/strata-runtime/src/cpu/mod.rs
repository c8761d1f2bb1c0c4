//! CPU backend: kernels that run the forward pass on the host processor.
//! Each submodule owns one family of kernels; `threadpool` runs them on all cores.

pub mod disjoint;
pub mod gemm;
pub mod isa;
pub mod matmul;
pub mod ops;
pub mod quant_dot;
pub mod threadpool;

pub use disjoint::DisjointMut;
pub use matmul::{matmul, matmul_many, ActPrecision, MatmulError, MatmulScratch, RowPaths, WeightMatrix};
pub use threadpool::ThreadPool;
