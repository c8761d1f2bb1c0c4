//! Portable scalar dot-product kernels, one per weight type: the reference the SIMD paths match.
//! Exact integer sums per block, scaled and summed in f32; written to auto-vectorize passably.

use super::act::bsum32;
use super::{act_format_for, act_row_bytes, weight_row_bytes, MatrixFn, Q8_1_META_BYTES};
use half::bf16;
use strata_formats::quant::QK_K;
use strata_formats::GgmlType;

/// The scalar kernel for weights of type `w`, if any.
pub(super) fn kernel(w: GgmlType) -> Option<MatrixFn> {
    use GgmlType::*;
    Some(match w {
        F32 => matrix::<RowF32>,
        F16 => matrix::<RowF16>,
        BF16 => matrix::<RowBf16>,
        Q8_0 => matrix::<RowQ8_0>,
        Q4_0 => matrix::<RowQ4_0>,
        Q4_1 => matrix::<RowQ4_1>,
        Q5_0 => matrix::<RowQ5_0>,
        Q5_1 => matrix::<RowQ5_1>,
        Q4K => matrix::<RowQ4K>,
        Q5K => matrix::<RowQ5K>,
        Q6K => matrix::<RowQ6K>,
        _ => return None,
    })
}

/// Dot product of one weight row with one activation row (both of `n` values).
trait RowDot {
    const TYPE: GgmlType;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32;
}

/// Every (weight row, activation row) pair, one at a time.
fn matrix<K: RowDot>(n: usize, w: &[u8], rows: usize, acts: &[u8], m: usize, out: &mut [f32]) {
    let wb = weight_row_bytes(K::TYPE, n);
    let ab = act_row_bytes(act_format_for(K::TYPE), n);
    for (w_row, o) in w.chunks_exact(wb).zip(out.chunks_exact_mut(m)).take(rows) {
        for (a_row, ov) in acts.chunks_exact(ab).zip(o.iter_mut()) {
            *ov = K::dot(n, w_row, a_row);
        }
    }
}

#[inline]
fn f16_at(b: &[u8], off: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// IEEE half to single, exactly, in plain integer arithmetic (`half` would check the CPU's
/// features on every call).
#[inline]
fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h & 0x8000) << 16;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match exp {
        // Zero or subnormal: man * 2^-24, exact in f32.
        0 => (man as f32 * (1.0 / 16_777_216.0)).to_bits(),
        // Infinity or NaN (payload kept).
        31 => 0x7f80_0000 | (man << 13),
        _ => ((exp + 112) << 23) | (man << 13),
    };
    f32::from_bits(sign | bits)
}

#[inline]
fn f32_at(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline]
fn i16_at(b: &[u8], off: usize) -> i32 {
    i32::from(i16::from_le_bytes([b[off], b[off + 1]]))
}

/// `sum w[k] * a[k]` over `N` weight values and `N` activation quants (bytes read as `i8`).
/// Fixed-size and branch-free, so the compiler vectorizes it for the baseline target.
#[inline]
fn idot<const N: usize>(w: &[i8; N], a: &[u8; N]) -> i32 {
    // Widened to i16 first: the i16 x i16 -> i32 sum is a shape vectorizers know well.
    let w16: [i16; N] = w.map(i16::from);
    let a16: [i16; N] = a.map(|v| i16::from(v as i8));
    let mut s = 0i32;
    for k in 0..N {
        s += i32::from(w16[k]) * i32::from(a16[k]);
    }
    s
}

/// A copy of `b[off..off + N]` as an array.
#[inline]
fn arr<T: Copy, const N: usize>(b: &[T], off: usize) -> [T; N] {
    let s = &b[off..off + N];
    std::array::from_fn(|k| s[k])
}

/// Sum of `w(k) * a(k)` for float weights, in 8 interleaved partial sums (as the SIMD
/// kernels do, and so the compiler can vectorize it), then added pairwise.
#[inline]
fn float_dot(n: usize, a: &[u8], w: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let n8 = n / 8 * 8;
    for base in (0..n8).step_by(8) {
        for (l, s) in acc.iter_mut().enumerate() {
            *s += w(base + l) * f32_at(a, 4 * (base + l));
        }
    }
    let mut total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for e in n8..n {
        total += w(e) * f32_at(a, 4 * e);
    }
    total
}

struct RowF32;
impl RowDot for RowF32 {
    const TYPE: GgmlType = GgmlType::F32;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        float_dot(n, a, |i| f32_at(w, 4 * i))
    }
}

struct RowF16;
impl RowDot for RowF16 {
    const TYPE: GgmlType = GgmlType::F16;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        float_dot(n, a, |i| f16_at(w, 2 * i))
    }
}

struct RowBf16;
impl RowDot for RowBf16 {
    const TYPE: GgmlType = GgmlType::BF16;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        float_dot(n, a, |i| {
            bf16::from_bits(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])).to_f32()
        })
    }
}

struct RowQ8_0;
impl RowDot for RowQ8_0 {
    const TYPE: GgmlType = GgmlType::Q8_0;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        dot_q8_1_blocks(n, w, a, 34, |wb| arr::<u8, 32>(wb, 2).map(|v| v as i8), false)
    }
}

/// The 32 values of 16 packed nibbles: low nibbles are values 0..16, high ones 16..32.
#[inline]
fn nibbles(q: &[u8; 16]) -> [i8; 32] {
    let mut out = [0i8; 32];
    for k in 0..16 {
        out[k] = (q[k] & 15) as i8;
        out[k + 16] = (q[k] >> 4) as i8;
    }
    out
}

/// Adds the fifth bits of a Q5 block (bit `k` of the little-endian `qh` word for value `k`).
#[inline]
fn with_fifth_bits(mut v: [i8; 32], qh: &[u8; 4]) -> [i8; 32] {
    let qh = u32::from_le_bytes(*qh);
    for (k, x) in v.iter_mut().enumerate() {
        *x |= (((qh >> k) & 1) << 4) as i8;
    }
    v
}

/// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 against a Q8_1 row: quants `q - offset`, scale `d`, and for
/// the `_1` types the min `m` at bytes 2..4 times the block's scaled activation sum.
fn dot_q8_1_blocks(n: usize, w: &[u8], a: &[u8], bb: usize, weights: impl Fn(&[u8]) -> [i8; 32], has_min: bool) -> f32 {
    let (qs, meta) = a.split_at(n);
    let mut acc = 0.0f32;
    for (b, wb) in w.chunks_exact(bb).enumerate() {
        let s = idot(&weights(wb), &arr(qs, 32 * b));
        let mb = Q8_1_META_BYTES * b;
        acc += f16_at(wb, 0) * f32_at(meta, mb) * s as f32;
        if has_min {
            acc += f16_at(wb, 2) * f32_at(meta, mb + 4);
        }
    }
    acc
}

struct RowQ4_0;
impl RowDot for RowQ4_0 {
    const TYPE: GgmlType = GgmlType::Q4_0;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        dot_q8_1_blocks(n, w, a, 18, |wb| nibbles(&arr(wb, 2)).map(|v| v - 8), false)
    }
}

struct RowQ4_1;
impl RowDot for RowQ4_1 {
    const TYPE: GgmlType = GgmlType::Q4_1;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        dot_q8_1_blocks(n, w, a, 20, |wb| nibbles(&arr(wb, 4)), true)
    }
}

struct RowQ5_0;
impl RowDot for RowQ5_0 {
    const TYPE: GgmlType = GgmlType::Q5_0;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        dot_q8_1_blocks(
            n,
            w,
            a,
            22,
            |wb| with_fifth_bits(nibbles(&arr(wb, 6)), &arr(wb, 2)).map(|v| v - 16),
            false,
        )
    }
}

struct RowQ5_1;
impl RowDot for RowQ5_1 {
    const TYPE: GgmlType = GgmlType::Q5_1;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        dot_q8_1_blocks(
            n,
            w,
            a,
            24,
            |wb| with_fifth_bits(nibbles(&arr(wb, 8)), &arr(wb, 4)),
            true,
        )
    }
}

/// The eight 6-bit scales and eight 6-bit mins packed in the 12 `scales` bytes of a
/// Q4_K / Q5_K super-block (one pair per 32-value sub-block).
fn unpack_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// The activation side of one Q8K super-block: quants, scale and per-16 sums.
struct Q8KBlock<'a> {
    q: &'a [u8],
    d: f32,
    bsums: &'a [u8],
}

/// Splits a Q8K activation row of `n` values into its super-blocks.
fn q8k_blocks(n: usize, a: &[u8]) -> impl Iterator<Item = Q8KBlock<'_>> {
    let nb = n / QK_K;
    let (qs, meta) = a.split_at(n);
    let (ds, bsums) = meta.split_at(4 * nb);
    qs.chunks_exact(QK_K)
        .zip(ds.chunks_exact(4))
        .zip(bsums.chunks_exact(32))
        .map(|((q, d), bsums)| Q8KBlock {
            q,
            d: f32_at(d, 0),
            bsums,
        })
}

/// Q4_K / Q5_K super-block of unpacked quants against Q8K: `d * sum_j sc_j dot_j` minus
/// `dmin * sum_j mn_j (sum of the activation quants of sub-block j)`, each times `da`.
fn k4_block(q: &[i8; QK_K], wb: &[u8], ab: &Q8KBlock) -> f32 {
    let (sc, mn) = unpack_scales_mins(&wb[4..16]);
    let mut sumi = 0i32;
    let mut summ = 0i32;
    for j in 0..8 {
        let wq: [i8; 32] = arr(q, 32 * j);
        sumi += i32::from(sc[j]) * idot(&wq, &arr(ab.q, 32 * j));
        summ += i32::from(mn[j]) * bsum32(ab.bsums, j);
    }
    f16_at(wb, 0) * ab.d * sumi as f32 - f16_at(wb, 2) * ab.d * summ as f32
}

struct RowQ4K;
impl RowDot for RowQ4K {
    const TYPE: GgmlType = GgmlType::Q4K;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        let mut acc = 0.0f32;
        for (wb, ab) in w.chunks_exact(144).zip(q8k_blocks(n, a)) {
            let qs = &wb[16..144];
            let mut q = [0i8; QK_K];
            for j in 0..4 {
                for l in 0..32 {
                    q[64 * j + l] = (qs[32 * j + l] & 15) as i8;
                    q[64 * j + 32 + l] = (qs[32 * j + l] >> 4) as i8;
                }
            }
            acc += k4_block(&q, wb, &ab);
        }
        acc
    }
}

struct RowQ5K;
impl RowDot for RowQ5K {
    const TYPE: GgmlType = GgmlType::Q5K;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        let mut acc = 0.0f32;
        for (wb, ab) in w.chunks_exact(176).zip(q8k_blocks(n, a)) {
            let qh = &wb[16..48];
            let qs = &wb[48..176];
            let mut q = [0i8; QK_K];
            for j in 0..4 {
                for l in 0..32 {
                    let h = qh[l] >> (2 * j);
                    q[64 * j + l] = ((qs[32 * j + l] & 15) | ((h & 1) << 4)) as i8;
                    q[64 * j + 32 + l] = ((qs[32 * j + l] >> 4) | ((h & 2) << 3)) as i8;
                }
            }
            acc += k4_block(&q, wb, &ab);
        }
        acc
    }
}

struct RowQ6K;
impl RowDot for RowQ6K {
    const TYPE: GgmlType = GgmlType::Q6K;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        let mut acc = 0.0f32;
        for (wb, ab) in w.chunks_exact(210).zip(q8k_blocks(n, a)) {
            let ql = &wb[0..128];
            let qh = &wb[128..192];
            let sc = &wb[192..208];
            // Values 0..64 (unsigned); the -32 offset comes off through the per-16 sums.
            // Half h, group g of 32, position l: low 4 bits from ql (low nibbles for g < 2),
            // high 2 bits from qh bits 2g, 2g+1.
            let mut q = [0i8; QK_K];
            for h in 0..2 {
                for g in 0..4 {
                    for l in 0..32 {
                        let low = ql[64 * h + 32 * (g & 1) + l];
                        let low = if g < 2 { low & 15 } else { low >> 4 };
                        let high = (qh[32 * h + l] >> (2 * g)) & 3;
                        q[128 * h + 32 * g + l] = (low | (high << 4)) as i8;
                    }
                }
            }
            let mut sumi = 0i32;
            for (k, &scale) in sc.iter().enumerate() {
                let wq: [i8; 16] = arr(&q, 16 * k);
                let s = idot(&wq, &arr(ab.q, 16 * k));
                sumi += i32::from(scale as i8) * (s - 32 * i16_at(ab.bsums, 2 * k));
            }
            acc += f16_at(wb, 208) * ab.d * sumi as f32;
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::f16_to_f32;

    #[test]
    fn f16_conversion_is_exact() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_to_f32(h);
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
            }
        }
    }
}
