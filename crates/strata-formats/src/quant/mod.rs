//! Quantized block formats of GGML (the types a GGUF tensor can have): dequantization and quantization.
//! Layouts and dequantization here are bit-identical to the reference `gguf` Python package.

use std::fmt;

mod dequant;
mod floats;
mod kquants;
mod legacy;
mod quantize;

pub use dequant::{dequantize, QuantError};
pub use kquants::scales_and_mins;
pub use quantize::{quantize, QUANTIZABLE};

/// Element type of a GGUF tensor, numbered as in GGML's `ggml_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    BF16 = 30,
}

/// Number of values in a K-quant super-block.
pub const QK_K: usize = 256;

impl GgmlType {
    /// The type with GGML id `id`, or `None` for ids strata does not know.
    pub fn from_id(id: u32) -> Option<GgmlType> {
        use GgmlType::*;
        Some(match id {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            9 => Q8_1,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            24 => I8,
            25 => I16,
            26 => I32,
            27 => I64,
            28 => F64,
            30 => BF16,
            _ => return None,
        })
    }

    /// Values per block (1 for plain element types).
    pub fn block_len(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | I8 | I16 | I32 | I64 | F64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 => 32,
            Q2K | Q3K | Q4K | Q5K | Q6K | Q8K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | I32 => 4,
            F16 | BF16 | I16 => 2,
            I8 => 1,
            I64 | F64 => 8,
            Q4_0 => 2 + 16,
            Q4_1 => 2 + 2 + 16,
            Q5_0 => 2 + 4 + 16,
            Q5_1 => 2 + 2 + 4 + 16,
            Q8_0 => 2 + 32,
            Q8_1 => 2 + 2 + 32,
            Q2K => QK_K / 16 + QK_K / 4 + 2 + 2,
            Q3K => QK_K / 8 + QK_K / 4 + 12 + 2,
            Q4K => 2 + 2 + 12 + QK_K / 2,
            Q5K => 2 + 2 + 12 + QK_K / 8 + QK_K / 2,
            Q6K => QK_K / 2 + QK_K / 4 + QK_K / 16 + 2,
            Q8K => 4 + QK_K + QK_K / 16 * 2,
        }
    }

    /// Bytes taken by `n` values, or `None` when `n` is not a whole number of blocks
    /// or the size overflows.
    pub fn bytes_for(self, n: u64) -> Option<u64> {
        let bl = self.block_len() as u64;
        if !n.is_multiple_of(bl) {
            return None;
        }
        (n / bl).checked_mul(self.block_bytes() as u64)
    }

    /// Whether values of this type are stored in quantized blocks.
    pub fn is_quantized(self) -> bool {
        self.block_len() > 1
    }

    /// Whether [`dequantize`] can decode values of this type.
    pub fn can_dequantize(self) -> bool {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q2K | Q3K | Q4K | Q5K | Q6K => true,
            Q8_1 | Q8K | I8 | I16 | I32 | I64 | F64 => false,
        }
    }

    /// Whether [`quantize`] can encode values as this type.
    pub fn can_quantize(self) -> bool {
        QUANTIZABLE.contains(&self)
    }

    /// GGML's name of the type (`Q4_K`, `BF16`, ...).
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            BF16 => "BF16",
        }
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
