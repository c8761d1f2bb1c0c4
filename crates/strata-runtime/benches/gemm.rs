//! Throughput of the prompt-path f32 GEMM (packed weight panels), one thread, in GFLOP/s.
//! `cargo bench -p strata-runtime --bench gemm`: the SmolLM2 shapes at 512 prompt rows.

use std::hint::black_box;
use std::time::Instant;

use strata_runtime::cpu::gemm::{gemm_packed, pack_panels, packed_len};

fn main() {
    let m = 512;
    // (weight rows of one tile, depth): the projections' tiles and the down projection's.
    for &(n, k) in &[(32usize, 576usize), (64, 576), (32, 1536)] {
        let a: Vec<f32> = (0..m * k).map(|i| ((i * 7919) % 1013) as f32 / 1013.0 - 0.5).collect();
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 104729) % 2039) as f32 / 2039.0 - 0.5)
            .collect();
        let mut panels = vec![0.0; packed_len(n, k)];
        pack_panels(&w, n, k, k, 1, &mut panels);
        let mut d = vec![0.0f32; m * n];
        let reps = 40;
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t = Instant::now();
            for _ in 0..reps {
                // SAFETY: d holds m x n values.
                unsafe { gemm_packed(m, n, k, black_box(&a), k, &panels, d.as_mut_ptr(), n) };
            }
            best = best.min(t.elapsed().as_secs_f64() / reps as f64);
        }
        black_box(&d);
        let gflops = 2.0 * (m * n * k) as f64 / best / 1e9;
        println!("gemm m={m} n={n} k={k}: {:.1} us, {gflops:.1} GFLOP/s", best * 1e6);
    }
}
