//! Dense f32 matrix products for compute-bound work (prompt chunks, prefill attention).
//! Thin, bounds-checked wrappers over the `gemm` crate, always single-threaded inside one call.

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
    let b_needed = if n == 0 { 0 } else { (n - 1) * ldb + k };
    // SAFETY: forwarded contract; B element (kk, j) at j*ldb + kk.
    unsafe { gemm_strided(m, n, k, a, lda, b, b_needed, (ldb, 1), dst, ldd) }
}

/// `dst[i*ldd + j] = sum_k a[i*lda + k] * b[k*ldb + j]` for i < m, j < n: `A * B`.
///
/// # Safety
/// As [`gemm_nt`].
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_nn(
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
    let b_needed = if k == 0 { 0 } else { (k - 1) * ldb + n };
    // SAFETY: forwarded contract; B element (kk, j) at kk*ldb + j.
    unsafe { gemm_strided(m, n, k, a, lda, b, b_needed, (1, ldb), dst, ldd) }
}

/// The shared body: B given by its (column, row) strides in elements.
///
/// # Safety
/// As [`gemm_nt`]; `b_needed` must bound the highest B index touched plus one.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_strided(
    m: usize,
    n: usize,
    k: usize,
    a: &[f32],
    lda: usize,
    b: &[f32],
    b_needed: usize,
    (b_cs, b_rs): (usize, usize),
    dst: *mut f32,
    ldd: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        a.len() >= (m - 1) * lda + k && b.len() >= b_needed,
        "gemm: operand too short"
    );
    // SAFETY: operands checked above; dst is the caller's contract.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            ldd as isize,
            false,
            a.as_ptr(),
            1,
            lda as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nt_and_nn_match_naive_products() {
        let (m, n, k) = (5, 7, 9);
        let a: Vec<f32> = (0..m * k).map(|i| (i % 11) as f32 - 5.0).collect();
        let b: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut d = vec![0.0; m * n];
        unsafe { gemm_nt(m, n, k, &a, k, &b, k, d.as_mut_ptr(), n) };
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|kk| a[i * k + kk] * b[j * k + kk]).sum();
                assert_eq!(d[i * n + j], want);
            }
        }
        // b viewed as k x n row-major.
        let mut e = vec![0.0; m * n];
        unsafe { gemm_nn(m, n, k, &a, k, &b, n, e.as_mut_ptr(), n) };
        for i in 0..m {
            for j in 0..n {
                let want: f32 = (0..k).map(|kk| a[i * k + kk] * b[kk * n + j]).sum();
                assert_eq!(e[i * n + j], want);
            }
        }
    }
}
