//! Throughput of the quantized dot-product kernels: GB/s of weight bytes, one thread, every
//! kernel this CPU runs (AVX-512 VNNI, AVX2; scalar too with QUANT_DOT_BENCH_SCALAR=1).
//! `cargo bench -p strata-runtime --bench quant_dot [-- FILTER]`; "hot" reuses one matrix
//! (cache-resident when it fits), "cold" cycles through copies totalling 256 MiB (DRAM);
//! "G MAC/s" is the hot figure in multiply-adds (what bounds many-row decode steps).

use std::hint::black_box;
use std::time::{Duration, Instant};

use strata_formats::GgmlType;
use strata_runtime::cpu::quant_dot::{act_row_bytes, kernels_for, quantize_act_row, weight_row_bytes, DotKernel};

const TYPES: [GgmlType; 11] = [
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::F32,
];

/// Deterministic filler bytes (xorshift), with finite f16 scales where the type has them.
fn weights(ty: GgmlType, n: usize, rows: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut w: Vec<u8> = (0..weight_row_bytes(ty, n) * rows)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s as u8
        })
        .collect();
    let half = half::f16::from_f32(0.01).to_le_bytes();
    let scale_offs: &[usize] = match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4K | GgmlType::Q5K => &[0, 2],
        GgmlType::Q6K => &[208],
        GgmlType::F16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&half);
            }
            &[]
        }
        GgmlType::F32 => {
            for c in w.chunks_exact_mut(4) {
                c.copy_from_slice(&0.01f32.to_le_bytes());
            }
            &[]
        }
        _ => &[],
    };
    for blk in w.chunks_exact_mut(ty.block_bytes()) {
        for &o in scale_offs {
            blk[o..o + 2].copy_from_slice(&half);
        }
    }
    w
}

/// Runs `f` (one pass over `bytes` weight bytes) until `budget` elapses; best GB/s.
fn measure(bytes: usize, budget: Duration, mut f: impl FnMut()) -> f64 {
    f();
    let start = Instant::now();
    let mut best = f64::MAX;
    while start.elapsed() < budget {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    bytes as f64 / best / 1e9
}

fn bench_one(k: &DotKernel, rows: usize, n: usize, m: usize, cold: bool) -> f64 {
    let ty = k.weight_type();
    let fmt = k.act_format();
    let ab = act_row_bytes(fmt, n);
    let mut acts = vec![0u8; ab * m];
    for (j, a) in acts.chunks_exact_mut(ab).enumerate() {
        let x: Vec<f32> = (0..n).map(|i| ((i * 7 + j * 13) % 29) as f32 - 14.0).collect();
        quantize_act_row(fmt, &x, a);
    }
    let file = weights(ty, n, rows, 0x1234_5678);
    let mut one = vec![0u8; k.layout().matrix_bytes(ty, rows, n)];
    k.layout().pack(ty, rows, n, &file, &mut one);
    let copies = if cold { (256 << 20) / one.len().max(1) + 1 } else { 1 };
    let mats: Vec<Vec<u8>> = (0..copies).map(|_| one.clone()).collect();
    let mut out = vec![0f32; rows * m];
    let mut next = 0;
    let budget = Duration::from_millis(if cold { 1500 } else { 400 });
    measure(one.len(), budget, || {
        let w = &mats[next];
        next = (next + 1) % mats.len();
        k.dot_matrix(n, black_box(w), rows, black_box(&acts), m, &mut out);
        black_box(&out);
    })
}

fn main() {
    let filter: Option<String> = std::env::args().skip(1).find(|a| !a.starts_with('-'));
    println!("type   isa         shape          m   hot GB/s  cold GB/s  G MAC/s");
    for ty in TYPES {
        if filter.as_deref().is_some_and(|f| !ty.name().eq_ignore_ascii_case(f)) {
            continue;
        }
        let n = if ty.block_len() == 256 { 768 } else { 576 };
        let with_scalar = std::env::var_os("QUANT_DOT_BENCH_SCALAR").is_some();
        let kernels: Vec<DotKernel> = kernels_for(ty)
            .into_iter()
            .filter(|k| with_scalar || k.isa() != "scalar")
            .collect();
        for k in &kernels {
            // m = 3: a speculative verification step; 1536x8960 a 1.5B model's down projection
            // (long rows: a row group spans 40-60 KiB of K-quants); the last shape is a down
            // projection whose activation rows are too wide for L1 at m = 32.
            for (rows, n, m) in [
                (1536, n, 1),
                (49152, n, 1),
                (1536, 8960, 1),
                (1536, n, 3),
                (1536, n, 4),
                (1536, n, 8),
                (1536, n, 32),
                (576, 2 * n, 32),
            ] {
                let hot = bench_one(k, rows, n, m, false);
                let cold = bench_one(k, rows, n, m, true);
                let macs = hot / weight_row_bytes(ty, n) as f64 * n as f64 * m as f64;
                println!(
                    "{:<6} {:<11} {:>6}x{:<6} {:>3} {:>9.1} {:>10.1} {:>8.1}",
                    ty.name(),
                    k.isa(),
                    rows,
                    n,
                    m,
                    hot,
                    cold,
                    macs
                );
            }
        }
    }
}
