//! Quantizers: f32 values into GGML blocks (float types, Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q4_K/Q5_K/Q6_K).
//! Blocks are byte for byte those of ggml's reference quantizers (K-quants without an importance matrix).

use super::dequant::{check_lengths, f16_scale, for_each_block};
use super::{GgmlType, QuantError, QK_K};

/// Encodes `values` as `ty` into `out`, which must be exactly `ty.bytes_for(values.len())` long.
///
/// Blocks are byte for byte those of ggml's reference quantizers (`quantize_row_*_ref`; for
/// Q4_0 ... Q8_0, F16 and BF16 also of `gguf.quants.quantize`): Q4_K, Q5_K and Q6_K choose each
/// sub-block's scale (and minimum) by ggml's weighted search, without an importance matrix.
/// Errors on a type it cannot write, a length that is not whole blocks, a wrong output length,
/// and non-finite values (which no block can hold).
pub fn quantize(ty: GgmlType, values: &[f32], out: &mut [u8]) -> Result<(), QuantError> {
    if !ty.can_quantize() {
        return Err(QuantError::QuantizeUnsupported { ty });
    }
    check_lengths(ty, values.len(), out.len())?;
    if let Some(index) = values.iter().position(|v| !v.is_finite()) {
        return Err(QuantError::NonFinite { index });
    }
    use GgmlType::*;
    match ty {
        F32 => for_each_value(values, out, |v| v.to_le_bytes()),
        F16 => for_each_value(values, out, |v| half::f16::from_f32(v).to_le_bytes()),
        BF16 => for_each_value(values, out, |v| half::bf16::from_f32(v).to_le_bytes()),
        Q4_0 => for_each_block(values, out, q4_0),
        Q4_1 => for_each_block(values, out, q4_1),
        Q5_0 => for_each_block(values, out, q5_0),
        Q5_1 => for_each_block(values, out, q5_1),
        Q8_0 => for_each_block(values, out, q8_0),
        Q4K => for_each_block(values, out, q4_k),
        Q5K => for_each_block(values, out, q5_k),
        Q6K => for_each_block(values, out, q6_k),
        Q8_1 | Q2K | Q3K | Q8K | I8 | I16 | I32 | I64 | F64 => return Err(QuantError::QuantizeUnsupported { ty }),
    }
    Ok(())
}

/// The types [`quantize`] writes.
pub const QUANTIZABLE: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

fn for_each_value<const N: usize>(values: &[f32], out: &mut [u8], encode: impl Fn(f32) -> [u8; N]) {
    for (&v, le) in values.iter().zip(out.chunks_exact_mut(N)) {
        le.copy_from_slice(&encode(v));
    }
}

/// ggml's `nearest_int`: round half to even. Beyond 2^22, where [`nearest_small`]'s trick
/// fails, it saturates (callers clamp anyway).
#[inline(always)]
fn nearest(x: f32) -> i32 {
    if x.abs() < 4_194_303.0 {
        nearest_small(x)
    } else {
        x as i32
    }
}

/// [`nearest`] for |x| < 2^22: adding 1.5 * 2^23 leaves the rounded integer in the low mantissa
/// bits, which inlines to two instructions (`round_ties_even` is a library call on baseline
/// x86-64) and, without `nearest`'s branch, vectorizes.
#[inline(always)]
fn nearest_small(x: f32) -> i32 {
    ((x + 12_582_912.0).to_bits() & 0x007F_FFFF) as i32 - 0x0040_0000
}

/// `x` as f16 bytes (round to nearest even, as ggml and numpy convert).
#[inline(always)]
fn f16_bytes(x: f32) -> [u8; 2] {
    half::f16::from_f32(x).to_le_bytes()
}

/// The value of largest magnitude (the first of equals), keeping its sign.
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    max
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter()
        .fold((f32::MAX, -f32::MAX), |(lo, hi), &v| (lo.min(v), hi.max(v)))
}

/// The reciprocal of a scale, 0 for a zero scale (an all-zero block).
#[inline(always)]
fn inverse(d: f32) -> f32 {
    if d == 0.0 {
        0.0
    } else {
        1.0 / d
    }
}

/// Packs 32 quants below 32 as Q5_0/Q5_1 do: fifth bits into a u32 (bit i for value i), low
/// nibbles of values i and i + 16 into byte i.
fn pack_5bit(q: &[u8; 32], high_bits: &mut [u8], nibbles: &mut [u8]) {
    let mut bits = 0u32;
    for (i, &v) in q.iter().enumerate() {
        bits |= u32::from(v >> 4) << i;
    }
    high_bits.copy_from_slice(&bits.to_le_bytes());
    for (i, byte) in nibbles.iter_mut().enumerate() {
        *byte = (q[i] & 0x0F) | ((q[i + 16] & 0x0F) << 4);
    }
}

/// Q4_0: d = (value of largest magnitude) / -8, q = clamp(trunc(x / d + 8.5), 0, 15).
fn q4_0(x: &[f32; 32], block: &mut [u8; 18]) {
    let d = signed_absmax(x) / -8.0;
    let id = inverse(d);
    block[0..2].copy_from_slice(&f16_bytes(d));
    for i in 0..16 {
        let lo = ((x[i] * id + 8.5) as i32).min(15) as u8;
        let hi = ((x[i + 16] * id + 8.5) as i32).min(15) as u8;
        block[2 + i] = lo | (hi << 4);
    }
}

/// Q4_1: d = (max - min) / 15, m = min, q = clamp(trunc((x - min) / d + 0.5), 0, 15).
fn q4_1(x: &[f32; 32], block: &mut [u8; 20]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = inverse(d);
    block[0..2].copy_from_slice(&f16_bytes(d));
    block[2..4].copy_from_slice(&f16_bytes(min));
    for i in 0..16 {
        let lo = (((x[i] - min) * id + 0.5) as i32).min(15) as u8;
        let hi = (((x[i + 16] - min) * id + 0.5) as i32).min(15) as u8;
        block[4 + i] = lo | (hi << 4);
    }
}

/// Q5_0: d = (value of largest magnitude) / -16, q = clamp(trunc(x / d + 16.5), 0, 31).
fn q5_0(x: &[f32; 32], block: &mut [u8; 22]) {
    let d = signed_absmax(x) / -16.0;
    let id = inverse(d);
    let q = x.map(|v| ((v * id + 16.5) as i32).min(31) as u8);
    block[0..2].copy_from_slice(&f16_bytes(d));
    let (high_bits, nibbles) = block[2..].split_at_mut(4);
    pack_5bit(&q, high_bits, nibbles);
}

/// Q5_1: d = (max - min) / 31, m = min, q = clamp(trunc((x - min) / d + 0.5), 0, 31).
fn q5_1(x: &[f32; 32], block: &mut [u8; 24]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = inverse(d);
    let q = x.map(|v| (((v - min) * id + 0.5) as i32).min(31) as u8);
    block[0..2].copy_from_slice(&f16_bytes(d));
    block[2..4].copy_from_slice(&f16_bytes(min));
    let (high_bits, nibbles) = block[4..].split_at_mut(4);
    pack_5bit(&q, high_bits, nibbles);
}

/// Q8_0: d = max |x| / 127, q = round(x / d) (half away from zero).
fn q8_0(x: &[f32; 32], block: &mut [u8; 34]) {
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    block[0..2].copy_from_slice(&f16_bytes(d));
    for (q, &v) in block[2..].iter_mut().zip(x) {
        *q = ((v * id).round() as i8) as u8;
    }
}

/// ggml's `make_qkx2_quants` for the eight 32-value sub-blocks of a super-block at once, lane j
/// being sub-block j (`x[i][j]`: value i of sub-block j): quants `l` in `0..=nmax` with
/// `x ≈ scale * l - min`, minimizing the `weights`-weighted squared error over `nstep + 1` trial
/// scales around `nmax / (max - min)` (steps of `rdelta` from `rmin`), each refined by least
/// squares. Every lane does the reference's operations in the reference's order, so the bytes
/// stay ggml's; the lanes only let the trials' loops run eight sub-blocks a vector. Returns each
/// sub-block's `(scale, min)` with `min >= 0`; `quants[j]` holds its chosen levels.
#[inline(always)]
fn scale_and_min_search(
    x: &[[f32; 8]; 32],
    weights: &[[f32; 8]; 32],
    nmax: i32,
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    quants: &mut [[u8; 32]; 8],
) -> ([f32; 8], [f32; 8]) {
    // The reference's nearest(iscale * (v - min)).clamp(0, nmax), with the product first held
    // to -1..=nmax + 1 (which clamps to the same level) so that [`nearest_small`] serves and the
    // loops vectorize; a NaN (a flat sub-block's lane, never used) becomes -1. Levels are kept
    // as f32 (exact) for the sums.
    let top = nmax as f32 + 1.0;
    let level =
        |iscale: f32, min: f32, v: f32| nearest_small((iscale * (v - min)).max(-1.0).min(top)).clamp(0, nmax) as f32;
    let (mut lo, mut hi) = ([f32::MAX; 8], [-f32::MAX; 8]);
    let (mut sum_w, mut sum_x) = ([-0.0f32; 8], [-0.0f32; 8]);
    for (xs, ws) in x.iter().zip(weights) {
        for j in 0..8 {
            lo[j] = lo[j].min(xs[j]);
            hi[j] = hi[j].max(xs[j]);
            sum_w[j] += ws[j];
            sum_x[j] += ws[j] * xs[j];
        }
    }
    let mut min = lo.map(|m| if m > 0.0 { 0.0 } else { m });
    let flat: [bool; 8] = std::array::from_fn(|j| hi[j] == min[j]);
    let mut scale = [0.0f32; 8];
    let mut best_error = [0.0f32; 8];
    for j in 0..8 {
        if flat[j] {
            quants[j] = [0; 32];
            continue;
        }
        let iscale = nmax as f32 / (hi[j] - min[j]);
        scale[j] = 1.0 / iscale;
        let mut err = 0.0;
        for (i, q) in quants[j].iter_mut().enumerate() {
            let l = level(iscale, min[j], x[i][j]);
            *q = l as u8;
            let diff = scale[j] * l + min[j] - x[i][j];
            err += weights[i][j] * diff * diff;
        }
        best_error[j] = err;
    }
    let mut trial = [[0.0f32; 8]; 32];
    for step in 0..=nstep {
        let iscale: [f32; 8] = std::array::from_fn(|j| (rmin + rdelta * step as f32 + nmax as f32) / (hi[j] - min[j]));
        let (mut sum_l, mut sum_l2, mut sum_xl) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
        for ((t, xs), ws) in trial.iter_mut().zip(x).zip(weights) {
            for j in 0..8 {
                let l = level(iscale[j], min[j], xs[j]);
                t[j] = l;
                sum_l[j] += ws[j] * l;
                sum_l2[j] += ws[j] * l * l;
                sum_xl[j] += ws[j] * l * xs[j];
            }
        }
        let mut this_scale = [0.0f32; 8];
        let mut this_min = [0.0f32; 8];
        let mut live = [false; 8];
        for j in 0..8 {
            let det = sum_w[j] * sum_l2[j] - sum_l[j] * sum_l[j];
            live[j] = !flat[j] && det > 0.0;
            this_scale[j] = (sum_w[j] * sum_xl[j] - sum_x[j] * sum_l[j]) / det;
            this_min[j] = (sum_l2[j] * sum_x[j] - sum_l[j] * sum_xl[j]) / det;
            if this_min[j] > 0.0 {
                this_min[j] = 0.0;
                this_scale[j] = sum_xl[j] / sum_l2[j];
            }
        }
        let mut err = [0.0f32; 8];
        for ((t, xs), ws) in trial.iter().zip(x).zip(weights) {
            for j in 0..8 {
                let diff = this_scale[j] * t[j] + this_min[j] - xs[j];
                err[j] += ws[j] * diff * diff;
            }
        }
        for j in 0..8 {
            if live[j] && err[j] < best_error[j] {
                for (i, q) in quants[j].iter_mut().enumerate() {
                    *q = trial[i][j] as u8;
                }
                best_error[j] = err[j];
                scale[j] = this_scale[j];
                min[j] = this_min[j];
            }
        }
    }
    (scale, min.map(|m| -m))
}

/// Runs `f` (inlined) compiled for AVX2: the scale search's eight lanes in one register. No FMA,
/// so the products and sums round as the reference's do.
///
/// # Safety
/// The CPU must have AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn with_avx2<R>(f: impl FnOnce() -> R) -> R {
    f()
}

/// Q4_K / Q5_K super-block: eight 32-value sub-blocks, each with its own scale and minimum
/// from [`scale_and_min_search`], stored as 6-bit multiples of one f16 `d` and `dmin`.
/// Writes d, dmin and the packed scales to `header` and each value's level (0..=nmax) to `levels`.
fn scaled_min_superblock(
    x: &[f32; QK_K],
    nmax: i32,
    rmin: f32,
    nstep: i32,
    header: &mut [u8; 16],
    levels: &mut [u8; QK_K],
) {
    // Sub-block j's value i at [i][j]; weights favour large values, as ggml's reference does:
    // the rms of the sub-block plus |x|.
    let mut xt = [[0.0f32; 8]; 32];
    let mut weights = [[0.0f32; 8]; 32];
    for (j, xs) in x.chunks_exact(32).enumerate() {
        let rms = (xs.iter().map(|v| v * v).sum::<f32>() / 32.0).sqrt();
        for (i, &v) in xs.iter().enumerate() {
            xt[i][j] = v;
            weights[i][j] = rms + v.abs();
        }
    }
    let mut sub_levels = [[0u8; 32]; 8];
    let mut search = || scale_and_min_search(&xt, &weights, nmax, rmin, 0.1, nstep, &mut sub_levels);
    #[cfg(target_arch = "x86_64")]
    let (scales, mins) = match std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        true => unsafe { with_avx2(search) },
        false => search(),
    };
    #[cfg(not(target_arch = "x86_64"))]
    let (scales, mins) = search();
    for (ls, sub) in levels.chunks_exact_mut(32).zip(&sub_levels) {
        ls.copy_from_slice(sub);
    }
    // Strictly greater than +0: an all-zero block's -0 minimum must not make dmin -0.
    let largest = |v: &[f32; 8]| v.iter().fold(0.0f32, |m, &s| if s > m { s } else { m });
    let (max_scale, max_min) = (largest(&scales), largest(&mins));
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let six_bits = |v: f32| nearest(v).min(63) as u8;
    let sc = scales.map(|s| six_bits(inv_scale * s));
    let mn = mins.map(|m| six_bits(inv_min * m));
    header[0..2].copy_from_slice(&f16_bytes(max_scale / 63.0));
    header[2..4].copy_from_slice(&f16_bytes(max_min / 63.0));
    let packed = &mut header[4..16];
    for j in 0..4 {
        packed[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        packed[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        packed[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
    }
    // Requantize against the scales as stored (f16 times 6 bits), as the decoder will read them.
    let d = f16_scale(header[0], header[1]);
    let dmin = f16_scale(header[2], header[3]);
    for (sub, (xs, ls)) in x.chunks_exact(32).zip(levels.chunks_exact_mut(32)).enumerate() {
        let dl = d * f32::from(sc[sub]);
        if dl == 0.0 {
            continue;
        }
        let ml = dmin * f32::from(mn[sub]);
        for (l, &v) in ls.iter_mut().zip(xs) {
            *l = nearest((v + ml) / dl).clamp(0, nmax) as u8;
        }
    }
}

/// Q4_K: d, dmin, 12 bytes of 6-bit scales and mins, then sub-blocks 2c and 2c+1 as the low
/// and high nibbles of bytes 32c..32c+32.
fn q4_k(x: &[f32; QK_K], block: &mut [u8; 144]) {
    let mut header = [0u8; 16];
    let mut levels = [0u8; QK_K];
    scaled_min_superblock(x, 15, -1.0, 20, &mut header, &mut levels);
    block[0..16].copy_from_slice(&header);
    for (c, pair) in levels.chunks_exact(64).enumerate() {
        for l in 0..32 {
            block[16 + 32 * c + l] = pair[l] | (pair[l + 32] << 4);
        }
    }
}

/// Q5_K: as Q4_K with the fifth bits first: bit s of byte l is the fifth bit of value 32s + l.
fn q5_k(x: &[f32; QK_K], block: &mut [u8; 176]) {
    let mut header = [0u8; 16];
    let mut levels = [0u8; QK_K];
    scaled_min_superblock(x, 31, -0.5, 15, &mut header, &mut levels);
    block[0..16].copy_from_slice(&header);
    let (fifth_bits, nibbles) = block[16..].split_at_mut(32);
    fifth_bits.fill(0);
    for (i, &l) in levels.iter().enumerate() {
        fifth_bits[i % 32] |= (l >> 4) << (i / 32);
    }
    for (c, pair) in levels.chunks_exact(64).enumerate() {
        for l in 0..32 {
            nibbles[32 * c + l] = (pair[l] & 0x0F) | ((pair[l + 32] & 0x0F) << 4);
        }
    }
}

/// Values smaller than this in magnitude make a sub-block count as all zero (ggml's `GROUP_MAX_EPS`).
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `make_qx_quants` with weights x²: a symmetric scale for 16 values and levels in
/// `-32..32`, searched over 19 trial scales around `-32 / (value of largest magnitude)`.
/// Returns the scale (its sign follows that of the largest value, negated) and writes the
/// chosen levels plus 32 to `levels` (all 0 for an all-zero group).
fn symmetric_scale_search(x: &[f32; 16], levels: &mut [u8; 16]) -> f32 {
    const NMAX: i32 = 32;
    let max = signed_absmax(x);
    if max.abs() < GROUP_MAX_EPS {
        *levels = [0; 16];
        return 0.0;
    }
    let level = |iscale: f32, v: f32| nearest(iscale * v).clamp(-NMAX, NMAX - 1);
    let sums = |iscale: f32| {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let l = level(iscale, v) as f32;
            let w = v * v;
            sumlx += w * v * l;
            suml2 += w * l * l;
        }
        (sumlx, suml2)
    };
    let set_levels = |levels: &mut [u8; 16], iscale: f32| {
        for (l, &v) in levels.iter_mut().zip(x) {
            *l = (level(iscale, v) + NMAX) as u8;
        }
    };
    let iscale = -(NMAX as f32) / max;
    let (sumlx, suml2) = sums(iscale);
    set_levels(levels, iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for step in (-9..=9).filter(|&s| s != 0) {
        let iscale = -(NMAX as f32 + 0.1 * step as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            set_levels(levels, iscale);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Q6_K: 128 bytes of low nibbles, 64 bytes of high 2-bit parts, 16 signed 8-bit scales (one per
/// 16 values, multiples of the f16 d), d; levels are stored plus 32 (see the decoder for the layout).
fn q6_k(x: &[f32; QK_K], block: &mut [u8; 210]) {
    let mut scales = [0.0f32; 16];
    let mut levels = [0u8; QK_K];
    for (s, (xs, ls)) in scales
        .iter_mut()
        .zip(x.chunks_exact(16).zip(levels.chunks_exact_mut(16)))
    {
        if let (Ok(xs), Ok(ls)) = (<&[f32; 16]>::try_from(xs), <&mut [u8; 16]>::try_from(ls)) {
            *s = symmetric_scale_search(xs, ls);
        }
    }
    let max_scale = signed_absmax(&scales);
    block.fill(0);
    if max_scale.abs() < GROUP_MAX_EPS {
        return;
    }
    let iscale = -128.0 / max_scale;
    block[208..210].copy_from_slice(&f16_bytes(1.0 / iscale));
    let d = f16_scale(block[208], block[209]);
    for (group, (xs, ls)) in x.chunks_exact(16).zip(levels.chunks_exact_mut(16)).enumerate() {
        let q_scale = nearest(iscale * scales[group]).min(127) as i8;
        block[192 + group] = q_scale as u8;
        let dl = d * f32::from(q_scale);
        // A zero scale keeps the search's levels, as ggml does (they decode to 0 either way).
        if dl == 0.0 {
            continue;
        }
        for (l, &v) in ls.iter_mut().zip(xs) {
            *l = (nearest(v / dl).clamp(-32, 31) + 32) as u8;
        }
    }
    let (low_nibbles, rest) = block.split_at_mut(128);
    let high_bits = &mut rest[..64];
    for (h, half) in levels.chunks_exact(128).enumerate() {
        for l in 0..32 {
            let q = [half[l], half[l + 32], half[l + 64], half[l + 96]];
            low_nibbles[64 * h + l] = (q[0] & 0x0F) | ((q[2] & 0x0F) << 4);
            low_nibbles[64 * h + l + 32] = (q[1] & 0x0F) | ((q[3] & 0x0F) << 4);
            high_bits[32 * h + l] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The AVX2 build of the search and the plain one give the same levels, scales and minimums
    /// (the reference fixtures in tests/quant_quantize.rs run whichever this CPU dispatches to).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_search_is_the_same_with_and_without_avx2() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        if !std::arch::is_x86_feature_detected!("avx2") {
            eprintln!("skipped: this CPU has no AVX2");
            return;
        }
        for round in 0..64 {
            let mut x = [[0.0f32; 8]; 32];
            let mut w = [[0.0f32; 8]; 32];
            for (i, xs) in x.iter_mut().enumerate() {
                for (j, v) in xs.iter_mut().enumerate() {
                    // Lane 0 flat in even rounds, lane 1 all positive: the branches of the reference.
                    *v = match j {
                        0 if round % 2 == 0 => -0.25,
                        1 => next().abs() + 0.1,
                        _ => next() * (1.0 + j as f32) * if i % 7 == 0 { 8.0 } else { 1.0 },
                    };
                }
            }
            for (xs, ws) in x.iter().zip(&mut w) {
                for j in 0..8 {
                    ws[j] = 0.1 + xs[j].abs();
                }
            }
            let (mut plain, mut avx2) = ([[0u8; 32]; 8], [[0u8; 32]; 8]);
            let a = scale_and_min_search(&x, &w, 15, -1.0, 0.1, 20, &mut plain);
            // SAFETY: checked above.
            let b = unsafe { with_avx2(|| scale_and_min_search(&x, &w, 15, -1.0, 0.1, 20, &mut avx2)) };
            assert_eq!(a.0.map(f32::to_bits), b.0.map(f32::to_bits), "round {round}: scales");
            assert_eq!(a.1.map(f32::to_bits), b.1.map(f32::to_bits), "round {round}: minimums");
            assert_eq!(plain, avx2, "round {round}: levels");
            if round % 2 == 0 {
                assert_eq!(plain[0], [0; 32], "round {round}: a flat sub-block's levels");
                assert_eq!((a.0[0], a.1[0]), (0.0, 0.25), "round {round}: a flat sub-block");
            }
        }
    }
}
