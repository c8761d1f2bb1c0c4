//! The CUDA backend (feature `cuda`): device, buffers and stream, NVRTC-compiled kernels,
//! cuBLASLt GEMMs and CUDA graphs. Libraries are loaded at run time, so it builds without CUDA.
//! Every kernel is launched through a typed call (`*_call.rs`) that holds its arguments in order.

/// `launch`, a call's `launch_with` straight on a GPU's stream; `$source` names the .cu file.
macro_rules! stream_launch {
    ($source:literal) => {
        #[doc = concat!("[`Self::launch_with`] straight on `gpu`'s stream.\n\n# Safety\nThe pointers must be device buffers sized for the call (see ", $source, ").")]
        pub unsafe fn launch(
            &self,
            gpu: &$crate::cuda::Gpu,
            kernels: &$crate::cuda::Kernels,
        ) -> Result<(), $crate::cuda::CudaError> {
            self.launch_with(|name, grid, threads, shared, args| {
                // SAFETY: the caller's promise; the arguments are the kernel's, in its .cu file's order.
                unsafe { gpu.launch(kernels.get(name), grid, threads, shared, args) }
            })
        }
    };
}

/// `launch_with` and `launch` of a call of one kernel, from the call's `name()`, `shape()` (grid,
/// threads a block, dynamic shared bytes) and `args()`; `$source` names the kernel's .cu file.
macro_rules! one_kernel_launch {
    ($source:literal) => {
        /// Launches the kernel through `launch(name, grid, threads a block, dynamic shared bytes,
        /// arguments)` (the forward pass's launcher profiles and ablates); an empty grid launches
        /// nothing (CUDA would refuse it).
        pub fn launch_with<E>(
            &self,
            mut launch: impl FnMut(&str, (u32, u32, u32), u32, u32, &mut [*mut std::ffi::c_void]) -> Result<(), E>,
        ) -> Result<(), E> {
            let (grid, threads, shared) = self.shape();
            if grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
                return Ok(());
            }
            launch(self.name(), grid, threads, shared, &mut self.args())
        }

        stream_launch!($source);
    };
}

pub mod activation_call;
pub mod attention_call;
pub mod device;
pub mod embedding_call;
pub mod gemm;
pub mod gemm_call;
pub mod kernels;
pub mod libraries;
pub mod nccl;
pub mod norm_call;
pub mod rope_call;
pub mod row_adjust_call;

pub use activation_call::SiluMulCall;
pub use attention_call::AttentionCall;
pub use device::{DeviceBuffer, Event, Gpu, GpuInfo, Graph, PinnedBuffer};
pub use embedding_call::EmbeddingCall;
pub use gemm::{Gemm, GemmOperands, GemmOut};
pub use gemm_call::{
    gemv_kernels, FixedOrderGemmCall, GemvCall, GemvKernels, GemvQkvRopeCall, GemvResidualCall, GemvSiluCall,
    SumRanksCall,
};
pub use kernels::{KernelSpec, Kernels, STAGED_ATTENTION_MAX_STAGES};
pub use nccl::{check_nccl, CommAbort, Communicator, NcclId};
pub use norm_call::{NormCall, NormOp};
pub use rope_call::{RopeCall, RopeKernel};
pub use row_adjust_call::{RowAdjustCall, RowAdjustSlot};

/// A kernel argument's address as a call's `args()` gives it: the unit tests pin each call's
/// arguments to its fields, in order.
#[cfg(test)]
pub(crate) fn arg_at<T>(field: &T) -> *mut std::ffi::c_void {
    field as *const T as *mut std::ffi::c_void
}

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

