//! Typed GGUF metadata values and conversions used by model loaders.
//! Arrays keep their element type so empty arrays still say what they hold.

use std::fmt;

/// Type tag of a metadata value, numbered as in the GGUF specification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MetaValueType {
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    F32,
    Bool,
    String,
    Array,
    U64,
    I64,
    F64,
}

impl MetaValueType {
    /// The type with GGUF id `id`, if it is one.
    pub fn from_id(id: u32) -> Option<Self> {
        use MetaValueType::*;
        Some(match id {
            0 => U8,
            1 => I8,
            2 => U16,
            3 => I16,
            4 => U32,
            5 => I32,
            6 => F32,
            7 => Bool,
            8 => String,
            9 => Array,
            10 => U64,
            11 => I64,
            12 => F64,
            _ => return None,
        })
    }

    /// Smallest number of bytes one value of this type takes in a file.
    pub fn min_encoded_len(self) -> u64 {
        use MetaValueType::*;
        match self {
            U8 | I8 | Bool => 1,
            U16 | I16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 | String => 8,
            Array => 12,
        }
    }
}

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(MetaValueType, Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is an integer of any width that is >= 0.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer, if it is an integer that fits.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float, if it is a float or an integer.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    /// The value as a bool (also accepts integers 0 and 1).
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => match self.as_u64() {
                Some(0) => Some(false),
                Some(1) => Some(true),
                _ => None,
            },
        }
    }

    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// The elements, if the value is an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(_, items) => Some(items),
            _ => None,
        }
    }

    /// The type tag of this value.
    pub fn value_type(&self) -> MetaValueType {
        match self {
            MetaValue::U8(_) => MetaValueType::U8,
            MetaValue::I8(_) => MetaValueType::I8,
            MetaValue::U16(_) => MetaValueType::U16,
            MetaValue::I16(_) => MetaValueType::I16,
            MetaValue::U32(_) => MetaValueType::U32,
            MetaValue::I32(_) => MetaValueType::I32,
            MetaValue::F32(_) => MetaValueType::F32,
            MetaValue::Bool(_) => MetaValueType::Bool,
            MetaValue::String(_) => MetaValueType::String,
            MetaValue::Array(..) => MetaValueType::Array,
            MetaValue::U64(_) => MetaValueType::U64,
            MetaValue::I64(_) => MetaValueType::I64,
            MetaValue::F64(_) => MetaValueType::F64,
        }
    }
}

impl fmt::Display for MetaValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaValue::String(s) if s.len() > 80 => {
                write!(f, "{:?}...", &s[..s.floor_char_boundary(80)])
            }
            MetaValue::String(s) => write!(f, "{s:?}"),
            MetaValue::Array(t, items) => write!(f, "[{:?}; {}]", t, items.len()),
            MetaValue::F32(v) => write!(f, "{v}"),
            MetaValue::F64(v) => write!(f, "{v}"),
            MetaValue::Bool(v) => write!(f, "{v}"),
            other => match other.as_i64() {
                Some(v) => write!(f, "{v}"),
                None => write!(f, "{}", other.as_u64().unwrap_or_default()),
            },
        }
    }
}
