//! GGML's K-quant super-block formats (256 values): Q2_K, Q3_K, Q4_K, Q5_K and Q6_K.
//! Super-blocks carry an f16 scale (and minimum) refined by small per-sub-block scales.

use super::dequant::{f16_scale, for_each_block};
use super::QK_K;

/// Q2_K: 16 scale bytes (low nibble scale, high nibble min, one per 16 values), 64 bytes of
/// 2-bit quants, f16 d, f16 dmin; value = (d * scale) * q - dmin * min.
///
/// Value `128h + 32j + l` has its quant in bits `2j..2j+2` of quant byte `32h + l`.
pub(super) fn q2_k(bytes: &[u8], out: &mut [f32]) {
    for_each_block(bytes, out, |block: &[u8; 84], values: &mut [f32; QK_K]| {
        let d = f16_scale(block[80], block[81]);
        let dmin = f16_scale(block[82], block[83]);
        let scales = &block[0..16];
        let quants = &block[16..80];
        for (group, values) in values.chunks_exact_mut(16).enumerate() {
            let scale = scales[group];
            let dl = d * f32::from(scale & 0x0F);
            let ml = dmin * f32::from(scale >> 4);
            let half = group / 8;
            let shift = 2 * ((group % 8) / 2);
            let start = 32 * half + 16 * (group % 2);
            for (value, &q) in values.iter_mut().zip(&quants[start..start + 16]) {
                *value = dl * f32::from((q >> shift) & 3) - ml;
            }
        }
    });
}

/// Q3_K: 32 bytes of high-bit mask, 64 bytes of 2-bit quants, 12 bytes of 6-bit signed
/// scales (one per 16 values), f16 d; value = (d * (scale - 32)) * q where q is the 2-bit
/// quant minus 4 when the value's mask bit is clear.
///
/// Value `128h + 32j + l` has its low bits in bits `2j..2j+2` of quant byte `32h + l`
/// and its mask bit in bit `4h + j` of mask byte `l`.
pub(super) fn q3_k(bytes: &[u8], out: &mut [f32]) {
    for_each_block(bytes, out, |block: &[u8; 110], values: &mut [f32; QK_K]| {
        let d = f16_scale(block[108], block[109]);
        let mask = &block[0..32];
        let quants = &block[32..96];
        let packed: &[u8] = &block[96..108];
        for (group, values) in values.chunks_exact_mut(16).enumerate() {
            let low = if group < 8 {
                packed[group] & 0x0F
            } else {
                packed[group - 8] >> 4
            };
            let high = (packed[8 + group % 4] >> (2 * (group / 4))) & 3;
            let scale = i32::from(low | (high << 4)) - 32;
            let dl = d * scale as f32;
            let half = group / 8;
            let shift = 2 * ((group % 8) / 2);
            let mask_bit = group / 2;
            let start = 16 * (group % 2);
            let quant_bytes = &quants[32 * half + start..32 * half + start + 16];
            let mask_bytes = &mask[start..start + 16];
            for ((value, &q), &m) in values.iter_mut().zip(quant_bytes).zip(mask_bytes) {
                let offset = if (m >> mask_bit) & 1 == 0 { 4 } else { 0 };
                *value = dl * (i32::from((q >> shift) & 3) - offset) as f32;
            }
        }
    });
}

/// Unpacks the eight 6-bit scales and eight 6-bit mins of Q4_K/Q5_K (ggml's
/// `get_scale_min_k4`): bytes 0..4 hold scales 0..4 in their low six bits, bytes 4..8
/// mins 0..4; scales and mins 4..8 take their low nibbles from bytes 8..12 (scale low,
/// min high) and their top two bits from the top bits of bytes 0..4 and 4..8.
#[inline(always)]
pub fn scales_and_mins(packed: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let mut scales = [0u8; 8];
    let mut mins = [0u8; 8];
    for i in 0..4 {
        scales[i] = packed[i] & 0x3F;
        mins[i] = packed[i + 4] & 0x3F;
        scales[i + 4] = (packed[i + 8] & 0x0F) | ((packed[i] >> 2) & 0x30);
        mins[i + 4] = (packed[i + 8] >> 4) | ((packed[i + 4] >> 2) & 0x30);
    }
    (scales, mins)
}

/// The 12 packed scale bytes starting at byte 4 of a Q4_K/Q5_K block.
#[inline(always)]
fn packed_scales(block: &[u8]) -> [u8; 12] {
    let mut packed = [0u8; 12];
    packed.copy_from_slice(&block[4..16]);
    packed
}

/// Q4_K: f16 d, f16 dmin, 12 bytes of packed 6-bit scales/mins (one pair per 32 values),
/// 128 bytes of nibbles; value = (d * scale) * q - dmin * min.
///
/// Sub-blocks 2c and 2c+1 are the low and high nibbles of quant bytes `32c..32c+32`.
pub(super) fn q4_k(bytes: &[u8], out: &mut [f32]) {
    for_each_block(bytes, out, |block: &[u8; 144], values: &mut [f32; QK_K]| {
        let d = f16_scale(block[0], block[1]);
        let dmin = f16_scale(block[2], block[3]);
        let (scales, mins) = scales_and_mins(&packed_scales(block));
        let quants = &block[16..144];
        for (sub, values) in values.chunks_exact_mut(32).enumerate() {
            let dl = d * f32::from(scales[sub]);
            let ml = dmin * f32::from(mins[sub]);
            let shift = 4 * (sub % 2);
            let start = 32 * (sub / 2);
            for (value, &q) in values.iter_mut().zip(&quants[start..start + 32]) {
                *value = dl * f32::from((q >> shift) & 0x0F) - ml;
            }
        }
    });
}

/// Q5_K: as Q4_K with 32 bytes of fifth bits after the scales: bit `s` of byte `l` is the
/// fifth bit of value `32s + l`; value = (d * scale) * q - dmin * min.
pub(super) fn q5_k(bytes: &[u8], out: &mut [f32]) {
    for_each_block(bytes, out, |block: &[u8; 176], values: &mut [f32; QK_K]| {
        let d = f16_scale(block[0], block[1]);
        let dmin = f16_scale(block[2], block[3]);
        let (scales, mins) = scales_and_mins(&packed_scales(block));
        let fifth_bits = &block[16..48];
        let quants = &block[48..176];
        for (sub, values) in values.chunks_exact_mut(32).enumerate() {
            let dl = d * f32::from(scales[sub]);
            let ml = dmin * f32::from(mins[sub]);
            let shift = 4 * (sub % 2);
            let start = 32 * (sub / 2);
            for ((value, &q), &h) in values.iter_mut().zip(&quants[start..start + 32]).zip(fifth_bits) {
                let q = ((q >> shift) & 0x0F) | (((h >> sub) & 1) << 4);
                *value = dl * f32::from(q) - ml;
            }
        }
    });
}

/// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 signed 8-bit scales
/// (one per 16 values), f16 d; value = (d * scale) * (q - 32).
///
/// Value `128h + 32j + l` takes its low nibble from byte `64h + 32(j % 2) + l` (low nibble
/// for j < 2, high for j >= 2) and its high bits from bits `2j..2j+2` of byte `32h + l`.
pub(super) fn q6_k(bytes: &[u8], out: &mut [f32]) {
    for_each_block(bytes, out, |block: &[u8; 210], values: &mut [f32; QK_K]| {
        let d = f16_scale(block[208], block[209]);
        let low_nibbles = &block[0..128];
        let high_bits = &block[128..192];
        let scales = &block[192..208];
        for (group, values) in values.chunks_exact_mut(16).enumerate() {
            let dl = d * f32::from(scales[group] as i8);
            let half = group / 8;
            let j = (group % 8) / 2;
            let start = 16 * (group % 2);
            let low_start = 64 * half + 32 * (j % 2) + start;
            let low_shift = 4 * (j / 2);
            let high_start = 32 * half + start;
            let high_shift = 2 * j;
            for ((value, &ql), &qh) in values
                .iter_mut()
                .zip(&low_nibbles[low_start..low_start + 16])
                .zip(&high_bits[high_start..high_start + 16])
            {
                let q = ((ql >> low_shift) & 0x0F) | (((qh >> high_shift) & 3) << 4);
                *value = dl * (i32::from(q) - 32) as f32;
            }
        }
    });
}
