//! Round trips GgufWriter -> GgufFile for every metadata type, tensor layout and alignment,
//! what the writer refuses, and the real default model read through the memory-mapped path.

mod common;

use common::default_model_path;
use strata_formats::gguf::{GgufError, GgufFile, GgufWriter, MetaValue, MetaValueType, TensorInfo};
use strata_formats::GgmlType;

/// Deterministic filler bytes, different for each `seed`.
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn arr(ty: MetaValueType, items: Vec<MetaValue>) -> MetaValue {
    MetaValue::Array(ty, items)
}

/// One entry of every value type, with edge values, nested and empty arrays.
fn every_metadata_type() -> Vec<(String, MetaValue)> {
    use MetaValue as V;
    use MetaValueType as T;
    let entries = vec![
        ("general.architecture", V::String("llama".into())),
        ("t.u8", V::U8(u8::MAX)),
        ("t.i8", V::I8(i8::MIN)),
        ("t.u16", V::U16(u16::MAX)),
        ("t.i16", V::I16(i16::MIN)),
        ("t.u32", V::U32(u32::MAX)),
        ("t.i32", V::I32(i32::MIN)),
        ("t.f32", V::F32(-1.5e-7)),
        ("t.f32_inf", V::F32(f32::INFINITY)),
        ("t.bool_true", V::Bool(true)),
        ("t.bool_false", V::Bool(false)),
        ("t.string", V::String("héllo, wörld ✓ 🦀".into())),
        ("t.string_empty", V::String(String::new())),
        ("t.string_long", V::String("ü".repeat(300))),
        ("t.u64", V::U64(u64::MAX)),
        ("t.i64", V::I64(i64::MIN)),
        ("t.f64", V::F64(std::f64::consts::PI)),
        ("t.f64_neg_zero", V::F64(-0.0)),
        ("t.arr_u8", arr(T::U8, vec![V::U8(0), V::U8(1), V::U8(255)])),
        ("t.arr_i8", arr(T::I8, vec![V::I8(-128), V::I8(127)])),
        ("t.arr_u16", arr(T::U16, vec![V::U16(7)])),
        ("t.arr_i16", arr(T::I16, vec![V::I16(-7), V::I16(300)])),
        ("t.arr_u32", arr(T::U32, (0..100).map(V::U32).collect())),
        ("t.arr_i32", arr(T::I32, vec![V::I32(-1), V::I32(i32::MAX)])),
        ("t.arr_f32", arr(T::F32, vec![V::F32(0.5), V::F32(-2.0)])),
        (
            "t.arr_bool",
            arr(T::Bool, vec![V::Bool(true), V::Bool(false), V::Bool(true)]),
        ),
        (
            "t.arr_string",
            arr(
                T::String,
                vec![V::String("a".into()), V::String(String::new()), V::String("ç".into())],
            ),
        ),
        ("t.arr_u64", arr(T::U64, vec![V::U64(u64::MAX), V::U64(0)])),
        ("t.arr_i64", arr(T::I64, vec![V::I64(i64::MIN)])),
        ("t.arr_f64", arr(T::F64, vec![V::F64(1e300), V::F64(-1e-300)])),
        ("t.arr_empty_u8", arr(T::U8, vec![])),
        ("t.arr_empty_string", arr(T::String, vec![])),
        ("t.arr_empty_array", arr(T::Array, vec![])),
        (
            "t.arr_of_arr",
            arr(
                T::Array,
                vec![
                    arr(T::U32, vec![V::U32(1), V::U32(2)]),
                    arr(T::String, vec![V::String("x".into())]),
                    arr(T::Bool, vec![]),
                ],
            ),
        ),
        (
            "t.arr_nested_4",
            arr(
                T::Array,
                vec![arr(T::Array, vec![arr(T::Array, vec![arr(T::I16, vec![V::I16(-3)])])])],
            ),
        ),
    ];
    entries.into_iter().map(|(k, v)| (k.to_string(), v)).collect()
}

/// Tensors of several types and ranks, with distinct data.
fn some_tensors() -> Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> {
    let shapes: Vec<(&str, Vec<u64>, GgmlType)> = vec![
        ("token_embd.weight", vec![64, 3], GgmlType::Q8_0),
        ("blk.0.attn_norm.weight", vec![7], GgmlType::F32),
        ("blk.0.ffn_down.weight", vec![256, 2], GgmlType::Q4K),
        ("blk.0.attn_q.weight", vec![32, 2, 1, 3], GgmlType::Q4_1),
        ("output.weight", vec![5, 3], GgmlType::F16),
        ("rope_freqs", vec![3], GgmlType::BF16),
        ("i8.tensor", vec![1], GgmlType::I8),
    ];
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (name, dims, ty))| {
            let n: u64 = dims.iter().product();
            let len = ty.bytes_for(n).unwrap() as usize;
            (name.to_string(), dims, ty, bytes(i as u64 + 1, len))
        })
        .collect()
}

fn build(version: u32, alignment: Option<MetaValue>) -> GgufWriter {
    let mut w = GgufWriter::with_version(version).unwrap();
    for (k, v) in every_metadata_type() {
        w.add_metadata(k, v).unwrap();
    }
    if let Some(a) = alignment {
        w.add_metadata("general.alignment", a).unwrap();
    }
    for (name, dims, ty, data) in some_tensors() {
        w.add_tensor(name, &dims, ty, data).unwrap();
    }
    w
}

/// Checks that `file` holds exactly what `build` put in, laid out at `alignment`.
fn check_round_trip(file: &GgufFile, version: u32, alignment: u64, file_len: usize) {
    assert_eq!(file.version, version);
    assert_eq!(file.alignment, alignment);
    assert_eq!(file.data_start() % alignment, 0);

    let expected = every_metadata_type();
    let read: Vec<_> = file
        .metadata()
        .iter()
        .filter(|(k, _)| k != "general.alignment")
        .cloned()
        .collect();
    assert_eq!(read.len(), expected.len());
    for ((rk, rv), (ek, ev)) in read.iter().zip(&expected) {
        assert_eq!(rk, ek);
        // Compare bits so -0.0 and the like must survive exactly.
        assert_eq!(format!("{rv:?}"), format!("{ev:?}"), "value of {ek}");
        assert_eq!(rv, ev, "value of {ek}");
        assert_eq!(file.get(ek), Some(ev));
    }
    assert_eq!(
        file.get_f64("t.f64_neg_zero").map(f64::to_bits),
        Some((-0.0f64).to_bits())
    );
    assert_eq!(file.get_str("general.architecture"), Some("llama"));
    assert_eq!(file.get_u64("t.u64"), Some(u64::MAX));
    assert_eq!(file.get_bool("t.bool_true"), Some(true));
    assert_eq!(file.get_array("t.arr_empty_array").map(<[_]>::len), Some(0));

    let tensors = some_tensors();
    assert_eq!(file.tensors().len(), tensors.len());
    let mut previous_end = 0;
    for (info, (name, dims, ty, data)) in file.tensors().iter().zip(&tensors) {
        assert_eq!(&info.name, name);
        assert_eq!(&info.dims, dims);
        assert_eq!(info.ty, *ty);
        assert_eq!(info.n_elements, dims.iter().product::<u64>());
        assert_eq!(info.n_bytes, data.len() as u64);
        assert_eq!(info.offset % alignment, 0, "{name} offset");
        assert!(info.offset >= previous_end, "{name} follows the previous tensor");
        // Tensors are packed: each starts at the first aligned offset after the previous one.
        assert_eq!(
            info.offset,
            previous_end.div_ceil(alignment) * alignment,
            "{name} offset"
        );
        previous_end = info.offset + info.n_bytes;
        assert_eq!(file.tensor_data(info), &data[..], "{name} data");
        assert_eq!(file.tensor(name), Some(info));
    }
    // The last tensor is padded to the alignment too.
    assert_eq!(
        file_len as u64,
        file.data_start() + previous_end.div_ceil(alignment) * alignment
    );
}

#[test]
fn round_trip_v3_every_type() {
    let bytes = build(3, None).to_bytes();
    let len = bytes.len();
    let file = GgufFile::from_bytes(bytes).unwrap();
    check_round_trip(&file, 3, 32, len);
}

#[test]
fn round_trip_v2_every_type() {
    let bytes = build(2, None).to_bytes();
    assert_eq!(&bytes[4..8], &2u32.to_le_bytes());
    let len = bytes.len();
    let file = GgufFile::from_bytes(bytes).unwrap();
    check_round_trip(&file, 2, 32, len);
}

#[test]
fn v2_and_v3_differ_only_in_the_version() {
    let v2 = build(2, None).to_bytes();
    let mut v3 = build(3, None).to_bytes();
    v3[4] = 2;
    assert_eq!(v2, v3);
}

#[test]
fn round_trip_custom_alignments() {
    for alignment in [1u64, 2, 8, 16, 64, 128, 4096, 1 << 16] {
        let value = MetaValue::U32(alignment as u32);
        let w = build(3, Some(value));
        assert_eq!(w.alignment(), alignment);
        let layout = w.layout();
        let bytes = w.to_bytes();
        assert_eq!(bytes.len() as u64, layout.total_len);
        let len = bytes.len();
        let file = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(file.data_start(), layout.data_start);
        let offsets: Vec<u64> = file.tensors().iter().map(|t| t.offset).collect();
        assert_eq!(offsets, layout.tensor_offsets);
        check_round_trip(&file, 3, alignment, len);
    }
}

#[test]
fn alignment_of_other_integer_types_is_honoured() {
    for value in [MetaValue::U64(64), MetaValue::U8(8), MetaValue::I32(256)] {
        let expected = value.as_u64().unwrap();
        let bytes = build(3, Some(value)).to_bytes();
        let len = bytes.len();
        let file = GgufFile::from_bytes(bytes).unwrap();
        check_round_trip(&file, 3, expected, len);
    }
}

#[test]
fn padding_bytes_are_zero() {
    let w = build(3, Some(MetaValue::U32(64)));
    let layout = w.layout();
    let bytes = w.to_bytes();
    let file = GgufFile::from_bytes(bytes.clone()).unwrap();
    let mut covered = vec![false; bytes.len()];
    covered[..layout.tensor_infos_start as usize].fill(true);
    let infos_end = layout.tensor_infos_start as usize
        + file
            .tensors()
            .iter()
            .map(|t| 8 + t.name.len() + 4 + 8 * t.dims.len() + 4 + 8)
            .sum::<usize>();
    covered[layout.tensor_infos_start as usize..infos_end].fill(true);
    for t in file.tensors() {
        let start = (file.data_start() + t.offset) as usize;
        covered[start..start + t.n_bytes as usize].fill(true);
    }
    for (i, byte) in bytes.iter().enumerate() {
        if !covered[i] {
            assert_eq!(*byte, 0, "padding byte at {i}");
        }
    }
}

#[test]
fn empty_file_round_trips() {
    for version in [2, 3] {
        let w = GgufWriter::with_version(version).unwrap();
        let bytes = w.to_bytes();
        assert_eq!(bytes.len(), 32, "24-byte header padded to 32");
        let file = GgufFile::from_bytes(bytes).unwrap();
        assert_eq!(file.version, version);
        assert!(file.metadata().is_empty());
        assert!(file.tensors().is_empty());
    }
}

#[test]
fn write_to_matches_to_bytes_and_reads_back_through_mmap() {
    let w = build(3, Some(MetaValue::U32(128)));
    let mut streamed = Vec::new();
    w.write_to(&mut streamed).unwrap();
    assert_eq!(streamed, w.to_bytes());

    let path = std::env::temp_dir().join(format!("strata-gguf-writer-{}.gguf", std::process::id()));
    std::fs::write(&path, &streamed).unwrap();
    let opened = GgufFile::open(&path);
    std::fs::remove_file(&path).unwrap();
    check_round_trip(&opened.unwrap(), 3, 128, streamed.len());
}

#[test]
fn string_array_helper() {
    let mut w = GgufWriter::new();
    w.add_string_array("tokenizer.ggml.tokens", ["<s>", "</s>", "héllo"])
        .unwrap();
    let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let tokens: Vec<&str> = file
        .get_array("tokenizer.ggml.tokens")
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(tokens, ["<s>", "</s>", "héllo"]);
}

#[test]
fn writer_refuses_what_the_reader_refuses() {
    use MetaValue as V;
    use MetaValueType as T;
    let mut w = GgufWriter::new();
    w.add_metadata("k", V::U32(1)).unwrap();
    assert!(matches!(w.add_metadata("k", V::U8(1)), Err(GgufError::DuplicateKey(k)) if k == "k"));

    for bad in [
        V::U32(0),
        V::U32(3),
        V::U64(1 << 31),
        V::I32(-8),
        V::String("32".into()),
    ] {
        let err = GgufWriter::new()
            .add_metadata("general.alignment", bad.clone())
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, GgufError::BadAlignment(_)), "{bad:?}: {err}");
    }
    assert!(matches!(
        GgufWriter::new().set_alignment(48),
        Err(GgufError::BadAlignment(48))
    ));

    let mixed = arr(T::U32, vec![V::U32(1), V::I32(2)]);
    let err = GgufWriter::new().add_metadata("mixed", mixed).map(|_| ()).unwrap_err();
    assert!(
        matches!(&err, GgufError::BadValue { key, .. } if key == "mixed"),
        "{err}"
    );
    let inner_mixed = arr(T::Array, vec![arr(T::U8, vec![V::U8(1)]), V::U8(2)]);
    assert!(matches!(
        GgufWriter::new().add_metadata("m", inner_mixed),
        Err(GgufError::BadValue { .. })
    ));

    let mut deep = arr(T::U8, vec![]);
    for _ in 0..4 {
        deep = arr(T::Array, vec![deep]);
    }
    let err = GgufWriter::new().add_metadata("deep", deep).map(|_| ()).unwrap_err();
    assert!(
        matches!(&err, GgufError::NestingTooDeep { key } if key == "deep"),
        "{err}"
    );

    for version in [0, 1, 4, u32::MAX] {
        assert!(matches!(GgufWriter::with_version(version), Err(GgufError::UnsupportedVersion(v)) if v == version));
    }

    let tensor_err = |dims: &[u64], ty: GgmlType, len: usize| {
        let err = GgufWriter::new()
            .add_tensor("t", dims, ty, vec![0u8; len])
            .map(|_| ())
            .unwrap_err();
        assert!(
            matches!(&err, GgufError::BadTensor { name, .. } if name == "t"),
            "{dims:?}: {err}"
        );
        err.to_string()
    };
    assert!(tensor_err(&[], GgmlType::F32, 0).contains("0 dimensions"));
    assert!(tensor_err(&[1, 1, 1, 1, 1], GgmlType::F32, 4).contains("5 dimensions"));
    assert!(tensor_err(&[4, 0], GgmlType::F32, 0).contains("zero dimension"));
    assert!(tensor_err(&[1 << 32, 1 << 32], GgmlType::F32, 0).contains("overflow"));
    assert!(tensor_err(&[1 << 62, 4], GgmlType::F32, 0).contains("overflow"));
    assert!(tensor_err(&[33], GgmlType::Q4_0, 18).contains("not a multiple"));
    assert!(tensor_err(&[4], GgmlType::F32, 15).contains("needs 16"));

    let mut w = GgufWriter::new();
    w.add_tensor("t", &[1], GgmlType::F32, vec![0u8; 4]).unwrap();
    let err = w
        .add_tensor("t", &[1], GgmlType::F32, vec![0u8; 4])
        .map(|_| ())
        .unwrap_err();
    assert!(matches!(&err, GgufError::DuplicateTensor(n) if n == "t"), "{err}");
    // Refused additions leave the writer as it was.
    assert_eq!(GgufFile::from_bytes(w.to_bytes()).unwrap().tensors().len(), 1);
}

fn open_default_model() -> GgufFile {
    GgufFile::open(default_model_path()).unwrap()
}

#[test]
fn reads_the_default_model() {
    let file = open_default_model();
    assert!(file.version == 2 || file.version == 3);
    assert_eq!(file.tensors().len(), 272);
    assert_eq!(file.get_str("general.architecture"), Some("llama"));
    assert_eq!(file.get_u64("llama.block_count"), Some(30));
    let embd = file.tensor("token_embd.weight").unwrap();
    assert_eq!(embd.ty, GgmlType::Q8_0);
    assert_eq!(embd.dims, [576, 49152]);
    assert_eq!(embd.n_bytes, 576 * 49152 / 32 * 34);
    assert_eq!(file.tensor_data(embd).len() as u64, embd.n_bytes);
    let tokens = file.get_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert!(tokens.iter().all(|t| t.as_str().is_some()));
    for t in file.tensors() {
        assert_eq!(t.offset % file.alignment, 0, "{}", t.name);
        assert_eq!(file.tensor_data(t).len() as u64, t.n_bytes, "{}", t.name);
    }
}

#[test]
fn writer_reproduces_the_default_model_byte_for_byte() {
    let path = default_model_path();
    let original = std::fs::read(&path).unwrap();
    let file = GgufFile::from_bytes(original.clone()).unwrap();
    let mut w = GgufWriter::with_version(file.version).unwrap();
    for (key, value) in file.metadata() {
        w.add_metadata(key.clone(), value.clone()).unwrap();
    }
    for TensorInfo { name, dims, ty, .. } in file.tensors() {
        let info = file.tensor(name).unwrap();
        w.add_tensor(name.clone(), dims, *ty, file.tensor_data(info).to_vec())
            .unwrap();
    }
    let layout = w.layout();
    assert_eq!(layout.data_start, file.data_start());
    let offsets: Vec<u64> = file.tensors().iter().map(|t| t.offset).collect();
    assert_eq!(layout.tensor_offsets, offsets);
    let written = w.to_bytes();
    assert_eq!(written.len(), original.len());
    let first_difference = written.iter().zip(&original).position(|(a, b)| a != b);
    assert_eq!(first_difference, None, "written image differs from {}", path.display());
}
