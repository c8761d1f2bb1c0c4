//! strata's own CUDA kernels: the `.cu` sources under `kernels/` (one per family), compiled by
//! NVRTC for the GPU's architecture with the model's shape baked in, and cached on disk.

use std::collections::HashMap;
use std::path::PathBuf;

use cudarc::driver::CudaFunction;
use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use super::device::Gpu;
use super::{driver, CudaError, QuantGemmTile};

const COMMON: &str = include_str!("../../kernels/common.cuh");

/// The kernels quant.cu defines for each block format: its GEMVs for 1, 2, 4 and 8 tokens
/// (plain, gate/up with SiLU, residual), its dequantization, its embedding lookup and its
/// tensor-core GEMMs (registers, shared-memory tiles); then the activation quantizer the GEMVs read,
/// the GEMM's split sum, the wide tiles of the formats that have them (Q4_K, Q6_K) and the wide
/// tiles of a Q4_K and a Q6_K segment in one launch.
macro_rules! quant_kernel_names {
    ($($f:literal),*) => {
        [$(
            concat!("qgemv_", $f, "_t1"), concat!("qgemv_", $f, "_t2"),
            concat!("qgemv_", $f, "_t4"), concat!("qgemv_", $f, "_t8"),
            concat!("qgemv_silu_", $f, "_t1"), concat!("qgemv_silu_", $f, "_t2"),
            concat!("qgemv_silu_", $f, "_t4"), concat!("qgemv_silu_", $f, "_t8"),
            concat!("qgemv_residual_", $f, "_t1"), concat!("qgemv_residual_", $f, "_t2"),
            concat!("qgemv_residual_", $f, "_t4"), concat!("qgemv_residual_", $f, "_t8"),
            concat!("dequant_", $f), concat!("embedding_", $f), concat!("qgemm_", $f),
            concat!("qgemm_tile_", $f),
        )* "quantize_q8", "qgemm_reduce", "qgemm_wide_q4_k", "qgemm_wide_q6_k",
          "qgemm_wide_pair_q4_k_q6_k", "qgemm_wide64_q4_k", "qgemm_wide64_q6_k",
          "qgemm_wide64_pair_q4_k_q6_k", "qgemm_wide128_q4_k", "qgemm_wide128_q6_k",
          "qgemm_wide128_pair_q4_k_q6_k", "qgemm_wide192_q4_k", "qgemm_wide192_q6_k",
          "qgemm_wide192_pair_q4_k_q6_k"]
    };
}

/// Every kernel family: (name, source, kernels it defines).
pub const FAMILIES: [(&str, &str, &[&str]); 9] = [
    (
        "embedding",
        include_str!("../../kernels/embedding.cu"),
        &["embedding_lookup", "embedding_lookup_f32"],
    ),
    (
        "norm",
        include_str!("../../kernels/norm.cu"),
        &[
            "rms_norm",
            "add_rms_norm",
            "add_residual",
            "rms_norm_rows",
            "rms_norm_f32",
            "add_rms_norm_f32",
            "rms_norm_rows_f32",
            "rms_norm_fp8",
            "add_rms_norm_fp8",
        ],
    ),
    (
        "rope",
        include_str!("../../kernels/rope.cu"),
        &[
            "qkv_rope_kv_write_bf16",
            "qkv_rope_kv_write_fp8",
            "qkv_rope_kv_write_f32",
        ],
    ),
    (
        "activation",
        include_str!("../../kernels/activation.cu"),
        &["silu_mul", "silu_mul_f32", "silu_mul_fp8"],
    ),
    (
        "attention",
        include_str!("../../kernels/attention.cu"),
        &[
            "paged_attention_bf16",
            "paged_attention_fp8",
            "paged_attention_mma_bf16",
            "paged_attention_mma_fp8",
            "paged_attention_staged_bf16",
            "paged_attention_staged_fp8",
            "attention_reduce",
            "paged_attention_f32",
            "attention_reduce_f32",
            "paged_attention_prefill_bf16",
            "paged_attention_prefill_fp8",
        ],
    ),
    (
        "sampling",
        include_str!("../../kernels/sampling.cu"),
        &[
            "sampling_limits",
            "argmax_slices",
            "argmax_merge",
            "tokens_from_argmax",
            "apply_row_adjust",
        ],
    ),
    (
        "gemm",
        concat!(
            include_str!("../../kernels/gemv.cuh"),
            include_str!("../../kernels/gemm.cu")
        ),
        &[
            "gemm_fixed_order",
            "sum_ranks",
            "gemv_t1",
            "gemv_t2",
            "gemv_t4",
            "gemv_t8",
            "gemv_silu_t1",
            "gemv_silu_t2",
            "gemv_silu_t4",
            "gemv_silu_t8",
            "gemv_qkv_rope_t1",
            "gemv_qkv_rope_t2",
            "gemv_qkv_rope_t4",
            "gemv_qkv_rope_t8",
            "gemv_residual_t1",
            "gemv_residual_t2",
            "gemv_residual_t4",
            "gemv_residual_t8",
        ],
    ),
    (
        "quant",
        concat!(
            include_str!("../../kernels/gemv.cuh"),
            include_str!("../../kernels/quant.cu")
        ),
        &quant_kernel_names!["q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k"],
    ),
    (
        "fp8",
        concat!(
            include_str!("../../kernels/gemv.cuh"),
            include_str!("../../kernels/fp8.cu")
        ),
        &[
            "fp8_gemv_t1",
            "fp8_gemv_t2",
            "fp8_gemv_t4",
            "fp8_gemv_t8",
            "fp8_gemv_silu_t1",
            "fp8_gemv_silu_t2",
            "fp8_gemv_silu_t4",
            "fp8_gemv_silu_t8",
            "fp8_gemv_residual_t1",
            "fp8_gemv_residual_t2",
            "fp8_gemv_residual_t4",
            "fp8_gemv_residual_t8",
            "fp8_mma_gemv_t1",
            "fp8_mma_gemv_t2",
            "fp8_mma_gemv_t4",
            "fp8_mma_gemv_t8",
            "fp8_mma_gemv_silu_t1",
            "fp8_mma_gemv_silu_t2",
            "fp8_mma_gemv_silu_t4",
            "fp8_mma_gemv_silu_t8",
            "fp8_mma_gemv_residual_t1",
            "fp8_mma_gemv_residual_t2",
            "fp8_mma_gemv_residual_t4",
            "fp8_mma_gemv_residual_t8",
            "fp8_gemv_qkv_rope_t1",
            "fp8_gemv_qkv_rope_t2",
            "fp8_gemv_qkv_rope_t4",
            "fp8_gemv_qkv_rope_t8",
            "fp8_dequant",
            "fp8_quantize_rows",
            "fp8_scale_output",
        ],
    ),
];

/// Most shared-memory stages a warp of `paged_attention_staged_*` may use (attention.cu).
pub const STAGED_ATTENTION_MAX_STAGES: usize = 4;
/// Warps of an attention block (attention.cu's ATTN_WARPS).
pub const ATTENTION_WARPS: usize = 4;

/// Query tokens of a `paged_attention_prefill_*` tile (attention.cu's PF_TOKENS).
pub const PREFILL_ATTENTION_TOKENS: usize = 16;

/// Whether `paged_attention_prefill_*` are built for heads of `head_dim` (attention.cu's
/// PF_ENABLED: a multiple of 16 up to 128; its body is empty otherwise).
pub fn prefill_attention_fits(head_dim: usize) -> bool {
    head_dim.is_multiple_of(16) && head_dim <= 128
}

/// Whether `name` is a staged attention kernel, and if so whether for an fp8 cache.
fn staged_attention_fp8(name: &str) -> Option<bool> {
    match name {
        "paged_attention_staged_bf16" => Some(false),
        "paged_attention_staged_fp8" => Some(true),
        _ => None,
    }
}

/// Dynamic shared memory of a `paged_attention_staged_*` block with `stages` stages a warp
/// (attention.cu's KvStage: K and V of 16 keys, then 32 fp8 scales); 0 stages (the other
/// attention kernels) need none.
pub fn staged_attention_shared_bytes(head_dim: usize, fp8: bool, stages: usize) -> usize {
    let elem = if fp8 { 1 } else { 2 };
    let stage = 2 * 16 * head_dim * elem + if fp8 { 128 } else { 0 };
    ATTENTION_WARPS * stages * stage
}

/// Threads of a `qkv_rope_kv_write_*` block (rope.cu): a warp for each of the KV head's `group`
/// query heads, then one for its k head and one for its v head.
pub fn rope_block_threads(group: usize) -> u32 {
    ((group + 2) * 32) as u32
}

/// The model constants compiled into the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelSpec {
    /// Per-head width (a multiple of 32, at most 256).
    pub head_dim: usize,
    /// Query heads per KV head (at most 8).
    pub group: usize,
}

impl KernelSpec {
    /// Checks the limits the attention kernel is written for.
    pub fn validate(&self) -> Result<(), String> {
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(32) || self.head_dim > 256 {
            return Err(format!(
                "head_dim {} is not supported by the CUDA attention kernel (multiples of 32 up to 256)",
                self.head_dim
            ));
        }
        if self.group == 0 || self.group > 8 {
            return Err(format!(
                "{} query heads per KV head is not supported by the CUDA attention kernel (1 to 8)",
                self.group
            ));
        }
        Ok(())
    }

    fn defines(&self) -> Vec<String> {
        vec![
            format!("-DHEAD_DIM={}", self.head_dim),
            format!("-DGROUP={}", self.group),
        ]
    }
}

/// The families whose kernels are compiled for the model's shape ([`KernelSpec`]); the others
/// compile once for every model.
const SHAPED_FAMILIES: [&str; 1] = ["attention"];

/// Compiles one family to PTX for `arch` (e.g. `compute_90`).
pub fn compile(family: &str, source: &str, spec: KernelSpec, arch: &'static str) -> Result<String, CudaError> {
    compile_variant(family, source, spec, arch, &[])
}

/// [`compile`] with `defines` ("NAME=VALUE") set as well: an opt-in variant of a family (e.g.
/// quant.cu's `QTILE_SPECIALIZED=1`), as `STRATA_KERNEL_DEFINES` would set them.
pub fn compile_variant(
    family: &str,
    source: &str,
    spec: KernelSpec,
    arch: &'static str,
    defines: &[&str],
) -> Result<String, CudaError> {
    let src = format!("{COMMON}\n{source}");
    let mut options = if SHAPED_FAMILIES.contains(&family) {
        spec.defines()
    } else {
        Vec::new()
    };
    options.push("--std=c++17".into());
    if std::env::var("STRATA_PDL").is_ok_and(|v| v == "late") {
        options.push("-DLAUNCH_NEXT_LATE".into());
    }
    // Benchmark variants: `STRATA_KERNEL_DEFINES="NAME=VALUE ..."` overrides a kernel constant
    // that its .cu file leaves open with #ifndef (e.g. ATTN_MIN_BLOCKS).
    if let Ok(defines) = std::env::var("STRATA_KERNEL_DEFINES") {
        options.extend(defines.split_whitespace().map(|d| format!("-D{d}")));
    }
    options.extend(defines.iter().map(|d| format!("-D{d}")));
    let opts = CompileOptions {
        arch: Some(arch),
        use_fast_math: Some(false),
        options,
        name: Some(format!("{family}.cu")),
        ..Default::default()
    };
    let key = cache_key(&src, &opts);
    if let Some(ptx) = read_cache(&key) {
        return Ok(ptx);
    }
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts).map_err(|e| CudaError::Compile {
        family: family.to_string(),
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => other.to_string(),
        },
    })?;
    let text = ptx.to_src();
    write_cache(&key, &text);
    Ok(text)
}

/// Whether NVRTC can be loaded (it compiles the kernels; no GPU needed).
pub fn nvrtc_available() -> bool {
    // SAFETY: only tries to dlopen the library.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles every family; the first failure is returned with its NVRTC log.
pub fn compile_all(spec: KernelSpec, arch: &'static str) -> Result<Vec<(&'static str, String)>, CudaError> {
    FAMILIES
        .iter()
        .map(|(name, src, _)| compile(name, src, spec, arch).map(|p| (*name, p)))
        .collect()
}

/// The target `family` compiles for on a GPU of capability `cc`. `STRATA_KERNEL_ARCH` unset:
/// [`arch_for`], except quant.cu on a 9.0 GPU, which takes the arch-specific `compute_90a` for
/// its wgmma tile GEMM; `compute_90a` on a 9.0 GPU: every family on it; [`arch_for`]'s own
/// target (e.g. `compute_90`): every family on that, the portable fallbacks (mma.sync tiles);
/// anything else is refused.
pub fn arch_to_compile(cc: (i32, i32), requested: Option<&str>, family: &str) -> Result<&'static str, CudaError> {
    let portable = arch_for(cc);
    match requested {
        None if cc == (9, 0) && family == "quant" => Ok("compute_90a"),
        None => Ok(portable),
        Some("compute_90a") if cc == (9, 0) => Ok("compute_90a"),
        Some(v) if v == portable => Ok(portable),
        Some(v) => Err(CudaError::Compile {
            family: "every".into(),
            log: format!(
                "STRATA_KERNEL_ARCH={v:?} is not supported on this GPU (compute capability {}.{}): only \
                 {portable}{}; unset it",
                cc.0,
                cc.1,
                if cc == (9, 0) { " or compute_90a" } else { "" }
            ),
        }),
    }
}

/// NVRTC's virtual architecture for a compute capability.
pub fn arch_for(cc: (i32, i32)) -> &'static str {
    match cc {
        (9, _) => "compute_90",
        (10, _) => "compute_100",
        (12, _) => "compute_120",
        (8, 9) => "compute_89",
        (8, 6) => "compute_86",
        (8, _) => "compute_80",
        _ => "compute_75",
    }
}

fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("STRATA_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/strata")))?;
    Some(base.join("kernels"))
}

fn cache_key(src: &str, opts: &CompileOptions) -> String {
    // FNV-1a over the source and options: stable across runs (unlike the std hasher's seeds).
    let mut h: u64 = 0xcbf29ce484222325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes {
            h ^= *b as u64;
            h = h.wrapping_mul(0x100000001b3);
        }
    };
    feed(src.as_bytes());
    feed(format!("{opts:?}").as_bytes());
    format!("{h:016x}")
}

fn read_cache(key: &str) -> Option<String> {
    std::fs::read_to_string(cache_dir()?.join(format!("{key}.ptx"))).ok()
}

fn write_cache(key: &str, ptx: &str) {
    // Best effort: a read-only cache only costs a recompile next time.
    if let Some(dir) = cache_dir() {
        if std::fs::create_dir_all(&dir).is_ok() {
            let tmp = dir.join(format!("{key}.ptx.{}", std::process::id()));
            if std::fs::write(&tmp, ptx).is_ok() {
                let _ = std::fs::rename(&tmp, dir.join(format!("{key}.ptx")));
            }
        }
    }
}

/// Every kernel, loaded on one GPU.
pub struct Kernels {
    functions: HashMap<&'static str, CudaFunction>,
    /// Dynamic shared bytes a kernel needs as compiled, whatever its call asks (the wgmma tiles').
    shared: HashMap<&'static str, u32>,
    /// Whether quant.cu's tile GEMM was compiled warp-specialized (QTILE_SPECIALIZED: 512 threads).
    specialized_tiles: bool,
    /// Whether quant.cu was compiled with wgmma (`compute_90a`, QTILE_WGMMA), so its wide tiles run.
    wide_tiles: bool,
    /// Whether those tiles copy x by TMA (QWIDE_TMA), so their calls need an x map.
    wide_tma: bool,
    /// Whether they copy their weight planes by TMA too (QWIDE_W_TMA): their calls need maps.
    wide_weights_by_tma: bool,
    /// Threads a block of a wide kernel has as compiled: [`WIDE_SS_THREADS`] where it is
    /// warp-specialized (QWIDE_SS), whatever its call asks.
    block_threads: HashMap<&'static str, u32>,
}

/// quant.cu's QTILE_WGMMA_SHARED: the tile GEMM's two weight and two x tiles of 128 x 64 bf16 and
/// 1,024 bytes of alignment slack, in dynamic shared memory where it multiplies by wgmma.
pub const QTILE_WGMMA_SHARED_BYTES: u32 = 4 * 128 * 64 * 2 + 1024;
/// The same where those tiles are warp-specialized: three stages of a weight and an x tile, the
/// slack, and two mbarriers a stage.
pub const QTILE_SPECIALIZED_SHARED_BYTES: u32 = 3 * 2 * 128 * 64 * 2 + 1024 + 16 * 3;
/// quant.cu's QWIDE_SHARED(NT) for the wide tile `tile` (NT its tokens: 64, 128, 192 or 256):
/// four stages of an NT x 64 bf16 x tile, 16 KB of raw weight bytes and an mbarrier, and the
/// slack.
pub fn wide_shared_bytes(tile: QuantGemmTile) -> u32 {
    4 * (tile.tokens() as u32 * 64 * 2 + 16384 + 8) + 1024
}

/// quant.cu's QWIDE_SS_THREADS: a block of the warp-specialized wide tiles (QWIDE_SS), which
/// Kernels::load tells by their PTX's `.maxntid`.
pub const WIDE_SS_THREADS: u32 = 384;
/// quant.cu's QWIDE_SS_SHARED: the warp-specialized wide tiles' (QWIDE_SS_THREADS threads) four
/// stages of a 256 x 64 bf16 x tile and 16 KB of raw weight bytes, two 128 x 64 bf16 A tiles,
/// twelve mbarriers and the slack.
pub const WIDE_SS_SHARED_BYTES: u32 = 4 * (256 * 64 * 2 + 16384) + 2 * 128 * 64 * 2 + 96 + 1024;

/// The threads a block of kernel `name` in `ptx` is bounded to (its entry's `.maxntid`), if any.
pub fn entry_max_threads(ptx: &str, name: &str) -> Option<u32> {
    let entry = ptx.split(&format!(".entry {name}(")).nth(1)?;
    let header = entry.split('{').next()?;
    let bound = header.split(".maxntid").nth(1)?;
    bound.split(',').next()?.trim().parse().ok()
}

/// Whether quant.cu's `ptx` holds the warp-specialized tile GEMM (QTILE_SPECIALIZED): its tile
/// kernels, alone in the family, are bounded to 512 threads a block.
pub fn has_specialized_tiles(ptx: &str) -> bool {
    ptx.contains(".maxntid 512,")
}

impl Kernels {
    /// Compiles (or takes from the cache) and loads every family for `gpu`.
    pub fn load(gpu: &Gpu, spec: KernelSpec) -> Result<Kernels, CudaError> {
        spec.validate().map_err(|log| CudaError::Compile {
            family: "attention".into(),
            log,
        })?;
        let requested = std::env::var("STRATA_KERNEL_ARCH").ok();
        let mut functions = HashMap::new();
        let mut shared = HashMap::new();
        let mut specialized_tiles = false;
        let mut wide_tiles = false;
        let mut wide_tma = false;
        let mut wide_weights_by_tma = false;
        let mut block_threads = HashMap::new();
        for (family, src, names) in FAMILIES {
            let arch = arch_to_compile(gpu.info.compute_capability, requested.as_deref(), family)?;
            let ptx = compile(family, src, spec, arch)?;
            let specialized = family == "quant" && has_specialized_tiles(&ptx);
            specialized_tiles |= specialized;
            // The wide tiles' only wgmma shape: absent where quant.cu compiled without wgmma.
            wide_tiles |= family == "quant" && ptx.contains("m64n256k16");
            wide_tma |= family == "quant" && ptx.contains("qwide_x_by_tma");
            wide_weights_by_tma |= family == "quant" && ptx.contains("qwide_weights_by_tma");
            // The wide kernels' block sizes as compiled, read before the PTX goes to the driver.
            let bounded: Vec<(&str, u32)> = names
                .iter()
                .filter(|name| QuantGemmTile::of_wide_kernel(name).is_some())
                .filter_map(|name| entry_max_threads(&ptx, name).map(|threads| (*name, threads)))
                .collect();
            block_threads.extend(bounded);
            let module = gpu
                .ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(driver("cuModuleLoadData"))?;
            for name in names {
                let f = module.load_function(name).map_err(driver("cuModuleGetFunction"))?;
                if let Some(fp8) = staged_attention_fp8(name) {
                    // Past 48 KB of dynamic shared memory a kernel must opt in.
                    let most = staged_attention_shared_bytes(spec.head_dim, fp8, STAGED_ATTENTION_MAX_STAGES);
                    f.set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        most as i32,
                    )
                    .map_err(driver("cuFuncSetAttribute"))?;
                }
                let wide = QuantGemmTile::of_wide_kernel(name);
                if arch == "compute_90a" && (name.starts_with("qgemm_tile_") || wide.is_some()) {
                    let tile_bytes = if block_threads.get(name) == Some(&WIDE_SS_THREADS) {
                        WIDE_SS_SHARED_BYTES
                    } else if let Some(tile) = wide {
                        wide_shared_bytes(tile)
                    } else if specialized {
                        QTILE_SPECIALIZED_SHARED_BYTES
                    } else {
                        QTILE_WGMMA_SHARED_BYTES
                    };
                    f.set_attribute(
                        cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                        tile_bytes as i32,
                    )
                    .map_err(driver("cuFuncSetAttribute"))?;
                    shared.insert(*name, tile_bytes);
                }
                functions.insert(*name, f);
            }
        }
        Ok(Kernels {
            functions,
            shared,
            specialized_tiles,
            wide_tiles,
            wide_tma,
            wide_weights_by_tma,
            block_threads,
        })
    }

    /// The shared-memory tile GEMM as quant.cu was compiled: [`QuantGemmTile::Specialized`]
    /// under QTILE_SPECIALIZED on wgmma, [`QuantGemmTile::Shared`] otherwise.
    pub fn shared_tile(&self) -> QuantGemmTile {
        if self.specialized_tiles {
            QuantGemmTile::Specialized
        } else {
            QuantGemmTile::Shared
        }
    }

    /// Whether quant.cu's wide tiles ([`QuantGemmTile::WIDE`]) run here: compiled with wgmma.
    pub fn wide_tiles(&self) -> bool {
        self.wide_tiles
    }

    /// Whether the wide tiles copy x by TMA (QWIDE_TMA): their calls then carry a map of x
    /// ([`super::QuantGemmCall::x_map_for`]).
    pub fn wide_tma(&self) -> bool {
        self.wide_tma
    }

    /// Whether those tiles copy their weight planes by TMA (QWIDE_W_TMA), so their calls need
    /// the planes' maps.
    pub fn wide_weights_by_tma(&self) -> bool {
        self.wide_weights_by_tma
    }

    /// Launches kernel `name` on `gpu`'s stream with `shared` dynamic shared bytes, or the more
    /// that the kernel needs as compiled, and `threads` a block unless a wide kernel was compiled
    /// for another count.
    ///
    /// # Safety
    /// `args` are the kernel's arguments in its .cu file's order, pointing into device buffers
    /// sized for the launch.
    pub unsafe fn launch(
        &self,
        gpu: &Gpu,
        name: &str,
        grid: (u32, u32, u32),
        threads: u32,
        shared: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), CudaError> {
        let shared = shared.max(self.shared.get(name).copied().unwrap_or(0));
        let threads = self.block_threads.get(name).copied().unwrap_or(threads);
        // SAFETY: the caller's promise.
        unsafe { gpu.launch(self.get(name), grid, threads, shared, args) }
    }

    /// The kernel called `name` (one of [`FAMILIES`]' lists).
    pub fn get(&self, name: &str) -> &CudaFunction {
        self.functions
            .get(name)
            .unwrap_or_else(|| panic!("kernel {name} is not in any family"))
    }
}

#[cfg(test)]
mod tests {
    use super::entry_max_threads;

    #[test]
    fn a_kernels_block_bound_is_read_from_its_entry_header() {
        let ptx = ".visible .entry ab(\n.param .u64 p\n)\n{\nret;\n}\n\
                   .visible .entry a(\n.param .u64 p\n)\n.maxntid 384, 1, 1\n.minnctapersm 1\n{\nret;\n}\n\
                   .visible .entry b(\n)\n{\n// .maxntid 99\nret;\n}\n";
        assert_eq!(entry_max_threads(ptx, "a"), Some(384));
        assert_eq!(
            entry_max_threads(ptx, "ab"),
            None,
            "another kernel's bound is not its own"
        );
        assert_eq!(
            entry_max_threads(ptx, "b"),
            None,
            "text past the body's start is not a bound"
        );
        assert_eq!(entry_max_threads(ptx, "c"), None);
    }
}
