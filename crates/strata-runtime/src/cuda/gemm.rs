//! Dense GEMMs through cuBLASLt, `y = x · wᵀ` with f32 accumulation: bf16 or FP8 E4M3 operands
//! (sm_89+) with a bf16 or f32 output, or f32 throughout (`--dtype float32`).
//! Descriptors and algorithm are built once per shape and reused (and captured); `tune` replaces
//! the heuristic's first choice by the fastest of its candidates and their split-k copies, timed.

use std::collections::HashMap;
use std::ffi::c_void;

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::sys::CUdeviceptr;

use super::device::{DeviceBuffer, Gpu};
use super::CudaError;

/// cuBLASLt's scratch space.
const WORKSPACE_BYTES: usize = 32 << 20;
/// Most heuristic candidates [`Gemm::tune`] times for a shape.
const TUNE_CANDIDATES: usize = 16;
/// Reduction parts of the split-k copies [`Gemm::tune`] adds of the heuristic's first
/// candidates (`SPLIT_K_OF` of them) where the algorithm supports it: narrow products (a few
/// thousand outputs x 256 tokens) make fewer output tiles than the GPU has SMs.
const SPLIT_K_PARTS: [i32; 3] = [2, 3, 4];
const SPLIT_K_OF: usize = 6;

/// Element type of a GEMM's output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmOut {
    Bf16,
    F32,
}

impl GemmOut {
    /// Bytes of one output element.
    pub fn bytes(self) -> usize {
        match self {
            GemmOut::Bf16 => 2,
            GemmOut::F32 => 4,
        }
    }
}

/// Element type of both operands (weights and activations) of every product of a [`Gemm`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmOperands {
    /// bf16; the output may be bf16 or f32.
    Bf16,
    /// f32 with f32 products and sums (no TF32); the output is f32.
    F32,
    /// FP8 E4M3 on tensor cores (compute capability 8.9 and later), unscaled: the output (bf16
    /// or f32) is the sum of the E4M3 values' products, which the caller scales.
    Fp8E4m3,
}

/// A product's shape `(n, k, t)`, output type, output row stride (`n`, or wider for a slab of a
/// larger output), and whether cuBLASLt scales an FP8 product itself ([`Gemm::matmul_scaled`]).
type PlanKey = (usize, usize, usize, GemmOut, usize, bool);

/// cuBLASLt's `CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F` (CUDA 12.9+): an f32 scale per row of
/// op(A) and per column of B, i.e. per weight row and per token.
const SCALE_OUTER_VEC_32F: i32 = 3;

struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    layouts: [sys::cublasLtMatrixLayout_t; 3],
    algo: sys::cublasLtMatmulAlgo_t,
}

/// A cuBLASLt handle with its workspace and plans.
pub struct Gemm {
    handle: sys::cublasLtHandle_t,
    operands: GemmOperands,
    workspace: DeviceBuffer,
    plans: HashMap<PlanKey, Plan>,
    /// FP8 products accumulate in the tensor cores' own precision, without cuBLASLt's periodic
    /// promotion to f32 (`set_fp8_fast_accum`).
    fp8_fast_accum: bool,
}

// SAFETY: the handle is used from one thread at a time (the owner's).
unsafe impl Send for Gemm {}

fn blas(op: &'static str) -> impl FnOnce(cudarc::cublaslt::result::CublasError) -> CudaError {
    move |e| CudaError::Blas {
        op,
        err: format!("{e:?}"),
    }
}

impl Gemm {
    /// A handle and workspace on `gpu` for products of `operands`.
    pub fn new(gpu: &Gpu, operands: GemmOperands) -> Result<Gemm, CudaError> {
        gpu.bind()?;
        let handle = lt::create_handle().map_err(blas("cublasLtCreate"))?;
        let workspace = gpu.alloc(WORKSPACE_BYTES, "the cuBLASLt workspace")?;
        Ok(Gemm {
            handle,
            operands,
            workspace,
            plans: HashMap::new(),
            fp8_fast_accum: true,
        })
    }

    /// Whether FP8 products skip cuBLASLt's periodic promotion to f32 sums (default on, as the
    /// FP8 serving stacks run; `STRATA_FP8_FAST_ACCUM=0` turns it off). Applies to plans made after.
    pub fn set_fp8_fast_accum(&mut self, on: bool) {
        self.fp8_fast_accum = on;
    }

    fn plan(&mut self, key: PlanKey) -> Result<&Plan, CudaError> {
        if !self.plans.contains_key(&key) {
            let plan = self.make_plan(key)?;
            self.plans.insert(key, plan);
        }
        Ok(&self.plans[&key])
    }

    fn make_plan(&self, (n, k, t, out, ld, scaled): PlanKey) -> Result<Plan, CudaError> {
        let (bf16, f32) = (sys::cudaDataType_t::CUDA_R_16BF, sys::cudaDataType_t::CUDA_R_32F);
        let e4m3 = sys::cudaDataType_t::CUDA_R_8F_E4M3;
        let (in_type, out_type) = match (self.operands, out) {
            (GemmOperands::Bf16, GemmOut::Bf16) => (bf16, bf16),
            (GemmOperands::Bf16, GemmOut::F32) => (bf16, f32),
            (GemmOperands::Fp8E4m3, GemmOut::Bf16) => (e4m3, bf16),
            (GemmOperands::Fp8E4m3, GemmOut::F32) => (e4m3, f32),
            (GemmOperands::F32, GemmOut::F32) => (f32, f32),
            (GemmOperands::F32, GemmOut::Bf16) => {
                return Err(CudaError::Blas {
                    op: "cublasLtMatmul",
                    err: "f32 operands give an f32 output, not bf16".into(),
                })
            }
        };
        // Column-major view: y(n x t) = op(w)(n x k) * x(k x t), with w stored k x n (transposed).
        let a = lt::create_matrix_layout(in_type, k as u64, n as u64, k as i64).map_err(blas("layout A"))?;
        let b = lt::create_matrix_layout(in_type, k as u64, t as u64, k as i64).map_err(blas("layout B"))?;
        let c = lt::create_matrix_layout(out_type, n as u64, t as u64, ld as i64).map_err(blas("layout C"))?;
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(blas("cublasLtMatmulDescCreate"))?;
        let transpose: i32 = 1;
        // SAFETY: the descriptor was just created; the attribute buffer outlives the call.
        unsafe {
            set_desc(desc, Desc::CUBLASLT_MATMUL_DESC_TRANSA, &transpose).map_err(blas("set TRANSA"))?;
            if self.operands == GemmOperands::Fp8E4m3 {
                let fast = self.fp8_fast_accum as i8;
                set_desc(desc, Desc::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast).map_err(blas("set FAST_ACCUM"))?;
            }
            if scaled {
                for attr in [
                    Desc::CUBLASLT_MATMUL_DESC_A_SCALE_MODE,
                    Desc::CUBLASLT_MATMUL_DESC_B_SCALE_MODE,
                ] {
                    set_desc(desc, attr, &SCALE_OUTER_VEC_32F).map_err(blas("set SCALE_MODE"))?;
                }
            }
        }
        let layouts = [a, b, c];
        let algo = self.candidates(desc, layouts, 1)?[0].algo;
        Ok(Plan { desc, layouts, algo })
    }

    /// Up to `count` of cuBLASLt's algorithms for a product, its best guess first.
    fn candidates(
        &self,
        desc: sys::cublasLtMatmulDesc_t,
        [a, b, c]: [sys::cublasLtMatrixLayout_t; 3],
        count: usize,
    ) -> Result<Vec<sys::cublasLtMatmulHeuristicResult_t>, CudaError> {
        let pref = lt::create_matmul_pref().map_err(blas("cublasLtMatmulPreferenceCreate"))?;
        let ws = WORKSPACE_BYTES as u64;
        // SAFETY: the preference was just created and is destroyed here; the results buffer
        // holds `count` entries and cuBLASLt writes at most that many.
        unsafe {
            let set = lt::set_matmul_pref_attribute(
                pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &ws as *const u64 as *const c_void,
                std::mem::size_of::<u64>(),
            )
            .map_err(blas("set workspace"));
            let mut results: Vec<sys::cublasLtMatmulHeuristicResult_t> = vec![std::mem::zeroed(); count];
            let mut found = 0i32;
            let got = set.and_then(|_| {
                sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    desc,
                    a,
                    b,
                    c,
                    c,
                    pref,
                    count as i32,
                    results.as_mut_ptr(),
                    &mut found,
                )
                .result()
                .map_err(blas("cublasLtMatmulAlgoGetHeuristic"))
            });
            let _ = lt::destroy_matmul_pref(pref);
            got?;
            results.truncate(found.max(0) as usize);
            results.retain(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS);
            if results.is_empty() {
                return Err(CudaError::Blas {
                    op: "cublasLtMatmulAlgoGetHeuristic",
                    err: "no algorithm for this shape".into(),
                });
            }
            Ok(results)
        }
    }

    /// Times up to TUNE_CANDIDATES of cuBLASLt's algorithms for shape `(n, k, t)`, and split-k
    /// copies of the first SPLIT_K_OF, each running over every matrix of `weights` in turn (a
    /// warm-up pass, then a timed one), and keeps the fastest for the shape. The matrices should
    /// be distinct (a model's layers): each product then reads its weights from memory as inside
    /// a forward pass, where one matrix timed back to back is served from L2 and favours
    /// algorithms that lose inside a step. Returns the timed pass of the heuristic's first choice
    /// and of the one kept, in ms. `scales` (weight rows, tokens) times the scaled FP8 product
    /// ([`Gemm::matmul_scaled`]) instead of the unscaled one.
    ///
    /// # Safety
    /// As [`Gemm::matmul`] for every matrix of `weights`. Not while `gpu`'s stream is captured.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn tune(
        &mut self,
        gpu: &Gpu,
        weights: &[CUdeviceptr],
        x: CUdeviceptr,
        y: CUdeviceptr,
        (n, k, t): (usize, usize, usize),
        out: GemmOut,
        scales: Option<(CUdeviceptr, CUdeviceptr)>,
    ) -> Result<(f32, f32), CudaError> {
        let key = (n, k, t, out, n, scales.is_some());
        self.plan(key)?;
        let plan = &self.plans[&key];
        if let Some(scales) = scales {
            set_scales(plan, scales)?;
        }
        let heuristic = self.candidates(plan.desc, plan.layouts, TUNE_CANDIDATES)?;
        let mut candidates: Vec<sys::cublasLtMatmulAlgo_t> = heuristic.iter().map(|r| r.algo).collect();
        // Split-k copies come after the heuristic's own candidates (`STRATA_GEMM_SPLIT_K=0`
        // leaves them out, for measurements).
        let split_from = candidates.len();
        if std::env::var("STRATA_GEMM_SPLIT_K").map_or(true, |v| v != "0") {
            for r in heuristic.iter().take(SPLIT_K_OF) {
                candidates.extend(self.split_k_copies(plan, &r.algo));
            }
        }
        let mut timed = Vec::with_capacity(candidates.len());
        for (i, algo) in candidates.iter().enumerate() {
            let pass = || -> Result<(), CudaError> {
                for &w in weights {
                    self.run(gpu, plan, algo, w, x, y)?;
                }
                Ok(())
            };
            // An algorithm that fails to launch here is not kept; the others still compete.
            let ms = pass().and_then(|_| {
                let start = gpu.record_event()?;
                pass()?;
                let end = gpu.record_event()?;
                start.elapsed_ms(&end)
            });
            match ms {
                Ok(ms) => timed.push((ms, *algo, i)),
                Err(_) => gpu.sync()?,
            }
        }
        let Some(&(first, _, _)) = timed.first() else {
            return Err(CudaError::Blas {
                op: "cublasLtMatmul",
                err: format!("no algorithm ran for {n}x{k}, {t} tokens"),
            });
        };
        let (mut best, mut algo, mut kept) = timed[0];
        for &(ms, a, i) in &timed[1..] {
            if ms < best {
                (best, algo, kept) = (ms, a, i);
            }
        }
        tracing::debug!(
            "GEMM {n}x{k}, {t} tokens: {} candidates ({} split-k), kept #{kept}{}: {first:.3} -> {best:.3} ms",
            timed.len(),
            candidates.len() - split_from,
            if kept >= split_from { " (split-k)" } else { "" }
        );
        if let Some(plan) = self.plans.get_mut(&key) {
            plan.algo = algo;
        }
        Ok((first, best))
    }

    /// Copies of `algo` that cut the reduction into SPLIT_K_PARTS parts, their partial sums in
    /// f32 in the workspace and then reduced in a fixed order (so a step's outputs stay the same
    /// from run to run), for an algorithm that supports it and copies cuBLASLt accepts.
    fn split_k_copies(&self, plan: &Plan, algo: &sys::cublasLtMatmulAlgo_t) -> Vec<sys::cublasLtMatmulAlgo_t> {
        use sys::cublasLtMatmulAlgoCapAttributes_t as Cap;
        use sys::cublasLtMatmulAlgoConfigAttributes_t as Config;
        let compute_type = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
        let support = algo_capability::<i32>(algo, Cap::CUBLASLT_ALGO_CAP_SPLITK_SUPPORT);
        let schemes = algo_capability::<u32>(algo, Cap::CUBLASLT_ALGO_CAP_REDUCTION_SCHEME_MASK);
        if support.unwrap_or(0) == 0 || schemes.unwrap_or(0) & compute_type == 0 {
            return Vec::new();
        }
        SPLIT_K_PARTS
            .iter()
            .filter_map(|&parts| {
                let mut copy = *algo;
                let configured = set_algo_config(&mut copy, Config::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &parts)
                    && set_algo_config(&mut copy, Config::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &compute_type);
                // SAFETY: the plan's descriptors are alive; the check only reads them and the copy.
                let accepted = configured
                    && unsafe {
                        let mut check: sys::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
                        sys::cublasLtMatmulAlgoCheck(
                            self.handle,
                            plan.desc,
                            plan.layouts[0],
                            plan.layouts[1],
                            plan.layouts[2],
                            plan.layouts[2],
                            &copy,
                            &mut check,
                        )
                        .result()
                        .is_ok()
                            && check.workspaceSize <= WORKSPACE_BYTES
                    };
                accepted.then_some(copy)
            })
            .collect()
    }

    /// `y[t, n] = x[t, k] · w[n, k]ᵀ` on `gpu`'s stream (row-major `w` and `x` of the operands'
    /// type; FP8 wants k a multiple of 16 and 16-byte aligned buffers, as cuBLASLt does).
    ///
    /// # Safety
    /// `w`, `x` and `y` must point to device buffers of at least `n*k`, `t*k` and `t*n`
    /// elements of their types.
    pub unsafe fn matmul(
        &mut self,
        gpu: &Gpu,
        w: CUdeviceptr,
        x: CUdeviceptr,
        y: CUdeviceptr,
        (n, k, t): (usize, usize, usize),
        out: GemmOut,
    ) -> Result<(), CudaError> {
        self.matmul_into_rows(gpu, w, x, y, (n, k, t), out, n)
    }

    /// [`Gemm::matmul`] into rows of `ld >= n` elements: `y[j * ld + i]` for `i < n` (a slab of
    /// a wider output).
    ///
    /// # Safety
    /// As [`Gemm::matmul`], with `y` holding `(t - 1) * ld + n` elements.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul_into_rows(
        &mut self,
        gpu: &Gpu,
        w: CUdeviceptr,
        x: CUdeviceptr,
        y: CUdeviceptr,
        (n, k, t): (usize, usize, usize),
        out: GemmOut,
        ld: usize,
    ) -> Result<(), CudaError> {
        self.product(gpu, (w, x, y), (n, k, t, out, ld, false), None)
    }

    /// An FP8 [`Gemm::matmul`] that cuBLASLt scales itself: `y[j, i] = (x[j] · w[i]) *
    /// w_scales[i] * x_scales[j]` (f32 scales), where the GPU and cuBLASLt support outer-vector
    /// scales (cuBLASLt 13.0 on an H200 did not). An error before anything is queued when not.
    ///
    /// # Safety
    /// As [`Gemm::matmul`], with `w_scales` holding n and `x_scales` t f32.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul_scaled(
        &mut self,
        gpu: &Gpu,
        w: CUdeviceptr,
        x: CUdeviceptr,
        y: CUdeviceptr,
        (n, k, t): (usize, usize, usize),
        out: GemmOut,
        (w_scales, x_scales): (CUdeviceptr, CUdeviceptr),
    ) -> Result<(), CudaError> {
        if self.operands != GemmOperands::Fp8E4m3 {
            return Err(CudaError::Blas {
                op: "cublasLtMatmul",
                err: "scales are for FP8 operands".into(),
            });
        }
        self.product(gpu, (w, x, y), (n, k, t, out, n, true), Some((w_scales, x_scales)))
    }

    /// One product of the plan for `key`, pointed at `scales` first for a scaled plan.
    unsafe fn product(
        &mut self,
        gpu: &Gpu,
        (w, x, y): (CUdeviceptr, CUdeviceptr, CUdeviceptr),
        key: PlanKey,
        scales: Option<(CUdeviceptr, CUdeviceptr)>,
    ) -> Result<(), CudaError> {
        if key.2 == 0 {
            return Ok(());
        }
        let algo = self.plan(key)?.algo;
        let plan = &self.plans[&key];
        if let Some(scales) = scales {
            set_scales(plan, scales)?;
        }
        self.run(gpu, plan, &algo, w, x, y)
    }

    /// One product with `plan`'s descriptors and `algo`.
    unsafe fn run(
        &self,
        gpu: &Gpu,
        plan: &Plan,
        algo: &sys::cublasLtMatmulAlgo_t,
        w: CUdeviceptr,
        x: CUdeviceptr,
        y: CUdeviceptr,
    ) -> Result<(), CudaError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        lt::matmul(
            self.handle,
            plan.desc,
            &alpha as *const f32 as *const c_void,
            &beta as *const f32 as *const c_void,
            w as *const c_void,
            plan.layouts[0],
            x as *const c_void,
            plan.layouts[1],
            y as *const c_void,
            plan.layouts[2],
            y as *mut c_void,
            plan.layouts[2],
            algo,
            self.workspace.ptr() as *mut c_void,
            WORKSPACE_BYTES,
            gpu.stream.cu_stream() as sys::cudaStream_t,
        )
        .map_err(blas("cublasLtMatmul"))
    }
}

use sys::cublasLtMatmulDescAttributes_t as Desc;

/// Sets a matmul descriptor attribute (`T` its C type).
///
/// # Safety
/// `desc` must be a live descriptor.
unsafe fn set_desc<T>(desc: sys::cublasLtMatmulDesc_t, attr: Desc, value: &T) -> Result<(), lt::CublasError> {
    lt::set_matmul_desc_attribute(desc, attr, value as *const T as *const c_void, std::mem::size_of::<T>())
}

/// Points a scaled plan at a product's weight-row and token scales (read when the product is
/// queued, so each product of a captured graph keeps its own).
fn set_scales(plan: &Plan, (w_scales, x_scales): (CUdeviceptr, CUdeviceptr)) -> Result<(), CudaError> {
    // SAFETY: the plan's descriptor lives as long as the plan; the values are copied.
    unsafe {
        set_desc(plan.desc, Desc::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scales).map_err(blas("set A_SCALE"))?;
        set_desc(plan.desc, Desc::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scales).map_err(blas("set B_SCALE"))
    }
}

/// A capability attribute of an algorithm (`T` its C type), if cuBLASLt reports it.
fn algo_capability<T: Default>(
    algo: &sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoCapAttributes_t,
) -> Option<T> {
    let (mut value, mut written) = (T::default(), 0usize);
    // SAFETY: `algo` is an initialised algorithm and the buffer is `T`'s size.
    unsafe {
        sys::cublasLtMatmulAlgoCapGetAttribute(
            algo,
            attr,
            &mut value as *mut T as *mut c_void,
            std::mem::size_of::<T>(),
            &mut written,
        )
    }
    .result()
    .ok()
    .map(|_| value)
}

/// Sets a configuration attribute of an algorithm (`T` its C type); whether cuBLASLt took it.
fn set_algo_config<T>(
    algo: &mut sys::cublasLtMatmulAlgo_t,
    attr: sys::cublasLtMatmulAlgoConfigAttributes_t,
    value: &T,
) -> bool {
    // SAFETY: `algo` is an initialised algorithm and the buffer is `T`'s size.
    unsafe {
        sys::cublasLtMatmulAlgoConfigSetAttribute(
            algo,
            attr,
            value as *const T as *const c_void,
            std::mem::size_of::<T>(),
        )
    }
    .result()
    .is_ok()
}

impl Drop for Gemm {
    fn drop(&mut self) {
        // SAFETY: each descriptor was created once by this object.
        unsafe {
            for (_, p) in self.plans.drain() {
                let _ = lt::destroy_matmul_desc(p.desc);
                for l in p.layouts {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
