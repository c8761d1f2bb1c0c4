//! Dense f32 products of activation rows with packed weight panels, for compute-bound prompt
//! rows: each output element is one FMA chain over k in order, whatever the number of rows.

/// Weight rows per packed panel: the 16 output columns of one register block (two 8-lane
/// registers).
pub const PANEL: usize = 16;
/// Activation rows per register block (6 x 2 accumulators, 2 panel loads and 1 broadcast fit
/// the 16 AVX2 registers).
const MR: usize = 6;
/// Depth of one pass over a panel: 256 x 16 floats (16 KiB) stay in L1 while every block of
/// activation rows runs over them.
const KC: usize = 256;

/// Floats that [`pack_panels`] writes for `rows` weight rows of `k` values.
pub fn packed_len(rows: usize, k: usize) -> usize {
    rows.div_ceil(PANEL) * PANEL * k
}

/// Packs the `rows x k` matrix W, whose element `(r, kk)` is `src[r * row_stride + kk *
/// depth_stride]`, into panels of [`PANEL`] rows: panel `p` holds rows `p*PANEL..` as `k`
/// consecutive groups of `PANEL` values (one per row, zero past the last row), the order
/// [`gemm_packed`] reads them in. Row-major W is `(k, 1)`; W given transposed is `(1, rows)`.
pub fn pack_panels(src: &[f32], rows: usize, k: usize, row_stride: usize, depth_stride: usize, dst: &mut [f32]) {
    if rows == 0 || k == 0 {
        return;
    }
    assert!(
        src.len() > (rows - 1) * row_stride + (k - 1) * depth_stride,
        "pack_panels: source too short for {rows} x {k}"
    );
    assert!(dst.len() >= packed_len(rows, k), "pack_panels: destination too short");
    for (p, panel) in dst[..packed_len(rows, k)].chunks_exact_mut(PANEL * k).enumerate() {
        let r0 = p * PANEL;
        let live = PANEL.min(rows - r0);
        if depth_stride == 1 {
            // Row-major: walk each source row once.
            for c in 0..PANEL {
                if c < live {
                    let row = &src[(r0 + c) * row_stride..(r0 + c) * row_stride + k];
                    for (group, &v) in panel.chunks_exact_mut(PANEL).zip(row) {
                        group[c] = v;
                    }
                } else {
                    panel.chunks_exact_mut(PANEL).for_each(|group| group[c] = 0.0);
                }
            }
        } else if row_stride == 1 {
            // Transposed: each depth's values for the panel's rows are contiguous.
            for (kk, group) in panel.chunks_exact_mut(PANEL).enumerate() {
                let base = r0 + kk * depth_stride;
                group[..live].copy_from_slice(&src[base..base + live]);
                group[live..].fill(0.0);
            }
        } else {
            for (kk, group) in panel.chunks_exact_mut(PANEL).enumerate() {
                let base = r0 * row_stride + kk * depth_stride;
                for (c, v) in group[..live].iter_mut().enumerate() {
                    *v = src[base + c * row_stride];
                }
                group[live..].fill(0.0);
            }
        }
    }
}

/// `dst[i*ldd + j] = sum_kk a[i*lda + kk] * W[j][kk]` for i < m, j < n, where `panels` holds
/// the n rows of W packed by [`pack_panels`]. Every element is computed as
/// `s = 0; for kk in 0..k { s = fma(a, w, s) }`, so it depends only on its own row and column.
///
/// # Safety
/// `dst` must be valid for reads and writes at every `i*ldd + j` (i < m, j < n) and no other
/// thread may access those elements during the call.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_packed(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    panels: &[f32],
    dst: *mut f32,
    ldd: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        a.len() >= (m - 1) * lda + k && panels.len() >= packed_len(n, k),
        "gemm: operand too short"
    );
    let p = Operands {
        m,
        n,
        k,
        a,
        lda,
        panels,
        dst,
        ldd,
    };
    #[cfg(target_arch = "x86_64")]
    if avx512::available() {
        // SAFETY: the CPU has AVX-512F (checked just now); operand bounds were checked above.
        unsafe { avx512::gemm_packed(&p) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if avx2::available() {
        // SAFETY: the CPU has AVX2 and FMA; operand bounds were checked above.
        unsafe { avx2::gemm_packed(&p) };
        return;
    }
    // SAFETY: operand bounds were checked above; dst is the caller's contract.
    unsafe { scalar_gemm_packed(&p) };
}

/// The operands of one product, shared by the kernels.
struct Operands<'a> {
    m: usize,
    n: usize,
    k: usize,
    a: &'a [f32],
    lda: usize,
    panels: &'a [f32],
    dst: *mut f32,
    ldd: usize,
}

/// Portable kernel: the same FMA chain per element as the AVX2 one, so the same bits.
///
/// # Safety
/// As [`gemm_packed`].
unsafe fn scalar_gemm_packed(p: &Operands) {
    for i in 0..p.m {
        let ar = &p.a[i * p.lda..i * p.lda + p.k];
        for j in 0..p.n {
            let panel = &p.panels[(j / PANEL) * PANEL * p.k..];
            let mut s = 0.0f32;
            for (kk, &av) in ar.iter().enumerate() {
                s = av.mul_add(panel[kk * PANEL + j % PANEL], s);
            }
            // SAFETY: (i, j) is inside the caller's m x n output.
            unsafe { *p.dst.add(i * p.ldd + j) = s };
        }
    }
}

/// Walks a product in passes of [`KC`] depths and, within each pass, blocks of at most `mr`
/// activation rows: `f(rows, i, k0, k1)` for the block of `rows` rows from `i` over depths
/// `k0..k1` (the SIMD kernels' outer loops).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn for_each_row_block(p: &Operands, mr: usize, mut f: impl FnMut(usize, usize, usize, usize)) {
    let mut k0 = 0;
    while k0 < p.k {
        let k1 = (k0 + KC).min(p.k);
        let mut i = 0;
        while i < p.m {
            let rows = mr.min(p.m - i);
            f(rows, i, k0, k1);
            i += rows;
        }
        k0 = k1;
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Operands, MR, PANEL};
    use std::arch::x86_64::*;

    /// One register block: `R` activation rows from `i0` against the panel of columns
    /// `j0..j0 + cols`, over depths `k0..k1`, continuing the chains stored in `dst` unless
    /// `k0 == 0`.
    #[inline(always)]
    unsafe fn block<const R: usize>(p: &Operands, i0: usize, j0: usize, cols: usize, k0: usize, k1: usize) {
        let a = p.a.as_ptr().add(i0 * p.lda);
        let b = p.panels.as_ptr().add(j0 * p.k);
        let d = p.dst.add(i0 * p.ldd + j0);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        if k0 > 0 {
            for (r, row) in acc.iter_mut().enumerate() {
                let mut buf = [0.0f32; PANEL];
                std::ptr::copy_nonoverlapping(d.add(r * p.ldd), buf.as_mut_ptr(), cols);
                row[0] = _mm256_loadu_ps(buf.as_ptr());
                row[1] = _mm256_loadu_ps(buf.as_ptr().add(8));
            }
        }
        for kk in k0..k1 {
            let b0 = _mm256_loadu_ps(b.add(kk * PANEL));
            let b1 = _mm256_loadu_ps(b.add(kk * PANEL + 8));
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm256_broadcast_ss(&*a.add(r * p.lda + kk));
                row[0] = _mm256_fmadd_ps(av, b0, row[0]);
                row[1] = _mm256_fmadd_ps(av, b1, row[1]);
            }
        }
        for (r, row) in acc.iter().enumerate() {
            if cols == PANEL {
                _mm256_storeu_ps(d.add(r * p.ldd), row[0]);
                _mm256_storeu_ps(d.add(r * p.ldd + 8), row[1]);
            } else {
                let mut buf = [0.0f32; PANEL];
                _mm256_storeu_ps(buf.as_mut_ptr(), row[0]);
                _mm256_storeu_ps(buf.as_mut_ptr().add(8), row[1]);
                std::ptr::copy_nonoverlapping(buf.as_ptr(), d.add(r * p.ldd), cols);
            }
        }
    }

    /// Whether the AVX2 kernel may run: the CPU has AVX2 and FMA, and `STRATA_CPU_ISA` allows it.
    pub(super) fn available() -> bool {
        crate::cpu::isa::allows(crate::cpu::isa::IsaLevel::Avx2)
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
    }

    /// # Safety
    /// AVX2 and FMA must be available; operands as [`super::gemm_packed`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gemm_packed(p: &Operands) {
        super::for_each_row_block(p, MR, |rows, i, k0, k1| {
            let mut j = 0;
            while j < p.n {
                let cols = PANEL.min(p.n - j);
                match rows {
                    6 => block::<6>(p, i, j, cols, k0, k1),
                    5 => block::<5>(p, i, j, cols, k0, k1),
                    4 => block::<4>(p, i, j, cols, k0, k1),
                    3 => block::<3>(p, i, j, cols, k0, k1),
                    2 => block::<2>(p, i, j, cols, k0, k1),
                    _ => block::<1>(p, i, j, cols, k0, k1),
                }
                j += PANEL;
            }
        });
    }
}

/// The AVX-512 kernel: one 16-lane register holds a whole panel row, so a register block is
/// up to 12 activation rows by two panels (24 accumulators of the 32 registers), half the FMA
/// instructions of the AVX2 kernel per value. Each element is the same FMA chain in the same
/// order, so the results are bit-identical to the AVX2 and scalar kernels.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{Operands, PANEL};
    use std::arch::x86_64::*;

    /// Activation rows per register block.
    const MR: usize = 12;

    /// Whether this kernel may run: the CPU has AVX-512F and `STRATA_CPU_ISA` allows AVX-512.
    pub(super) fn available() -> bool {
        crate::cpu::isa::allows(crate::cpu::isa::IsaLevel::Avx512Vnni) && std::is_x86_feature_detected!("avx512f")
    }

    /// One register block: `R` activation rows from `i0` against the `NP` panels from column
    /// `j0` (`cols` live columns in all, the rest zero padding), over depths `k0..k1`,
    /// continuing the chains stored in `dst` unless `k0 == 0`.
    #[inline(always)]
    unsafe fn block<const R: usize, const NP: usize>(
        p: &Operands,
        i0: usize,
        j0: usize,
        cols: usize,
        k0: usize,
        k1: usize,
    ) {
        let a = p.a.as_ptr().add(i0 * p.lda);
        let b = p.panels.as_ptr().add(j0 * p.k);
        let d = p.dst.add(i0 * p.ldd + j0);
        // Live columns of each panel as a lane mask.
        let mut masks = [0u16; NP];
        for (q, mask) in masks.iter_mut().enumerate() {
            let live = cols.saturating_sub(q * PANEL).min(PANEL);
            *mask = ((1u32 << live) - 1) as u16;
        }
        let mut acc = [[_mm512_setzero_ps(); NP]; R];
        if k0 > 0 {
            for (r, row) in acc.iter_mut().enumerate() {
                for (q, v) in row.iter_mut().enumerate() {
                    *v = _mm512_maskz_loadu_ps(masks[q], d.add(r * p.ldd + q * PANEL));
                }
            }
        }
        for kk in k0..k1 {
            let mut bv = [_mm512_setzero_ps(); NP];
            for (q, v) in bv.iter_mut().enumerate() {
                *v = _mm512_loadu_ps(b.add(q * PANEL * p.k + kk * PANEL));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(r * p.lda + kk));
                for (v, &w) in row.iter_mut().zip(&bv) {
                    *v = _mm512_fmadd_ps(av, w, *v);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (q, &v) in row.iter().enumerate() {
                _mm512_mask_storeu_ps(d.add(r * p.ldd + q * PANEL), masks[q], v);
            }
        }
    }

    /// The blocks of `rows` activation rows from `i` over every panel.
    #[inline(always)]
    unsafe fn row_block<const R: usize>(p: &Operands, i: usize, k0: usize, k1: usize) {
        let mut j = 0;
        while j < p.n {
            let cols = (2 * PANEL).min(p.n - j);
            if cols > PANEL {
                block::<R, 2>(p, i, j, cols, k0, k1);
            } else {
                block::<R, 1>(p, i, j, cols, k0, k1);
            }
            j += 2 * PANEL;
        }
    }

    /// # Safety
    /// AVX-512F must be available; operands as [`super::gemm_packed`].
    #[target_feature(enable = "avx512f,fma")]
    pub(super) unsafe fn gemm_packed(p: &Operands) {
        super::for_each_row_block(p, MR, |rows, i, k0, k1| match rows {
            12 => row_block::<12>(p, i, k0, k1),
            11 => row_block::<11>(p, i, k0, k1),
            10 => row_block::<10>(p, i, k0, k1),
            9 => row_block::<9>(p, i, k0, k1),
            8 => row_block::<8>(p, i, k0, k1),
            7 => row_block::<7>(p, i, k0, k1),
            6 => row_block::<6>(p, i, k0, k1),
            5 => row_block::<5>(p, i, k0, k1),
            4 => row_block::<4>(p, i, k0, k1),
            3 => row_block::<3>(p, i, k0, k1),
            2 => row_block::<2>(p, i, k0, k1),
            _ => row_block::<1>(p, i, k0, k1),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f64> {
        let mut d = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                d[i * n + j] = (0..k).map(|kk| a[i * k + kk] as f64 * b[j * k + kk] as f64).sum();
            }
        }
        d
    }

    /// `A * B^T` through packing and the dispatched kernel.
    fn product(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
        let mut panels = vec![f32::NAN; packed_len(n, k)];
        pack_panels(b, n, k, k, 1, &mut panels);
        let mut d = vec![0.0; m * n];
        unsafe { gemm_packed(m, n, k, a, k, &panels, d.as_mut_ptr(), n) };
        d
    }

    #[test]
    fn packing_puts_each_row_in_its_panel_column() {
        let (rows, k) = (19, 5);
        let w: Vec<f32> = (0..rows * k).map(|i| i as f32).collect();
        let mut dst = vec![f32::NAN; packed_len(rows, k)];
        pack_panels(&w, rows, k, k, 1, &mut dst);
        assert_eq!(dst.len(), 2 * PANEL * k);
        for r in 0..2 * PANEL {
            for kk in 0..k {
                let got = dst[(r / PANEL) * PANEL * k + kk * PANEL + r % PANEL];
                let want = if r < rows { w[r * k + kk] } else { 0.0 };
                assert_eq!(got, want, "row {r} depth {kk}");
            }
        }
        // The same matrix given transposed packs to the same panels.
        let wt: Vec<f32> = (0..k * rows).map(|i| w[(i % rows) * k + i / rows]).collect();
        let mut dst_t = vec![f32::NAN; packed_len(rows, k)];
        pack_panels(&wt, rows, k, 1, rows, &mut dst_t);
        assert_eq!(dst, dst_t);
    }

    #[test]
    fn matches_a_naive_product_on_odd_shapes() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (5, 7, 9),
            (6, 16, 8),
            (9, 10, 67),
            (13, 64, 576),
            (7, 33, 600),
        ] {
            let a: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 / 11.0 - 0.5).collect();
            let b: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 / 7.0 - 0.5).collect();
            let d = product(m, n, k, &a, &b);
            for (got, want) in d.iter().zip(naive(m, n, k, &a, &b)) {
                assert!(
                    (*got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "{m}x{n}x{k}: {got} vs {want}"
                );
            }
        }
    }

    /// A row's result must not depend on how many other rows are in the product, nor on where
    /// the product starts, nor on the columns beside it: prompt rows go through these GEMMs
    /// whatever the batch.
    #[test]
    fn a_row_is_computed_the_same_whatever_m() {
        for &(n, k) in &[(64usize, 576usize), (64, 1536), (16, 64), (7, 20)] {
            let b: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 1013) as f32 / 1013.0 - 0.5).collect();
            let max_m = 300;
            let a: Vec<f32> = (0..max_m * k)
                .map(|i| ((i * 104729) % 2039) as f32 / 2039.0 - 0.5)
                .collect();
            let mut panels = vec![0.0; packed_len(n, k)];
            pack_panels(&b, n, k, k, 1, &mut panels);
            let mut full = vec![0.0; max_m * n];
            unsafe { gemm_packed(max_m, n, k, &a, k, &panels, full.as_mut_ptr(), n) };
            for m in (1..=9).chain([31, 97, 255]) {
                for first in [0usize, 3, 17] {
                    let mut part = vec![0.0; m * n];
                    unsafe { gemm_packed(m, n, k, &a[first * k..], k, &panels, part.as_mut_ptr(), n) };
                    assert_eq!(
                        &part[..],
                        &full[first * n..(first + m) * n],
                        "n={n} k={k}: rows {first}.. differ when computed {m} at a time"
                    );
                }
            }
            // One column alone (another panel layout) must not change a value either.
            let mut one = vec![0.0; packed_len(1, k)];
            pack_panels(&b[(n - 1) * k..], 1, k, k, 1, &mut one);
            let mut cols = vec![0.0; max_m];
            unsafe { gemm_packed(max_m, 1, k, &a, k, &one, cols.as_mut_ptr(), 1) };
            for i in 0..max_m {
                assert_eq!(cols[i], full[i * n + n - 1]);
            }
        }
    }

    /// Every kernel this CPU runs (AVX-512, AVX2, scalar; called directly, whatever
    /// `STRATA_CPU_ISA` says) gives the same bits, on shapes with partial register blocks,
    /// partial panels and depths past one `KC` pass.
    #[test]
    fn every_kernel_this_cpu_runs_gives_the_same_bits() {
        for &(m, n, k) in &[
            (1, 1, 1),
            (13, 33, 600),
            (12, 32, 256),
            (25, 48, 257),
            (7, 5, 3),
            (30, 64, 576),
        ] {
            let a: Vec<f32> = (0..m * k)
                .map(|i| ((i * 104729) % 2039) as f32 / 2039.0 - 0.5)
                .collect();
            let b: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 1013) as f32 / 1013.0 - 0.5).collect();
            let mut panels = vec![0.0; packed_len(n, k)];
            pack_panels(&b, n, k, k, 1, &mut panels);
            let run = |kernel: unsafe fn(&Operands)| {
                // NaN outside the m x n block (stride n + 3) shows any write past a row.
                let ldd = n + 3;
                let mut d = vec![f32::NAN; m * ldd];
                let p = Operands {
                    m,
                    n,
                    k,
                    a: &a,
                    lda: k,
                    panels: &panels,
                    dst: d.as_mut_ptr(),
                    ldd,
                };
                // SAFETY: the features of `kernel` were checked by the caller; d holds m x ldd.
                unsafe { kernel(&p) };
                for (i, row) in d.chunks_exact(ldd).enumerate() {
                    assert!(row[n..].iter().all(|v| v.is_nan()), "{m}x{n}x{k}: wrote past row {i}");
                }
                d.iter().map(|v| v.to_bits()).collect::<Vec<u32>>()
            };
            let want = run(scalar_gemm_packed);
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    assert_eq!(run(avx2::gemm_packed), want, "avx2 {m}x{n}x{k}");
                }
                if std::is_x86_feature_detected!("avx512f") {
                    assert_eq!(run(avx512::gemm_packed), want, "avx512 {m}x{n}x{k}");
                }
            }
        }
    }
}
