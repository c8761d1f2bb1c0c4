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
                unsafe { kernels.launch(gpu, name, grid, threads, shared, args) }
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
pub mod fp8_call;
pub mod gemm;
pub mod gemm_call;
pub mod kernels;
pub mod libraries;
pub mod nccl;
pub mod norm_call;
pub mod quant_call;
pub mod rope_call;
pub mod row_adjust_call;
pub mod sampling_call;
pub mod tma;

pub use activation_call::{SiluMulCall, SiluMulFp8Call, SILU_FP8_MAX_INTER};
pub use attention_call::{prompt_tiles, AttentionCall, PrefillAttentionCall};
pub use device::{DeviceBuffer, Event, Gpu, GpuInfo, Graph, PinnedBuffer};
pub use embedding_call::EmbeddingCall;
pub use fp8_call::{
    Fp8DequantCall, Fp8Gemv, Fp8GemvCall, Fp8GemvQkvRopeCall, Fp8GemvResidualCall, Fp8GemvSiluCall,
    Fp8QuantizeRowsCall, Fp8ScaleOutputCall,
};
pub use gemm::{Gemm, GemmOperands, GemmOut};
pub use gemm_call::{
    gemv_kernels, FixedOrderGemmCall, GemvCall, GemvKernels, GemvQkvRopeCall, GemvResidualCall, GemvSiluCall,
    SumRanksCall,
};
pub use kernels::{prefill_attention_fits, KernelSpec, Kernels, STAGED_ATTENTION_MAX_STAGES};
pub use nccl::{check_nccl, CommAbort, Communicator, NcclId};
pub use norm_call::{NormCall, NormOp};
pub use quant_call::{
    DequantCall, QuantEmbeddingCall, QuantFormat, QuantGemmCall, QuantGemmPairCall, QuantGemmReduceCall, QuantGemmTile,
    QuantGemvCall, QuantGemvResidualCall, QuantGemvSiluCall, QuantizeQ8Call, Q8_BLOCK, QGEMM_K, QUANT_FORMATS,
};
pub use rope_call::{RopeCall, RopeKernel};
pub use row_adjust_call::{RowAdjustCall, RowAdjustSlot};
pub use sampling_call::{ChooseTokensCall, TokensFromArgmaxCall};
pub use tma::TmaMap;

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

#[cfg(test)]
mod tests {
    use super::gemm_call::GEMV_KERNELS;
    use super::kernels::FAMILIES;
    use super::*;

    /// Every kernel a typed call launches, by the call's own naming.
    fn called_kernels() -> Vec<String> {
        let mut names = Vec::new();
        let mut record = |name: &str, _, _, _, _: &mut [*mut std::ffi::c_void]| {
            names.push(name.to_string());
            Ok::<(), ()>(())
        };
        for float32 in [false, true] {
            for op in [
                NormOp::Norm,
                NormOp::AddNorm { delta: 1, splits: 1 },
                NormOp::Add { delta: 1, splits: 1 },
                NormOp::Gather { row_ids: 1 },
            ] {
                let c = NormCall {
                    op,
                    x: 1,
                    weight: 0,
                    out: 1,
                    n: 4,
                    eps: 0.0,
                    rows: 1,
                    float32,
                    fp8: None,
                };
                c.launch_with(&mut record).unwrap();
                NormCall { fp8: Some((1, 1)), ..c }.launch_with(&mut record).unwrap();
            }
            let e = EmbeddingCall {
                table: 1,
                tokens: 1,
                out: 1,
                hidden: 4,
                vocab_start: 0,
                vocab_rows: 1,
                rows: 1,
                float32,
            };
            e.launch_with(&mut record).unwrap();
            let s = SiluMulCall {
                gate_up: 1,
                out: 1,
                inter: 8,
                tokens: 1,
                float32,
            };
            s.launch_with(&mut record).unwrap();
        }
        let s = SiluMulFp8Call {
            gate_up: 1,
            tok_scales: 1,
            col_scales: 1,
            out: 1,
            q: 1,
            q_scales: 1,
            inter: 8,
            tokens: 1,
        };
        s.launch_with(&mut record).unwrap();
        let choose = ChooseTokensCall {
            logits: 1,
            vocab: 1,
            sampling: 1,
            limits: 1,
            part_vals: 1,
            part_ids: 1,
            ids: 1,
            vals: 1,
            vocab_start: 0,
            rows: 1,
        };
        choose.launch_with(&mut record).unwrap();
        let feed = TokensFromArgmaxCall {
            tokens: 1,
            ids: 1,
            n: 1,
        };
        feed.launch_with(&mut record).unwrap();
        let gemm = FixedOrderGemmCall {
            w: 1,
            x: 1,
            y: 1,
            n: 1,
            k: 8,
            t: 1,
            chunks: 1,
            out_f32: 0,
        };
        gemm.launch_with(&mut record).unwrap();
        let sum = SumRanksCall {
            parts: 1,
            out: 1,
            count: 1,
            ranks: 1,
        };
        sum.launch_with(&mut record).unwrap();
        let rope = [RopeKernel::Bf16, RopeKernel::Fp8, RopeKernel::F32].map(RopeKernel::name);
        let gemvs = GEMV_KERNELS
            .iter()
            .flat_map(|g| [g.plain, g.silu, g.qkv_rope, g.residual]);
        names.extend(rope.into_iter().chain(gemvs).map(String::from));
        let mut wides = Vec::new();
        for format in QUANT_FORMATS {
            for t in [1, 2, 4, 8] {
                let g = QuantGemvCall {
                    format,
                    w: 1,
                    x: 1,
                    x_scales: 1,
                    two_pass: 0,
                    y: 1,
                    n: 1,
                    k: 256,
                    t,
                    ld: 1,
                    out_f32: 0,
                    norm_in: 0,
                    eps: 0.0,
                };
                let s = QuantGemvSiluCall {
                    format,
                    w: 1,
                    x: 1,
                    x_scales: 1,
                    two_pass: 0,
                    out: 1,
                    inter: 1,
                    k: 256,
                    t,
                    norm_in: 0,
                    eps: 0.0,
                };
                let r = QuantGemvResidualCall {
                    format,
                    w: 1,
                    x: 1,
                    x_scales: 1,
                    two_pass: 0,
                    res: 1,
                    res_bf16: 1,
                    norm_out: 1,
                    next_norm: 0,
                    n: 1,
                    k: 256,
                    t,
                };
                names.extend([g.name(), s.name(), r.name()].map(String::from));
            }
            let d = DequantCall {
                format,
                w: 1,
                out: 1,
                n: 1,
                k: 256,
                first: 0,
                rows: 1,
            };
            let e = QuantEmbeddingCall {
                format,
                table: 1,
                tokens: 1,
                out: 1,
                hidden: 256,
                vocab_start: 0,
                vocab_rows: 1,
                rows: 1,
            };
            let m = QuantGemmCall {
                format,
                tile: QuantGemmTile::Registers,
                w: 1,
                x: 1,
                y: 1,
                parts: 1,
                n: 1,
                k: 256,
                t: 9,
                ld: 1,
                out_f32: 0,
                steps_per_split: 2,
                x_map: TmaMap::NONE,
                w_maps: [TmaMap::NONE; 3],
                tail: 0,
                tail_splits: 1,
            };
            let tiled = QuantGemmCall {
                tile: QuantGemmTile::Shared,
                ..m
            };
            names.extend([d.name(), e.name(), m.name(), tiled.name()].map(String::from));
            if format.has_wide_tiles() {
                for tile in QuantGemmTile::WIDE {
                    let wide = QuantGemmCall { tile, ..m };
                    names.push(wide.name().to_string());
                    wides.push(wide);
                }
            }
        }
        // The wide pairs, a width each: the Q4_K wide call over a whole tile, then the Q6_K one.
        for tile in QuantGemmTile::WIDE {
            let pair = match wides.iter().filter(|w| w.tile == tile).collect::<Vec<_>>()[..] {
                [q4, q6] => QuantGemmPairCall::of(QuantGemmCall { n: 128, ..*q4 }, *q6),
                _ => None,
            };
            names.push(pair.expect("the Q4_K, Q6_K pair").name().to_string());
        }
        let q = QuantizeQ8Call {
            x: 1,
            xq: 1,
            xs: 1,
            k: 256,
            t: 1,
            two_pass: 0,
        };
        names.push(q.name().to_string());
        let r = QuantGemmReduceCall {
            parts: 1,
            y: 1,
            n: 1,
            t: 1,
            ld: 1,
            splits: 2,
            out_f32: 0,
        };
        names.push(r.name().to_string());
        names.extend(fp8_call::called_kernels().into_iter().map(String::from));
        names
    }

    #[test]
    fn the_typed_calls_name_only_compiled_kernels_and_cover_all_but_attention() {
        let called = called_kernels();
        let compiled: Vec<&str> = FAMILIES
            .iter()
            .flat_map(|(_, _, names)| names.iter().copied())
            .collect();
        for name in &called {
            assert!(compiled.contains(&name.as_str()), "{name} is in no family");
        }
        // attention_call.rs and row_adjust_call.rs name the rest (tested there).
        let elsewhere = |n: &str| n.contains("attention") || n == "apply_row_adjust";
        let uncalled: Vec<&str> = compiled
            .into_iter()
            .filter(|n| !elsewhere(n) && !called.iter().any(|c| c == n))
            .collect();
        assert!(uncalled.is_empty(), "kernels without a typed call: {uncalled:?}");
    }
}
