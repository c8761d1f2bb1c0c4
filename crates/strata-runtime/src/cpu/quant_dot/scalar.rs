//! Portable scalar dot-product kernels, one per weight type: the reference the SIMD paths match.
//! Integer sums per block exactly as the SIMD kernels form them, then scaled and summed in f32.

use super::act::q8_1_offset;
use super::{act_format_for, act_row_bytes, weight_row_bytes, MatrixFn};
use half::{bf16, f16};
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
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

#[inline]
fn f32_at(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

#[inline]
fn i16_at(b: &[u8], off: usize) -> i32 {
    i32::from(i16::from_le_bytes([b[off], b[off + 1]]))
}

/// The `i8` quants of a 32-block of activations.
#[inline]
fn act_q(qs: &[u8], blk: usize) -> &[u8] {
    &qs[32 * blk..32 * blk + 32]
}

struct RowF32;
impl RowDot for RowF32 {
    const TYPE: GgmlType = GgmlType::F32;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        (0..n).map(|i| f32_at(w, 4 * i) * f32_at(a, 4 * i)).sum()
    }
}

struct RowF16;
impl RowDot for RowF16 {
    const TYPE: GgmlType = GgmlType::F16;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        (0..n).map(|i| f16_at(w, 2 * i) * f32_at(a, 4 * i)).sum()
    }
}

struct RowBf16;
impl RowDot for RowBf16 {
    const TYPE: GgmlType = GgmlType::BF16;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        (0..n)
            .map(|i| {
                let wv = bf16::from_bits(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])).to_f32();
                wv * f32_at(a, 4 * i)
            })
            .sum()
    }
}

/// Sum over a 32-block of Q8_1 quants (block `b` of `nb`, interleaved layout) times `wq[i]`.
#[inline]
fn isum32_q8_1(qs: &[u8], nb: usize, b: usize, wq: impl Fn(usize) -> i32) -> i32 {
    (0..32)
        .map(|i| wq(i) * i32::from(qs[q8_1_offset(nb, b, i)] as i8))
        .sum()
}

/// Sum over a 32-block of `wq[i] * aq[i]` where `wq` gives the weight's integer value.
#[inline]
fn isum32(aq: &[u8], wq: impl Fn(usize) -> i32) -> i32 {
    aq.iter()
        .enumerate()
        .map(|(i, &a)| wq(i) * i32::from(a as i8))
        .sum()
}

struct RowQ8_0;
impl RowDot for RowQ8_0 {
    const TYPE: GgmlType = GgmlType::Q8_0;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        let (qs, meta) = a.split_at(n);
        let mut acc = 0.0f32;
        for (b, wb) in w.chunks_exact(34).enumerate() {
            let s = isum32(act_q(qs, b), |i| i32::from(wb[2 + i] as i8));
            acc += f16_at(wb, 0) * f32_at(meta, 4 * b) * s as f32;
        }
        acc
    }
}

struct RowQ4_0;
impl RowDot for RowQ4_0 {
    const TYPE: GgmlType = GgmlType::Q4_0;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        let (qs, meta) = a.split_at(n);
        let mut acc = 0.0f32;
        for (b, wb) in w.chunks_exact(18).enumerate() {
            let s = isum32_q8_1(qs, n / 32, b, |i| nibble(&wb[2..18], i) - 8);
            acc += f16_at(wb, 0) * f32_at(meta, 8 * b) * s as f32;
        }
        acc
    }
}

/// Element `i` (0..32) of a 16-byte nibble array: low nibbles are 0..16, high 16..32.
#[inline]
fn nibble(q: &[u8], i: usize) -> i32 {
    i32::from(if i < 16 { q[i] & 15 } else { q[i - 16] >> 4 })
}

/// Fifth bit of element `i` (0..32) of a Q5 block, from its little-endian `qh` word.
#[inline]
fn bit5(qh: u32, i: usize) -> i32 {
    (((qh >> i) & 1) << 4) as i32
}

struct RowQ4_1;
impl RowDot for RowQ4_1 {
    const TYPE: GgmlType = GgmlType::Q4_1;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        let (qs, meta) = a.split_at(n);
        let mut acc = 0.0f32;
        for (b, wb) in w.chunks_exact(20).enumerate() {
            let s = isum32_q8_1(qs, n / 32, b, |i| nibble(&wb[4..20], i));
            acc += f16_at(wb, 0) * f32_at(meta, 8 * b) * s as f32;
            acc += f16_at(wb, 2) * f32_at(meta, 8 * b + 4);
        }
        acc
    }
}

struct RowQ5_0;
impl RowDot for RowQ5_0 {
    const TYPE: GgmlType = GgmlType::Q5_0;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        let (qs, meta) = a.split_at(n);
        let mut acc = 0.0f32;
        for (b, wb) in w.chunks_exact(22).enumerate() {
            let qh = u32::from_le_bytes([wb[2], wb[3], wb[4], wb[5]]);
            let s = isum32_q8_1(qs, n / 32, b, |i| (nibble(&wb[6..22], i) | bit5(qh, i)) - 16);
            acc += f16_at(wb, 0) * f32_at(meta, 8 * b) * s as f32;
        }
        acc
    }
}

struct RowQ5_1;
impl RowDot for RowQ5_1 {
    const TYPE: GgmlType = GgmlType::Q5_1;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        let (qs, meta) = a.split_at(n);
        let mut acc = 0.0f32;
        for (b, wb) in w.chunks_exact(24).enumerate() {
            let qh = u32::from_le_bytes([wb[4], wb[5], wb[6], wb[7]]);
            let s = isum32_q8_1(qs, n / 32, b, |i| nibble(&wb[8..24], i) | bit5(qh, i));
            acc += f16_at(wb, 0) * f32_at(meta, 8 * b) * s as f32;
            acc += f16_at(wb, 2) * f32_at(meta, 8 * b + 4);
        }
        acc
    }
}

/// The eight 6-bit scales and eight 6-bit mins packed in the 12 `scales` bytes of a
/// Q4_K / Q5_K super-block (one pair per 32-value sub-block).
pub(super) fn unpack_scales_mins(s: &[u8]) -> ([u8; 8], [u8; 8]) {
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

/// `sum over sub-blocks of mins[j] * (sum of the 32 activation quants of sub-block j)`.
fn min_term(mn: &[u8; 8], bsums: &[u8]) -> i32 {
    (0..8)
        .map(|j| i32::from(mn[j]) * (i16_at(bsums, 4 * j) + i16_at(bsums, 4 * j + 2)))
        .sum()
}

struct RowQ4K;
impl RowDot for RowQ4K {
    const TYPE: GgmlType = GgmlType::Q4K;
    fn dot(n: usize, w: &[u8], a: &[u8]) -> f32 {
        let mut acc = 0.0f32;
        for (wb, ab) in w.chunks_exact(144).zip(q8k_blocks(n, a)) {
            let (sc, mn) = unpack_scales_mins(&wb[4..16]);
            let qs = &wb[16..144];
            let mut sumi = 0i32;
            for j in 0..4 {
                let q = &qs[32 * j..32 * j + 32];
                let lo = isum32(&ab.q[64 * j..64 * j + 32], |i| i32::from(q[i] & 15));
                let hi = isum32(&ab.q[64 * j + 32..64 * j + 64], |i| i32::from(q[i] >> 4));
                sumi += i32::from(sc[2 * j]) * lo + i32::from(sc[2 * j + 1]) * hi;
            }
            let summ = min_term(&mn, ab.bsums);
            acc += f16_at(wb, 0) * ab.d * sumi as f32;
            acc -= f16_at(wb, 2) * ab.d * summ as f32;
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
            let (sc, mn) = unpack_scales_mins(&wb[4..16]);
            let qh = &wb[16..48];
            let qs = &wb[48..176];
            let mut sumi = 0i32;
            for j in 0..4 {
                let q = &qs[32 * j..32 * j + 32];
                let lo = isum32(&ab.q[64 * j..64 * j + 32], |i| {
                    i32::from(q[i] & 15) | (i32::from((qh[i] >> (2 * j)) & 1) << 4)
                });
                let hi = isum32(&ab.q[64 * j + 32..64 * j + 64], |i| {
                    i32::from(q[i] >> 4) | (i32::from((qh[i] >> (2 * j + 1)) & 1) << 4)
                });
                sumi += i32::from(sc[2 * j]) * lo + i32::from(sc[2 * j + 1]) * hi;
            }
            let summ = min_term(&mn, ab.bsums);
            acc += f16_at(wb, 0) * ab.d * sumi as f32;
            acc -= f16_at(wb, 2) * ab.d * summ as f32;
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
            // Values 0..64 (unsigned); the -32 offset is applied through the per-16 sums.
            let q6 = |e: usize| -> i32 {
                let (h, r) = (e / 128, e % 128);
                let (g, l) = (r / 32, r % 32);
                let low = ql[64 * h + 32 * (g & 1) + l];
                let low = if g < 2 { low & 15 } else { low >> 4 };
                let high = (qh[32 * h + l] >> (2 * g)) & 3;
                i32::from(low | (high << 4))
            };
            let mut sumi = 0i32;
            for (k, &scale) in sc.iter().enumerate() {
                let s: i32 = (16 * k..16 * k + 16)
                    .map(|e| q6(e) * i32::from(ab.q[e] as i8))
                    .sum();
                sumi += i32::from(scale as i8) * (s - 32 * i16_at(ab.bsums, 2 * k));
            }
            acc += f16_at(wb, 208) * ab.d * sumi as f32;
        }
        acc
    }
}
