//! The CUDA backend (feature `cuda`): device, buffers and stream, NVRTC-compiled kernels,
//! cuBLASLt GEMMs and CUDA graphs. Libraries are loaded at run time, so it builds without CUDA.

pub mod attention_call;
pub mod device;
pub mod gemm;
pub mod kernels;
pub mod libraries;
pub mod nccl;
pub mod row_adjust_call;

pub use attention_call::AttentionCall;
pub use device::{DeviceBuffer, Event, Gpu, GpuInfo, Graph, PinnedBuffer};
pub use gemm::{Gemm, GemmOperands, GemmOut};
pub use kernels::{KernelSpec, Kernels, STAGED_ATTENTION_MAX_STAGES};
pub use nccl::{check_nccl, CommAbort, Communicator, NcclId};
pub use row_adjust_call::{RowAdjustCall, RowAdjustSlot};

/// Why the CUDA backend cannot do something.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// A library is missing; the message says which and where strata looked.
    #[error("the CUDA backend cannot start: {0}")]
    Missing(String),
    /// No usable GPU.
    #[error("no CUDA GPU: {0}")]
    NoDevice(String),
    /// A driver call failed.
    #[error("CUDA driver error in {op}: {err}")]
    Driver { op: &'static str, err: String },
    /// A kernel did not compile (the NVRTC log is included).
    #[error("kernel family `{family}` did not compile with NVRTC: {log}")]
    Compile { family: String, log: String },
    /// A cuBLASLt call failed.
    #[error("cuBLASLt error in {op}: {err}")]
    Blas { op: &'static str, err: String },
    /// An NCCL call failed.
    #[error("NCCL error in {op}: {err}")]
    Nccl { op: &'static str, err: String },
    /// Device memory ran out.
    #[error("out of GPU memory allocating {bytes} bytes for {what}: {err}")]
    OutOfMemory { what: String, bytes: usize, err: String },
}

/// Maps a driver error with the name of the operation.
pub(crate) fn driver(op: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> CudaError {
    move |e| CudaError::Driver { op, err: e.to_string() }
}
