//! Dequantization checked bit for bit against fixtures from the reference `gguf` package
//! (scripts/make_quant_fixtures.py), plus the errors for malformed calls.

use proptest::prelude::*;
use strata_formats::quant::{dequantize, GgmlType, QuantError};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A fixture: raw block bytes and the reference's little-endian f32 output.
struct Fixture {
    ty: GgmlType,
    blocks: &'static [u8],
    expected: &'static [u8],
}

macro_rules! fixture {
    ($ty:expr, $name:literal) => {
        Fixture {
            ty: $ty,
            blocks: include_bytes!(concat!("fixtures/quant/", $name, ".bin")),
            expected: include_bytes!(concat!("fixtures/quant/", $name, ".f32")),
        }
    };
}

fn fixtures() -> Vec<Fixture> {
    vec![
        fixture!(GgmlType::F32, "F32"),
        fixture!(GgmlType::F16, "F16"),
        fixture!(GgmlType::BF16, "BF16"),
        fixture!(GgmlType::Q4_0, "Q4_0"),
        fixture!(GgmlType::Q4_1, "Q4_1"),
        fixture!(GgmlType::Q5_0, "Q5_0"),
        fixture!(GgmlType::Q5_1, "Q5_1"),
        fixture!(GgmlType::Q8_0, "Q8_0"),
        fixture!(GgmlType::Q2K, "Q2_K"),
        fixture!(GgmlType::Q3K, "Q3_K"),
        fixture!(GgmlType::Q4K, "Q4_K"),
        fixture!(GgmlType::Q5K, "Q5_K"),
        fixture!(GgmlType::Q6K, "Q6_K"),
    ]
}

const SUPPORTED: [GgmlType; 13] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2K,
    GgmlType::Q3K,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

fn expected_bits(fixture: &Fixture) -> Vec<u32> {
    fixture
        .expected
        .chunks_exact(4)
        .map(|le| u32::from_le_bytes([le[0], le[1], le[2], le[3]]))
        .collect()
}

/// Index and bits of the first value that differs, if any.
fn first_mismatch(actual: &[f32], expected: &[u32]) -> Option<(usize, u32, u32)> {
    actual
        .iter()
        .zip(expected)
        .enumerate()
        .find(|(_, (a, &e))| a.to_bits() != e)
        .map(|(i, (a, &e))| (i, a.to_bits(), e))
}

#[test]
fn every_supported_type_has_a_fixture() {
    let covered: Vec<GgmlType> = fixtures().iter().map(|f| f.ty).collect();
    assert_eq!(covered, SUPPORTED);
    for ty in SUPPORTED {
        assert!(ty.can_dequantize(), "{ty}");
    }
}

#[test]
fn fixtures_match_reference_bit_for_bit() -> TestResult {
    for fixture in fixtures() {
        let expected = expected_bits(&fixture);
        assert!(!expected.is_empty(), "{}: empty fixture", fixture.ty);
        let mut out = vec![f32::NAN; expected.len()];
        dequantize(fixture.ty, fixture.blocks, &mut out)?;
        assert_eq!(
            first_mismatch(&out, &expected),
            None,
            "{}: (index, ours, reference)",
            fixture.ty
        );
    }
    Ok(())
}

#[test]
fn quantized_fixtures_are_finite() {
    for fixture in fixtures().iter().filter(|f| f.ty.is_quantized()) {
        let bits = expected_bits(fixture);
        assert!(bits.iter().all(|&b| f32::from_bits(b).is_finite()), "{}", fixture.ty);
    }
}

/// Decoding a buffer block by block (as the prefill path does per tile) gives the same
/// values as decoding it whole.
#[test]
fn block_by_block_equals_whole() -> TestResult {
    for fixture in fixtures() {
        let expected = expected_bits(&fixture);
        let block_len = fixture.ty.block_len();
        let block_bytes = fixture.ty.block_bytes();
        let mut out = vec![0.0f32; block_len];
        for (index, block) in fixture.blocks.chunks_exact(block_bytes).enumerate() {
            dequantize(fixture.ty, block, &mut out)?;
            let want = &expected[index * block_len..(index + 1) * block_len];
            assert_eq!(first_mismatch(&out, want), None, "{} block {index}", fixture.ty);
        }
    }
    Ok(())
}

#[test]
fn f16_matches_half_on_every_non_nan_pattern() -> TestResult {
    let bits: Vec<u16> = (0..=u16::MAX).collect();
    let bytes: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
    let mut out = vec![0.0f32; bits.len()];
    dequantize(GgmlType::F16, &bytes, &mut out)?;
    for (&b, &value) in bits.iter().zip(&out) {
        let half = half::f16::from_bits(b);
        if half.is_nan() {
            // The reference keeps the payload and does not set the quiet bit.
            let sign = u32::from(b & 0x8000) << 16;
            let payload = u32::from(b & 0x03FF) << 13;
            assert_eq!(value.to_bits(), sign | 0x7F80_0000 | payload, "{b:#06x}");
        } else {
            assert_eq!(value.to_bits(), half.to_f32().to_bits(), "{b:#06x}");
        }
    }
    Ok(())
}

#[test]
fn empty_input_is_fine() -> TestResult {
    for ty in SUPPORTED {
        dequantize(ty, &[], &mut [])?;
    }
    Ok(())
}

#[test]
fn wrong_byte_length_is_an_error() {
    for fixture in fixtures() {
        let values = expected_bits(&fixture).len();
        let mut out = vec![0.0f32; values];
        let short = &fixture.blocks[..fixture.blocks.len() - 1];
        let mut long = fixture.blocks.to_vec();
        long.push(0);
        for bytes in [short, &long[..], &[][..]] {
            assert_eq!(
                dequantize(fixture.ty, bytes, &mut out),
                Err(QuantError::WrongByteLength {
                    ty: fixture.ty,
                    values,
                    expected: fixture.blocks.len() as u64,
                    actual: bytes.len(),
                })
            );
        }
    }
}

#[test]
fn partial_block_is_an_error() {
    for ty in SUPPORTED.into_iter().filter(|ty| ty.is_quantized()) {
        let bytes = vec![0u8; 2 * ty.block_bytes()];
        for values in [1, ty.block_len() - 1, ty.block_len() + 1] {
            let mut out = vec![0.0f32; values];
            assert_eq!(
                dequantize(ty, &bytes, &mut out),
                Err(QuantError::PartialBlock {
                    ty,
                    values,
                    block_len: ty.block_len()
                })
            );
        }
    }
}

#[test]
fn unsupported_types_are_an_error() {
    use GgmlType::*;
    for ty in [Q8_1, Q8K, I8, I16, I32, I64, F64] {
        assert!(!ty.can_dequantize());
        let bytes = vec![0u8; ty.block_bytes()];
        let mut out = vec![0.0f32; ty.block_len()];
        assert_eq!(dequantize(ty, &bytes, &mut out), Err(QuantError::Unsupported { ty }));
    }
}

#[test]
fn errors_say_what_is_wrong() {
    let err = QuantError::WrongByteLength {
        ty: GgmlType::Q4K,
        values: 256,
        expected: 144,
        actual: 143,
    };
    assert_eq!(
        err.to_string(),
        "256 Q4_K values take 144 bytes, but 143 bytes were given"
    );
}

proptest! {
    /// Any bytes and any lengths: an Ok or an Err, never a panic; Ok exactly when the
    /// lengths fit.
    #[test]
    fn arbitrary_input_never_panics(
        type_index in 0..SUPPORTED.len(),
        bytes in proptest::collection::vec(any::<u8>(), 0..1200),
        values in 0usize..1100,
    ) {
        let ty = SUPPORTED[type_index];
        let mut out = vec![0.0f32; values];
        let fits = ty.bytes_for(values as u64) == Some(bytes.len() as u64);
        prop_assert_eq!(dequantize(ty, &bytes, &mut out).is_ok(), fits);
    }

    /// Whole blocks of random bytes always decode.
    #[test]
    fn random_whole_blocks_decode(
        type_index in 0..SUPPORTED.len(),
        blocks in 0usize..4,
        seed in any::<u64>(),
    ) {
        let ty = SUPPORTED[type_index];
        let mut state = seed;
        let bytes: Vec<u8> = (0..blocks * ty.block_bytes())
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (state >> 56) as u8
            })
            .collect();
        let mut out = vec![0.0f32; blocks * ty.block_len()];
        prop_assert!(dequantize(ty, &bytes, &mut out).is_ok());
    }
}
