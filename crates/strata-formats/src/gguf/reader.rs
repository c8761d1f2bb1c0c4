//! Parsing of a GGUF file (v2 and v3) from a memory map or a byte buffer.
//! Counts and lengths are bounded by the bytes left, so a hostile header cannot make us allocate much.

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::metadata::{MetaValue, MetaValueType};
use super::{DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
use crate::limits::MAX_METADATA_VALUES;
use crate::quant::GgmlType;
use crate::storage::Storage;

/// Deepest nesting of arrays inside arrays that we accept.
pub(super) const MAX_ARRAY_DEPTH: usize = 4;
/// Most entries reserved up front for a list whose length comes from the file. Longer lists grow
/// as they are read, so memory follows the bytes actually parsed, not the count a header claims.
const MAX_PREALLOC: u64 = 1024;

/// Capacity to reserve for a list the file says has `count` entries.
fn prealloc(count: u64) -> usize {
    count.min(MAX_PREALLOC) as usize
}

/// Why a GGUF file could not be read. Each message is whole: none repeats an inner error's text
/// as a `source()` too, so a printed chain says everything once.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot open {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("not a GGUF file (magic bytes {0:02x?}, expected \"GGUF\")")]
    BadMagic([u8; 4]),
    #[error("GGUF version {0} is not supported (strata reads versions 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("file is truncated: {what} needs {needed} bytes at offset {offset}, file has {len}")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    #[error("{what}: count {count} is impossible for a file of {len} bytes")]
    AbsurdCount { what: String, count: u64, len: u64 },
    #[error("metadata key {key:?}: the metadata arrays hold more than {MAX_METADATA_VALUES} values in all, strata's limit; the file is corrupt")]
    TooManyValues { key: String },
    #[error("metadata key {key:?}: unknown value type id {id}")]
    UnknownValueType { key: String, id: u32 },
    #[error("metadata key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH}")]
    NestingTooDeep { key: String },
    #[error("{what} is not valid UTF-8")]
    BadUtf8 { what: String },
    #[error("metadata key {0:?} appears twice")]
    DuplicateKey(String),
    #[error("tensor {0:?} appears twice")]
    DuplicateTensor(String),
    #[error("general.alignment = {0} is not a power of two between 1 and 2^30")]
    BadAlignment(u64),
    #[error("metadata key {key:?}: {reason}")]
    BadValue { key: String, reason: String },
    #[error("tensor {name:?}: {reason}")]
    BadTensor { name: String, reason: String },
    #[error("tensors {a:?} and {b:?} overlap in the data section")]
    OverlappingTensors { a: String, b: String },
}

/// Where a tensor lives and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGML order: `dims[0]` is the contiguous (row) length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section (as stored in the file).
    pub offset: u64,
    pub n_elements: u64,
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Length of one row (the contiguous dimension).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }

    /// Number of rows (product of all dimensions but the first).
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }
}

/// An opened GGUF file: parsed header plus access to tensor bytes.
pub struct GgufFile {
    pub version: u32,
    pub alignment: u64,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    data_start: u64,
    storage: Storage,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Opens and memory-maps `path`, then parses and validates its header.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref();
        let storage = Storage::map(path).map_err(|error| GgufError::Io {
            path: path.to_path_buf(),
            error,
        })?;
        Self::parse(storage)
    }

    /// Parses a GGUF image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(Storage::Owned(bytes))
    }

    fn parse(storage: Storage) -> Result<Self, GgufError> {
        let bytes = storage.bytes();
        let mut c = Cursor {
            bytes,
            pos: 0,
            array_values: 0,
        };
        let magic: [u8; 4] = c.take(4, "magic")?.try_into().unwrap_or_default();
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic(magic));
        }
        let version = c.u32("version")?;
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = c.u64("tensor count")?;
        let n_kv = c.u64("metadata count")?;
        // A tensor info takes at least 8 (name len) + 4 (n_dims) + 4 (type) + 8 (offset) bytes.
        c.check_count("tensor count", n_tensors, 24)?;
        c.check_count("metadata count", n_kv, 12)?;

        let mut metadata = Vec::with_capacity(prealloc(n_kv));
        let mut meta_index = HashMap::with_capacity(prealloc(n_kv));
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key #{i}"))?;
            let type_id = c.u32(&format!("type of metadata key {key:?}"))?;
            let ty = MetaValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
                key: key.clone(),
                id: type_id,
            })?;
            let value = c.value(&key, ty, 0)?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::DuplicateKey(key));
            }
            metadata.push((key, value));
        }

        let alignment = match meta_index.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(&i) => {
                let a = metadata[i].1.as_u64().unwrap_or(0);
                if a == 0 || !a.is_power_of_two() || a > 1 << 30 {
                    return Err(GgufError::BadAlignment(a));
                }
                a
            }
        };

        let mut tensors = Vec::with_capacity(prealloc(n_tensors));
        let mut tensor_index = HashMap::with_capacity(prealloc(n_tensors));
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name #{i}"))?;
            let n_dims = c.u32(&format!("dimension count of tensor {name:?}"))? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(bad_tensor(
                    &name,
                    format!("{n_dims} dimensions (GGML allows 1 to {MAX_DIMS})"),
                ));
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(c.u64(&format!("dimensions of tensor {name:?}"))?);
            }
            let type_id = c.u32(&format!("type of tensor {name:?}"))?;
            let ty = GgmlType::from_id(type_id)
                .ok_or_else(|| bad_tensor(&name, format!("unknown tensor type id {type_id}")))?;
            let offset = c.u64(&format!("offset of tensor {name:?}"))?;
            let n_elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| bad_tensor(&name, format!("dimensions {dims:?} overflow")))?;
            if dims.contains(&0) {
                return Err(bad_tensor(&name, format!("has a zero dimension {dims:?}")));
            }
            if dims[0] % ty.block_len() as u64 != 0 {
                return Err(bad_tensor(
                    &name,
                    format!(
                        "row length {} is not a multiple of the {} block size {}",
                        dims[0],
                        ty,
                        ty.block_len()
                    ),
                ));
            }
            let n_bytes = ty
                .bytes_for(n_elements)
                .ok_or_else(|| bad_tensor(&name, format!("size of {n_elements} {ty} values overflows")))?;
            if offset % alignment != 0 {
                return Err(bad_tensor(
                    &name,
                    format!("offset {offset} is not aligned to {alignment}"),
                ));
            }
            if tensor_index.insert(name.clone(), tensors.len()).is_some() {
                return Err(GgufError::DuplicateTensor(name));
            }
            tensors.push(TensorInfo {
                name,
                dims,
                ty,
                offset,
                n_elements,
                n_bytes,
            });
        }

        let data_start = c.pos.div_ceil(alignment).saturating_mul(alignment);
        let file_len = bytes.len() as u64;
        if data_start > file_len && !tensors.is_empty() {
            return Err(GgufError::Truncated {
                what: "tensor data section".into(),
                offset: c.pos,
                needed: data_start - c.pos,
                len: file_len,
            });
        }
        let data_len = file_len.saturating_sub(data_start);
        for t in &tensors {
            let end = t.offset.checked_add(t.n_bytes);
            if end.is_none_or(|e| e > data_len) {
                return Err(bad_tensor(
                    &t.name,
                    format!(
                        "data [{}, +{}) runs past the end of the data section ({} bytes); the file is truncated or corrupt",
                        t.offset, t.n_bytes, data_len
                    ),
                ));
            }
        }
        let mut order: Vec<&TensorInfo> = tensors.iter().collect();
        order.sort_by_key(|t| t.offset);
        for pair in order.windows(2) {
            if pair[0].offset + pair[0].n_bytes > pair[1].offset {
                return Err(GgufError::OverlappingTensors {
                    a: pair[0].name.clone(),
                    b: pair[1].name.clone(),
                });
            }
        }

        Ok(GgufFile {
            version,
            alignment,
            metadata,
            meta_index,
            tensors,
            tensor_index,
            data_start,
            storage,
        })
    }

    /// All metadata in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    /// The metadata value under `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Integer metadata under `key`.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(MetaValue::as_u64)
    }

    /// Float metadata under `key`.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(MetaValue::as_f64)
    }

    /// String metadata under `key`.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(MetaValue::as_str)
    }

    /// Bool metadata under `key`.
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key).and_then(MetaValue::as_bool)
    }

    /// Array metadata under `key`.
    pub fn get_array(&self, key: &str) -> Option<&[MetaValue]> {
        self.get(key).and_then(MetaValue::as_array)
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of `t` (validated to lie inside the file when the file was opened).
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let r = self.tensor_range(t);
        &self.storage.bytes()[r]
    }

    fn tensor_range(&self, t: &TensorInfo) -> Range<usize> {
        let start = (self.data_start + t.offset) as usize;
        start..start + t.n_bytes as usize
    }

    /// Offset of the data section from the start of the file.
    pub fn data_start(&self) -> u64 {
        self.data_start
    }
}

fn bad_tensor(name: &str, reason: String) -> GgufError {
    GgufError::BadTensor {
        name: name.to_string(),
        reason,
    }
}

struct Cursor<'a> {
    bytes: &'a [u8],
    pos: u64,
    /// Values in all metadata arrays read so far, bounded by [`MAX_METADATA_VALUES`].
    array_values: u64,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        self.bytes.len() as u64 - self.pos
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(GgufError::Truncated {
                what: what.to_string(),
                offset: self.pos,
                needed: n,
                len: self.bytes.len() as u64,
            });
        }
        let start = self.pos as usize;
        self.pos += n;
        Ok(&self.bytes[start..start + n as usize])
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], GgufError> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// Errors unless `count` items of at least `min_len` bytes each fit in what is left.
    fn check_count(&self, what: &str, count: u64, min_len: u64) -> Result<(), GgufError> {
        if count.checked_mul(min_len).is_none_or(|need| need > self.remaining()) {
            return Err(GgufError::AbsurdCount {
                what: what.to_string(),
                count,
                len: self.bytes.len() as u64,
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String, GgufError> {
        let len = self.u64(what)?;
        let raw = self.take(len, what)?;
        String::from_utf8(raw.to_vec()).map_err(|_| GgufError::BadUtf8 { what: what.to_string() })
    }

    fn value(&mut self, key: &str, ty: MetaValueType, depth: usize) -> Result<MetaValue, GgufError> {
        let what = || format!("value of metadata key {key:?}");
        Ok(match ty {
            MetaValueType::U8 => MetaValue::U8(self.array::<1>(&what())?[0]),
            MetaValueType::I8 => MetaValue::I8(self.array::<1>(&what())?[0] as i8),
            MetaValueType::U16 => MetaValue::U16(u16::from_le_bytes(self.array(&what())?)),
            MetaValueType::I16 => MetaValue::I16(i16::from_le_bytes(self.array(&what())?)),
            MetaValueType::U32 => MetaValue::U32(u32::from_le_bytes(self.array(&what())?)),
            MetaValueType::I32 => MetaValue::I32(i32::from_le_bytes(self.array(&what())?)),
            MetaValueType::F32 => MetaValue::F32(f32::from_le_bytes(self.array(&what())?)),
            MetaValueType::U64 => MetaValue::U64(u64::from_le_bytes(self.array(&what())?)),
            MetaValueType::I64 => MetaValue::I64(i64::from_le_bytes(self.array(&what())?)),
            MetaValueType::F64 => MetaValue::F64(f64::from_le_bytes(self.array(&what())?)),
            MetaValueType::Bool => match self.array::<1>(&what())?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => {
                    return Err(GgufError::BadValue {
                        key: key.to_string(),
                        reason: format!("bool holds {b}, not 0 or 1"),
                    })
                }
            },
            MetaValueType::String => MetaValue::String(self.string(&what())?),
            MetaValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::NestingTooDeep { key: key.to_string() });
                }
                let type_id = self.u32(&what())?;
                let elem = MetaValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
                    key: key.to_string(),
                    id: type_id,
                })?;
                let count = self.u64(&what())?;
                self.check_count(
                    &format!("array length of metadata key {key:?}"),
                    count,
                    elem.min_encoded_len(),
                )?;
                self.array_values = self.array_values.saturating_add(count);
                if self.array_values > MAX_METADATA_VALUES {
                    return Err(GgufError::TooManyValues { key: key.to_string() });
                }
                let mut items = Vec::with_capacity(prealloc(count));
                for _ in 0..count {
                    items.push(self.value(key, elem, depth + 1)?);
                }
                MetaValue::Array(elem, items)
            }
        })
    }
}
