//! The bytes of an opened model file: memory-mapped from disk, or held in memory.
//! Shared by the GGUF and safetensors readers, which validate them before handing any out.

use std::fs::File;
use std::path::Path;

use memmap2::Mmap;

pub(crate) enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    /// Memory-maps the file at `path`.
    pub(crate) fn map(path: &Path) -> std::io::Result<Storage> {
        let file = File::open(path)?;
        // SAFETY: the map is read-only; strata never writes model files while serving them.
        // A file truncated by another process while mapped would fault, as with every mmap reader.
        let map = unsafe { Mmap::map(&file) }?;
        Ok(Storage::Mapped(map))
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}
