//! GGUF writer: builds a v2 or v3 image (header, metadata, tensor infos, aligned tensor data).
//! It refuses anything the reader would refuse; tensor data can be held or streamed in at write time.

use std::collections::HashSet;
use std::io::{self, Write};

use super::metadata::{MetaValue, MetaValueType};
use super::reader::{GgufError, MAX_ARRAY_DEPTH};
use super::{DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_DIMS};
use crate::quant::GgmlType;

/// Metadata key that sets the alignment of tensor data.
const ALIGNMENT_KEY: &str = "general.alignment";
/// Largest alignment the reader accepts.
const MAX_ALIGNMENT: u64 = 1 << 30;

/// A tensor waiting to be written.
#[derive(Debug, Clone)]
struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    n_bytes: u64,
    /// `None` for a tensor declared with [`GgufWriter::add_tensor_info`]: its bytes come at write time.
    data: Option<Vec<u8>>,
}

/// Where each part of the image will lie, in bytes from the start of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GgufLayout {
    /// Start of the metadata key/values (right after the 24-byte header).
    pub metadata_start: u64,
    /// Start of the tensor infos (right after the last metadata value).
    pub tensor_infos_start: u64,
    /// Start of the data section (tensor infos padded to the alignment).
    pub data_start: u64,
    /// Offset of each tensor inside the data section, in the order the tensors were added.
    pub tensor_offsets: Vec<u64>,
    /// Length of the whole image, including the padding after the last tensor.
    pub total_len: u64,
}

/// Builds a GGUF image in memory.
///
/// Metadata and tensors keep the order they were added in. Each tensor's data starts at a
/// multiple of the alignment (`general.alignment` when that key is added, else 32) and the
/// gaps are zero bytes, as GGML and the reference Python writer lay them out.
///
/// ```
/// use strata_formats::gguf::{GgufFile, GgufWriter, MetaValue};
/// use strata_formats::GgmlType;
///
/// let mut w = GgufWriter::new();
/// w.add_metadata("general.architecture", MetaValue::String("llama".into()))?;
/// w.add_tensor("output_norm.weight", &[4], GgmlType::F32, vec![0u8; 16])?;
/// let file = GgufFile::from_bytes(w.to_bytes())?;
/// assert_eq!(file.get_str("general.architecture"), Some("llama"));
/// # Ok::<(), strata_formats::gguf::GgufError>(())
/// ```
#[derive(Debug, Clone)]
pub struct GgufWriter {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, MetaValue)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    tensor_names: HashSet<String>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// A writer for a GGUF v3 image with no metadata and no tensors.
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            tensor_names: HashSet::new(),
        }
    }

    /// A writer for GGUF version `version` (2 or 3; both share one layout for little-endian files).
    pub fn with_version(version: u32) -> Result<Self, GgufError> {
        if version != 2 && version != 3 {
            return Err(GgufError::UnsupportedVersion(version));
        }
        Ok(GgufWriter { version, ..Self::new() })
    }

    /// The GGUF version that will be written.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of tensor data that will be written.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Adds the metadata entry `key = value`.
    ///
    /// Errors on a key added before, an array whose elements are not all of its declared type,
    /// arrays nested deeper than the reader accepts, and a `general.alignment` that is not an
    /// integer power of two up to 2^30 (that key also sets the alignment of tensor data).
    pub fn add_metadata(&mut self, key: impl Into<String>, value: MetaValue) -> Result<&mut Self, GgufError> {
        let key = key.into();
        if self.keys.contains(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        self.check_metadata(&key, &value)?;
        self.keys.insert(key.clone());
        self.metadata.push((key, value));
        Ok(self)
    }

    /// Replaces the value of `key` where it was added (adds it when it was not), with the checks
    /// of [`Self::add_metadata`]: how a test turns a valid model into a subtly broken one.
    pub fn set_metadata(&mut self, key: impl Into<String>, value: MetaValue) -> Result<&mut Self, GgufError> {
        let key = key.into();
        let Some(i) = self.metadata.iter().position(|(k, _)| *k == key) else {
            return self.add_metadata(key, value);
        };
        self.check_metadata(&key, &value)?;
        self.metadata[i].1 = value;
        Ok(self)
    }

    /// Errors on a value the reader would refuse; `general.alignment` also sets the alignment.
    fn check_metadata(&mut self, key: &str, value: &MetaValue) -> Result<(), GgufError> {
        check_value(key, value, 0)?;
        if key == ALIGNMENT_KEY {
            let alignment = value.as_u64().unwrap_or(0);
            if !alignment.is_power_of_two() || alignment > MAX_ALIGNMENT {
                return Err(GgufError::BadAlignment(alignment));
            }
            self.alignment = alignment;
        }
        Ok(())
    }

    /// Adds `general.alignment` as a `u32`, as the GGUF specification types it.
    pub fn set_alignment(&mut self, alignment: u32) -> Result<&mut Self, GgufError> {
        self.add_metadata(ALIGNMENT_KEY, MetaValue::U32(alignment))
    }

    /// Adds a string array, the shape of `tokenizer.ggml.tokens` and `tokenizer.ggml.merges`.
    pub fn add_string_array<S: Into<String>>(
        &mut self,
        key: impl Into<String>,
        items: impl IntoIterator<Item = S>,
    ) -> Result<&mut Self, GgufError> {
        let items = items.into_iter().map(|s| MetaValue::String(s.into())).collect();
        self.add_metadata(key, MetaValue::Array(MetaValueType::String, items))
    }

    /// Adds a tensor with dimensions `dims` in GGML order (`dims[0]` is the row length).
    ///
    /// `data` must hold exactly the bytes of that many `ty` values. Errors on a name added
    /// before, 0 or more than 4 dimensions, a zero dimension, a row length that is not a
    /// whole number of `ty` blocks, a size that overflows, or data of the wrong length.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: impl Into<Vec<u8>>,
    ) -> Result<&mut Self, GgufError> {
        let name = name.into();
        let data = data.into();
        let expected = tensor_size(&name, dims, ty)?;
        if data.len() as u64 != expected {
            return Err(GgufError::BadTensor {
                name,
                reason: format!("{} bytes of data given, {dims:?} {ty} needs {expected}", data.len()),
            });
        }
        self.push_tensor(name, dims, ty, expected, Some(data))
    }

    /// Declares a tensor, with the checks of [`Self::add_tensor`], whose bytes are asked for only
    /// when [`Self::write_streaming`] reaches it: how a file larger than memory is written.
    pub fn add_tensor_info(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
    ) -> Result<&mut Self, GgufError> {
        let name = name.into();
        let n_bytes = tensor_size(&name, dims, ty)?;
        self.push_tensor(name, dims, ty, n_bytes, None)
    }

    fn push_tensor(
        &mut self,
        name: String,
        dims: &[u64],
        ty: GgmlType,
        n_bytes: u64,
        data: Option<Vec<u8>>,
    ) -> Result<&mut Self, GgufError> {
        if self.tensor_names.contains(&name) {
            return Err(GgufError::DuplicateTensor(name));
        }
        self.tensor_names.insert(name.clone());
        self.tensors.push(PendingTensor {
            name,
            dims: dims.to_vec(),
            ty,
            n_bytes,
            data,
        });
        Ok(self)
    }

    /// Where each part of the image will lie once written.
    pub fn layout(&self) -> GgufLayout {
        let metadata_start = 4 + 4 + 8 + 8;
        let metadata_len: u64 = self
            .metadata
            .iter()
            .map(|(k, v)| string_len(k) + 4 + value_len(v))
            .sum();
        let tensor_infos_start = metadata_start + metadata_len;
        let infos_len: u64 = self
            .tensors
            .iter()
            .map(|t| string_len(&t.name) + 4 + 8 * t.dims.len() as u64 + 4 + 8)
            .sum();
        let data_start = align_up(tensor_infos_start + infos_len, self.alignment);
        let mut tensor_offsets = Vec::with_capacity(self.tensors.len());
        let mut data_len = 0;
        for t in &self.tensors {
            tensor_offsets.push(data_len);
            data_len = align_up(data_len + t.n_bytes, self.alignment);
        }
        GgufLayout {
            metadata_start,
            tensor_infos_start,
            data_start,
            tensor_offsets,
            total_len: data_start + data_len,
        }
    }

    /// Writes the image to `out`: header, metadata, tensor infos, padding, then tensor data.
    /// Errors (InvalidInput) at a tensor declared by [`Self::add_tensor_info`], which has no data here.
    pub fn write_to<W: Write>(&self, out: &mut W) -> io::Result<()> {
        self.write_streaming(out, |index| {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("tensor {:?} was declared without data", self.tensors[index].name),
            ))
        })
    }

    /// Writes the image as [`Self::write_to`] does, asking `data_of(i)` for the bytes of the `i`-th
    /// tensor (in the order added) where it was declared without data, one tensor at a time, so
    /// only one tensor's bytes need be in memory. Bytes of the wrong length are an InvalidData error.
    pub fn write_streaming<W: Write, E: From<io::Error>>(
        &self,
        out: &mut W,
        mut data_of: impl FnMut(usize) -> Result<Vec<u8>, E>,
    ) -> Result<(), E> {
        let layout = self.layout();
        let mut out = CountingWriter { out, written: 0 };

        out.put(&GGUF_MAGIC)?;
        out.put(&self.version.to_le_bytes())?;
        out.put(&(self.tensors.len() as u64).to_le_bytes())?;
        out.put(&(self.metadata.len() as u64).to_le_bytes())?;

        let mut buf = Vec::new();
        for (key, value) in &self.metadata {
            buf.clear();
            encode_string(&mut buf, key);
            buf.extend_from_slice(&type_id(value.value_type()).to_le_bytes());
            encode_value(&mut buf, value);
            out.put(&buf)?;
        }
        for (t, offset) in self.tensors.iter().zip(&layout.tensor_offsets) {
            buf.clear();
            encode_string(&mut buf, &t.name);
            buf.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                buf.extend_from_slice(&d.to_le_bytes());
            }
            buf.extend_from_slice(&(t.ty as u32).to_le_bytes());
            buf.extend_from_slice(&offset.to_le_bytes());
            out.put(&buf)?;
        }

        for (index, (t, offset)) in self.tensors.iter().zip(&layout.tensor_offsets).enumerate() {
            out.pad_to(layout.data_start + offset)?;
            match &t.data {
                Some(data) => out.put(data)?,
                None => {
                    let data = data_of(index)?;
                    if data.len() as u64 != t.n_bytes {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!(
                                "tensor {:?}: {} bytes given, {} declared",
                                t.name,
                                data.len(),
                                t.n_bytes
                            ),
                        )
                        .into());
                    }
                    out.put(&data)?;
                }
            }
        }
        out.pad_to(layout.total_len)?;
        debug_assert_eq!(out.written, layout.total_len);
        Ok(())
    }

    /// The whole image as bytes (cut short at a tensor declared without data).
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(self.layout().total_len as usize);
        // Writing into a Vec cannot fail; only a tensor without data stops it.
        let _ = self.write_to(&mut bytes);
        bytes
    }
}

/// Bytes taken by `dims` values of `ty`, after the checks the reader makes on a tensor info.
fn tensor_size(name: &str, dims: &[u64], ty: GgmlType) -> Result<u64, GgufError> {
    let bad = |reason: String| GgufError::BadTensor {
        name: name.to_string(),
        reason,
    };
    if dims.is_empty() || dims.len() > MAX_DIMS {
        return Err(bad(format!("{} dimensions (GGML allows 1 to {MAX_DIMS})", dims.len())));
    }
    if dims.contains(&0) {
        return Err(bad(format!("has a zero dimension {dims:?}")));
    }
    let n_elements = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
    if !dims[0].is_multiple_of(ty.block_len() as u64) {
        return Err(bad(format!(
            "row length {} is not a multiple of the {ty} block size {}",
            dims[0],
            ty.block_len()
        )));
    }
    ty.bytes_for(n_elements)
        .ok_or_else(|| bad(format!("size of {n_elements} {ty} values overflows")))
}

/// Errors unless every array in `value` holds only elements of its declared type and arrays
/// nest no deeper than the reader accepts.
fn check_value(key: &str, value: &MetaValue, depth: usize) -> Result<(), GgufError> {
    let MetaValue::Array(elem, items) = value else {
        return Ok(());
    };
    if depth >= MAX_ARRAY_DEPTH {
        return Err(GgufError::NestingTooDeep { key: key.to_string() });
    }
    for (i, item) in items.iter().enumerate() {
        if item.value_type() != *elem {
            return Err(GgufError::BadValue {
                key: key.to_string(),
                reason: format!("array of {elem:?} holds a {:?} at index {i}", item.value_type()),
            });
        }
        check_value(key, item, depth + 1)?;
    }
    Ok(())
}

/// A writer that counts the bytes written, so padding can be computed from them.
struct CountingWriter<'a, W> {
    out: &'a mut W,
    written: u64,
}

impl<W: Write> CountingWriter<'_, W> {
    fn put(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.written += bytes.len() as u64;
        self.out.write_all(bytes)
    }

    /// Writes zero bytes until `pos` bytes have been written.
    fn pad_to(&mut self, pos: u64) -> io::Result<()> {
        const ZEROS: [u8; 256] = [0; 256];
        while self.written < pos {
            let n = (pos - self.written).min(ZEROS.len() as u64) as usize;
            self.put(&ZEROS[..n])?;
        }
        Ok(())
    }
}

fn align_up(n: u64, alignment: u64) -> u64 {
    n.div_ceil(alignment) * alignment
}

fn string_len(s: &str) -> u64 {
    8 + s.len() as u64
}

/// Encoded length of `value` without its type id.
fn value_len(value: &MetaValue) -> u64 {
    match value {
        MetaValue::U8(_) | MetaValue::I8(_) | MetaValue::Bool(_) => 1,
        MetaValue::U16(_) | MetaValue::I16(_) => 2,
        MetaValue::U32(_) | MetaValue::I32(_) | MetaValue::F32(_) => 4,
        MetaValue::U64(_) | MetaValue::I64(_) | MetaValue::F64(_) => 8,
        MetaValue::String(s) => string_len(s),
        MetaValue::Array(_, items) => 4 + 8 + items.iter().map(value_len).sum::<u64>(),
    }
}

/// The GGUF id of a metadata value type (the inverse of [`MetaValueType::from_id`]).
fn type_id(ty: MetaValueType) -> u32 {
    use MetaValueType::*;
    match ty {
        U8 => 0,
        I8 => 1,
        U16 => 2,
        I16 => 3,
        U32 => 4,
        I32 => 5,
        F32 => 6,
        Bool => 7,
        String => 8,
        Array => 9,
        U64 => 10,
        I64 => 11,
        F64 => 12,
    }
}

fn encode_string(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

/// Appends `value` without its type id (array elements carry none).
fn encode_value(buf: &mut Vec<u8>, value: &MetaValue) {
    match value {
        MetaValue::U8(v) => buf.push(*v),
        MetaValue::I8(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I16(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::U32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F32(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::Bool(v) => buf.push(u8::from(*v)),
        MetaValue::String(s) => encode_string(buf, s),
        MetaValue::Array(elem, items) => {
            buf.extend_from_slice(&type_id(*elem).to_le_bytes());
            buf.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                encode_value(buf, item);
            }
        }
        MetaValue::U64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::I64(v) => buf.extend_from_slice(&v.to_le_bytes()),
        MetaValue::F64(v) => buf.extend_from_slice(&v.to_le_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn type_ids_round_trip() {
        for id in 0..13 {
            let ty = MetaValueType::from_id(id).expect("ids 0..13 are all types");
            assert_eq!(type_id(ty), id);
        }
    }

    #[test]
    fn set_metadata_replaces_in_place_or_adds() {
        let mut w = GgufWriter::new();
        w.add_metadata("a", MetaValue::U32(1)).unwrap();
        w.add_metadata("b", MetaValue::U32(2)).unwrap();
        w.set_metadata("a", MetaValue::U64(1 << 31)).unwrap();
        w.set_metadata("c", MetaValue::Bool(true)).unwrap();
        w.set_metadata(ALIGNMENT_KEY, MetaValue::U32(64)).unwrap();
        assert_eq!(w.alignment(), 64);
        let err = w.set_metadata(ALIGNMENT_KEY, MetaValue::U32(3)).unwrap_err();
        assert!(matches!(err, GgufError::BadAlignment(3)), "{err}");
        let file = crate::gguf::GgufFile::from_bytes(w.to_bytes()).unwrap();
        let keys: Vec<&str> = file.metadata().iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["a", "b", "c", ALIGNMENT_KEY]);
        assert_eq!(file.get_u64("a"), Some(1 << 31));
    }

    #[test]
    fn layout_matches_written_length() {
        let mut w = GgufWriter::new();
        w.set_alignment(64).unwrap();
        w.add_tensor("a", &[3], GgmlType::F32, vec![1u8; 12]).unwrap();
        w.add_tensor("b", &[32, 2], GgmlType::Q8_0, vec![2u8; 68]).unwrap();
        let layout = w.layout();
        assert_eq!(layout.tensor_offsets, vec![0, 64]);
        assert_eq!(w.to_bytes().len() as u64, layout.total_len);
        assert_eq!(layout.total_len, layout.data_start + 64 + 128);
    }

    #[test]
    fn streamed_tensors_write_the_same_image_as_held_ones() {
        let mut held = GgufWriter::new();
        held.add_tensor("a", &[3], GgmlType::F32, vec![1u8; 12]).unwrap();
        held.add_tensor("b", &[32, 2], GgmlType::Q8_0, vec![2u8; 68]).unwrap();
        let mut streamed = GgufWriter::new();
        streamed.add_tensor("a", &[3], GgmlType::F32, vec![1u8; 12]).unwrap();
        streamed.add_tensor_info("b", &[32, 2], GgmlType::Q8_0).unwrap();
        let mut bytes = Vec::new();
        let mut asked = Vec::new();
        streamed
            .write_streaming(&mut bytes, |i| {
                asked.push(i);
                Ok::<_, io::Error>(vec![2u8; 68])
            })
            .unwrap();
        assert_eq!(asked, [1]);
        assert_eq!(bytes, held.to_bytes());

        let short = streamed.write_streaming(&mut Vec::new(), |_| Ok::<_, io::Error>(vec![2u8; 67]));
        assert_eq!(short.unwrap_err().kind(), io::ErrorKind::InvalidData);
        let unfilled = streamed.write_to(&mut Vec::new()).unwrap_err();
        assert_eq!(unfilled.kind(), io::ErrorKind::InvalidInput);
        assert!(unfilled.to_string().contains("\"b\""), "{unfilled}");
        assert!(matches!(
            streamed.add_tensor_info("c", &[100], GgmlType::Q4K),
            Err(GgufError::BadTensor { .. })
        ));
    }
}
