//! Fuzz targets of the file readers (GGUF and safetensors), driven by `strata-fuzz`: mutated
//! images never panic, allocate in proportion to their size, and what is accepted is consistent.
//!
//! `make test` runs each target's default cases from seed 0; `make fuzz` runs each for
//! `STRATA_FUZZ_SECONDS` from a fresh seed. Inputs that once failed live in
//! `tests/fuzz_regressions/<target>/` and are replayed first.

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use common::default_model_path;
use proptest::prelude::{prop_oneof, Strategy};
use serde_json::Value;
use strata_formats::gguf::{GgufFile, GgufWriter, MetaValue};
use strata_formats::safetensors::{serialize, Dtype, SafetensorsFile};
use strata_fuzz::{
    fuzz, json_mutated, mutated, regressions_dir, replay_dir, Bounds, CountingAllocator, Outcome, Target,
};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// A GGUF image keeps at most 32 bytes of metadata values per byte it parsed (a one-byte array
/// element becomes a 32-byte value), plus the copy of the image the reader owns.
const GGUF_BOUNDS: Bounds = Bounds {
    bytes_per_input_byte: 40,
    fixed_bytes: 1 << 20,
    time: Duration::from_secs(2),
};

const GGUF_SMALL: Target = Target {
    name: "gguf_small_tokenizer",
    default_cases: 6000,
    bounds: GGUF_BOUNDS,
};

const GGUF_FULL: Target = Target {
    name: "gguf_full_tokenizer",
    default_cases: 150,
    bounds: GGUF_BOUNDS,
};

/// The JSON header parses into a few times its size; the image is copied once.
const SAFETENSORS: Target = Target {
    name: "safetensors",
    default_cases: 20000,
    bounds: Bounds {
        bytes_per_input_byte: 64,
        fixed_bytes: 1 << 20,
        time: Duration::from_secs(2),
    },
};

/// A valid image to mutate, and where its metadata and tensor infos lie.
struct BaseImage {
    bytes: Arc<Vec<u8>>,
    metadata: std::ops::Range<usize>,
    tensor_infos: std::ops::Range<usize>,
}

/// The default model's metadata and all its tensor infos (same names, types and ranks) with one
/// block of data per tensor, so a case parses in microseconds. Arrays longer than
/// `max_array_len` (the tokenizer) are cut to that length.
fn base_image(max_array_len: usize) -> BaseImage {
    let model = GgufFile::open(default_model_path()).unwrap();
    let mut w = GgufWriter::with_version(model.version).unwrap();
    for (key, value) in model.metadata() {
        let value = match value {
            MetaValue::Array(ty, items) if items.len() > max_array_len => {
                MetaValue::Array(*ty, items[..max_array_len].to_vec())
            }
            other => other.clone(),
        };
        w.add_metadata(key.clone(), value).unwrap();
    }
    for (i, t) in model.tensors().iter().enumerate() {
        let mut dims = vec![1u64; t.dims.len()];
        dims[0] = t.ty.block_len() as u64;
        let data: Vec<u8> = (0..t.ty.block_bytes()).map(|j| (i * 31 + j * 7) as u8).collect();
        w.add_tensor(t.name.clone(), &dims, t.ty, data).unwrap();
    }
    let layout = w.layout();
    let bytes = w.to_bytes();
    assert_eq!(GgufFile::from_bytes(bytes.clone()).unwrap().tensors().len(), 272);
    let (meta, infos, data) = (
        layout.metadata_start as usize,
        layout.tensor_infos_start as usize,
        layout.data_start as usize,
    );
    BaseImage {
        bytes: Arc::new(bytes),
        // The header's counts and the first keys, where most parsing decisions are made.
        metadata: 0..(meta + 4096).min(infos),
        tensor_infos: infos..data,
    }
}

fn small_base() -> &'static BaseImage {
    static BASE: OnceLock<BaseImage> = OnceLock::new();
    BASE.get_or_init(|| base_image(64))
}

fn full_base() -> &'static BaseImage {
    static BASE: OnceLock<BaseImage> = OnceLock::new();
    BASE.get_or_init(|| base_image(usize::MAX))
}

/// Parses a GGUF image; an accepted file must be consistent and keep every tensor in the buffer.
fn check_gguf(image: &[u8]) -> Outcome {
    let len = image.len() as u64;
    let file = match GgufFile::from_bytes(image.to_vec()) {
        Ok(file) => file,
        Err(err) => {
            assert!(!err.to_string().is_empty());
            return Outcome::Refused;
        }
    };
    assert!(file.version == 2 || file.version == 3);
    assert!(file.alignment.is_power_of_two());
    assert_eq!(file.data_start() % file.alignment, 0);
    for (key, value) in file.metadata() {
        assert!(file.get(key).is_some());
        let _ = value.to_string();
    }
    let mut ranges = Vec::with_capacity(file.tensors().len());
    for t in file.tensors() {
        let end = file
            .data_start()
            .checked_add(t.offset)
            .and_then(|s| s.checked_add(t.n_bytes));
        assert!(
            end.is_some_and(|e| e <= len),
            "tensor {} lies outside the buffer",
            t.name
        );
        assert_eq!(file.tensor_data(t).len() as u64, t.n_bytes);
        assert_eq!(t.offset % file.alignment, 0);
        assert!((1..=4).contains(&t.dims.len()));
        assert_eq!(
            Some(t.n_elements),
            t.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
        );
        assert_eq!(file.tensor(&t.name), Some(t));
        ranges.push((t.offset, t.offset + t.n_bytes));
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        assert!(pair[0].1 <= pair[1].0, "accepted overlapping tensors");
    }
    Outcome::Accepted
}

fn fuzz_gguf(target: Target, base: &BaseImage) {
    replay_dir(
        target,
        &regressions_dir(env!("CARGO_MANIFEST_DIR"), &target),
        check_gguf,
    );
    let hot = [base.metadata.clone(), base.tensor_infos.clone()];
    fuzz(target, mutated(Arc::clone(&base.bytes), &hot), check_gguf);
}

#[test]
fn gguf_reader_with_a_small_tokenizer() {
    fuzz_gguf(GGUF_SMALL, small_base());
}

#[test]
fn gguf_reader_with_the_full_tokenizer() {
    fuzz_gguf(GGUF_FULL, full_base());
}

/// A small safetensors image of every dtype strata computes with and one it only reads.
fn safetensors_seed() -> (Value, Vec<u8>) {
    let a: Vec<u8> = (0..24).collect();
    let b: Vec<u8> = (0..8).collect();
    let ids: Vec<u8> = (0..16).collect();
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    let image = serialize(
        &[
            ("model.embed_tokens.weight", Dtype::F32, &[2, 3], &a),
            ("model.norm.weight", Dtype::BF16, &[4], &b),
            ("model.layers.0.mlp.up_proj.weight", Dtype::F16, &[2, 2], &b),
            ("position_ids", Dtype::I64, &[2], &ids),
        ],
        &meta,
    )
    .unwrap();
    let header_len = u64::from_le_bytes(image[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&image[8..8 + header_len]).unwrap();
    (header, image[8 + header_len..].to_vec())
}

/// Reads a safetensors image; an accepted file must keep every tensor in the buffer, and every
/// tensor strata computes with must describe its bytes exactly.
fn check_safetensors(image: &[u8]) -> Outcome {
    let file = match SafetensorsFile::from_bytes("fuzz.safetensors", image.to_vec()) {
        Ok(file) => file,
        Err(err) => {
            assert!(err.to_string().starts_with("fuzz.safetensors: "), "{err}");
            return Outcome::Refused;
        }
    };
    let mut previous_end = 0;
    for t in file.tensors() {
        assert!(t.begin >= previous_end, "accepted overlapping tensors");
        previous_end = t.end;
        assert_eq!(file.data(t).len() as u64, t.end - t.begin);
        assert_eq!(file.tensor(&t.name).map(|x| &x.name), Some(&t.name));
        if let Ok(info) = t.tensor_info() {
            assert_eq!(info.n_bytes, info.ty.bytes_for(info.n_elements).unwrap());
        }
    }
    Outcome::Accepted
}

/// A safetensors image of a header and the data after it.
fn image_of(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut image = (header.len() as u64).to_le_bytes().to_vec();
    image.extend_from_slice(header);
    image.extend_from_slice(data);
    image
}

#[test]
fn safetensors_reader() {
    replay_dir(
        SAFETENSORS,
        &regressions_dir(env!("CARGO_MANIFEST_DIR"), &SAFETENSORS),
        check_safetensors,
    );
    let (header, data) = safetensors_seed();
    let seed_image = Arc::new(image_of(header.to_string().as_bytes(), &data));
    // Header edits written back with their true length, or byte edits of the whole image
    // (which also reach the length field and the data).
    let header_edits = json_mutated(Arc::new(header)).prop_map(move |header| image_of(&header, &data));
    let byte_edits = mutated(Arc::clone(&seed_image), &[0..8, 8..seed_image.len()]);
    fuzz(
        SAFETENSORS,
        prop_oneof![3 => header_edits, 1 => byte_edits],
        check_safetensors,
    );
}
