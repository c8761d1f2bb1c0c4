//! The quantizers: bytes checked against the reference `gguf` package where it quantizes and
//! against ggml's own reference quantizers for the K-quants (scripts/make_quant_fixtures.py),
//! round-trip error bounds per type, and the errors for bad calls.

use proptest::prelude::*;
use proptest::test_runner::{RngAlgorithm, TestRng};
use strata_formats::quant::{dequantize, quantize, GgmlType, QuantError, QUANTIZABLE};

type TestResult = Result<(), Box<dyn std::error::Error>>;

/// Values the `gguf` package quantized (64 blocks of 32), and what it made of them per type.
const INPUT: &[u8] = include_bytes!("fixtures/quant/quantize_input.f32");
/// Values ggml's reference K-quantizers quantized (64 super-blocks of 256).
const K_INPUT: &[u8] = include_bytes!("fixtures/quant/quantize_k_input.f32");

macro_rules! reference {
    ($ty:expr, $name:literal, $input:expr) => {
        (
            $ty,
            $input,
            &include_bytes!(concat!("fixtures/quant/quantize_", $name, ".bin"))[..],
        )
    };
}

/// Each type, the little-endian f32 input, and the reference's bytes.
fn references() -> [(GgmlType, &'static [u8], &'static [u8]); 10] {
    [
        reference!(GgmlType::F16, "F16", INPUT),
        reference!(GgmlType::BF16, "BF16", INPUT),
        reference!(GgmlType::Q4_0, "Q4_0", INPUT),
        reference!(GgmlType::Q4_1, "Q4_1", INPUT),
        reference!(GgmlType::Q5_0, "Q5_0", INPUT),
        reference!(GgmlType::Q5_1, "Q5_1", INPUT),
        reference!(GgmlType::Q8_0, "Q8_0", INPUT),
        reference!(GgmlType::Q4K, "Q4_K", K_INPUT),
        reference!(GgmlType::Q5K, "Q5_K", K_INPUT),
        reference!(GgmlType::Q6K, "Q6_K", K_INPUT),
    ]
}

fn f32_values(le: &[u8]) -> Vec<f32> {
    le.chunks_exact(4)
        .map(|le| f32::from_le_bytes([le[0], le[1], le[2], le[3]]))
        .collect()
}

fn quantized(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>, QuantError> {
    let len = ty.bytes_for(values.len() as u64).unwrap_or(0) as usize;
    let mut out = vec![0u8; len];
    quantize(ty, values, &mut out)?;
    Ok(out)
}

fn round_trip(ty: GgmlType, values: &[f32]) -> Result<Vec<f32>, QuantError> {
    let bytes = quantized(ty, values)?;
    let mut out = vec![f32::NAN; values.len()];
    dequantize(ty, &bytes, &mut out)?;
    Ok(out)
}

/// sqrt(sum (x - y)^2 / sum x^2).
fn relative_rms_error(x: &[f32], y: &[f32]) -> f64 {
    let err: f64 = x
        .iter()
        .zip(y)
        .map(|(&a, &b)| (f64::from(a) - f64::from(b)).powi(2))
        .sum();
    let norm: f64 = x.iter().map(|&a| f64::from(a).powi(2)).sum();
    (err / norm).sqrt()
}

/// Seeded draws from proptest's generator, so every run sees the same data.
struct Draws(TestRng);

impl Draws {
    fn new(seed: u8) -> Draws {
        Draws(TestRng::from_seed(RngAlgorithm::ChaCha, &[seed; 32]))
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.0.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// Standard normal (Box-Muller).
    fn normal(&mut self) -> f32 {
        let (u, v) = (self.uniform(), self.uniform());
        ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
    }
}

const N: usize = 64 * 256;

/// Standard normal values.
fn gaussian() -> Vec<f32> {
    let mut rng = Draws::new(1);
    (0..N).map(|_| rng.normal()).collect()
}

/// Like trained weight rows: normal values whose scale varies from row to row (of 1024), with
/// 1 in 200 an outlier eight times larger.
fn weight_like() -> Vec<f32> {
    let mut rng = Draws::new(2);
    let row_scales: Vec<f32> = (0..N / 1024)
        .map(|_| 0.01 * (1.0 + 3.0 * rng.uniform() as f32))
        .collect();
    (0..N)
        .map(|i| {
            let outlier = if rng.0.next_u64().is_multiple_of(200) { 8.0 } else { 1.0 };
            rng.normal() * row_scales[i / 1024] * outlier
        })
        .collect()
}

/// Smooth, all-positive values around 1 (a norm's gains) plus a slow sine: the shape where a
/// block's minimum matters most.
fn structured() -> Vec<f32> {
    let mut rng = Draws::new(3);
    (0..N)
        .map(|i| 1.0 + 0.3 * (i as f32 / 40.0).sin() + 0.05 * rng.normal())
        .collect()
}

/// Bounds on the relative RMS error of a round trip, per type, over the three data sets above:
/// about 10% over the worst measured, which is always `weight_like` (measured, in %:
/// F16 0.020, BF16 0.17, Q8_0 0.75, Q6_K 2.28, Q5_K 4.13, Q5_1 4.31, Q5_0 6.03, Q4_K 8.34,
/// Q4_1 8.83, Q4_0 12.0; on `gaussian`: Q8_0 0.54, Q6_K 1.78, Q5_K 3.59, Q4_K 7.11, Q4_0 8.58).
fn error_bound(ty: GgmlType) -> f64 {
    use GgmlType::*;
    match ty {
        F32 => 0.0,
        F16 => 0.0003,
        BF16 => 0.002,
        Q8_0 => 0.0085,
        Q6K => 0.025,
        Q5K => 0.045,
        Q5_1 => 0.047,
        Q5_0 => 0.066,
        Q4K => 0.092,
        Q4_1 => 0.097,
        Q4_0 => 0.132,
        other => panic!("no bound for {other}"),
    }
}

#[test]
fn bytes_match_the_reference_quantizers() -> TestResult {
    assert_eq!(f32_values(INPUT).len(), 64 * 32);
    assert_eq!(f32_values(K_INPUT).len(), 64 * 256);
    for (ty, input, expected) in references() {
        let ours = quantized(ty, &f32_values(input))?;
        assert_eq!(ours.len(), expected.len(), "{ty}");
        let first_diff = ours.iter().zip(expected).position(|(a, b)| a != b);
        assert_eq!(
            first_diff,
            None,
            "{ty}: first differing byte (block {:?})",
            first_diff.map(|i| i / ty.block_bytes())
        );
    }
    Ok(())
}

#[test]
fn round_trip_error_is_within_bounds() -> TestResult {
    let sets = [
        ("gaussian", gaussian()),
        ("weight-like", weight_like()),
        ("structured", structured()),
    ];
    let mut report = String::new();
    let mut over = Vec::new();
    for ty in QUANTIZABLE {
        report.push_str(&format!("{ty:>5}:"));
        for (name, values) in &sets {
            let error = relative_rms_error(values, &round_trip(ty, values)?);
            report.push_str(&format!(" {name} {:.3}%", 100.0 * error));
            if error > error_bound(ty) {
                over.push(format!("{ty} on {name}: {error:.5} > {}", error_bound(ty)));
            }
        }
        report.push('\n');
    }
    println!("relative RMS error of quantize -> dequantize:\n{report}");
    assert!(over.is_empty(), "over the bounds: {over:?}");
    Ok(())
}

#[test]
fn all_zero_blocks_stay_zero() -> TestResult {
    for ty in QUANTIZABLE {
        let values = vec![0.0f32; 2 * 256];
        let out = round_trip(ty, &values)?;
        assert!(out.iter().all(|&v| v == 0.0), "{ty}: {:?}", &out[..8]);
    }
    Ok(())
}

#[test]
fn a_zero_block_beside_a_large_one_stays_zero() -> TestResult {
    for ty in QUANTIZABLE {
        let mut values = vec![0.0f32; 2 * 256];
        let mut rng = Draws::new(4);
        values[256..].iter_mut().for_each(|v| *v = 100.0 * rng.normal());
        let out = round_trip(ty, &values)?;
        assert!(out[..256].iter().all(|&v| v == 0.0), "{ty}: {:?}", &out[..8]);
    }
    Ok(())
}

#[test]
fn a_row_that_is_not_whole_blocks_is_an_error() {
    for ty in QUANTIZABLE.into_iter().filter(|t| t.is_quantized()) {
        for values in [1, ty.block_len() - 1, ty.block_len() + 1] {
            let err = quantized(ty, &vec![1.0; values]).unwrap_err();
            assert_eq!(
                err,
                QuantError::PartialBlock {
                    ty,
                    values,
                    block_len: ty.block_len()
                }
            );
            assert!(err.to_string().contains("not a whole number of"), "{err}");
        }
    }
}

#[test]
fn a_wrong_output_length_is_an_error() {
    for ty in QUANTIZABLE {
        let values = vec![1.0f32; 256];
        let expected = ty.bytes_for(256).unwrap_or(0);
        let mut out = vec![0u8; expected as usize + 1];
        assert_eq!(
            quantize(ty, &values, &mut out),
            Err(QuantError::WrongByteLength {
                ty,
                values: 256,
                expected,
                actual: expected as usize + 1
            })
        );
    }
}

#[test]
fn non_finite_values_are_an_error() {
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
        let mut values = vec![0.5f32; 256];
        values[77] = bad;
        assert_eq!(
            quantized(GgmlType::Q4K, &values),
            Err(QuantError::NonFinite { index: 77 })
        );
    }
}

#[test]
fn types_without_a_quantizer_are_an_error() {
    for ty in [
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q8_1,
        GgmlType::Q8K,
        GgmlType::I32,
    ] {
        assert!(!ty.can_quantize());
        let err = quantized(ty, &[0.0; 256]).unwrap_err();
        assert_eq!(err, QuantError::QuantizeUnsupported { ty });
        assert!(err.to_string().contains("Q4_K"), "{err}");
    }
}

/// Per-block error bound relative to the block's largest magnitude, generous enough for any
/// shape of data (the scale's f16 and 6-bit rounding included).
fn block_error_bound(ty: GgmlType) -> f32 {
    use GgmlType::*;
    match ty {
        F32 => 0.0,
        F16 => 0.001,
        BF16 => 0.004,
        Q8_0 => 0.006,
        Q6K => 0.04,
        Q5_0 | Q5_1 | Q5K => 0.07,
        Q4_0 | Q4_1 | Q4K => 0.15,
        other => panic!("no bound for {other}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Any finite values of a sane range quantize, and every value comes back within a bound
    /// set by the largest magnitude of its super-block: the layouts agree with the decoder.
    #[test]
    fn every_value_comes_back_close(values in prop::collection::vec(-1000.0f32..1000.0, 256..=512), ty_index in 0..QUANTIZABLE.len()) {
        let ty = QUANTIZABLE[ty_index];
        let len = values.len() / 256 * 256;
        let values = &values[..len];
        let out = round_trip(ty, values).unwrap();
        for (block, (x, y)) in values.chunks(256).zip(out.chunks(256)).enumerate() {
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, (a, b)) in x.iter().zip(y).enumerate() {
                prop_assert!((a - b).abs() <= block_error_bound(ty) * amax, "{} block {} value {}: {} -> {}", ty, block, i, a, b);
            }
        }
    }
}
