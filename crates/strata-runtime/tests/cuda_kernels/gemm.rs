//! gemm.cu's decode GEMVs against cuBLASLt, a tuned cuBLASLt algorithm against the heuristic's,
//! and the RMSNorm carried between GEMVs against the norm kernels.

use strata_runtime::cuda::gemm_call::NORM_SLOTS;
use strata_runtime::cuda::{
    DeviceBuffer, Gemm, GemmOperands, GemmOut, GemvCall, GemvResidualCall, GemvSiluCall, KernelSpec, Kernels, NormCall,
    NormOp,
};

use crate::common::{
    bf16_bits, bf16_value, compiled_tokens, first_gpu, random_bf16, random_f32, read_bf16, worst_relative,
};

#[test]
fn decode_gemvs_match_cublaslt() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    let mut gemm = Gemm::new(&gpu, GemmOperands::Bf16).unwrap();
    // SmolLM2's k (576: not a multiple of 256), Llama-3-8B's, an odd row count, a long row.
    for (n, k) in [(1000usize, 576usize), (4096, 4096), (333, 1536), (257, 14336)] {
        let w = gpu.upload(&random_bf16(2 * n * k, 1), "w").unwrap();
        for t in 1..=8usize {
            let x = gpu.upload(&random_bf16(t * k, 2 + t as u64), "x").unwrap();
            let reference = gpu.alloc(t * 2 * n * 4, "reference").unwrap();
            let (wp, xp, rp) = (w.ptr(), x.ptr(), reference.ptr());
            // SAFETY: w holds 2n x k, x t x k, reference t x 2n f32.
            unsafe { gemm.matmul(&gpu, wp, xp, rp, (2 * n, k, t), GemmOut::F32) }.unwrap();
            let mut want = vec![0f32; t * 2 * n];
            gpu.read(&reference, 0, &mut want).unwrap();
            // The plain GEMV over the first n rows, f32 out.
            let y = gpu.alloc(t * n * 4, "y").unwrap();
            let plain = GemvCall {
                w: wp,
                x: xp,
                y: y.ptr(),
                n: n as i32,
                k: k as i32,
                t: t as i32,
                out_f32: 1,
                norm_in: 0,
                eps: 0.0,
            };
            assert_eq!(plain.name(), format!("gemv_t{}", compiled_tokens(t)));
            // SAFETY: buffers sized as above.
            unsafe { plain.launch(&gpu, &kernels) }.unwrap();
            let mut got = vec![0f32; t * n];
            gpu.read(&y, 0, &mut got).unwrap();
            let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
            for j in 0..t {
                for r in 0..n {
                    let (a, b) = (got[j * n + r], want[j * 2 * n + r]);
                    assert!(
                        (a - b).abs() <= 1e-4 * scale,
                        "gemv n {n} k {k} t {t}: row {r} token {j}: {a} vs cuBLASLt {b}"
                    );
                }
            }
            // The gate/up variant over all 2n rows (gate = first n), silu(gate) * up in bf16.
            let act = gpu.alloc(t * n * 2, "act").unwrap();
            let silu = GemvSiluCall {
                w: wp,
                x: xp,
                out: act.ptr(),
                inter: n as i32,
                k: k as i32,
                t: t as i32,
                norm_in: 0,
                eps: 0.0,
            };
            // SAFETY: buffers sized as above.
            unsafe { silu.launch(&gpu, &kernels) }.unwrap();
            let mut got = vec![0u16; t * n];
            gpu.read(&act, 0, &mut got).unwrap();
            let bf = |v: f32| bf16_value(bf16_bits(v));
            let mut worst = 0f32;
            let mut largest = 0f32;
            for j in 0..t {
                for r in 0..n {
                    let (g, u) = (bf(want[j * 2 * n + r]), bf(want[j * 2 * n + n + r]));
                    let expect = g / (1.0 + (-g).exp()) * u;
                    let a = bf16_value(got[j * n + r]);
                    worst = worst.max((a - expect).abs());
                    largest = largest.max(expect.abs());
                }
            }
            assert!(
                worst <= 0.02 * largest,
                "gemv_silu n {n} k {k} t {t}: off by {worst} of {largest}"
            );
        }
    }
}

#[test]
fn a_tuned_gemm_computes_what_the_heuristic_one_does() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let mut gemm = Gemm::new(&gpu, GemmOperands::Bf16).unwrap();
    let (n, k, t) = (1024usize, 2048usize, 96usize);
    let weights: Vec<DeviceBuffer> = (0..4)
        .map(|i| gpu.upload(&random_bf16(n * k, 90 + i), "w").unwrap())
        .collect();
    let x = gpu.upload(&random_bf16(t * k, 99), "x").unwrap();
    let y = gpu.alloc(t * n * 4, "y").unwrap();
    let ptrs: Vec<u64> = weights.iter().map(|w| w.ptr()).collect();
    let (xp, yp) = (x.ptr(), y.ptr());
    let product = |gemm: &mut Gemm| {
        let mut out = vec![0f32; t * n];
        // SAFETY: w is n x k bf16, x t x k bf16, y t x n f32.
        unsafe { gemm.matmul(&gpu, ptrs[3], xp, yp, (n, k, t), GemmOut::F32) }.unwrap();
        gpu.read(&y, 0, &mut out).unwrap();
        out
    };
    let before = product(&mut gemm);
    // SAFETY: as above, for each of the four matrices.
    let (first, best) = unsafe { gemm.tune(&gpu, &ptrs, xp, yp, (n, k, t), GemmOut::F32, None) }.unwrap();
    eprintln!("{n}x{k}, {t} tokens, 4 matrices: heuristic's first {first:.3} ms, kept {best:.3} ms");
    assert!(
        best > 0.0 && best <= first,
        "kept {best} ms against the first choice's {first} ms"
    );
    let after = product(&mut gemm);
    // Another algorithm may sum in another order (split k), not to another value.
    let rel = worst_relative(&after, &before);
    assert!(rel <= 1e-4, "the tuned algorithm's products differ by {rel}");
}

#[test]
fn norms_carried_by_the_gemvs_equal_the_norm_kernels() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    let eps = 1e-5f32;
    // (hidden, the residual GEMV's k, the next GEMV's rows): SmolLM2's o projection and
    // gate/up, Llama-3-8B's hidden size.
    for (h, k_in, n_out) in [(576usize, 576usize, 1536usize), (4096, 4096, 1024)] {
        let w_res = gpu.upload(&random_bf16(h * k_in, 61), "w_res").unwrap();
        let gamma: Vec<f32> = random_f32(h, 62).into_iter().map(|v| 0.5 + v.abs()).collect();
        let w_next = random_bf16(n_out * h, 63);
        // weights.rs's fold: column c times gamma[c], rounded once.
        let folded: Vec<u16> = w_next
            .iter()
            .enumerate()
            .map(|(i, &b)| bf16_bits(bf16_value(b) * gamma[i % h]))
            .collect();
        let (g, w_next, folded) = (
            gpu.upload(&gamma, "gamma").unwrap(),
            gpu.upload(&w_next, "w_next").unwrap(),
            gpu.upload(&folded, "folded").unwrap(),
        );
        // Residual magnitudes whose sums of squares take the fine sum, and (300) the coarse one.
        for magnitude in [1e-3f32, 1.0, 300.0] {
            for t in [1usize, 3, 8] {
                let x0: Vec<f32> = random_f32(t * h, 70 + t as u64).iter().map(|v| v * magnitude).collect();
                let a = gpu.upload(&random_bf16(t * k_in, 80 + t as u64), "a").unwrap();
                let (h32, k32, n32, t32) = (h as i32, k_in as i32, n_out as i32, t as i32);
                // The kernels' way: the f32 projection, add_rms_norm, the next GEMV.
                let x_ref = gpu.upload(&x0, "x").unwrap();
                let proj = gpu.alloc(t * h * 4, "proj").unwrap();
                let xn = gpu.alloc(t * h * 2, "xn").unwrap();
                let y_ref = gpu.alloc(t * n_out * 2, "y").unwrap();
                let projection = GemvCall {
                    w: w_res.ptr(),
                    x: a.ptr(),
                    y: proj.ptr(),
                    n: h32,
                    k: k32,
                    t: t32,
                    out_f32: 1,
                    norm_in: 0,
                    eps: 0.0,
                };
                let add_norm = NormCall {
                    op: NormOp::AddNorm {
                        delta: proj.ptr(),
                        splits: 1,
                    },
                    x: x_ref.ptr(),
                    weight: g.ptr(),
                    out: xn.ptr(),
                    n: h32,
                    eps,
                    rows: t,
                    float32: false,
                    fp8: None,
                };
                let next = GemvCall {
                    w: w_next.ptr(),
                    x: xn.ptr(),
                    y: y_ref.ptr(),
                    n: n32,
                    k: h32,
                    out_f32: 0,
                    ..projection
                };
                // SAFETY: buffers sized as above.
                unsafe {
                    projection.launch(&gpu, &kernels).unwrap();
                    add_norm.launch(&gpu, &kernels).unwrap();
                    next.launch(&gpu, &kernels).unwrap();
                }
                let mut want_x = vec![0f32; t * h];
                gpu.read(&x_ref, 0, &mut want_x).unwrap();
                let want_y = read_bf16(&gpu, &y_ref, t * n_out);
                // Carried: gemv_residual, then the GEMV over the folded weights scaled by the sums.
                // Twice, to see the atomically added sums give the same bits.
                let mut runs = Vec::new();
                for _ in 0..2 {
                    let x = gpu.upload(&x0, "x").unwrap();
                    let xb = gpu.alloc(t * h * 2, "xb").unwrap();
                    let sums = gpu.upload(&vec![0u64; 8 * NORM_SLOTS * 2], "norm sums").unwrap();
                    let y = gpu.alloc(t * n_out * 2, "y").unwrap();
                    let residual = GemvResidualCall {
                        w: w_res.ptr(),
                        x: a.ptr(),
                        res: x.ptr(),
                        res_bf16: xb.ptr(),
                        norm_out: sums.ptr(),
                        n: h32,
                        k: k32,
                        t: t32,
                    };
                    let normed = GemvCall {
                        w: folded.ptr(),
                        x: xb.ptr(),
                        y: y.ptr(),
                        norm_in: sums.ptr(),
                        eps,
                        ..next
                    };
                    // SAFETY: buffers sized as above; sums holds 8 tokens x NORM_SLOTS x 2 u64.
                    unsafe {
                        residual.launch(&gpu, &kernels).unwrap();
                        normed.launch(&gpu, &kernels).unwrap();
                    }
                    let mut got_x = vec![0f32; t * h];
                    gpu.read(&x, 0, &mut got_x).unwrap();
                    let case = format!("hidden {h}, magnitude {magnitude}, t {t}");
                    assert_eq!(got_x, want_x, "{case}: the residual differs from add_rms_norm's");
                    let got_xb = read_bf16(&gpu, &xb, t * h);
                    let rounded: Vec<f32> = want_x.iter().map(|&v| bf16_value(bf16_bits(v))).collect();
                    assert_eq!(got_xb, rounded, "{case}: the bf16 residual is not the f32 one rounded");
                    let got_y = read_bf16(&gpu, &y, t * n_out);
                    let rel = worst_relative(&got_y, &want_y);
                    assert!(rel <= 1.0 / 64.0, "{case}: the next GEMV is off by {rel}");
                    runs.push(got_y);
                }
                assert!(
                    runs[0].iter().zip(&runs[1]).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "hidden {h}, magnitude {magnitude}, t {t}: two runs differ"
                );
            }
        }
    }
}
