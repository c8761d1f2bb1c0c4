//! GGUF reader: header, metadata key/values, tensor infos, and memory-mapped tensor data.
//! Every count, length and offset is checked against the file before use, so bad files give errors.

mod metadata;
mod reader;
mod writer;

pub use metadata::{MetaValue, MetaValueType};
pub use reader::{GgufError, GgufFile, TensorInfo};
pub use writer::{GgufLayout, GgufWriter};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Most dimensions a GGML tensor can have.
pub const MAX_DIMS: usize = 4;
