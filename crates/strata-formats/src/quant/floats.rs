//! Plain float element types (F32, F16, BF16) read from little-endian bytes into f32.
//! Conversions keep every bit pattern the way the reference does, NaN payloads included.

/// Little-endian f32 values, copied bit for bit.
pub(super) fn f32_values(bytes: &[u8], out: &mut [f32]) {
    for (value, le) in out.iter_mut().zip(bytes.chunks_exact(4)) {
        // Always 4 bytes; copying the array whole (not byte by byte) compiles to a memcpy.
        if let Ok(le) = <[u8; 4]>::try_from(le) {
            *value = f32::from_le_bytes(le);
        }
    }
}

/// Little-endian f16 values, widened exactly.
pub(super) fn f16_values(bytes: &[u8], out: &mut [f32]) {
    for (value, le) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        // Always 2 bytes; a whole-array copy keeps the loop's loads vectorized.
        if let Ok(le) = <[u8; 2]>::try_from(le) {
            *value = f16_bits_to_f32(u16::from_le_bytes(le));
        }
    }
}

/// Little-endian bf16 values: the upper half of an f32.
pub(super) fn bf16_values(bytes: &[u8], out: &mut [f32]) {
    for (value, le) in out.iter_mut().zip(bytes.chunks_exact(2)) {
        if let Ok(le) = <[u8; 2]>::try_from(le) {
            *value = f32::from_bits(u32::from(u16::from_le_bytes(le)) << 16);
        }
    }
}

/// Widens f16 bits to f32 without branches, so loops over it vectorize.
///
/// Equals `half::f16::to_f32` for every non-NaN input. NaNs keep their payload as is
/// (a signaling NaN stays signaling), as numpy's conversion does; `half` sets the quiet bit.
#[inline(always)]
fn f16_bits_to_f32(bits: u16) -> f32 {
    const F16_EXP_MASK: u32 = 0x7C00;
    const F16_MIN_NORMAL: u32 = 0x0400;
    const REBIAS: u32 = (127 - 15) << 23;
    let bits = u32::from(bits);
    let sign = (bits & 0x8000) << 16;
    let magnitude = bits & 0x7FFF;
    let normal = (magnitude << 13) + REBIAS;
    let inf_or_nan = 0x7F80_0000 | ((magnitude & 0x03FF) << 13);
    // Subnormals (and zero) are an integer count of 2^-24, exact in f32.
    let subnormal = ((magnitude as i32) as f32 * f32::from_bits(0x3380_0000)).to_bits();
    let widened = if magnitude >= F16_EXP_MASK {
        inf_or_nan
    } else if magnitude >= F16_MIN_NORMAL {
        normal
    } else {
        subnormal
    };
    f32::from_bits(sign | widened)
}
