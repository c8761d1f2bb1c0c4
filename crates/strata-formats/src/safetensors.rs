//! safetensors reader (memory-mapped, every offset checked) and writer, plus sharded checkpoints
//! (`model.safetensors.index.json`); BF16, F16 and F32 tensors map onto [`GgmlType`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::gguf::TensorInfo;
use crate::limits::{read_text_limited, MAX_JSON_FILE_BYTES};
use crate::quant::GgmlType;
use crate::storage::Storage;

/// Largest JSON header we read (the reference implementation's limit too).
pub const MAX_HEADER_LEN: u64 = 100 << 20;
/// The index file of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// The weights file of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";

/// Why a safetensors file or checkpoint could not be read (each message whole, as [`GgufError`]'s).
///
/// [`GgufError`]: crate::gguf::GgufError
#[derive(Debug, thiserror::Error)]
pub enum SafetensorsError {
    #[error("cannot read {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("{path}: not a valid safetensors file: {reason}")]
    Malformed { path: PathBuf, reason: String },
    #[error("{path}: {reason}")]
    BadIndex { path: PathBuf, reason: String },
    #[error("unsupported dtype {dtype} for tensor {name} (strata reads BF16, F16 and F32)")]
    UnsupportedDtype { name: String, dtype: String },
}

/// Element type of a safetensors tensor (the names the format spells in `dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    F8E4M3,
    F8E5M2,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    I64,
    U64,
    F64,
}

impl Dtype {
    const ALL: [Dtype; 15] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::F8E4M3,
        Dtype::F8E5M2,
        Dtype::I16,
        Dtype::U16,
        Dtype::F16,
        Dtype::BF16,
        Dtype::I32,
        Dtype::U32,
        Dtype::F32,
        Dtype::I64,
        Dtype::U64,
        Dtype::F64,
    ];

    /// The spelling in a safetensors header.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
            Dtype::I16 => "I16",
            Dtype::U16 => "U16",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
            Dtype::I32 => "I32",
            Dtype::U32 => "U32",
            Dtype::F32 => "F32",
            Dtype::I64 => "I64",
            Dtype::U64 => "U64",
            Dtype::F64 => "F64",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
            Dtype::I16 | Dtype::U16 | Dtype::F16 | Dtype::BF16 => 2,
            Dtype::I32 | Dtype::U32 | Dtype::F32 => 4,
            Dtype::I64 | Dtype::U64 | Dtype::F64 => 8,
        }
    }

    fn parse(s: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.name() == s)
    }

    /// The GGML type with the same bytes, for the types strata computes with.
    pub fn ggml_type(self) -> Option<GgmlType> {
        match self {
            Dtype::F32 => Some(GgmlType::F32),
            Dtype::F16 => Some(GgmlType::F16),
            Dtype::BF16 => Some(GgmlType::BF16),
            _ => None,
        }
    }

    /// The safetensors dtype holding the bytes of GGML type `ty`, if one does.
    pub fn from_ggml(ty: GgmlType) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|d| d.ggml_type() == Some(ty))
    }
}

impl std::fmt::Display for Dtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// One tensor of a safetensors file.
#[derive(Debug, Clone, PartialEq)]
pub struct SafeTensor {
    pub name: String,
    pub dtype: Dtype,
    /// Row-major (PyTorch) order: the last dimension is contiguous.
    pub shape: Vec<u64>,
    /// Start and end of its bytes, relative to the data after the header.
    pub begin: u64,
    pub end: u64,
}

impl SafeTensor {
    /// The descriptor the GGUF side uses (GGML dimension order: `dims[0]` contiguous), or an
    /// error naming the tensor when its dtype is not one strata computes with.
    pub fn tensor_info(&self) -> Result<TensorInfo, SafetensorsError> {
        let ty = self
            .dtype
            .ggml_type()
            .ok_or_else(|| SafetensorsError::UnsupportedDtype {
                name: self.name.clone(),
                dtype: self.dtype.name().into(),
            })?;
        Ok(TensorInfo {
            name: self.name.clone(),
            dims: self.shape.iter().rev().copied().collect(),
            ty,
            offset: self.begin,
            n_elements: self.shape.iter().product(),
            n_bytes: self.end - self.begin,
        })
    }
}

/// An opened, validated safetensors file.
pub struct SafetensorsFile {
    path: PathBuf,
    storage: Storage,
    data_start: usize,
    tensors: Vec<SafeTensor>,
    index: HashMap<String, usize>,
    metadata: BTreeMap<String, String>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl SafetensorsFile {
    /// Opens and memory-maps `path`, then parses and validates its header: the length is within
    /// the file and [`MAX_HEADER_LEN`], every dtype is known, every tensor's bytes match its
    /// shape, lie inside the file and overlap no other tensor's.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, SafetensorsError> {
        let path = path.as_ref().to_path_buf();
        let storage = Storage::map(&path).map_err(|error| SafetensorsError::Io {
            path: path.clone(),
            error,
        })?;
        Self::parse(path, storage)
    }

    /// Parses a safetensors image held in memory; `path` only names it in errors.
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self, SafetensorsError> {
        Self::parse(path.into(), Storage::Owned(bytes))
    }

    fn parse(path: PathBuf, storage: Storage) -> Result<Self, SafetensorsError> {
        let (header_len, tensors, metadata) = parse(storage.bytes()).map_err(|reason| SafetensorsError::Malformed {
            path: path.clone(),
            reason,
        })?;
        let index = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(SafetensorsFile {
            path,
            storage,
            data_start: 8 + header_len,
            tensors,
            index,
            metadata,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// All tensors, in the order of their data.
    pub fn tensors(&self) -> &[SafeTensor] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&SafeTensor> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The bytes of `t` (checked to lie inside the file when it was opened).
    pub fn data(&self, t: &SafeTensor) -> &[u8] {
        &self.storage.bytes()[self.data_start + t.begin as usize..self.data_start + t.end as usize]
    }

    /// The `__metadata__` strings of the header.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }
}

type Header = (usize, Vec<SafeTensor>, BTreeMap<String, String>);

/// Parses and validates the header of a safetensors image; errors are the reason only.
fn parse(bytes: &[u8]) -> Result<Header, String> {
    let file_len = bytes.len() as u64;
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(format!(
            "file of {file_len} bytes is shorter than the 8-byte header length"
        ));
    };
    let header_len = u64::from_le_bytes(len_bytes.try_into().unwrap_or_default());
    if header_len > MAX_HEADER_LEN {
        return Err(format!(
            "header length {header_len} exceeds the limit of {MAX_HEADER_LEN} bytes"
        ));
    }
    if header_len > file_len - 8 {
        return Err(format!(
            "header length {header_len} runs past the end of the file ({file_len} bytes); the file is truncated"
        ));
    }
    let header_len = header_len as usize;
    let header = std::str::from_utf8(&bytes[8..8 + header_len]).map_err(|_| "header is not valid UTF-8")?;
    let json: Map<String, Value> = match serde_json::from_str(header) {
        Ok(Value::Object(m)) => m,
        Ok(_) => return Err("header is not a JSON object".into()),
        Err(e) => return Err(format!("header is not valid JSON: {e}")),
    };
    let data_len = file_len - 8 - header_len as u64;
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::with_capacity(json.len());
    for (name, entry) in &json {
        if name == "__metadata__" {
            let obj = entry.as_object().ok_or("__metadata__ is not an object")?;
            for (k, v) in obj {
                let v = v
                    .as_str()
                    .ok_or_else(|| format!("__metadata__ value of {k:?} is not a string"))?;
                metadata.insert(k.clone(), v.to_string());
            }
            continue;
        }
        tensors.push(parse_tensor(name, entry, data_len).map_err(|e| format!("tensor {name}: {e}"))?);
    }
    tensors.sort_by_key(|t| (t.begin, t.end));
    for pair in tensors.windows(2) {
        if pair[0].end > pair[1].begin {
            return Err(format!("tensors {} and {} overlap", pair[0].name, pair[1].name));
        }
    }
    Ok((header_len, tensors, metadata))
}

fn parse_tensor(name: &str, entry: &Value, data_len: u64) -> Result<SafeTensor, String> {
    let obj = entry.as_object().ok_or("entry is not an object")?;
    let dtype = obj.get("dtype").and_then(Value::as_str).ok_or("missing dtype")?;
    let dtype = Dtype::parse(dtype).ok_or_else(|| format!("unknown dtype {dtype:?}"))?;
    let shape = obj
        .get("shape")
        .and_then(Value::as_array)
        .ok_or("missing shape")?
        .iter()
        .map(|d| d.as_u64().ok_or_else(|| format!("shape dimension {d} is not a count")))
        .collect::<Result<Vec<u64>, String>>()?;
    let offsets = obj
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .ok_or("data_offsets is not a pair")?;
    let offset = |i: usize| {
        offsets[i]
            .as_u64()
            .ok_or_else(|| format!("data offset {} is not a count", offsets[i]))
    };
    let (begin, end) = (offset(0)?, offset(1)?);
    let need = shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("shape {shape:?} overflows"))?;
    if begin > end || end > data_len {
        return Err(format!(
            "data_offsets [{begin}, {end}] lie outside the data ({data_len} bytes); the file is truncated or corrupt"
        ));
    }
    if end - begin != need {
        return Err(format!(
            "data_offsets [{begin}, {end}] hold {} bytes, but shape {shape:?} of {dtype} needs {need}",
            end - begin
        ));
    }
    Ok(SafeTensor {
        name: name.to_string(),
        dtype,
        shape,
        begin,
        end,
    })
}

/// Serializes tensors `(name, dtype, shape, bytes)` and `__metadata__` into a safetensors image,
/// data in the given order, header padded with spaces to a multiple of 8 bytes.
pub fn serialize(
    tensors: &[(&str, Dtype, &[u64], &[u8])],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, String> {
    let mut header = Map::new();
    if !metadata.is_empty() {
        header.insert(
            "__metadata__".into(),
            serde_json::to_value(metadata).map_err(|e| e.to_string())?,
        );
    }
    let mut offset = 0u64;
    for &(name, dtype, shape, data) in tensors {
        let need = shape.iter().product::<u64>() * dtype.size();
        if need != data.len() as u64 {
            return Err(format!(
                "tensor {name}: {} bytes, shape {shape:?} of {dtype} needs {need}",
                data.len()
            ));
        }
        let end = offset + need;
        let entry = serde_json::json!({ "dtype": dtype.name(), "shape": shape, "data_offsets": [offset, end] });
        if header.insert(name.to_string(), entry).is_some() {
            return Err(format!("tensor {name} appears twice"));
        }
        offset = end;
    }
    let mut json = Value::Object(header).to_string().into_bytes();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len() + offset as usize);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for &(_, _, _, data) in tensors {
        out.extend_from_slice(data);
    }
    Ok(out)
}

/// All safetensors files of a checkpoint directory, looked up by tensor name.
#[derive(Debug)]
pub struct SafetensorsSet {
    files: Vec<SafetensorsFile>,
    /// Tensor name -> index into `files`.
    owner: HashMap<String, usize>,
}

impl SafetensorsSet {
    /// Opens the weights of the checkpoint in `dir`: the shards `model.safetensors.index.json`
    /// names when it exists, else every `*.safetensors` file there. Errors on a tensor held by two
    /// files, an index entry whose file lacks it, and a directory without weights.
    pub fn open_dir(dir: &Path) -> Result<Self, SafetensorsError> {
        let index_path = dir.join(INDEX_FILE);
        if index_path.is_file() {
            return Self::open_index(&index_path);
        }
        let io = |error| SafetensorsError::Io {
            path: dir.to_path_buf(),
            error,
        };
        let mut paths: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        if paths.is_empty() {
            return Err(SafetensorsError::BadIndex {
                path: dir.to_path_buf(),
                reason: format!("no {SINGLE_FILE}, {INDEX_FILE} or other *.safetensors file"),
            });
        }
        paths.sort();
        let files = paths.iter().map(SafetensorsFile::open).collect::<Result<Vec<_>, _>>()?;
        let mut owner = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for t in f.tensors() {
                if let Some(prev) = owner.insert(t.name.clone(), i) {
                    return Err(SafetensorsError::BadIndex {
                        path: dir.to_path_buf(),
                        reason: format!(
                            "tensor {} is in both {} and {}",
                            t.name,
                            files[prev].path().display(),
                            f.path().display()
                        ),
                    });
                }
            }
        }
        Ok(SafetensorsSet { files, owner })
    }

    /// Opens the shards a `model.safetensors.index.json` names in its `weight_map`.
    pub fn open_index(index_path: &Path) -> Result<Self, SafetensorsError> {
        let bad = |reason: String| SafetensorsError::BadIndex {
            path: index_path.to_path_buf(),
            reason,
        };
        let text = read_text_limited(index_path, MAX_JSON_FILE_BYTES).map_err(|error| SafetensorsError::Io {
            path: index_path.to_path_buf(),
            error,
        })?;
        let json: Value = serde_json::from_str(&text).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        let map = json
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| bad("missing the weight_map object".into()))?;
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let mut shard_of: HashMap<&str, usize> = HashMap::new();
        let mut files = Vec::new();
        let mut owner = HashMap::with_capacity(map.len());
        for (name, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| bad(format!("weight_map entry of {name} is not a file name")))?;
            if file.is_empty() || file.contains(['/', '\\']) || file == ".." {
                return Err(bad(format!(
                    "weight_map names {file:?} for {name}; shards must be plain file names beside the index"
                )));
            }
            let i = match shard_of.get(file) {
                Some(&i) => i,
                None => {
                    files.push(SafetensorsFile::open(dir.join(file))?);
                    shard_of.insert(file, files.len() - 1);
                    files.len() - 1
                }
            };
            if files[i].tensor(name).is_none() {
                return Err(bad(format!("weight_map puts {name} in {file}, which does not hold it")));
            }
            owner.insert(name.to_string(), i);
        }
        Ok(SafetensorsSet { files, owner })
    }

    /// The tensor named `name` and the file holding it.
    pub fn get(&self, name: &str) -> Option<(&SafetensorsFile, &SafeTensor)> {
        let f = &self.files[*self.owner.get(name)?];
        f.tensor(name).map(|t| (f, t))
    }

    /// The opened files.
    pub fn files(&self) -> &[SafetensorsFile] {
        &self.files
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("strata-st-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A header `json` followed by `data`, with the length field saying `len` (or the real length).
    fn image(json: &str, len: Option<u64>, data: &[u8]) -> Vec<u8> {
        let mut out = len.unwrap_or(json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(json.as_bytes());
        out.extend_from_slice(data);
        out
    }

    fn open_err(dir: &Path, bytes: &[u8]) -> String {
        let path = dir.join("bad.safetensors");
        std::fs::write(&path, bytes).unwrap();
        let e = SafetensorsFile::open(&path).expect_err("must be refused").to_string();
        assert!(e.contains("bad.safetensors"), "{e}");
        e
    }

    #[test]
    fn writes_and_reads_back_every_supported_dtype() {
        let dir = temp_dir("roundtrip");
        let a: Vec<u8> = (0..24).collect();
        let b: Vec<u8> = (0..8).collect();
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let img = serialize(
            &[
                ("a", Dtype::F32, &[2, 3], &a),
                ("b", Dtype::BF16, &[4], &b),
                ("c", Dtype::F16, &[1, 4], &b),
            ],
            &meta,
        )
        .unwrap();
        let path = dir.join("m.safetensors");
        std::fs::write(&path, img).unwrap();
        let f = SafetensorsFile::open(&path).unwrap();
        assert_eq!(f.metadata(), &meta);
        let t = f.tensor("a").unwrap();
        assert_eq!((t.dtype, &t.shape[..], f.data(t)), (Dtype::F32, &[2u64, 3][..], &a[..]));
        let info = t.tensor_info().unwrap();
        assert_eq!((info.dims, info.ty, info.n_bytes), (vec![3, 2], GgmlType::F32, 24));
        assert_eq!(f.data(f.tensor("b").unwrap()), &b[..]);
        assert_eq!(f.tensor("c").unwrap().tensor_info().unwrap().ty, GgmlType::F16);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn malformed_files_are_refused_with_the_reason() {
        let dir = temp_dir("malformed");
        let t = |dtype: &str, shape: &str, offsets: &str| {
            format!(r#"{{"w": {{"dtype": "{dtype}", "shape": {shape}, "data_offsets": {offsets}}}}}"#)
        };
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (vec![1, 2, 3], "shorter than the 8-byte header length"),
            (image("{}", Some(u64::MAX), &[]), "exceeds the limit"),
            (image("{}", Some(1000), &[]), "runs past the end of the file"),
            (image("{not json", None, &[]), "not valid JSON"),
            (image("[1]", None, &[]), "not a JSON object"),
            (image(&t("Q4", "[2]", "[0, 2]"), None, &[0; 2]), "unknown dtype \"Q4\""),
            (image(&t("F32", "[2]", "[0, 4]"), None, &[0; 4]), "needs 8"),
            (image(&t("F32", "[2]", "[0, 8]"), None, &[0; 4]), "outside the data"),
            (image(&t("F32", "[2]", "[8, 0]"), None, &[0; 8]), "outside the data"),
            (image(&t("F32", "[2]", "[0]"), None, &[0; 8]), "not a pair"),
            (
                image(&t("F32", "[4294967296, 4294967296]", "[0, 8]"), None, &[0; 8]),
                "overflows",
            ),
            (
                image(
                    r#"{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}"#,
                    None,
                    &[0; 12],
                ),
                "tensors a and b overlap",
            ),
            (image(r#"{"__metadata__": {"k": 1}}"#, None, &[]), "not a string"),
        ];
        for (bytes, want) in cases {
            let e = open_err(&dir, &bytes);
            assert!(e.contains(want), "expected {want:?} in {e:?}");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn other_dtypes_read_but_are_refused_for_computing() {
        let dir = temp_dir("dtype");
        let path = dir.join("m.safetensors");
        std::fs::write(
            &path,
            serialize(&[("ids", Dtype::I64, &[2], &[0; 16])], &BTreeMap::new()).unwrap(),
        )
        .unwrap();
        let f = SafetensorsFile::open(&path).unwrap();
        let e = f.tensor("ids").unwrap().tensor_info().unwrap_err().to_string();
        assert_eq!(
            e,
            "unsupported dtype I64 for tensor ids (strata reads BF16, F16 and F32)"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sharded_checkpoints_follow_the_index_and_refuse_a_bad_one() {
        let dir = temp_dir("shards");
        let one = serialize(&[("a", Dtype::F32, &[1], &[1, 0, 0, 0])], &BTreeMap::new()).unwrap();
        let two = serialize(&[("b", Dtype::F32, &[1], &[2, 0, 0, 0])], &BTreeMap::new()).unwrap();
        std::fs::write(dir.join("model-00001-of-00002.safetensors"), &one).unwrap();
        std::fs::write(dir.join("model-00002-of-00002.safetensors"), &two).unwrap();
        let write_index = |map: &str| {
            std::fs::write(
                dir.join(INDEX_FILE),
                format!(r#"{{"metadata": {{"total_size": 8}}, "weight_map": {map}}}"#),
            )
            .unwrap()
        };
        write_index(r#"{"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}"#);
        let set = SafetensorsSet::open_dir(&dir).unwrap();
        assert_eq!(set.files().len(), 2);
        let (f, t) = set.get("b").unwrap();
        assert_eq!(f.data(t), &[2, 0, 0, 0]);
        assert!(set.get("c").is_none());

        write_index(r#"{"a": "model-00002-of-00002.safetensors"}"#);
        let e = SafetensorsSet::open_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("puts a in model-00002-of-00002.safetensors"), "{e}");
        write_index(r#"{"a": "../elsewhere.safetensors"}"#);
        let e = SafetensorsSet::open_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("plain file names"), "{e}");
        write_index(r#"{"a": "missing.safetensors"}"#);
        let e = SafetensorsSet::open_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("missing.safetensors"), "{e}");

        // Without an index every *.safetensors file counts, and a tensor in two files is an error.
        std::fs::remove_file(dir.join(INDEX_FILE)).unwrap();
        assert!(SafetensorsSet::open_dir(&dir).unwrap().get("a").is_some());
        std::fs::write(dir.join("extra.safetensors"), &one).unwrap();
        let e = SafetensorsSet::open_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("tensor a is in both"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
        let e = SafetensorsSet::open_dir(&dir).unwrap_err().to_string();
        assert!(e.contains("cannot read"), "{e}");
    }
}
