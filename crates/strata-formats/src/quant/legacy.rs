//! GGML's original 32-value block formats: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0.
//! Each block is an f16 scale (and for `_1` an f16 minimum), then packed quants.

use super::dequant::{f16_scale, for_each_block};

const BLOCK_LEN: usize = 32;
const HALF: usize = BLOCK_LEN / 2;

/// Q4_0: f16 d, 16 bytes of nibbles (low nibbles are values 0..16, high 16..32);
/// value = d * (q - 8).
pub(super) fn q4_0(bytes: &[u8], out: &mut [f32]) {
    for_each_block(bytes, out, |block: &[u8; 18], values: &mut [f32; BLOCK_LEN]| {
        let d = f16_scale(block[0], block[1]);
        let (low, high) = values.split_at_mut(HALF);
        for ((low, high), &q) in low.iter_mut().zip(high).zip(&block[2..18]) {
            *low = d * (i32::from(q & 0x0F) - 8) as f32;
            *high = d * (i32::from(q >> 4) - 8) as f32;
        }
    });
}

/// Q4_1: f16 d, f16 m, 16 bytes of nibbles as in Q4_0; value = d * q + m.
pub(super) fn q4_1(bytes: &[u8], out: &mut [f32]) {
    for_each_block(bytes, out, |block: &[u8; 20], values: &mut [f32; BLOCK_LEN]| {
        let d = f16_scale(block[0], block[1]);
        let m = f16_scale(block[2], block[3]);
        let (low, high) = values.split_at_mut(HALF);
        for ((low, high), &q) in low.iter_mut().zip(high).zip(&block[4..20]) {
            *low = d * f32::from(q & 0x0F) + m;
            *high = d * f32::from(q >> 4) + m;
        }
    });
}

/// Q5_0: f16 d, a little-endian u32 whose bit i is the fifth bit of value i, then
/// nibbles as in Q4_0; value = d * (q - 16).
pub(super) fn q5_0(bytes: &[u8], out: &mut [f32]) {
    for_each_block(bytes, out, |block: &[u8; 22], values: &mut [f32; BLOCK_LEN]| {
        let d = f16_scale(block[0], block[1]);
        let high_bits = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
        let (low, high) = values.split_at_mut(HALF);
        for (i, ((low, high), &q)) in low.iter_mut().zip(high).zip(&block[6..22]).enumerate() {
            let q_low = u32::from(q & 0x0F) | (((high_bits >> i) & 1) << 4);
            let q_high = u32::from(q >> 4) | (((high_bits >> (i + HALF)) & 1) << 4);
            *low = d * (q_low as i32 - 16) as f32;
            *high = d * (q_high as i32 - 16) as f32;
        }
    });
}

/// Q5_1: f16 d, f16 m, the fifth bits as in Q5_0, then nibbles; value = d * q + m.
pub(super) fn q5_1(bytes: &[u8], out: &mut [f32]) {
    for_each_block(bytes, out, |block: &[u8; 24], values: &mut [f32; BLOCK_LEN]| {
        let d = f16_scale(block[0], block[1]);
        let m = f16_scale(block[2], block[3]);
        let high_bits = u32::from_le_bytes([block[4], block[5], block[6], block[7]]);
        let (low, high) = values.split_at_mut(HALF);
        for (i, ((low, high), &q)) in low.iter_mut().zip(high).zip(&block[8..24]).enumerate() {
            let q_low = u32::from(q & 0x0F) | (((high_bits >> i) & 1) << 4);
            let q_high = u32::from(q >> 4) | (((high_bits >> (i + HALF)) & 1) << 4);
            *low = d * q_low as f32 + m;
            *high = d * q_high as f32 + m;
        }
    });
}

/// Q8_0: f16 d, 32 signed bytes; value = q * d.
pub(super) fn q8_0(bytes: &[u8], out: &mut [f32]) {
    for_each_block(bytes, out, |block: &[u8; 34], values: &mut [f32; BLOCK_LEN]| {
        let d = f16_scale(block[0], block[1]);
        for (value, &q) in values.iter_mut().zip(&block[2..34]) {
            *value = f32::from(q as i8) * d;
        }
    });
}
