//! The limits every model-file loader checks a number from a file against before it allocates.
//! Each is far above any released model, so only corrupt or hostile files meet them.

use std::io::Read;
use std::path::Path;

/// Largest `config.json`, `generation_config.json`, `tokenizer_config.json`, chat template or
/// safetensors index read (real ones are kilobytes; a 405B model's index is ~100 KiB).
pub const MAX_JSON_FILE_BYTES: u64 = 16 << 20;
/// Largest `tokenizer.json` read (Gemma 3's, among the largest, is 33 MiB).
pub const MAX_TOKENIZER_FILE_BYTES: u64 = 256 << 20;
/// Most values in all of a GGUF file's metadata arrays together (a 262k-token vocabulary with its
/// scores, types and merges is about 1M). Each costs 32 bytes in memory however few it takes on disk.
pub const MAX_METADATA_VALUES: u64 = 1 << 23;
/// Most transformer blocks (the largest released dense models have 126).
pub const MAX_LAYERS: usize = 4096;
/// Widest embedding (hidden size); released models reach 16384.
pub const MAX_HIDDEN: usize = 1 << 20;
/// Widest feed-forward layer; released models reach 53248.
pub const MAX_INTERMEDIATE: usize = 1 << 22;
/// Most attention heads (query or key/value); released models reach 128.
pub const MAX_HEADS: usize = 1 << 14;
/// Widest attention head.
pub const MAX_HEAD_DIM: usize = 512;
/// Largest vocabulary; released models reach 262144 tokens.
pub const MAX_VOCAB: usize = 1 << 24;
/// Longest context a model may declare; released models reach 10M tokens.
pub const MAX_CONTEXT: usize = 1 << 26;
/// Most ids a `tokenizer.json` may skip (ids past the number of tokens it lists). Tables indexed by
/// id are sized by the largest id, so a lone huge id must not size them.
pub const MAX_TOKEN_ID_GAP: usize = 1 << 16;

/// Most end-of-sequence ids a `config.json` or `generation_config.json` may list (real ones list
/// up to a handful; each is compared with the others).
pub const MAX_STOP_IDS: usize = 1024;
/// Most work deriving SentencePiece merges from a GGUF vocabulary may take: the sum of its tokens'
/// squared lengths in bytes (every split of every token is tried). A 256k-token vocabulary sums
/// to about 10^7; 2^30 takes about a second.
pub const MAX_SPM_SPLIT_WORK: u64 = 1 << 30;

/// Reads the UTF-8 text of `path`, refusing a file longer than `limit` bytes before reading it.
/// The error is an `io::Error` whose message names the limit, for the caller's "cannot read" text.
pub fn read_text_limited(path: &Path, limit: u64) -> std::io::Result<String> {
    let file = std::fs::File::open(path)?;
    let len = file.metadata()?.len();
    if len > limit {
        return Err(too_large(len, limit));
    }
    let mut text = String::with_capacity(len as usize);
    // `take` also bounds a file that grows while it is read.
    file.take(limit + 1).read_to_string(&mut text)?;
    if text.len() as u64 > limit {
        return Err(too_large(text.len() as u64, limit));
    }
    Ok(text)
}

fn too_large(len: u64, limit: u64) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::FileTooLarge,
        format!("the file is {len} bytes, over strata's limit of {limit} bytes for this kind of file"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_text_limited_refuses_a_longer_file_and_reads_one_at_the_limit() {
        let dir = std::env::temp_dir().join(format!("strata-limits-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("f.json");
        std::fs::write(&path, "0123456789").unwrap();
        assert_eq!(read_text_limited(&path, 10).unwrap(), "0123456789");
        let e = read_text_limited(&path, 9).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::FileTooLarge);
        assert_eq!(
            e.to_string(),
            "the file is 10 bytes, over strata's limit of 9 bytes for this kind of file"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
