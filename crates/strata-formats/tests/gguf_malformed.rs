//! Hand-crafted broken GGUF files, each of which must give one specific `GgufError`, never a panic.
//! A counting allocator checks that hostile counts cannot make the reader allocate much.

use std::time::{Duration, Instant};

use strata_formats::gguf::{GgufError, GgufFile, GgufWriter, MetaValue, MetaValueType};
use strata_formats::GgmlType;
use strata_fuzz::{peak_allocation, CountingAllocator};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

// ---------------------------------------------------------------------------------------------
// A byte-level builder for files the writer would refuse to write.

const F32: u32 = GgmlType::F32 as u32;
const Q4_0: u32 = GgmlType::Q4_0 as u32;
const T_U8: u32 = 0;
const T_U32: u32 = 4;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;

#[derive(Clone)]
struct Raw(Vec<u8>);

impl Raw {
    /// Magic, `version`, tensor count and metadata count.
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw(b"GGUF".to_vec()).u32(version).u64(n_tensors).u64(n_kv)
    }

    fn u8(mut self, v: u8) -> Raw {
        self.0.push(v);
        self
    }

    fn u32(mut self, v: u32) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn u64(mut self, v: u64) -> Raw {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn raw_str(self, s: &[u8]) -> Raw {
        let mut r = self.u64(s.len() as u64);
        r.0.extend_from_slice(s);
        r
    }

    fn str(self, s: &str) -> Raw {
        self.raw_str(s.as_bytes())
    }

    fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key).u32(T_U32).u32(v)
    }

    fn tensor(self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Raw {
        let mut r = self.str(name).u32(dims.len() as u32);
        for &d in dims {
            r = r.u64(d);
        }
        r.u32(ty).u64(offset)
    }

    /// Zero padding to `alignment`, then `n` data bytes.
    fn data(mut self, alignment: usize, n: usize) -> Raw {
        let padded = self.0.len().div_ceil(alignment) * alignment;
        self.0.resize(padded + n, 0xAB);
        self
    }
}

/// Parses `bytes`, which must fail; returns the error after checking it reads as a sentence.
fn fails(bytes: Vec<u8>) -> GgufError {
    let err = GgufFile::from_bytes(bytes).expect_err("a malformed file must not parse");
    let message = err.to_string();
    assert!(
        message.len() > 10 && !message.contains("{"),
        "unreadable message {message:?}"
    );
    err
}

fn reason_of(err: &GgufError) -> &str {
    match err {
        GgufError::BadTensor { reason, .. } | GgufError::BadValue { reason, .. } => reason,
        other => panic!("expected BadTensor or BadValue, got {other:?}"),
    }
}

/// One tensor info for a one-tensor file with enough data behind it.
fn one_tensor(dims: &[u64], ty: u32, offset: u64) -> Vec<u8> {
    Raw::header(3, 1, 0).tensor("t", dims, ty, offset).data(32, 64).0
}

/// A small valid file with metadata of several kinds and three tensors.
fn small_valid_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.add_metadata("general.architecture", MetaValue::String("llama".into()))
        .unwrap();
    w.add_metadata("llama.block_count", MetaValue::U32(2)).unwrap();
    w.add_metadata("general.alignment", MetaValue::U32(16)).unwrap();
    w.add_string_array("tokenizer.ggml.tokens", ["a", "bc", ""]).unwrap();
    let nested = MetaValue::Array(
        MetaValueType::Array,
        vec![MetaValue::Array(
            MetaValueType::Bool,
            vec![MetaValue::Bool(true), MetaValue::Bool(false)],
        )],
    );
    w.add_metadata("nested", nested).unwrap();
    w.add_metadata("f", MetaValue::F64(0.25)).unwrap();
    w.add_tensor("a", &[3], GgmlType::F32, vec![1u8; 12]).unwrap();
    w.add_tensor("b", &[32, 2], GgmlType::Q8_0, vec![2u8; 68]).unwrap();
    w.add_tensor("c", &[5], GgmlType::F16, vec![3u8; 10]).unwrap();
    w.to_bytes()
}

// ---------------------------------------------------------------------------------------------

#[test]
fn empty_file_is_truncated() {
    let err = fails(vec![]);
    assert!(
        matches!(&err, GgufError::Truncated { what, offset: 0, needed: 4, len: 0 } if what == "magic"),
        "{err}"
    );
}

#[test]
fn bad_magic() {
    let mut bytes = small_valid_file();
    bytes[..4].copy_from_slice(b"GGML");
    assert!(matches!(fails(bytes), GgufError::BadMagic(m) if &m == b"GGML"));
    let err = fails(b"\x7fELF\x02\x01\x01\0".to_vec());
    assert!(matches!(err, GgufError::BadMagic(_)));
    assert!(err.to_string().contains("not a GGUF file"));
}

#[test]
fn unsupported_versions() {
    for version in [0, 1, 4, 0x0300_0000, u32::MAX] {
        let mut bytes = small_valid_file();
        bytes[4..8].copy_from_slice(&version.to_le_bytes());
        let err = fails(bytes);
        assert!(matches!(err, GgufError::UnsupportedVersion(v) if v == version), "{err}");
        assert!(err.to_string().contains("versions 2 and 3"));
    }
}

#[test]
fn every_truncation_of_a_small_valid_file_fails_cleanly() {
    let valid = small_valid_file();
    let file = GgufFile::from_bytes(valid.clone()).expect("the full file parses");
    let header_end = file.data_start() as usize;
    let data_end = file
        .tensors()
        .iter()
        .map(|t| file.data_start() + t.offset + t.n_bytes)
        .max()
        .unwrap() as usize;
    // Only the padding after the last tensor may be cut without harm.
    for len in data_end..valid.len() {
        assert_eq!(GgufFile::from_bytes(valid[..len].to_vec()).unwrap().tensors().len(), 3);
    }
    for len in 0..data_end {
        let err = fails(valid[..len].to_vec());
        match &err {
            GgufError::Truncated { len: l, .. } => assert_eq!(*l, len as u64),
            // A cut inside a list is caught by the count check before the list is read.
            GgufError::AbsurdCount { len: l, .. } => assert_eq!(*l, len as u64),
            GgufError::BadTensor { reason, .. } if len >= header_end => {
                assert!(reason.contains("past the end"))
            }
            other => panic!("truncated to {len} bytes: unexpected {other:?}"),
        }
    }
}

#[test]
fn absurd_tensor_and_metadata_counts() {
    for count in [u64::MAX, 1 << 40, 1 << 62, 1_000_000] {
        let err = fails(Raw::header(3, count, 0).0);
        assert!(matches!(&err, GgufError::AbsurdCount { what, count: c, .. } if what == "tensor count" && *c == count));
        let err = fails(Raw::header(3, 0, count).0);
        assert!(
            matches!(&err, GgufError::AbsurdCount { what, count: c, .. } if what == "metadata count" && *c == count)
        );
        assert!(err.to_string().contains("impossible"));
    }
}

#[test]
fn absurd_string_lengths() {
    // Metadata key.
    let err = fails(Raw::header(3, 0, 1).u64(u64::MAX).u32(T_U8).u8(0).0);
    assert!(
        matches!(&err, GgufError::Truncated { what, needed: u64::MAX, .. } if what == "metadata key #0"),
        "{err}"
    );
    // String value.
    let err = fails(Raw::header(3, 0, 1).str("k").u32(T_STRING).u64(1 << 40).0);
    assert!(
        matches!(&err, GgufError::Truncated { needed, .. } if *needed == 1 << 40),
        "{err}"
    );
    // String inside an array.
    let err = fails(
        Raw::header(3, 0, 1)
            .str("k")
            .u32(T_ARRAY)
            .u32(T_STRING)
            .u64(1)
            .u64(u64::MAX - 7)
            .0,
    );
    assert!(matches!(&err, GgufError::Truncated { .. }), "{err}");
    // Tensor name.
    let err = fails(Raw::header(3, 1, 0).u64(1 << 50).u32(1).u64(1).u32(F32).u64(0).0);
    assert!(
        matches!(&err, GgufError::Truncated { what, .. } if what == "tensor name #0"),
        "{err}"
    );
}

#[test]
fn absurd_array_lengths() {
    for (elem, count) in [
        (T_U8, 1u64 << 60),
        (T_U8, u64::MAX),
        (T_STRING, u64::MAX / 4),
        (T_ARRAY, 1 << 62),
    ] {
        let bytes = Raw::header(3, 0, 1)
            .str("arr")
            .u32(T_ARRAY)
            .u32(elem)
            .u64(count)
            .u8(0)
            .0;
        let start = Instant::now();
        let (result, peak) = peak_allocation(|| GgufFile::from_bytes(bytes));
        let err = result.unwrap_err();
        assert!(
            matches!(&err, GgufError::AbsurdCount { what, count: c, .. } if what.contains("\"arr\"") && *c == count),
            "{err}"
        );
        assert!(start.elapsed() < Duration::from_secs(1));
        assert!(peak < 64 * 1024, "an absurd array length allocated {peak} bytes");
    }
}

#[test]
fn metadata_arrays_past_the_value_limit_are_refused_before_they_cost_32_bytes_a_byte() {
    use strata_formats::limits::MAX_METADATA_VALUES;
    // Two arrays of one-byte values that together pass the limit by one; every byte is in the
    // file, so only the limit stops them (each value would take 32 bytes in memory: 256 MiB).
    let half = MAX_METADATA_VALUES / 2;
    let mut bytes = Raw::header(3, 0, 2).str("a").u32(T_ARRAY).u32(T_U8).u64(half).0;
    bytes.resize(bytes.len() + half as usize, 7);
    let mut bytes = Raw(bytes).str("b").u32(T_ARRAY).u32(T_U8).u64(half + 1).0;
    bytes.resize(bytes.len() + half as usize + 1, 7);
    let len = bytes.len();
    let (result, peak) = peak_allocation(|| GgufFile::from_bytes(bytes));
    let err = result.unwrap_err();
    assert!(matches!(&err, GgufError::TooManyValues { key } if key == "b"), "{err}");
    assert!(err.to_string().contains("more than 8388608 values in all"), "{err}");
    assert!(peak < 40 * len, "{peak} bytes for a {len}-byte file");
}

#[test]
fn unknown_metadata_value_types() {
    for id in [13, 14, 255, u32::MAX] {
        let err = fails(Raw::header(3, 0, 1).str("key").u32(id).u64(0).0);
        assert!(
            matches!(&err, GgufError::UnknownValueType { key, id: i } if key == "key" && *i == id),
            "{err}"
        );
        let err = fails(Raw::header(3, 0, 1).str("arr").u32(T_ARRAY).u32(id).u64(0).0);
        assert!(
            matches!(&err, GgufError::UnknownValueType { key, id: i } if key == "arr" && *i == id),
            "{err}"
        );
    }
}

#[test]
fn unknown_tensor_type_ids() {
    // 4 and 5 were Q4_2 and Q4_3, long removed from GGML.
    for id in [4, 5, 31, 99, u32::MAX] {
        let err = fails(one_tensor(&[32], id, 0));
        assert!(
            reason_of(&err).contains(&format!("unknown tensor type id {id}")),
            "{err}"
        );
    }
}

#[test]
fn dimension_counts_zero_and_five() {
    let err = fails(one_tensor(&[], F32, 0));
    assert!(reason_of(&err).contains("0 dimensions"), "{err}");
    let err = fails(one_tensor(&[1, 1, 1, 1, 1], F32, 0));
    assert!(reason_of(&err).contains("5 dimensions"), "{err}");
    let err = fails(Raw::header(3, 1, 0).str("t").u32(u32::MAX).data(32, 64).0);
    assert!(reason_of(&err).contains("dimensions"), "{err}");
}

#[test]
fn dimension_product_overflows() {
    let err = fails(one_tensor(&[1 << 32, 1 << 32, 2], F32, 0));
    assert!(reason_of(&err).contains("overflow"), "{err}");
    let err = fails(one_tensor(&[u64::MAX, u64::MAX], F32, 0));
    assert!(reason_of(&err).contains("overflow"), "{err}");
    // The element count fits, its size in bytes does not.
    let err = fails(one_tensor(&[1 << 62, 2], F32, 0));
    assert!(reason_of(&err).contains("overflows"), "{err}");
}

#[test]
fn zero_dimensions() {
    for dims in [&[0u64][..], &[4, 0], &[0, 4, 4, 4]] {
        let err = fails(one_tensor(dims, F32, 0));
        assert!(reason_of(&err).contains("zero dimension"), "{dims:?}: {err}");
    }
}

#[test]
fn row_length_not_a_whole_number_of_blocks() {
    let err = fails(one_tensor(&[33, 1], Q4_0, 0));
    assert!(
        reason_of(&err).contains("row length 33 is not a multiple of the Q4_0 block size 32"),
        "{err}"
    );
    let err = fails(one_tensor(&[128], GgmlType::Q4K as u32, 0));
    assert!(reason_of(&err).contains("block size 256"), "{err}");
}

#[test]
fn misaligned_offset() {
    for offset in [1, 4, 31] {
        let err = fails(one_tensor(&[4], F32, offset));
        assert!(reason_of(&err).contains("is not aligned to 32"), "{err}");
    }
}

#[test]
fn data_past_the_end() {
    // Offset past the end.
    let err = fails(one_tensor(&[4], F32, 64));
    assert!(reason_of(&err).contains("past the end"), "{err}");
    // Offset so large that offset + size overflows.
    let err = fails(one_tensor(&[4], F32, !31u64));
    assert!(reason_of(&err).contains("past the end"), "{err}");
    // Size past the end.
    let err = fails(one_tensor(&[17], F32, 0));
    assert!(reason_of(&err).contains("past the end"), "{err}");
    // The data section itself is missing: tensor infos end mid-way through the alignment.
    let err = fails(Raw::header(3, 1, 0).tensor("t", &[1], F32, 0).0);
    assert!(
        matches!(&err, GgufError::Truncated { what, .. } if what == "tensor data section"),
        "{err}"
    );
}

#[test]
fn overlapping_tensors() {
    let bytes = Raw::header(3, 2, 0)
        .tensor("a", &[16], F32, 0)
        .tensor("b", &[4], F32, 32)
        .data(32, 128)
        .0;
    let err = fails(bytes);
    assert!(
        matches!(&err, GgufError::OverlappingTensors { a, b } if a == "a" && b == "b"),
        "{err}"
    );
    let bytes = Raw::header(3, 2, 0)
        .tensor("a", &[4], F32, 0)
        .tensor("b", &[4], F32, 0)
        .data(32, 128)
        .0;
    assert!(matches!(fails(bytes), GgufError::OverlappingTensors { .. }));
    // Touching is fine.
    let bytes = Raw::header(3, 2, 0)
        .tensor("a", &[8], F32, 0)
        .tensor("b", &[8], F32, 32)
        .data(32, 64)
        .0;
    GgufFile::from_bytes(bytes).unwrap();
}

#[test]
fn duplicates() {
    let err = fails(Raw::header(3, 0, 2).kv_u32("k", 1).kv_u32("k", 2).0);
    assert!(matches!(&err, GgufError::DuplicateKey(k) if k == "k"), "{err}");
    let bytes = Raw::header(3, 2, 0)
        .tensor("t", &[4], F32, 0)
        .tensor("t", &[4], F32, 32)
        .data(32, 64)
        .0;
    let err = fails(bytes);
    assert!(matches!(&err, GgufError::DuplicateTensor(n) if n == "t"), "{err}");
}

#[test]
fn bad_alignment_values() {
    for alignment in [0u32, 3, 48, 1 << 31] {
        let err = fails(Raw::header(3, 0, 1).kv_u32("general.alignment", alignment).0);
        assert!(
            matches!(err, GgufError::BadAlignment(a) if a == alignment as u64),
            "{err}"
        );
    }
    let err = fails(Raw::header(3, 0, 1).str("general.alignment").u32(T_STRING).str("32").0);
    assert!(matches!(err, GgufError::BadAlignment(0)), "{err}");
    let err = fails(Raw::header(3, 0, 1).str("general.alignment").u32(T_U64).u64(1 << 40).0);
    assert!(matches!(err, GgufError::BadAlignment(a) if a == 1 << 40), "{err}");
}

#[test]
fn invalid_utf8() {
    let err = fails(Raw::header(3, 0, 1).raw_str(b"ke\xffy").u32(T_U8).u8(0).0);
    assert!(
        matches!(&err, GgufError::BadUtf8 { what } if what == "metadata key #0"),
        "{err}"
    );
    let err = fails(Raw::header(3, 0, 1).str("k").u32(T_STRING).raw_str(b"\xc3\x28").0);
    assert!(
        matches!(&err, GgufError::BadUtf8 { what } if what.contains("\"k\"")),
        "{err}"
    );
    let err = fails(
        Raw::header(3, 1, 0)
            .raw_str(b"\xed\xa0\x80")
            .u32(1)
            .u64(4)
            .u32(F32)
            .u64(0)
            .data(32, 16)
            .0,
    );
    assert!(
        matches!(&err, GgufError::BadUtf8 { what } if what == "tensor name #0"),
        "{err}"
    );
}

#[test]
fn bool_that_is_neither_0_nor_1() {
    for byte in [2u8, 0xFF] {
        let err = fails(Raw::header(3, 0, 1).str("flag").u32(T_BOOL).u8(byte).0);
        assert!(
            matches!(&err, GgufError::BadValue { key, .. } if key == "flag"),
            "{err}"
        );
        assert!(reason_of(&err).contains(&format!("bool holds {byte}")));
        let err = fails(
            Raw::header(3, 0, 1)
                .str("flags")
                .u32(T_ARRAY)
                .u32(T_BOOL)
                .u64(3)
                .u8(1)
                .u8(0)
                .u8(byte)
                .0,
        );
        assert!(
            matches!(&err, GgufError::BadValue { key, .. } if key == "flags"),
            "{err}"
        );
    }
}

/// `depth` arrays nested inside each other, the innermost empty.
fn nested_arrays(depth: usize) -> Vec<u8> {
    let mut r = Raw::header(3, 0, 1).str("deep").u32(T_ARRAY);
    for _ in 1..depth {
        r = r.u32(T_ARRAY).u64(1);
    }
    r.u32(T_U8).u64(0).0
}

#[test]
fn nesting_too_deep() {
    let file = GgufFile::from_bytes(nested_arrays(4)).unwrap();
    assert!(file.get_array("deep").is_some());
    for depth in [5, 6, 1000] {
        let err = fails(nested_arrays(depth));
        assert!(
            matches!(&err, GgufError::NestingTooDeep { key } if key == "deep"),
            "{err}"
        );
    }
}

#[test]
fn missing_file_is_an_io_error() {
    let err = GgufFile::open("/nonexistent/strata/model.gguf").unwrap_err();
    assert!(
        matches!(&err, GgufError::Io { path, .. } if path.ends_with("model.gguf")),
        "{err}"
    );
    assert!(err.to_string().contains("/nonexistent/strata/model.gguf"));
}

/// A claimed count that the file is long enough for must not be trusted for preallocation:
/// memory should follow what is actually read, not what the header promises.
#[test]
fn claimed_counts_do_not_drive_allocation() {
    const FILE_LEN: usize = 16 << 20;
    let pad = |mut bytes: Vec<u8>| {
        bytes.resize(FILE_LEN, 2);
        bytes
    };
    let cases = [
        // An array of 16 M bools whose first element is invalid.
        (
            "bool array",
            pad(Raw::header(3, 0, 1)
                .str("b")
                .u32(T_ARRAY)
                .u32(T_BOOL)
                .u64(FILE_LEN as u64 - 64)
                .0),
        ),
        // A million metadata entries, the first of which has an unknown type.
        ("metadata count", pad(Raw::header(3, 0, 1 << 20).str("k").u32(99).0)),
        // Half a million tensors, the first of which has no dimensions.
        ("tensor count", pad(Raw::header(3, 1 << 19, 0).str("t").u32(0).0)),
    ];
    for (what, bytes) in cases {
        let (result, peak) = peak_allocation(|| GgufFile::from_bytes(bytes));
        assert!(result.is_err(), "{what}");
        assert!(
            peak < 1 << 20,
            "{what}: parsing a {FILE_LEN}-byte file peaked at {peak} bytes allocated"
        );
    }
}

#[test]
fn trailing_bytes_after_the_data_are_ignored() {
    let mut bytes = small_valid_file();
    bytes.extend_from_slice(&[0xEE; 100]);
    assert_eq!(GgufFile::from_bytes(bytes).unwrap().tensors().len(), 3);
}
