//! quant.cu against strata's CPU dequantizer: the int8 activation blocks, and for each block
//! format the decode GEMVs over them (plain, gate/up with SiLU, residual with the next norm's
//! sums), dequantization of a matrix and of a slab of its rows, the embedding, and the
//! tensor-core GEMMs (registers, shared-memory and wide tiles, whole and split k) against the
//! bf16-rounded weights (the wide tiles, which decode in bf16 pairs, against a model of their
//! roundings), and the norms that sum a split GEMM's partial sums in qgemm_reduce's place.

use strata_formats::quant::{dequantize, scales_and_mins};
use strata_runtime::cuda::{
    DequantCall, DeviceBuffer, Gpu, KernelSpec, Kernels, NormCall, NormOp, QuantEmbeddingCall, QuantFormat,
    QuantGemmCall, QuantGemmPairCall, QuantGemmReduceCall, QuantGemmTile, QuantGemvCall, QuantGemvResidualCall,
    QuantGemvSiluCall, QuantizeQ8Call, TmaMap, Q8_BLOCK, QUANT_FORMATS,
};

use crate::common::{bf16_bits, bf16_value, first_gpu, random_bf16, random_f32, read_bf16, ResidualCase};

/// `rows` rows of `k / block` random blocks of `format` whose f16 scale fields are small finite
/// values (the rest of each block random bytes), as the file holds them.
fn random_blocks(format: QuantFormat, rows: usize, k: usize, seed: u64) -> Vec<u8> {
    let (bb, n) = (format.block_bytes(), rows * k / format.block_len());
    let mut state = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut bytes: Vec<u8> = (0..n * bb).map(|_| next() as u8).collect();
    // f16 scale fields: (offset in the block, count).
    let fields: &[usize] = match format {
        QuantFormat::Q4_0 | QuantFormat::Q8_0 => &[0],
        QuantFormat::Q4_1 | QuantFormat::Q4K | QuantFormat::Q5K => &[0, 2],
        QuantFormat::Q6K => &[208],
    };
    for b in bytes.chunks_exact_mut(bb) {
        for &at in fields {
            // 2^-10 .. 2^-6, either sign: 0x1400..0x2400 | sign.
            let h = (0x1400u16 + (next() % 0x1000) as u16) | if next() & 1 == 1 { 0x8000 } else { 0 };
            b[at..at + 2].copy_from_slice(&h.to_le_bytes());
        }
    }
    bytes
}

/// The blocks in quant.cu's layout on the GPU.
fn upload_segment(gpu: &Gpu, format: QuantFormat, blocks: &[u8], rows: usize, k: usize) -> DeviceBuffer {
    let buf = gpu.alloc(blocks.len(), "segment").unwrap();
    let mut placed = vec![0u8; blocks.len()];
    format.place_rows(blocks, k / format.block_len(), 0, rows, &mut |at, b| {
        placed[at..at + b.len()].copy_from_slice(b)
    });
    gpu.write(&buf, 0, &placed).unwrap();
    buf
}

fn dot(w: &[f32], x: &[f32]) -> f64 {
    w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum()
}

/// x (`[t, k]`) quantized by `quantize_q8` on the GPU (one pass, or two), checked against the
/// rule (per block of 32: scale amax / 127, q = round(x · 127 / amax), the sum of x; the second
/// pass the same of what the first left). Returns the values the int8 blocks stand for, and per
/// token the sum over blocks of |sum of x - sum of those values|: what a block's min or offset,
/// applied to the exact sum, adds to the error of a product.
fn quantize_on_gpu(
    gpu: &Gpu,
    kernels: &Kernels,
    x: &[f32],
    xd: &DeviceBuffer,
    (k, t): (usize, usize),
    two_pass: bool,
) -> (DeviceBuffer, DeviceBuffer, Vec<f32>, Vec<f64>) {
    let xq = gpu.alloc(QuantizeQ8Call::value_bytes(k, t), "xq").unwrap();
    let xs = gpu.alloc(QuantizeQ8Call::scale_bytes(k, t), "xs").unwrap();
    let call = QuantizeQ8Call {
        x: xd.ptr(),
        xq: xq.ptr(),
        xs: xs.ptr(),
        k: k as i32,
        t: t as i32,
        two_pass: two_pass as i32,
    };
    // SAFETY: x t x k bf16, xq and xs sized for two passes.
    unsafe { call.launch(gpu, kernels) }.unwrap();
    let blocks = t * k / Q8_BLOCK;
    let mut q = vec![0u8; 2 * t * k];
    gpu.read(&xq, 0, &mut q).unwrap();
    let mut scales = vec![0f32; 3 * blocks];
    gpu.read(&xs, 0, &mut scales).unwrap();
    // One pass over `left`: checks the quants and scale at `q`/`d`, returns what the pass keeps.
    let pass = |left: &[f32], q: &[u8], d: f32, at: usize| -> Vec<f32> {
        let amax = left.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(
            (d - amax / 127.0).abs() <= 1e-6 * amax,
            "block at {at}: scale {d} for amax {amax}"
        );
        left.iter()
            .zip(q)
            .enumerate()
            .map(|(i, (&v, &byte))| {
                let got = byte as i8 as f32;
                let want = if amax > 0.0 {
                    (v * (127.0 / amax)).round_ties_even()
                } else {
                    0.0
                };
                assert!((got - want).abs() <= 1.0, "value {}: {got} vs {want}", at + i);
                got * d
            })
            .collect()
    };
    let mut dequantized = vec![0f32; t * k];
    let mut sum_gap = vec![0f64; t];
    for (b, block) in x.chunks_exact(Q8_BLOCK).enumerate() {
        let at = b * Q8_BLOCK;
        let (d, sum) = (scales[2 * b], scales[2 * b + 1]);
        let exact: f64 = block.iter().map(|&v| v as f64).sum();
        assert!(
            (sum as f64 - exact).abs() <= 1e-5 * (1.0 + exact.abs()),
            "block {b}: sum {sum} vs {exact}"
        );
        let first = pass(block, &q[at..at + Q8_BLOCK], d, at);
        let mut back: Vec<f32> = first.clone();
        if two_pass {
            let left: Vec<f32> = block
                .iter()
                .zip(&q[at..])
                .map(|(&v, &byte)| (-(byte as i8 as f32)).mul_add(d, v))
                .collect();
            let second = pass(&left, &q[t * k + at..t * k + at + Q8_BLOCK], scales[2 * blocks + b], at);
            back.iter_mut().zip(&second).for_each(|(a, b)| *a += b);
        }
        dequantized[at..at + Q8_BLOCK].copy_from_slice(&back);
        let kept: f64 = back.iter().map(|&v| v as f64).sum();
        sum_gap[at / k] += (exact - kept).abs();
    }
    (xq, xs, dequantized, sum_gap)
}

#[test]
fn quantized_kernels_match_the_cpu_dequantizer() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    for format in QUANT_FORMATS {
        // An odd row count, a short and a long row (multiples of 256 for every format).
        for (n, k) in [(37usize, 768usize), (258, 2816)] {
            let blocks = random_blocks(format, 2 * n, k, n as u64 + k as u64);
            let mut w = vec![0f32; 2 * n * k];
            dequantize(format.ggml_type(), &blocks, &mut w).unwrap();
            let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!(scale.is_finite() && scale > 0.0, "{format:?}: weights {scale}");
            let seg = upload_segment(&gpu, format, &blocks, 2 * n, k);
            let ctx = format!("{format:?} n {n} k {k}");

            // Dequantization: exact (products of an f16 and a small integer, in f32, bf16-rounded).
            let out = gpu.alloc(2 * n * k * 2, "dequant").unwrap();
            let d = DequantCall {
                format,
                w: seg.ptr(),
                out: out.ptr(),
                n: 2 * n as i32,
                k: k as i32,
                first: 0,
                rows: 2 * n as i32,
            };
            // SAFETY: seg holds 2n x k of `format`, out 2n x k bf16.
            unsafe { d.launch(&gpu, &kernels) }.unwrap();
            let got = read_bf16(&gpu, &out, 2 * n * k);
            let worst = got
                .iter()
                .zip(&w)
                .map(|(g, v)| (g - bf16_value(bf16_bits(*v))).abs())
                .fold(0f32, f32::max);
            assert!(worst <= 1e-6 * scale, "{ctx}: dequant off by {worst}");
            // A slab: rows n - 3 .. n + 4 of the segment, to the start of `out`.
            let slab = DequantCall {
                first: n as i32 - 3,
                rows: 7,
                ..d
            };
            // SAFETY: as above, 7 rows.
            unsafe { slab.launch(&gpu, &kernels) }.unwrap();
            let got = read_bf16(&gpu, &out, 7 * k);
            let want = &w[(n - 3) * k..(n + 4) * k];
            let worst = got
                .iter()
                .zip(want)
                .map(|(g, v)| (g - bf16_value(bf16_bits(*v))).abs())
                .fold(0f32, f32::max);
            assert!(worst <= 1e-6 * scale, "{ctx}: dequant of a slab off by {worst}");

            // Embedding rows 3 and 2n - 1 and an id outside the table.
            let ids = [3u32, 2 * n as u32 - 1, 10_000_000];
            let tokens = gpu.upload(&ids, "ids").unwrap();
            let emb = gpu.alloc(3 * k * 4, "emb").unwrap();
            let e = QuantEmbeddingCall {
                format,
                table: seg.ptr(),
                tokens: tokens.ptr(),
                out: emb.ptr(),
                hidden: k as i32,
                vocab_start: 0,
                vocab_rows: 2 * n as i32,
                rows: 3,
            };
            // SAFETY: table 2n x k, 3 ids, emb 3 x k f32.
            unsafe { e.launch(&gpu, &kernels) }.unwrap();
            let mut got = vec![0f32; 3 * k];
            gpu.read(&emb, 0, &mut got).unwrap();
            for (i, &id) in ids.iter().enumerate() {
                let want: &[f32] = if (id as usize) < 2 * n {
                    &w[id as usize * k..(id as usize + 1) * k]
                } else {
                    &[0.0; 4096][..k]
                };
                let row = &got[i * k..(i + 1) * k];
                let off = row.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(off <= 1e-6 * scale, "{ctx}: embedding of {id} off by {off}");
            }

            for t in [1usize, 3, 8] {
                let xb = random_bf16(t * k, 7 + t as u64);
                let x: Vec<f32> = xb.iter().map(|&b| bf16_value(b)).collect();
                let xd = gpu.upload(&xb, "x").unwrap();
                // Three tokens take two passes (the `high` activations), one and eight one.
                let two_pass = t == 3;
                let (xq, xs, xhat, sum_gap) = quantize_on_gpu(&gpu, &kernels, &x, &xd, (k, t), two_pass);
                // The products of the int8 values; a block's min or offset applies to the exact
                // sum, off from the int8 values' by sum_gap, times at most `scale` (the fixture's
                // mins are below its largest weight).
                let want = |j: usize, r: usize| dot(&w[r * k..(r + 1) * k], &xhat[j * k..(j + 1) * k]);
                let tol_of = |j: usize| 2e-5 * scale as f64 * k as f64 + scale as f64 * sum_gap[j];

                // Plain, f32 out into a wider output (ld = 2n + 5), rows n..2n.
                let ld = 2 * n + 5;
                let y = gpu.alloc(t * ld * 4, "y").unwrap();
                gpu.zero(&y, 0, t * ld * 4).unwrap();
                let plain = QuantGemvCall {
                    format,
                    w: seg.ptr(),
                    x: xq.ptr(),
                    x_scales: xs.ptr(),
                    two_pass: two_pass as i32,
                    y: y.ptr(),
                    n: 2 * n as i32,
                    k: k as i32,
                    t: t as i32,
                    ld: ld as i32,
                    out_f32: 1,
                    norm_in: 0,
                    eps: 0.0,
                };
                // SAFETY: seg 2n x k, x t x k int8 blocks, y t x ld f32.
                unsafe { plain.launch(&gpu, &kernels) }.unwrap();
                let mut got = vec![0f32; t * ld];
                gpu.read(&y, 0, &mut got).unwrap();
                for j in 0..t {
                    for r in 0..2 * n {
                        let (a, b) = (got[j * ld + r] as f64, want(j, r));
                        assert!(
                            (a - b).abs() <= tol_of(j),
                            "{ctx} t {t}: gemv row {r} token {j}: {a} vs {b}"
                        );
                    }
                    assert_eq!(got[j * ld + 2 * n], 0.0, "{ctx}: wrote past its rows");
                }

                // Gate (rows 0..n) and up (n..2n) with SiLU, bf16 out.
                let act = gpu.alloc(t * n * 2, "act").unwrap();
                let silu = QuantGemvSiluCall {
                    format,
                    w: seg.ptr(),
                    x: xq.ptr(),
                    x_scales: xs.ptr(),
                    two_pass: two_pass as i32,
                    out: act.ptr(),
                    inter: n as i32,
                    k: k as i32,
                    t: t as i32,
                    norm_in: 0,
                    eps: 0.0,
                };
                // SAFETY: as above; act t x n bf16.
                unsafe { silu.launch(&gpu, &kernels) }.unwrap();
                let got = read_bf16(&gpu, &act, t * n);
                for j in 0..t {
                    for r in 0..n {
                        let (g, u) = (want(j, r), want(j, n + r));
                        let s = g / (1.0 + (-g).exp()) * u;
                        let a = got[j * n + r] as f64;
                        let bound = 1e-2 * s.abs() + tol_of(j) * (u.abs() + g.abs() + 1.0);
                        assert!(
                            (a - s).abs() <= bound,
                            "{ctx} t {t}: silu row {r} token {j}: {a} vs {s}"
                        );
                    }
                }

                // Residual over all 2n rows, times the next norm's weights, with its sums.
                let case = ResidualCase::new(&gpu, t, 2 * n);
                let residual = QuantGemvResidualCall {
                    format,
                    w: seg.ptr(),
                    x: xq.ptr(),
                    x_scales: xs.ptr(),
                    two_pass: two_pass as i32,
                    res: case.res.ptr(),
                    res_bf16: case.res_bf16.ptr(),
                    norm_out: case.sums.ptr(),
                    next_norm: case.next_norm_on_gpu.ptr(),
                    n: 2 * n as i32,
                    k: k as i32,
                    t: t as i32,
                };
                // SAFETY: res t x 2n f32, res_bf16 t x 2n bf16, sums t slots, g 2n f32.
                unsafe { residual.launch(&gpu, &kernels) }.unwrap();
                case.check(&gpu, want, |j, _| tol_of(j), &format!("{ctx} t {t}"));
            }
        }
    }
}

/// x rounded to bf16 (nearest, ties to even) from f64, as one bf16 fma rounds its exact result.
fn round_to_bf16(x: f64) -> f64 {
    if x == 0.0 {
        return 0.0;
    }
    let exp = ((x.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let ulp = 2f64.powi(exp - 7);
    (x / ulp).round_ties_even() * ulp
}

/// Every value of a Q4_K or Q6_K file's blocks as (q - offset, scale, bias), where the value is
/// (q - offset) times scale plus bias, the scale and bias in f32 as quant.cu works them out; None
/// for the formats without wide tiles.
fn wide_value_parts(format: QuantFormat, blocks: &[u8]) -> Option<Vec<(i32, f32, f32)>> {
    let f16 = |b: &[u8], at: usize| half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    let mut out = Vec::new();
    for b in blocks.chunks_exact(format.block_bytes()) {
        match format {
            QuantFormat::Q4K => {
                let (d, dmin) = (f16(b, 0), f16(b, 2));
                let (scales, mins) = scales_and_mins(b[4..16].try_into().unwrap());
                for j in 0..8 {
                    let (sc, mn) = (scales[j] as f32, mins[j] as f32);
                    for l in 0..32 {
                        let q = (b[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) as i32 & 0xF;
                        out.push((q, d * sc, -(dmin * mn)));
                    }
                }
            }
            QuantFormat::Q6K => {
                let d = f16(b, 208);
                for i in 0..256 {
                    let (h, j, l) = (i / 128, (i / 32) % 4, i % 32);
                    let low = (b[64 * h + 32 * (j % 2) + l] >> (4 * (j / 2))) as i32 & 0xF;
                    let high = (b[128 + 32 * h + l] >> (2 * j)) as i32 & 3;
                    out.push((
                        (low | high << 4) - 32,
                        d * b[192 + 8 * h + 2 * j + l / 16] as i8 as f32,
                        0.0,
                    ));
                }
            }
            _ => return None,
        }
    }
    Some(out)
}

/// The weights the wide tiles decode (quant.cu's QWIDE_BF16X2, the default): (q - offset) times
/// the scale in bf16 plus the bias in bf16, rounded once.
fn bf16_pair_weights(format: QuantFormat, blocks: &[u8]) -> Option<Vec<f64>> {
    let in_bf16 = |v: f32| bf16_value(bf16_bits(v)) as f64;
    let parts = wide_value_parts(format, blocks)?;
    Some(
        parts
            .into_iter()
            .map(|(q, s, b)| round_to_bf16(q as f64 * in_bf16(s) + in_bf16(b)))
            .collect(),
    )
}

#[test]
fn the_wide_tile_decode_model_follows_the_cpu_dequantizer() {
    // No GPU needed: the parts bf16_pair_weights rounds must give the CPU's weights unrounded.
    for format in QUANT_FORMATS {
        let (n, k) = (3, 512);
        let blocks = random_blocks(format, n, k, 7);
        let mut w = vec![0f32; n * k];
        dequantize(format.ggml_type(), &blocks, &mut w).unwrap();
        let Some(parts) = wide_value_parts(format, &blocks) else {
            assert!(!format.has_wide_tiles(), "{format:?} has wide tiles but no model");
            continue;
        };
        assert_eq!(parts.len(), w.len());
        for (i, ((q, s, b), &want)) in parts.into_iter().zip(&w).enumerate() {
            let got = q as f64 * s as f64 + b as f64;
            let size = (q as f64 * s as f64).abs() + (b as f64).abs();
            assert!(
                (got - want as f64).abs() <= 1e-6 * size,
                "{format:?} value {i}: {got} vs {want}"
            );
        }
    }
    assert_eq!(round_to_bf16(1.0 + 1.0 / 256.0), 1.0, "a tie rounds to even");
    assert_eq!(round_to_bf16(1.0 + 3.0 / 256.0), 1.0 + 1.0 / 64.0);
    assert_eq!(round_to_bf16(-3.0), -3.0);
}

#[test]
fn quantized_gemm_matches_the_bf16_rounded_weights() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    // quant.cu's tensor-core GEMMs over quantized blocks: the tiles as compiled here, and the wide
    // tiles (of 256, 64, 128 and 192 tokens) of the formats that have them where quant.cu has
    // wgmma.
    for format in QUANT_FORMATS {
        let wide = match kernels.wide_tiles() && format.has_wide_tiles() {
            true => QuantGemmTile::WIDE.to_vec(),
            false => Vec::new(),
        };
        let tiles: Vec<QuantGemmTile> = [QuantGemmTile::Registers, kernels.shared_tile()]
            .into_iter()
            .chain(wide)
            .collect();
        // Rows past a 128-row tile and short of one; tokens within one 64-token tile, past it,
        // a partial third and past four (of 128-token tiles: within one, a partial second and
        // past two; of 256: within one, a partial second); k of 6 and 22 steps of 128 columns
        // (12 and 44 of 64). Every GEMM, whole and with k split 3 ways.
        for (n, k) in [(37usize, 768usize), (258, 2816)] {
            let blocks = random_blocks(format, n, k, 3 * n as u64 + k as u64);
            let mut w = vec![0f32; n * k];
            dequantize(format.ggml_type(), &blocks, &mut w).unwrap();
            let wb: Vec<f64> = w.iter().map(|&v| bf16_value(bf16_bits(v)) as f64).collect();
            let seg = upload_segment(&gpu, format, &blocks, n, k);
            // The wide tiles' weights, unless built with their f32 decode (QWIDE_BF16X2=0).
            let f32_wide = std::env::var("STRATA_KERNEL_DEFINES").is_ok_and(|d| d.contains("QWIDE_BF16X2=0"));
            let wide_weights = (!f32_wide).then(|| bf16_pair_weights(format, &blocks)).flatten();
            for (t, tile) in [9usize, 70, 130, 300]
                .into_iter()
                .flat_map(|t| tiles.iter().map(move |&tile| (t, tile)))
            {
                let xb = random_bf16(t * k, 11 + t as u64);
                let x: Vec<f64> = xb.iter().map(|&b| bf16_value(b) as f64).collect();
                let xd = gpu.upload(&xb, "x").unwrap();
                let steps = k / tile.k_step();
                // f32 into a wider output (ld = n + 3); bf16 with k split three ways.
                let ld = n + 3;
                let y = gpu.alloc(t * ld * 4, "y").unwrap();
                gpu.zero(&y, 0, t * ld * 4).unwrap();
                let parts = gpu.alloc(3 * t * n * 4, "parts").unwrap();
                let yb = gpu.alloc(t * n * 2, "y bf16").unwrap();
                let whole = QuantGemmCall {
                    format,
                    tile,
                    w: seg.ptr(),
                    x: xd.ptr(),
                    y: y.ptr(),
                    parts: 0,
                    n: n as i32,
                    k: k as i32,
                    t: t as i32,
                    ld: ld as i32,
                    out_f32: 1,
                    steps_per_split: steps as i32,
                    x_map: TmaMap::NONE,
                    w_maps: [TmaMap::NONE; 3],
                    tail: 0,
                    tail_splits: 1,
                };
                let whole = whole.with_maps(&kernels).unwrap();
                // SAFETY: seg n x k of `format`, x t x k bf16, y t x ld f32.
                unsafe { whole.launch(&gpu, &kernels) }.unwrap();
                let split = QuantGemmCall {
                    y: yb.ptr(),
                    parts: parts.ptr(),
                    ld: n as i32,
                    out_f32: 0,
                    steps_per_split: steps.div_ceil(3) as i32,
                    ..whole
                };
                assert_eq!(split.grid_splits(), 3);
                // SAFETY: as above; parts 3 x t x n f32.
                unsafe { split.launch(&gpu, &kernels) }.unwrap();
                let reduce = split.reduce().expect("k split three ways");
                // SAFETY: parts 3 x t x n f32, yb t x n bf16.
                unsafe { reduce.launch(&gpu, &kernels) }.unwrap();
                let mut got = vec![0f32; t * ld];
                gpu.read(&y, 0, &mut got).unwrap();
                let got_bf16 = read_bf16(&gpu, &yb, t * n);
                // The wide tiles again with k split 3 ways in their last two row tiles (or the
                // only one), and 5 ways (the last share empty where k has few steps); the tail's
                // sums added into y by the reduce.
                let tails: Vec<Vec<f32>> = if tile.is_wide() {
                    [3, 5]
                        .into_iter()
                        .map(|ways| {
                            let tail_parts = gpu.alloc(ways as usize * t * n * 4, "tail parts").unwrap();
                            let tail = QuantGemmCall {
                                parts: tail_parts.ptr(),
                                tail: n.div_ceil(128).min(2) as i32,
                                tail_splits: ways,
                                ..whole
                            };
                            gpu.zero(&y, 0, t * ld * 4).unwrap();
                            let reduce = tail.reduce().expect("the tail's k splits");
                            // SAFETY: as the whole call; tail_parts holds ways x t x n f32.
                            unsafe {
                                tail.launch(&gpu, &kernels).unwrap();
                                reduce.launch(&gpu, &kernels).unwrap();
                            }
                            let mut got = vec![0f32; t * ld];
                            gpu.read(&y, 0, &mut got).unwrap();
                            got
                        })
                        .collect()
                } else {
                    Vec::new()
                };
                let ctx = format!("{format:?} {tile:?} n {n} k {k} t {t}");
                let weights = match (&wide_weights, tile) {
                    (Some(ww), tile) if tile.is_wide() => ww,
                    _ => &wb,
                };
                for j in 0..t {
                    for r in 0..n {
                        let (wr, xr) = (&weights[r * k..(r + 1) * k], &x[j * k..(j + 1) * k]);
                        let want: f64 = wr.iter().zip(xr).map(|(a, b)| a * b).sum();
                        let size: f64 = wr.iter().zip(xr).map(|(a, b)| (a * b).abs()).sum();
                        let a = got[j * ld + r] as f64;
                        assert!(
                            (a - want).abs() <= 1e-4 * size + 1e-9,
                            "{ctx}: row {r} token {j}: {a} vs {want}"
                        );
                        for (i, p) in tails.iter().enumerate() {
                            let a = p[j * ld + r] as f64;
                            assert!(
                                (a - want).abs() <= 1e-4 * size + 1e-9,
                                "{ctx}: tail {i}, row {r} token {j}: {a} vs {want}"
                            );
                        }
                        let b = got_bf16[j * n + r] as f64;
                        assert!(
                            (b - want).abs() <= 1e-4 * size + want.abs() / 128.0 + 1e-9,
                            "{ctx}: split row {r} token {j}: {b} vs {want}"
                        );
                    }
                    assert_eq!(got[j * ld + n], 0.0, "{ctx}: wrote past its rows");
                    for p in &tails {
                        assert_eq!(p[j * ld + n], 0.0, "{ctx}: with a tail, wrote past its rows");
                    }
                }
            }
        }
    }
}

#[test]
fn a_wide_pair_computes_what_its_segments_compute_alone() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    if !kernels.wide_tiles() {
        eprintln!("skipped: quant.cu has no wide tiles on this GPU (they need sm_90a)");
        return;
    }
    // A Q4_K segment of whole tiles, then a Q6_K one of part of a tile (a QKV whose v rows are
    // Q6_K): one launch of both must give the bits of each launched alone with the same k
    // steps a block, whole (into an f32 y wider than the product) and split 3 ways (bf16 after
    // one reduce of all rows against one a segment), on each wide tile.
    let (n0, n1, k) = (256usize, 70usize, 2816usize);
    let n = n0 + n1;
    let blocks0 = random_blocks(QuantFormat::Q4K, n0, k, 5);
    let blocks1 = random_blocks(QuantFormat::Q6K, n1, k, 6);
    let (seg0, seg1) = (
        upload_segment(&gpu, QuantFormat::Q4K, &blocks0, n0, k),
        upload_segment(&gpu, QuantFormat::Q6K, &blocks1, n1, k),
    );
    let steps = k / QuantGemmTile::Wide256.k_step();
    for (t, tile) in [40usize, 130, 300]
        .into_iter()
        .flat_map(|t| QuantGemmTile::WIDE.map(|tile| (t, tile)))
    {
        let xd = gpu.upload(&random_bf16(t * k, 40 + t as u64), "x").unwrap();
        let ld = n + 3;
        for (splits, out_f32) in [(1usize, 1i32), (3, 0)] {
            let elem = if out_f32 == 1 { 4 } else { 2 };
            let ys: Vec<DeviceBuffer> = (0..2)
                .map(|_| {
                    let y = gpu.alloc(t * ld * elem, "y").unwrap();
                    gpu.zero(&y, 0, t * ld * elem).unwrap();
                    y
                })
                .collect();
            let parts = gpu.alloc(splits * t * n * 4, "parts").unwrap();
            let alone = |y: u64, seg: &DeviceBuffer, format, rows, first_row: usize| {
                let call = QuantGemmCall {
                    format,
                    tile,
                    w: seg.ptr(),
                    x: xd.ptr(),
                    y: y + (first_row * elem) as u64,
                    parts: parts.ptr(),
                    n: rows as i32,
                    k: k as i32,
                    t: t as i32,
                    ld: ld as i32,
                    out_f32,
                    steps_per_split: steps.div_ceil(splits) as i32,
                    x_map: TmaMap::NONE,
                    w_maps: [TmaMap::NONE; 3],
                    tail: 0,
                    tail_splits: 1,
                };
                call.with_maps(&kernels).unwrap()
            };
            let (a, b) = (
                alone(ys[0].ptr(), &seg0, QuantFormat::Q4K, n0, 0),
                alone(ys[0].ptr(), &seg1, QuantFormat::Q6K, n1, n0),
            );
            // SAFETY: segments n0 and n1 x k of their formats, x t x k bf16, y t x ld, parts
            // splits x t x n f32; each alone call's reduce runs before the next call reuses parts.
            unsafe {
                for call in [a, b] {
                    call.launch(&gpu, &kernels).unwrap();
                    if let Some(r) = call.reduce() {
                        r.launch(&gpu, &kernels).unwrap();
                    }
                }
            }
            let pair = QuantGemmPairCall::of(QuantGemmCall { y: ys[1].ptr(), ..a }, b).expect("a Q4_K, Q6_K pair");
            assert_eq!(pair.reduce().is_some(), splits > 1);
            // SAFETY: as above, into the second y.
            unsafe {
                pair.launch(&gpu, &kernels).unwrap();
                if let Some(r) = pair.reduce() {
                    r.launch(&gpu, &kernels).unwrap();
                }
            }
            let read = |y: &DeviceBuffer| {
                let mut bytes = vec![0u8; t * ld * elem];
                gpu.read(y, 0, &mut bytes).unwrap();
                bytes
            };
            let (want, got) = (read(&ys[0]), read(&ys[1]));
            let first_diff = want.iter().zip(&got).position(|(w, g)| w != g);
            assert!(
                first_diff.is_none(),
                "{tile:?} t {t}, {splits} splits: the pair differs from its segments alone at byte {first_diff:?}"
            );
            assert!(
                want.iter().any(|&v| v != 0),
                "{tile:?} t {t}, {splits} splits: nothing written"
            );
        }
    }
}

#[test]
fn norms_sum_the_k_splits_as_qgemm_reduce_does() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    // A quantized GEMM into `proj` that split k leaves [splits, t, n] f32 sums; the norm after it
    // (add_rms_norm) or the last residual add (add_residual) adds them itself. Both must give
    // the bits qgemm_reduce into `proj` and the one-array kernels give.
    let (n, eps) = (576usize, 1e-5f32);
    for (t, splits) in [(1usize, 2usize), (7, 4), (130, 3)] {
        // Parts of mixed magnitudes, so the order of the additions shows in the bits.
        let parts: Vec<f32> = random_f32(splits * t * n, 90 + t as u64)
            .iter()
            .enumerate()
            .map(|(i, v)| v * [1.0, 3e4, 1e-3, 7.0][i % 4])
            .collect();
        let x0 = random_f32(t * n, 91 + t as u64);
        let gamma: Vec<f32> = random_f32(n, 92).into_iter().map(|v| 0.5 + v.abs()).collect();
        let (p, g) = (
            gpu.upload(&parts, "parts").unwrap(),
            gpu.upload(&gamma, "gamma").unwrap(),
        );
        for add_only in [false, true] {
            let run = |delta: u64, splits: usize, reduce_first: bool| {
                let x = gpu.upload(&x0, "x").unwrap();
                let out = gpu.alloc(t * n * 2, "out").unwrap();
                let proj = gpu.alloc(t * n * 4, "proj").unwrap();
                let reduce = QuantGemmReduceCall {
                    parts: p.ptr(),
                    y: proj.ptr(),
                    n: n as i32,
                    t: t as i32,
                    ld: n as i32,
                    splits: splits as i32,
                    out_f32: 1,
                };
                let (delta, splits) = if reduce_first {
                    (proj.ptr(), 1)
                } else {
                    (delta, splits as i32)
                };
                let op = if add_only {
                    NormOp::Add { delta, splits }
                } else {
                    NormOp::AddNorm { delta, splits }
                };
                let norm = NormCall {
                    op,
                    x: x.ptr(),
                    weight: g.ptr(),
                    out: out.ptr(),
                    n: n as i32,
                    eps,
                    rows: t,
                    float32: false,
                    fp8: None,
                };
                // SAFETY: parts holds splits x t x n f32, x and proj t x n f32, out t x n bf16.
                unsafe {
                    if reduce_first {
                        reduce.launch(&gpu, &kernels).unwrap();
                    }
                    norm.launch(&gpu, &kernels).unwrap();
                }
                let mut got = vec![0f32; t * n];
                gpu.read(&x, 0, &mut got).unwrap();
                (got, read_bf16(&gpu, &out, t * n))
            };
            let (want_x, want_out) = run(0, splits, true);
            let (got_x, got_out) = run(p.ptr(), splits, false);
            let case = format!("t {t}, {splits} splits, add only: {add_only}");
            assert_eq!(got_x, want_x, "{case}: the residual differs from qgemm_reduce's");
            if !add_only {
                assert_eq!(got_out, want_out, "{case}: the normed rows differ");
            }
            // The sums moved the residual: the parts were read.
            assert!(got_x.iter().zip(&x0).any(|(a, b)| a != b), "{case}: nothing added");
        }
    }
}
