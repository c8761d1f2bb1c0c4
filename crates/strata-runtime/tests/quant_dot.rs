//! Tests of the fused quantized dot products: AVX2 against scalar, both against an f64
//! reference over dequantized weights, batched (m > 1) against single rows.

use half::{bf16, f16};
use strata_formats::quant::dequantize;
use strata_formats::GgmlType;
use strata_runtime::cpu::isa::IsaLevel;
use strata_runtime::cpu::quant_dot::{
    act_format_for, act_row_bytes, dot_rows, has_avx2, is_supported, kernel_for, kernel_for_cap, kernels_for,
    quantize_act_row, quantize_act_row_scalar, scalar_kernel_for, weight_row_bytes, ActFormat, DotKernel, WeightLayout,
};

/// Small deterministic generator (SplitMix64).
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[-1, 1)`.
    fn sym(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn bytes(&mut self, out: &mut [u8]) {
        for b in out {
            *b = self.next_u64() as u8;
        }
    }
}

const TYPES: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Row lengths to try for a type.
fn lengths(ty: GgmlType) -> Vec<usize> {
    match ty.block_len() {
        1 => vec![1, 7, 8, 33, 64, 100, 576],
        32 => vec![32, 64, 96, 160, 576, 1024],
        _ => vec![256, 512, 768, 1536],
    }
}

/// Byte offsets of the f16 scale fields in a block of `ty`.
fn scale_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 => &[0],
        Q4_1 | Q5_1 | Q4K | Q5K => &[0, 2],
        Q6K => &[208],
        _ => &[],
    }
}

/// `rows` random weight rows of `n` values: random bytes with finite, moderate f16 scales.
fn random_weights(rng: &mut Rng, ty: GgmlType, n: usize, rows: usize) -> Vec<u8> {
    let mut w = vec![0u8; weight_row_bytes(ty, n) * rows];
    match ty {
        GgmlType::F32 => {
            for c in w.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.sym().to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(rng.sym()).to_le_bytes());
            }
        }
        GgmlType::BF16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&bf16::from_f32(rng.sym()).to_le_bytes());
            }
        }
        _ => {
            rng.bytes(&mut w);
            for blk in w.chunks_exact_mut(ty.block_bytes()) {
                for &off in scale_offsets(ty) {
                    let s = rng.sym() * 0.05 + if rng.sym() > 0.0 { 0.001 } else { -0.001 };
                    blk[off..off + 2].copy_from_slice(&f16::from_f32(s).to_le_bytes());
                }
            }
        }
    }
    w
}

/// Random activations whose magnitude varies from block to block, with an all-zero stretch.
fn random_acts(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n).map(|_| rng.sym()).collect();
    for (b, c) in x.chunks_mut(32).enumerate() {
        let scale = [1.0, 0.01, 30.0, 0.5][b % 4];
        for v in c.iter_mut() {
            *v *= scale;
        }
    }
    if n >= 64 {
        x[32..64].fill(0.0);
    }
    x
}

fn quantize(fmt: ActFormat, x: &[f32]) -> Vec<u8> {
    let mut q = vec![0u8; act_row_bytes(fmt, x.len())];
    quantize_act_row(fmt, x, &mut q);
    let mut qs = vec![0u8; q.len()];
    quantize_act_row_scalar(fmt, x, &mut qs);
    assert_eq!(q, qs, "dispatched and scalar quantizers differ for {fmt:?}");
    q
}

/// The values the quantized activation row stands for (documented layouts).
fn dequant_acts(fmt: ActFormat, n: usize, a: &[u8]) -> Vec<f64> {
    let f32_at = |o: usize| f64::from(f32::from_le_bytes([a[o], a[o + 1], a[o + 2], a[o + 3]]));
    match fmt {
        ActFormat::F32 => (0..n).map(|i| f32_at(4 * i)).collect(),
        ActFormat::Q8_1 => (0..n)
            .map(|i| f64::from(a[i] as i8) * f32_at(n + 12 * (i / 32)))
            .collect(),
        ActFormat::Q8K => (0..n)
            .map(|i| f64::from(a[i] as i8) * f32_at(n + 4 * (i / 256)))
            .collect(),
    }
}

/// Checks the Q8_1 block sums and Q8K per-16 sums against the quants.
fn check_act_sums(fmt: ActFormat, n: usize, a: &[u8]) {
    let q = |i: usize| i32::from(a[i] as i8);
    match fmt {
        ActFormat::Q8_1 => {
            for b in 0..n / 32 {
                let o = n + 12 * b;
                let d = f32::from_le_bytes([a[o], a[o + 1], a[o + 2], a[o + 3]]);
                let s = f32::from_le_bytes([a[o + 4], a[o + 5], a[o + 6], a[o + 7]]);
                let stored = i32::from_le_bytes([a[o + 8], a[o + 9], a[o + 10], a[o + 11]]);
                let sum: i32 = (32 * b..32 * b + 32).map(q).sum();
                assert_eq!(stored, sum);
                assert_eq!(s.to_bits(), (d * sum as f32).to_bits());
            }
        }
        ActFormat::Q8K => {
            let nb = n / 256;
            for g in 0..n / 16 {
                let o = n + 4 * nb + 2 * g;
                let s = i16::from_le_bytes([a[o], a[o + 1]]);
                let sum: i32 = (16 * g..16 * g + 16).map(q).sum();
                assert_eq!(i32::from(s), sum);
            }
        }
        _ => {}
    }
}

fn dequant_weights(ty: GgmlType, n: usize, w_row: &[u8]) -> Vec<f64> {
    let mut out = vec![0f32; n];
    if let Err(e) = dequantize(ty, w_row, &mut out) {
        panic!("dequantize {ty}: {e}");
    }
    out.into_iter().map(f64::from).collect()
}

/// The `rows` file rows `file` in the layout kernel `k` reads.
fn packed(k: &DotKernel, n: usize, rows: usize, file: &[u8]) -> Vec<u8> {
    let ty = k.weight_type();
    let mut out = vec![0u8; k.layout().matrix_bytes(ty, rows, n)];
    k.layout().pack(ty, rows, n, file, &mut out);
    out
}

/// One weight row (file bytes) against `m` activation rows.
fn run(k: &DotKernel, n: usize, w_row: &[u8], acts: &[u8], m: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; m];
    k.dot_rows(n, &packed(k, n, 1, w_row), acts, m, &mut out);
    out
}

#[test]
fn act_formats_are_the_documented_ones() {
    use GgmlType::*;
    for (ty, fmt) in [
        (F32, ActFormat::F32),
        (F16, ActFormat::F32),
        (BF16, ActFormat::F32),
        (Q4_0, ActFormat::Q8_1),
        (Q5_0, ActFormat::Q8_1),
        (Q8_0, ActFormat::Q8_1),
        (Q4_1, ActFormat::Q8_1),
        (Q5_1, ActFormat::Q8_1),
        (Q4K, ActFormat::Q8K),
        (Q5K, ActFormat::Q8K),
        (Q6K, ActFormat::Q8K),
    ] {
        assert_eq!(act_format_for(ty), fmt, "{ty}");
        assert!(is_supported(ty));
        let k = kernel_for(ty).expect("supported type has a kernel");
        assert_eq!(k.act_format(), fmt);
        assert_eq!(k.weight_type(), ty);
    }
    assert_eq!(act_row_bytes(ActFormat::Q8_1, 64), 64 + 24);
    assert_eq!(act_row_bytes(ActFormat::Q8K, 512), 512 + 2 * 36);
    assert_eq!(act_row_bytes(ActFormat::F32, 5), 20);
    for ty in [Q2K, Q3K, Q8_1, Q8K, I8, I32, F64] {
        assert!(!is_supported(ty));
        assert!(kernel_for(ty).is_none() && scalar_kernel_for(ty).is_none());
    }
}

#[test]
fn quantized_activations_are_consistent() {
    let mut rng = Rng(7);
    for fmt in [ActFormat::Q8_1, ActFormat::Q8K, ActFormat::F32] {
        for n in [256usize, 512, 1280] {
            let mut x = random_acts(&mut rng, n);
            // Ties, extremes and non-finite values must quantize identically on both paths.
            x[1] = 0.5;
            x[2] = -2.5;
            x[3] = f32::NAN;
            x[100] = f32::INFINITY;
            x[101] = -0.0;
            let q = quantize(fmt, &x);
            check_act_sums(fmt, n, &q);
            if fmt != ActFormat::F32 {
                // Finite blocks stay within half a step of the input.
                let deq = dequant_acts(fmt, n, &q);
                let bl = fmt.block_len();
                for (b, (xb, db)) in x.chunks(bl).zip(deq.chunks(bl)).enumerate() {
                    if xb.iter().all(|v| v.is_finite()) {
                        let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                        for (xv, dv) in xb.iter().zip(db) {
                            let err = (f64::from(*xv) - dv).abs();
                            assert!(
                                err <= f64::from(amax) / 254.0 * 1.0001 + 1e-30,
                                "{fmt:?} block {b}: {xv} -> {dv}"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// Every type, several lengths: each SIMD kernel == scalar (tight), all near the f64 references.
#[test]
fn kernels_match_reference() {
    let avx2 = has_avx2();
    if !avx2 {
        println!("skipping AVX2 comparisons: this CPU lacks AVX2/FMA/F16C");
    }
    let mut rng = Rng(42);
    for ty in TYPES {
        let fmt = act_format_for(ty);
        let scalar = scalar_kernel_for(ty).expect("scalar kernel");
        let all = kernels_for(ty);
        assert_eq!(
            kernel_for(ty).expect("kernel").isa(),
            all[0].isa(),
            "kernel_for is the fastest"
        );
        assert_eq!(all.last().expect("scalar last").isa(), "scalar");
        let simd: Vec<DotKernel> = all.into_iter().filter(|k| k.isa() != "scalar").collect();
        assert_eq!(simd.iter().any(|k| k.isa() == "avx2"), avx2);
        for n in lengths(ty) {
            for trial in 0..6 {
                let w = random_weights(&mut rng, ty, n, 1);
                let x = random_acts(&mut rng, n);
                let a = quantize(fmt, &x);
                let wd = dequant_weights(ty, n, &w);
                let xq = dequant_acts(fmt, n, &a);
                let mag: f64 = wd.iter().zip(&x).map(|(w, x)| (w * f64::from(*x)).abs()).sum();
                let mag_q: f64 = wd.iter().zip(&xq).map(|(w, x)| (w * x).abs()).sum();
                let exact_q: f64 = wd.iter().zip(&xq).map(|(w, x)| w * x).sum();
                let exact: f64 = wd.iter().zip(&x).map(|(w, x)| w * f64::from(*x)).sum();
                // Rounding the activations moves each by at most half a step.
                let bl = fmt.block_len();
                let act_err: f64 = if fmt == ActFormat::F32 {
                    0.0
                } else {
                    x.chunks(bl)
                        .zip(wd.chunks(bl))
                        .map(|(xb, wb)| {
                            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
                            let wsum: f64 = wb.iter().map(|v| v.abs()).sum();
                            wsum * f64::from(amax) / 254.0
                        })
                        .sum()
                };
                let tight = 1e-5 * mag_q.max(mag) + 1e-30;

                let s = run(&scalar, n, &w, &a, 1)[0];
                let ctx = format!("{ty} n={n} trial={trial}");
                assert!(s.is_finite(), "{ctx}: scalar {s}");
                assert!(
                    (f64::from(s) - exact_q).abs() <= tight,
                    "{ctx}: scalar {s} vs exact over quantized activations {exact_q} (tol {tight})"
                );
                assert!(
                    (f64::from(s) - exact).abs() <= act_err * 1.0001 + tight,
                    "{ctx}: scalar {s} vs f64 reference {exact} (tol {})",
                    act_err + tight
                );
                for k in &simd {
                    let f = run(k, n, &w, &a, 1)[0];
                    assert!(
                        (f - s).abs() as f64 <= tight,
                        "{ctx}: {} {f} vs scalar {s} (tol {tight})",
                        k.isa()
                    );
                }
            }
        }
    }
}

/// m activation rows at once, and many weight rows at once, give exactly (bit for bit) the
/// one-by-one results: every (weight row, activation row) pair is summed in the same order
/// whatever tile computes it, so results do not depend on batch size or thread split.
#[test]
fn batched_rows_match_single_rows() {
    let mut rng = Rng(1234);
    for ty in TYPES {
        let fmt = act_format_for(ty);
        let n = match ty.block_len() {
            1 => 100,
            32 => 352,
            _ => 768,
        };
        // Two row groups and a padded third.
        let rows = 19;
        let ab = act_row_bytes(fmt, n);
        let wb = weight_row_bytes(ty, n);
        let file = random_weights(&mut rng, ty, n, rows);
        for k in &kernels_for(ty) {
            let w = packed(k, n, rows, &file);
            let align = k.layout().row_align();
            for m in [1usize, 2, 3, 4, 5, 8, 13] {
                let mut acts = vec![0u8; ab * m];
                for a in acts.chunks_exact_mut(ab) {
                    quantize_act_row(fmt, &random_acts(&mut rng, n), a);
                }
                let ctx = format!("{ty} {} m={m}", k.isa());
                // Whole matrix at once, and every sub-range of rows a thread may take.
                let mut all = vec![f32::NAN; rows * m];
                k.dot_matrix(n, &w, rows, &acts, m, &mut all);
                for lo in (0..rows).step_by(align) {
                    for hi in lo + 1..=rows {
                        let mut part = vec![f32::NAN; (hi - lo) * m];
                        let bytes = &w[k.layout().row_bytes_range(ty, n, lo..hi)];
                        k.dot_matrix(n, bytes, hi - lo, &acts, m, &mut part);
                        assert_eq!(bits(&part), bits(&all[lo * m..hi * m]), "{ctx} rows {lo}..{hi}");
                        // By activation row, where the kernel writes so: the same bits.
                        let mut cols = vec![f32::NAN; (hi - lo) * m];
                        if k.dot_matrix_columns(n, bytes, hi - lo, &acts, m, &mut cols) {
                            let back: Vec<f32> =
                                (0..(hi - lo) * m).map(|i| cols[(i % m) * (hi - lo) + i / m]).collect();
                            assert_eq!(bits(&back), bits(&part), "{ctx} rows {lo}..{hi} by activation row");
                        }
                    }
                }
                assert_eq!(
                    k.writes_columns(),
                    k.isa() != "scalar"
                        && matches!(
                            ty,
                            GgmlType::Q4_0
                                | GgmlType::Q4_1
                                | GgmlType::Q8_0
                                | GgmlType::Q4K
                                | GgmlType::Q5K
                                | GgmlType::Q6K
                        ),
                    "{ctx}: the row-group kernels write by activation row"
                );
                for r in 0..rows {
                    let w_row = &file[r * wb..(r + 1) * wb];
                    let batched = run(k, n, w_row, &acts, m);
                    assert_eq!(bits(&batched), bits(&all[r * m..(r + 1) * m]), "{ctx} row {r}");
                    for (j, a) in acts.chunks_exact(ab).enumerate() {
                        let single = run(k, n, w_row, a, 1)[0];
                        assert_eq!(single.to_bits(), batched[j].to_bits(), "{ctx} row {r} act {j}");
                    }
                }
                // The free function dispatches to kernel_for's kernel.
                if k.isa() == kernel_for(ty).expect("kernel").isa() {
                    let mut free = vec![0f32; m];
                    dot_rows(ty, n, &w, &acts, m, &mut free);
                    assert_eq!(bits(&free), bits(&all[..m]), "{ctx} dot_rows");
                }
            }
        }
    }
}

/// The AVX-512 VNNI builds give the AVX2 builds' results bit for bit (the same exact integer
/// sums, the same float code), for every tile shape the matrix function uses.
#[test]
fn vnni_matches_avx2_bit_for_bit() {
    let mut rng = Rng(77);
    let mut compared = 0;
    for ty in TYPES {
        let ks = kernels_for(ty);
        let (Some(vnni), Some(avx2)) = (
            ks.iter().find(|k| k.isa() == "avx512vnni"),
            ks.iter().find(|k| k.isa() == "avx2"),
        ) else {
            continue;
        };
        let fmt = act_format_for(ty);
        // 352 = 11 blocks: the pairs and the odd last block (K-quants: 2 and 5 super-blocks).
        let ns = if ty.block_len() == 256 {
            [512usize, 1280]
        } else {
            [352, 576]
        };
        for n in ns {
            let rows = 9;
            let ab = act_row_bytes(fmt, n);
            let w = packed(vnni, n, rows, &random_weights(&mut rng, ty, n, rows));
            assert_eq!(vnni.layout(), avx2.layout(), "{ty}");
            for m in [1usize, 2, 3, 4, 7, 32] {
                let mut acts = vec![0u8; ab * m];
                for a in acts.chunks_exact_mut(ab) {
                    quantize_act_row(fmt, &random_acts(&mut rng, n), a);
                }
                let mut a = vec![f32::NAN; rows * m];
                let mut b = vec![f32::NAN; rows * m];
                vnni.dot_matrix(n, &w, rows, &acts, m, &mut a);
                avx2.dot_matrix(n, &w, rows, &acts, m, &mut b);
                assert_eq!(bits(&a), bits(&b), "{ty} n={n} m={m}");
            }
        }
        compared += 1;
    }
    if compared == 0 {
        println!("skipping: this CPU lacks AVX-512 VNNI (no vpdpbusd builds to compare)");
    } else {
        assert_eq!(
            compared, 8,
            "Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants have VNNI builds"
        );
    }
}

/// The SIMD builds of Q4_0, Q4_1, Q8_0 and the K-quants read row groups; the scalar ones and every other type
/// the file's rows. A matrix one row short of a group is padded.
#[test]
fn layouts_are_the_documented_ones() {
    for ty in TYPES {
        for k in kernels_for(ty) {
            let grouped = k.isa() != "scalar"
                && matches!(
                    ty,
                    GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0 | GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K
                );
            let want = if grouped {
                WeightLayout::RowGroups8
            } else {
                WeightLayout::File
            };
            assert_eq!(k.layout(), want, "{ty} {}", k.isa());
        }
    }
    let l = WeightLayout::RowGroups8;
    assert_eq!(l.matrix_bytes(GgmlType::Q4_1, 7, 64), 8 * 40);
    assert_eq!(WeightLayout::File.matrix_bytes(GgmlType::Q4_1, 7, 64), 7 * 40);
}

/// A short weight slice is refused in the kernel's layout's terms.
#[test]
#[should_panic(expected = "weight slice")]
fn short_weights_panic() {
    let k = kernel_for(GgmlType::Q4_1).expect("kernel");
    let w = vec![0u8; k.layout().matrix_bytes(GgmlType::Q4_1, 9, 64) - 1];
    let a = vec![0u8; act_row_bytes(ActFormat::Q8_1, 64)];
    let mut out = [0f32; 9];
    k.dot_matrix(64, &w, 9, &a, 1, &mut out);
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn empty_shapes_do_nothing_or_zero() {
    let k = kernel_for(GgmlType::Q4_1).expect("kernel");
    let mut out = [1.0f32; 2];
    k.dot_matrix(0, &[], 2, &[], 1, &mut out);
    assert_eq!(out, [0.0, 0.0]);
    let mut out = [1.0f32; 1];
    k.dot_matrix(32, &[], 0, &[0u8; 44], 1, &mut out);
    let w = vec![0u8; k.layout().matrix_bytes(GgmlType::Q4_1, 1, 32)];
    k.dot_matrix(32, &w, 1, &[], 0, &mut out);
    assert_eq!(out, [1.0]);
}

#[test]
#[should_panic(expected = "activation slice")]
fn short_activations_panic() {
    let k = kernel_for(GgmlType::Q8_0).expect("kernel");
    let w = vec![0u8; k.layout().matrix_bytes(GgmlType::Q8_0, 1, 64)];
    let a = vec![0u8; act_row_bytes(ActFormat::Q8_1, 64) - 1];
    let mut out = [0f32; 1];
    k.dot_rows(64, &w, &a, 1, &mut out);
}

#[test]
#[should_panic(expected = "not a multiple")]
fn partial_blocks_panic() {
    let k = kernel_for(GgmlType::Q4K).expect("kernel");
    let mut out = [0f32; 1];
    k.dot_rows(128, &[0u8; 1000], &[0u8; 1000], 1, &mut out);
}

/// `STRATA_CPU_ISA` caps the dispatch: every type gets the fastest kernel at or below the cap
/// (AVX2 under `avx2` where the CPU has it, never VNNI; the scalar one under `scalar`).
#[test]
fn an_isa_cap_picks_the_fastest_kernel_at_or_below_it() {
    for ty in TYPES {
        let fastest = kernel_for_cap(ty, None).expect("kernel");
        assert_eq!(fastest.isa(), kernels_for(ty)[0].isa());
        let avx2 = kernel_for_cap(ty, Some(IsaLevel::Avx2)).expect("kernel");
        assert!(avx2.level() <= IsaLevel::Avx2, "{ty}: {}", avx2.isa());
        assert_eq!(avx2.isa() == "avx2", has_avx2(), "{ty}: {}", avx2.isa());
        let scalar = kernel_for_cap(ty, Some(IsaLevel::Scalar)).expect("kernel");
        assert_eq!(scalar.isa(), "scalar");
    }
}
