//! The entry point that turns GGML-typed bytes into f32 values, and the errors it and `quantize` report.
//! Checks lengths up front, then hands whole blocks to the per-family decoders.

use thiserror::Error;

use super::{floats, kquants, legacy, GgmlType};

/// Why a buffer could not be dequantized.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QuantError {
    /// strata has no dequantizer for this type.
    #[error("dequantizing {ty} is not supported")]
    Unsupported { ty: GgmlType },
    /// strata has no quantizer for this type.
    #[error("quantizing to {ty} is not supported (strata writes F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K)")]
    QuantizeUnsupported { ty: GgmlType },
    /// A value to quantize is infinite or NaN.
    #[error("value {index} is infinite or NaN; only finite values can be quantized")]
    NonFinite { index: usize },
    /// The requested number of values does not fill whole blocks.
    #[error("{values} values are not a whole number of {ty} blocks of {block_len} values")]
    PartialBlock {
        ty: GgmlType,
        values: usize,
        block_len: usize,
    },
    /// The byte buffer is not exactly the size of the requested values.
    #[error("{values} {ty} values take {expected} bytes, but {actual} bytes were given")]
    WrongByteLength {
        ty: GgmlType,
        values: usize,
        expected: u64,
        actual: usize,
    },
}

/// Decodes `out.len()` values of type `ty` from `bytes` into `out`.
///
/// `bytes` must be exactly `ty.bytes_for(out.len())` long. Results are bit-identical to
/// the reference `gguf` Python package (`gguf.quants.dequantize`). Allocates nothing,
/// so it is cheap to call per row or per tile; any byte content is accepted.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), QuantError> {
    if !ty.can_dequantize() {
        return Err(QuantError::Unsupported { ty });
    }
    check_lengths(ty, out.len(), bytes.len())?;
    use GgmlType::*;
    match ty {
        F32 => floats::f32_values(bytes, out),
        F16 => floats::f16_values(bytes, out),
        BF16 => floats::bf16_values(bytes, out),
        Q4_0 => legacy::q4_0(bytes, out),
        Q4_1 => legacy::q4_1(bytes, out),
        Q5_0 => legacy::q5_0(bytes, out),
        Q5_1 => legacy::q5_1(bytes, out),
        Q8_0 => legacy::q8_0(bytes, out),
        Q2K => kquants::q2_k(bytes, out),
        Q3K => kquants::q3_k(bytes, out),
        Q4K => kquants::q4_k(bytes, out),
        Q5K => kquants::q5_k(bytes, out),
        Q6K => kquants::q6_k(bytes, out),
        Q8_1 | Q8K | I8 | I16 | I32 | I64 | F64 => return Err(QuantError::Unsupported { ty }),
    }
    Ok(())
}

/// Errors unless `values` values of type `ty` are whole blocks taking exactly `bytes` bytes.
pub(super) fn check_lengths(ty: GgmlType, values: usize, bytes: usize) -> Result<(), QuantError> {
    let expected = ty.bytes_for(values as u64).ok_or(QuantError::PartialBlock {
        ty,
        values,
        block_len: ty.block_len(),
    })?;
    if bytes as u64 != expected {
        return Err(QuantError::WrongByteLength {
            ty,
            values,
            expected,
            actual: bytes,
        });
    }
    Ok(())
}

/// Calls `code` on each whole block of `input` and its counterpart in `out` (block bytes and
/// their values, either way round), as fixed-size arrays so the coders index without bounds
/// checks. Callers have checked that both slices hold the same number of blocks.
#[inline(always)]
pub(super) fn for_each_block<I, O, const IN: usize, const OUT: usize>(
    input: &[I],
    out: &mut [O],
    code: impl Fn(&[I; IN], &mut [O; OUT]),
) {
    for (block, values) in input.chunks_exact(IN).zip(out.chunks_exact_mut(OUT)) {
        // chunks_exact yields exactly IN / OUT items, so both conversions succeed.
        if let (Ok(block), Ok(values)) = (<&[I; IN]>::try_from(block), <&mut [O; OUT]>::try_from(values)) {
            code(block, values);
        }
    }
}

/// The f16 scale stored little-endian in `lo`, `hi`, widened to f32.
///
/// Uses `half`'s pure-software conversion: exact for every finite value, inlinable, and
/// free of per-call CPU feature checks. (It quiets NaN scales; any arithmetic on them
/// would too, so block outputs are unaffected.)
#[inline(always)]
pub(super) fn f16_scale(lo: u8, hi: u8) -> f32 {
    half::f16::from_le_bytes([lo, hi]).to_f32_const()
}
