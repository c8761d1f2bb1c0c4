//! Property test: the header of the real default model, mutated at random, never makes the reader
//! panic, and whatever it accepts has every tensor's data inside the buffer.
//!
//! The images are rewritten with `GgufWriter`: the model's full metadata and all 272 tensor infos
//! (same names, types and ranks) but one block of fake data per tensor, so a case parses in
//! microseconds. `PROPTEST_CASES` sets the number of cases of the main property (default 6000);
//! the property over the full-size tokenizer runs a fortieth of that, as each case parses 1.8 MB.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use strata_formats::gguf::{GgufFile, GgufWriter, MetaValue};

const DEFAULT_MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const DEFAULT_CASES: u32 = 6000;

/// The default model in the strata cache (`$STRATA_CACHE`, else `~/.cache/strata`).
fn default_model_path() -> PathBuf {
    let cache = match std::env::var_os("STRATA_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/strata"),
    };
    let path = cache.join("models").join(DEFAULT_MODEL);
    assert!(path.is_file(), "{} is missing: run `make fetch` first", path.display());
    path
}

/// Number of cases of the main property: `PROPTEST_CASES` if set, else `DEFAULT_CASES`.
fn main_cases() -> u32 {
    match std::env::var("PROPTEST_CASES") {
        Ok(v) => v.parse().expect("PROPTEST_CASES is a number"),
        Err(_) => DEFAULT_CASES,
    }
}

/// A valid image to mutate, and where its parts lie.
struct BaseImage {
    bytes: Vec<u8>,
    tensor_infos_start: usize,
    data_start: usize,
}

/// The default model's metadata and tensor infos with one block of data per tensor.
/// Arrays longer than `max_array_len` (the tokenizer) are cut to that length.
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
        // Same rank and type, one block of values.
        let mut dims = vec![1u64; t.dims.len()];
        dims[0] = t.ty.block_len() as u64;
        let data: Vec<u8> = (0..t.ty.block_bytes()).map(|j| (i * 31 + j * 7) as u8).collect();
        w.add_tensor(t.name.clone(), &dims, t.ty, data).unwrap();
    }
    let layout = w.layout();
    let bytes = w.to_bytes();
    let parsed = GgufFile::from_bytes(bytes.clone()).expect("the base image is valid");
    assert_eq!(parsed.tensors().len(), 272);
    BaseImage {
        bytes,
        tensor_infos_start: layout.tensor_infos_start as usize,
        data_start: layout.data_start as usize,
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

/// One edit of the image. Positions past the end are taken modulo the current length.
#[derive(Debug, Clone)]
enum Mutation {
    FlipBit {
        at: usize,
        bit: u8,
    },
    SetByte {
        at: usize,
        byte: u8,
    },
    /// Overwrite with (the first bytes of) a little-endian integer such as a count or length.
    Overwrite {
        at: usize,
        bytes: Vec<u8>,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Remove {
        at: usize,
        len: usize,
    },
    Truncate {
        len: usize,
    },
}

impl Mutation {
    fn apply(&self, image: &mut Vec<u8>) {
        let pos = |at: usize, len: usize| if len == 0 { 0 } else { at % len };
        match self {
            Mutation::FlipBit { at, bit } if !image.is_empty() => {
                let i = pos(*at, image.len());
                image[i] ^= 1 << bit;
            }
            Mutation::SetByte { at, byte } if !image.is_empty() => {
                let i = pos(*at, image.len());
                image[i] = *byte;
            }
            Mutation::Overwrite { at, bytes } => {
                let i = pos(*at, image.len());
                let end = (i + bytes.len()).min(image.len());
                image[i..end].copy_from_slice(&bytes[..end - i]);
            }
            Mutation::Insert { at, bytes } => {
                let i = pos(*at, image.len() + 1);
                image.splice(i..i, bytes.iter().copied());
            }
            Mutation::Remove { at, len } => {
                let i = pos(*at, image.len());
                let end = (i + len).min(image.len());
                image.drain(i..end);
            }
            Mutation::Truncate { len } => image.truncate(*len),
            _ => {}
        }
    }
}

/// Positions biased towards the header, the first metadata, and the tensor infos.
fn position(base: &BaseImage) -> BoxedStrategy<usize> {
    prop_oneof![
        3 => 0..64usize,
        2 => 0..4096usize,
        5 => base.tensor_infos_start..base.data_start,
        1 => 0..base.bytes.len(),
    ]
    .boxed()
}

/// Integers a corrupt count, length, type id or offset is likely to hold.
fn interesting_integer() -> impl Strategy<Value = Vec<u8>> {
    let value = prop_oneof![
        Just(0u64),
        Just(1),
        Just(2),
        Just(5),
        Just(31),
        Just(32),
        Just(1 << 31),
        Just(1 << 32),
        Just(1 << 40),
        Just(1 << 60),
        Just(u64::MAX),
        Just(u64::MAX - 31),
        any::<u64>(),
    ];
    (value, prop_oneof![Just(1usize), Just(2), Just(4), Just(8)])
        .prop_map(|(v, width)| v.to_le_bytes()[..width].to_vec())
}

fn mutation(base: &BaseImage) -> BoxedStrategy<Mutation> {
    let byte = prop_oneof![Just(0x00u8), Just(0xFF), any::<u8>()];
    let truncate_len = prop_oneof![
        2 => 0..base.data_start + 64,
        2 => base.data_start..base.bytes.len(),
        1 => 0..base.bytes.len(),
    ];
    prop_oneof![
        3 => (position(base), 0..8u8).prop_map(|(at, bit)| Mutation::FlipBit { at, bit }),
        3 => (position(base), byte).prop_map(|(at, byte)| Mutation::SetByte { at, byte }),
        3 => (position(base), interesting_integer()).prop_map(|(at, bytes)| Mutation::Overwrite { at, bytes }),
        1 => (position(base), proptest::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        1 => (position(base), 1..16usize).prop_map(|(at, len)| Mutation::Remove { at, len }),
        2 => truncate_len.prop_map(|len| Mutation::Truncate { len }),
    ]
    .boxed()
}

/// Parses `image`; an error is fine, an accepted file must be consistent and inside the buffer.
fn check(image: Vec<u8>) -> Result<bool, TestCaseError> {
    let len = image.len() as u64;
    let file = match GgufFile::from_bytes(image) {
        Ok(file) => file,
        Err(err) => {
            prop_assert!(!err.to_string().is_empty());
            return Ok(false);
        }
    };
    prop_assert!(file.version == 2 || file.version == 3);
    prop_assert!(file.alignment.is_power_of_two());
    prop_assert_eq!(file.data_start() % file.alignment, 0);
    for (key, value) in file.metadata() {
        prop_assert!(file.get(key).is_some());
        let _ = value.to_string();
    }
    let mut ranges = Vec::with_capacity(file.tensors().len());
    for t in file.tensors() {
        let start = file.data_start().checked_add(t.offset);
        let end = start.and_then(|s| s.checked_add(t.n_bytes));
        prop_assert!(
            end.is_some_and(|e| e <= len),
            "tensor {} lies outside the {len}-byte buffer",
            t.name
        );
        prop_assert_eq!(file.tensor_data(t).len() as u64, t.n_bytes);
        prop_assert_eq!(t.offset % file.alignment, 0);
        prop_assert!((1..=4).contains(&t.dims.len()));
        prop_assert_eq!(
            Some(t.n_elements),
            t.dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d))
        );
        prop_assert_eq!(file.tensor(&t.name), Some(t));
        ranges.push((t.offset, t.offset + t.n_bytes));
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        prop_assert!(pair[0].1 <= pair[1].0, "accepted overlapping tensors");
    }
    Ok(true)
}

/// Runs `cases` mutated copies of `base` through `check`, and reports how many were accepted.
fn run_mutations(name: &str, base: &BaseImage, cases: u32) {
    let config = Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    };
    let mut runner = TestRunner::new(config);
    let accepted = AtomicUsize::new(0);
    let started = Instant::now();
    let strategy = proptest::collection::vec(mutation(base), 1..=4);
    let result = runner.run(&strategy, |mutations| {
        let mut image = base.bytes.clone();
        for m in &mutations {
            m.apply(&mut image);
        }
        if check(image)? {
            accepted.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    if let Err(failure) = result {
        panic!("{name}: {failure}");
    }
    let accepted = accepted.into_inner();
    eprintln!(
        "{name}: {cases} cases on a {}-byte image in {:.1?}, {accepted} accepted",
        base.bytes.len(),
        started.elapsed()
    );
    // Some mutations (in string bytes, padding or data) leave a valid file; the test must reach
    // the acceptance checks, not only the error paths.
    if cases >= 100 {
        assert!(accepted > 0, "{name}: no mutated image was accepted");
        assert!(accepted < cases as usize, "{name}: every mutated image was accepted");
    }
}

#[test]
fn mutated_model_header_never_panics() {
    run_mutations("small tokenizer", small_base(), main_cases());
}

#[test]
fn mutated_full_model_header_never_panics() {
    run_mutations("full tokenizer", full_base(), (main_cases() / 40).max(1));
}
