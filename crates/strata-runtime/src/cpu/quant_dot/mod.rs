//! Fused quantized dot products: one weight row (any supported GGML type) against activation rows.
//! Owns the activation formats, their quantization, and the run-time choice of scalar, AVX2 or AVX-512 VNNI.

mod act;
mod layout;
mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;

use strata_formats::quant::QK_K;
use strata_formats::GgmlType;

use crate::cpu::isa::{allowed_under, IsaLevel};

pub use act::{act_residual, quantize_act_row_scalar};
pub use layout::{WeightLayout, GROUP_ROWS};

/// Format the activation vector is quantized into before a dot product with a weight type.
///
/// The layouts are private to this module (only [`quantize_act_row`] writes them and only
/// these kernels read them). A row of `n` values is laid out as:
///
/// - `F32`: `n` little-endian `f32`.
/// - `Q8_1`: `n` `i8` quants in value order, then per 32-block `f32 d`, `f32 s` and `i32 sum`
///   where `sum` is the sum of the block's quants and `s = d * sum` (what the min of Q4_1 and
///   Q5_1 needs; the offsets of Q4_0, Q5_0 and, on VNNI, Q8_0 come off `sum` exactly).
/// - `Q8K`: `n` `i8` quants, then one `f32 d` per 256-block, then per 256-block sixteen
///   `i16` sums of each 16 quants.
///
/// Quants are symmetric in `[-127, 127]` with `d = max|x| / 127`, rounded half to even.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ActFormat {
    /// Plain `f32` (for F32, F16 and BF16 weights).
    F32,
    /// 32-blocks of `i8` with a scale and the block sum (for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1
    /// weights: the sum carries the min of Q4_1/Q5_1 and the `-8`/`-16` offset of
    /// Q4_0/Q5_0, which lets them multiply unsigned quants).
    Q8_1,
    /// 256-blocks of `i8` with a scale and per-16 sums (for the K-quants).
    Q8K,
}

impl ActFormat {
    /// Values per block: `n` must be a multiple of this.
    pub fn block_len(self) -> usize {
        match self {
            ActFormat::F32 => 1,
            ActFormat::Q8_1 => 32,
            ActFormat::Q8K => QK_K,
        }
    }
}

/// The activation format each weight type's kernel reads (unlike GGML, Q4_0, Q5_0 and Q8_0
/// take Q8_1 like Q4_1 and Q5_1: the offset of the first two then comes off the block sum
/// exactly). Types without a kernel
/// (see [`is_supported`]) get [`ActFormat::F32`]; [`kernel_for`] returns `None` for them.
pub fn act_format_for(w: GgmlType) -> ActFormat {
    use GgmlType::*;
    match w {
        Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 => ActFormat::Q8_1,
        Q4K | Q5K | Q6K => ActFormat::Q8K,
        _ => ActFormat::F32,
    }
}

/// Whether a dot-product kernel exists for weights of type `w`.
pub fn is_supported(w: GgmlType) -> bool {
    use GgmlType::*;
    matches!(w, F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q4K | Q5K | Q6K)
}

/// Bytes one activation row of `n` values takes in format `fmt`
/// (`n` must be a multiple of `fmt.block_len()`; the result is meaningless otherwise).
pub fn act_row_bytes(fmt: ActFormat, n: usize) -> usize {
    match fmt {
        ActFormat::F32 => 4 * n,
        ActFormat::Q8_1 => n + Q8_1_META_BYTES * (n / 32),
        ActFormat::Q8K => n + 36 * (n / QK_K),
    }
}

/// Bytes after the quants of a Q8_1 row per 32-block: `f32 d`, `f32 s`, `i32 sum`.
pub(crate) const Q8_1_META_BYTES: usize = 12;

/// Bytes one weight row of `n` values of type `w` takes (`n` a multiple of `w.block_len()`).
pub fn weight_row_bytes(w: GgmlType, n: usize) -> usize {
    n / w.block_len() * w.block_bytes()
}

/// Quantizes the activations `x` (`n = x.len()` values, a multiple of `fmt.block_len()`)
/// into `out[..act_row_bytes(fmt, n)]`, using AVX2 where the CPU has it. The bytes written
/// are identical to [`quantize_act_row_scalar`]'s.
///
/// # Panics
/// If `n` is not a multiple of the block length or `out` is too short.
pub fn quantize_act_row(fmt: ActFormat, x: &[f32], out: &mut [u8]) {
    act::check_act_args(fmt, x, out);
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::isa::allows(IsaLevel::Avx2) && avx2::quantize_act_row(fmt, x, out) {
        return;
    }
    act::quantize_act_row_unchecked(fmt, x, out);
}

/// The raw kernel: `n`, weight rows (`rows` of them, in the kernel's [`WeightLayout`]),
/// activation rows (`m`, contiguous), output `out[r * m + j]`. Arguments are validated before
/// it is called.
type MatrixFn = fn(n: usize, w: &[u8], rows: usize, acts: &[u8], m: usize, out: &mut [f32]);

/// A dot-product kernel for one weight type, chosen once; call it in hot loops.
///
/// A matrix-vector product `y = W x` with `W` stored in GGML type `t`:
///
/// 1. `let k = kernel_for(t)?;` once (the CPU-feature dispatch happens here, not per call),
///    and store the matrix in `k.layout()` ([`WeightLayout::pack`]) once;
/// 2. quantize each activation row with [`quantize_act_row`] into a buffer of
///    [`act_row_bytes`]`(k.act_format(), n)` bytes per row (rows contiguous);
/// 3. `k.dot_matrix(n, w_bytes, rows, acts, m, out)` for all weight rows at once (or for a
///    range of them per thread that starts at a multiple of `k.layout().row_align()`).
///
/// With `m > 1` activation rows each weight block is loaded and unpacked once and used for
/// several activation rows (the batched-decode path). Every (weight row, activation
/// row) result is bit-identical whatever `m` and whatever range of rows a call covers, so
/// results do not depend on batch composition or on how rows are split between threads.
#[derive(Clone, Copy)]
pub struct DotKernel {
    weight: GgmlType,
    act: ActFormat,
    isa: IsaLevel,
    layout: WeightLayout,
    f: MatrixFn,
    /// The same kernel writing its output by activation row, where it has such a build.
    columns: Option<MatrixFn>,
}

impl std::fmt::Debug for DotKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DotKernel")
            .field("weight", &self.weight)
            .field("act", &self.act)
            .field("isa", &self.isa)
            .field("layout", &self.layout)
            .finish()
    }
}

impl DotKernel {
    /// The weight type this kernel reads.
    pub fn weight_type(&self) -> GgmlType {
        self.weight
    }

    /// The activation format this kernel reads.
    pub fn act_format(&self) -> ActFormat {
        self.act
    }

    /// How this kernel expects the weight matrix's bytes.
    pub fn layout(&self) -> WeightLayout {
        self.layout
    }

    /// The instruction set of this kernel: `"scalar"`, `"avx2"` or `"avx512vnni"`.
    pub fn isa(&self) -> &'static str {
        self.isa.name()
    }

    /// The instruction-set level the kernel is built for.
    pub fn level(&self) -> IsaLevel {
        self.isa
    }

    /// Dot products of the first weight row of `w` (`n` values, in the kernel's layout: for
    /// [`WeightLayout::RowGroups8`] the whole first group) with `m` activation rows
    /// (contiguous, `act_row_bytes(self.act_format(), n)` bytes each), written to `out[..m]`.
    /// The results are bit-identical to [`DotKernel::dot_matrix`]'s for that row.
    ///
    /// # Panics
    /// If `n` is not a multiple of the weight and activation block lengths, or a slice is
    /// shorter than these sizes say.
    #[inline]
    pub fn dot_rows(&self, n: usize, w: &[u8], acts: &[u8], m: usize, out: &mut [f32]) {
        self.dot_matrix(n, w, 1, acts, m, out);
    }

    /// Dot products of `rows` weight rows (in the kernel's layout, `layout().matrix_bytes(w,
    /// rows, n)` bytes) with `m` activation rows: `out[r * m + j] = dot(weight row r,
    /// activation row j)`. With `m == 1` this is `y = W x` written straight into
    /// `out[..rows]`; a thread can take any range of rows that starts at a multiple of
    /// `layout().row_align()`, with the bytes of [`WeightLayout::row_bytes_range`] and the
    /// matching part of `out`.
    ///
    /// # Panics
    /// As [`DotKernel::dot_rows`], with `w` needing `rows` rows and `out` `rows * m` values.
    #[inline]
    pub fn dot_matrix(&self, n: usize, w: &[u8], rows: usize, acts: &[u8], m: usize, out: &mut [f32]) {
        self.run(self.f, n, w, rows, acts, m, out);
    }

    /// Whether [`DotKernel::dot_matrix_columns`] has a build for this kernel (the row-group
    /// types on AVX2 and AVX-512 VNNI).
    pub fn writes_columns(&self) -> bool {
        self.columns.is_some()
    }

    /// [`DotKernel::dot_matrix`] with its output by activation row, `out[j * rows + r]`, bit for
    /// bit the same values: a batch's product lands in the layout of its output matrix without
    /// a transposition. Returns `false`, writing nothing, where the kernel has no such build.
    ///
    /// # Panics
    /// As [`DotKernel::dot_matrix`].
    #[inline]
    pub fn dot_matrix_columns(&self, n: usize, w: &[u8], rows: usize, acts: &[u8], m: usize, out: &mut [f32]) -> bool {
        let Some(f) = self.columns else {
            return false;
        };
        self.run(f, n, w, rows, acts, m, out);
        true
    }

    /// Checks the arguments of a `rows` x `m` product and runs `f` on them.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    fn run(&self, f: MatrixFn, n: usize, w: &[u8], rows: usize, acts: &[u8], m: usize, out: &mut [f32]) {
        let bl = self.weight.block_len().max(self.act.block_len());
        assert!(
            n.is_multiple_of(bl),
            "quant_dot: n = {n} is not a multiple of {bl} for {}",
            self.weight
        );
        let wb = weight_row_bytes(self.weight, n);
        let ab = act_row_bytes(self.act, n);
        let need_w = wb.checked_mul(self.layout.stored_rows(rows));
        let need_a = ab.checked_mul(m);
        let need_o = rows.checked_mul(m);
        assert!(
            need_w.is_some_and(|b| w.len() >= b),
            "quant_dot: weight slice of {} bytes is short of {rows} rows of {wb} ({:?})",
            w.len(),
            self.layout
        );
        assert!(
            need_a.is_some_and(|b| acts.len() >= b),
            "quant_dot: activation slice of {} bytes is short of {m} rows of {ab}",
            acts.len()
        );
        assert!(
            need_o.is_some_and(|b| out.len() >= b),
            "quant_dot: output of {} values is short of {rows} x {m}",
            out.len()
        );
        if rows == 0 || m == 0 {
            return;
        }
        if n == 0 {
            out[..rows * m].fill(0.0);
            return;
        }
        let stored = wb * self.layout.stored_rows(rows);
        f(n, &w[..stored], rows, &acts[..ab * m], m, &mut out[..rows * m]);
    }
}

/// The fastest kernel this CPU runs for weights of type `w` (AVX-512 VNNI for the 8-bit
/// types where the CPU has it, else AVX2 when the CPU has AVX2, FMA and F16C), within the
/// `STRATA_CPU_ISA` cap, or `None` when the type has no kernel.
pub fn kernel_for(w: GgmlType) -> Option<DotKernel> {
    kernel_for_cap(w, crate::cpu::isa::isa_cap())
}

/// The layout [`kernel_for`]`(w)` reads: how the CPU backend stores matrices of `w`.
pub fn cpu_layout(w: GgmlType) -> WeightLayout {
    kernel_for(w).map_or(WeightLayout::File, |k| k.layout())
}

/// The fastest kernel for `w` whose instruction set is at most `cap` (`None`: no cap).
pub fn kernel_for_cap(w: GgmlType, cap: Option<IsaLevel>) -> Option<DotKernel> {
    kernels_for(w).into_iter().find(|k| allowed_under(k.level(), cap))
}

/// Every kernel this CPU runs for weights of type `w`, fastest first, the scalar one last
/// (what the tests and the benchmark compare). The SIMD builds give bit-identical results
/// to each other; the scalar one agrees within rounding.
pub fn kernels_for(w: GgmlType) -> Vec<DotKernel> {
    let mut out = Vec::new();
    // Every SIMD build of a type the row groups hold reads them.
    let layout = if WeightLayout::RowGroups8.holds(w) {
        WeightLayout::RowGroups8
    } else {
        WeightLayout::File
    };
    #[cfg(target_arch = "x86_64")]
    {
        let make = |isa, f| DotKernel {
            weight: w,
            act: act_format_for(w),
            isa,
            layout,
            f,
            columns: avx2::columns_kernel(w, isa == IsaLevel::Avx512Vnni),
        };
        out.extend(avx2::kernel_vnni(w).map(|f| make(IsaLevel::Avx512Vnni, f)));
        out.extend(avx2::kernel(w).map(|f| make(IsaLevel::Avx2, f)));
    }
    out.extend(scalar_kernel_for(w));
    out
}

/// The portable scalar kernel for weights of type `w` (the reference the SIMD kernels are
/// tested against), or `None` when the type has no kernel.
pub fn scalar_kernel_for(w: GgmlType) -> Option<DotKernel> {
    scalar::kernel(w).map(|f| DotKernel {
        weight: w,
        act: act_format_for(w),
        isa: IsaLevel::Scalar,
        layout: WeightLayout::File,
        f,
        columns: None,
    })
}

/// Whether the AVX2 kernels can run on this CPU (AVX2, FMA and F16C present).
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        avx2::available()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Dot products of the first weight row of `w_row` (`n` values of type `w`, in the layout of
/// [`kernel_for`]`(w)`) with `m` activation rows (each `act_row_bytes(act_format_for(w), n)`
/// bytes, contiguous), written to `out[..m]`. Dispatches on every call; hot loops should hold
/// a [`DotKernel`] from [`kernel_for`].
///
/// # Panics
/// If `w` has no kernel ([`is_supported`]), or as [`DotKernel::dot_rows`].
pub fn dot_rows(w: GgmlType, n: usize, w_row: &[u8], acts: &[u8], m: usize, out: &mut [f32]) {
    match kernel_for(w) {
        Some(k) => k.dot_rows(n, w_row, acts, m, out),
        None => panic!("quant_dot: no dot-product kernel for weight type {w}"),
    }
}
