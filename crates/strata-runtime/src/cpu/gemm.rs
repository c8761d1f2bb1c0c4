//! Dense f32 matrix products `A * B^T` for compute-bound work (prompt chunks), single-threaded
//! per call. Every output element is summed in one fixed order, so a row's result never depends
//! on how many other rows are in the product: the engine's batch invariance rests on this.

/// Lanes of one accumulator: each output element is the fixed-order sum of 8 interleaved partial
/// sums over `k` (then the `k % 8` tail in order).
const LANES: usize = 8;
/// Rows of `A` per register block.
const MR: usize = 4;
/// Rows of `B` per register block.
const NR: usize = 3;

/// `dst[i*ldd + j] = sum_k a[i*lda + k] * b[j*ldb + k]` for i < m, j < n: `A * B^T`.
///
/// # Safety
/// `dst` must be valid for writes at every `i*ldd + j` (i < m, j < n) and no other thread may
/// access those elements during the call.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_nt(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
    dst: *mut f32,
    ldd: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        a.len() >= (m - 1) * lda + k && b.len() >= (n - 1) * ldb + k,
        "gemm: operand too short"
    );
    let p = Operands {
        k,
        a,
        lda,
        b,
        ldb,
        dst,
        ldd,
    };
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA; operand bounds were checked above.
        unsafe { avx2::gemm_nt(&p, m, n) };
        return;
    }
    // SAFETY: operand bounds were checked above; dst is the caller's contract.
    unsafe { scalar_gemm_nt(&p, m, n) };
}

/// The operands of one product, shared by the kernels.
struct Operands<'a> {
    k: usize,
    a: &'a [f32],
    lda: usize,
    b: &'a [f32],
    ldb: usize,
    dst: *mut f32,
    ldd: usize,
}

/// Portable kernel with the same per-element summation structure as the AVX2 one.
///
/// # Safety
/// As [`gemm_nt`].
unsafe fn scalar_gemm_nt(p: &Operands, m: usize, n: usize) {
    let k8 = p.k - p.k % LANES;
    for i in 0..m {
        let ar = &p.a[i * p.lda..i * p.lda + p.k];
        for j in 0..n {
            let br = &p.b[j * p.ldb..j * p.ldb + p.k];
            let mut lanes = [0.0f32; LANES];
            for kk in (0..k8).step_by(LANES) {
                for l in 0..LANES {
                    lanes[l] = ar[kk + l].mul_add(br[kk + l], lanes[l]);
                }
            }
            let mut s =
                ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
            for kk in k8..p.k {
                s = ar[kk].mul_add(br[kk], s);
            }
            // SAFETY: (i, j) is inside the caller's m x n output.
            unsafe { *p.dst.add(i * p.ldd + j) = s };
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{Operands, LANES, MR, NR};
    use std::arch::x86_64::*;

    /// Sum of the 8 lanes in the order of the scalar kernel.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        // (l0+l4, l1+l5, l2+l6, l3+l7) -> (l0+l4 + l2+l6, l1+l5 + l3+l7) -> total
        let x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        let y = _mm_add_ps(x, _mm_movehl_ps(x, x));
        let z = _mm_add_ss(y, _mm_shuffle_ps(y, y, 1));
        _mm_cvtss_f32(z)
    }

    /// One register block: `R` rows of A against `C` rows of B, over all of k.
    #[inline(always)]
    unsafe fn block<const R: usize, const C: usize>(p: &Operands, i0: usize, j0: usize) {
        let k8 = p.k - p.k % LANES;
        let a = p.a.as_ptr();
        let b = p.b.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut kk = 0;
        while kk < k8 {
            let mut bv = [_mm256_setzero_ps(); C];
            for (c, v) in bv.iter_mut().enumerate() {
                *v = _mm256_loadu_ps(b.add((j0 + c) * p.ldb + kk));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm256_loadu_ps(a.add((i0 + r) * p.lda + kk));
                for (c, v) in row.iter_mut().enumerate() {
                    *v = _mm256_fmadd_ps(av, bv[c], *v);
                }
            }
            kk += LANES;
        }
        for (r, row) in acc.iter().enumerate() {
            for (c, v) in row.iter().enumerate() {
                let mut s = hsum(*v);
                for t in k8..p.k {
                    s = (*a.add((i0 + r) * p.lda + t)).mul_add(*b.add((j0 + c) * p.ldb + t), s);
                }
                *p.dst.add((i0 + r) * p.ldd + j0 + c) = s;
            }
        }
    }

    macro_rules! dispatch_cols {
        ($r:literal, $cols:expr, $p:expr, $i:expr, $j:expr) => {
            match $cols {
                3 => block::<$r, 3>($p, $i, $j),
                2 => block::<$r, 2>($p, $i, $j),
                _ => block::<$r, 1>($p, $i, $j),
            }
        };
    }

    /// # Safety
    /// AVX2 and FMA must be available; operands as [`super::gemm_nt`].
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn gemm_nt(p: &Operands, m: usize, n: usize) {
        let mut i = 0;
        while i < m {
            let rows = MR.min(m - i);
            let mut j = 0;
            while j < n {
                let cols = NR.min(n - j);
                match rows {
                    4 => dispatch_cols!(4, cols, p, i, j),
                    3 => dispatch_cols!(3, cols, p, i, j),
                    2 => dispatch_cols!(2, cols, p, i, j),
                    _ => dispatch_cols!(1, cols, p, i, j),
                }
                j += cols;
            }
            i += rows;
        }
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

    #[test]
    fn matches_a_naive_product_on_odd_shapes() {
        for &(m, n, k) in &[(1, 1, 1), (5, 7, 9), (4, 3, 8), (9, 10, 67), (13, 64, 576)] {
            let a: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 / 11.0 - 0.5).collect();
            let b: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 / 7.0 - 0.5).collect();
            let mut d = vec![0.0; m * n];
            unsafe { gemm_nt(m, n, k, &a, k, &b, k, d.as_mut_ptr(), n) };
            for (got, want) in d.iter().zip(naive(m, n, k, &a, &b)) {
                assert!(
                    (*got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "{m}x{n}x{k}: {got} vs {want}"
                );
            }
        }
    }

    /// A row's result must not depend on how many other rows are in the product, nor on where
    /// the product starts: prompt rows go through these GEMMs whatever the batch.
    #[test]
    fn a_row_is_computed_the_same_whatever_m() {
        for &(n, k) in &[(64usize, 576usize), (64, 1536), (16, 64), (7, 20)] {
            let b: Vec<f32> = (0..n * k).map(|i| ((i * 7919) % 1013) as f32 / 1013.0 - 0.5).collect();
            let max_m = 300;
            let a: Vec<f32> = (0..max_m * k)
                .map(|i| ((i * 104729) % 2039) as f32 / 2039.0 - 0.5)
                .collect();
            let mut full = vec![0.0; max_m * n];
            unsafe { gemm_nt(max_m, n, k, &a, k, &b, k, full.as_mut_ptr(), n) };
            for m in (1..=9).chain([31, 97, 255]) {
                for first in [0usize, 3, 17] {
                    let mut part = vec![0.0; m * n];
                    unsafe { gemm_nt(m, n, k, &a[first * k..], k, &b, k, part.as_mut_ptr(), n) };
                    assert_eq!(
                        &part[..],
                        &full[first * n..(first + m) * n],
                        "n={n} k={k}: rows {first}.. differ when computed {m} at a time"
                    );
                }
            }
            // Fewer columns at a time must not change a value either.
            let mut cols = vec![0.0; max_m];
            unsafe { gemm_nt(max_m, 1, k, &a, k, &b[(n - 1) * k..], k, cols.as_mut_ptr(), 1) };
            for i in 0..max_m {
                assert_eq!(cols[i], full[i * n + n - 1]);
            }
        }
    }

    #[test]
    fn the_scalar_kernel_agrees_with_the_dispatched_one() {
        let (m, n, k) = (6, 5, 70);
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 31) % 17) as f32 / 17.0 - 0.5).collect();
        let b: Vec<f32> = (0..n * k).map(|i| ((i * 13) % 19) as f32 / 19.0 - 0.5).collect();
        let (mut d1, mut d2) = (vec![0.0; m * n], vec![0.0; m * n]);
        unsafe { gemm_nt(m, n, k, &a, k, &b, k, d1.as_mut_ptr(), n) };
        let p = Operands {
            k,
            a: &a,
            lda: k,
            b: &b,
            ldb: k,
            dst: d2.as_mut_ptr(),
            ldd: n,
        };
        unsafe { scalar_gemm_nt(&p, m, n) };
        assert_eq!(d1, d2);
    }
}
