//! Activation quantization: f32 rows into the F32 / Q8_1 / Q8K layouts the kernels read.
//! This scalar code is the definition; the AVX2 version in `avx2.rs` writes identical bytes.

use super::{act_row_bytes, ActFormat, Q8_1_META_BYTES};
use strata_formats::quant::QK_K;

/// Checks the arguments of a quantization call.
///
/// # Panics
/// If `x.len()` is not a multiple of the block length or `out` is too short.
pub(super) fn check_act_args(fmt: ActFormat, x: &[f32], out: &[u8]) {
    let n = x.len();
    let bl = fmt.block_len();
    assert!(
        n.is_multiple_of(bl),
        "quantize_act_row: {n} values is not a multiple of {bl} for {fmt:?}"
    );
    let need = act_row_bytes(fmt, n);
    assert!(
        out.len() >= need,
        "quantize_act_row: output of {} bytes is short of {need} for {n} values as {fmt:?}",
        out.len()
    );
}

/// The portable reference quantizer: same contract and same bytes as
/// [`super::quantize_act_row`].
///
/// # Panics
/// If `x.len()` is not a multiple of the block length or `out` is too short.
pub fn quantize_act_row_scalar(fmt: ActFormat, x: &[f32], out: &mut [u8]) {
    check_act_args(fmt, x, out);
    quantize_act_row_unchecked(fmt, x, out);
}

/// Scale of a block whose largest magnitude is `amax`: `(d, 1/d)`, with `1/d = 0` for an
/// all-zero block. Shared with the AVX2 path so both compute the very same numbers.
#[inline]
pub(super) fn scales(amax: f32) -> (f32, f32) {
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    (d, id)
}

/// One quant: `x * id` rounded half to even, clamped to `[-127, 127]`.
#[inline]
fn quant(x: f32, id: f32) -> i8 {
    (x * id).round_ties_even().clamp(-127.0, 127.0) as i8
}

/// Quantizes `x` into `q` (same length) with a symmetric scale; returns `(d, sum of quants)`.
fn quant_block(x: &[f32], q: &mut [u8]) -> (f32, i32) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let (d, id) = scales(amax);
    let mut sum = 0i32;
    for (qv, &v) in q.iter_mut().zip(x) {
        let qi = quant(v, id);
        sum += i32::from(qi);
        *qv = qi as u8;
    }
    (d, sum)
}

/// Quantization after [`check_act_args`] passed.
pub(super) fn quantize_act_row_unchecked(fmt: ActFormat, x: &[f32], out: &mut [u8]) {
    let n = x.len();
    match fmt {
        ActFormat::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        ActFormat::Q8_1 => {
            let (qs, meta) = out.split_at_mut(n);
            for ((xb, qb), mb) in x
                .chunks_exact(32)
                .zip(qs.chunks_exact_mut(32))
                .zip(meta.chunks_exact_mut(Q8_1_META_BYTES))
            {
                let (d, sum) = quant_block(xb, qb);
                write_q8_1_meta(d, sum, mb);
            }
        }
        ActFormat::Q8K => {
            let nb = n / QK_K;
            let (qs, meta) = out.split_at_mut(n);
            let (ds, bsums) = meta.split_at_mut(4 * nb);
            for (((xb, qb), db), sb) in x
                .chunks_exact(QK_K)
                .zip(qs.chunks_exact_mut(QK_K))
                .zip(ds.chunks_exact_mut(4))
                .zip(bsums.chunks_exact_mut(32))
            {
                let (d, _) = quant_block(xb, qb);
                db.copy_from_slice(&d.to_le_bytes());
                write_bsums(qb, sb);
            }
        }
    }
}

/// Writes the sixteen `i16` sums of each 16 quants of a 256-block.
pub(super) fn write_bsums(q: &[u8], out: &mut [u8]) {
    for (g, o) in q.chunks_exact(16).zip(out.chunks_exact_mut(2)) {
        let s: i16 = g.iter().map(|&b| i16::from(b as i8)).sum();
        o.copy_from_slice(&s.to_le_bytes());
    }
}

/// The sum of the activation quants of 32-value sub-block `j` of a 256-block, from the sums
/// [`write_bsums`] wrote (two of its 16-quant sums).
#[inline]
pub(super) fn bsum32(bsums: &[u8], j: usize) -> i32 {
    let at = |o: usize| i32::from(i16::from_le_bytes([bsums[o], bsums[o + 1]]));
    at(4 * j) + at(4 * j + 2)
}

/// Writes a Q8_1 block's metadata: `d`, `s = d * sum` and `sum`.
pub(super) fn write_q8_1_meta(d: f32, sum: i32, out: &mut [u8]) {
    out[..4].copy_from_slice(&d.to_le_bytes());
    out[4..8].copy_from_slice(&(d * sum as f32).to_le_bytes());
    out[8..12].copy_from_slice(&sum.to_le_bytes());
}

/// `x` minus what the quantized row `q` (written by [`super::quantize_act_row`] from `x`) stands
/// for, into `residual`. Quantizing the residual as a second row and adding both dot products
/// carries ~14 bits of each activation instead of ~8 (see `matmul`).
///
/// # Panics
/// If the lengths do not match `fmt` and `x.len()`.
pub fn act_residual(fmt: ActFormat, x: &[f32], q: &[u8], residual: &mut [f32]) {
    check_act_args(fmt, x, q);
    assert_eq!(residual.len(), x.len(), "act_residual: residual length");
    let n = x.len();
    let f32_at = |b: &[u8], o: usize| f32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    match fmt {
        ActFormat::F32 => residual.fill(0.0),
        ActFormat::Q8_1 => {
            for (i, (r, &v)) in residual.iter_mut().zip(x).enumerate() {
                *r = v - f32::from(q[i] as i8) * f32_at(q, n + Q8_1_META_BYTES * (i / 32));
            }
        }
        ActFormat::Q8K => {
            for (i, (r, &v)) in residual.iter_mut().zip(x).enumerate() {
                *r = v - f32::from(q[i] as i8) * f32_at(q, n + 4 * (i / QK_K));
            }
        }
    }
}
