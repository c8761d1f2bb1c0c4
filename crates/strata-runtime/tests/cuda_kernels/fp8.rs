//! fp8.cu against a CPU reference: the decode GEMVs (plain, gate/up with SiLU, residual with the
//! next norm's sums), dequantization to bf16, and the FP8 tensor-core product (activation
//! quantization, cuBLASLt on E4M3, output scaling) where the GPU has FP8 tensor cores; and the
//! kernels that fuse the activation quantization and scaling (norm.cu's and activation.cu's
//! `*_fp8`) against the kernels they replace.

use strata_runtime::cuda::{
    DeviceBuffer, Fp8DequantCall, Fp8Gemv, Fp8GemvCall, Fp8GemvResidualCall, Fp8GemvSiluCall, Fp8QuantizeRowsCall,
    Fp8ScaleOutputCall, Gemm, GemmOperands, GemmOut, Gpu, KernelSpec, Kernels, NormCall, NormOp, SiluMulCall,
    SiluMulFp8Call,
};

use crate::common::{bf16_bits, bf16_value, first_gpu, random_bf16, random_f32, read_bf16, xorshift, ResidualCase};

/// The value of an E4M3 byte (OCP "fn": no infinities; 0x7f and 0xff are NaN).
fn e4m3(b: u8) -> f32 {
    let (e, m) = (((b >> 3) & 15) as i32, (b & 7) as f32);
    let v = if e == 0 {
        m / 512.0
    } else {
        (1.0 + m / 8.0) * 2f32.powi(e - 7)
    };
    if b & 0x80 != 0 {
        -v
    } else {
        v
    }
}

/// `count` random E4M3 bytes, NaN left out (every other value, subnormals included).
fn random_e4m3(count: usize, seed: u64) -> Vec<u8> {
    let mut next = xorshift(seed);
    (0..count)
        .map(|_| {
            let b = (next() >> 32) as u8;
            if b & 0x7f == 0x7f {
                b & 0xfe
            } else {
                b
            }
        })
        .collect()
}

/// An FP8 matrix on the GPU and its values: bytes, per-row scales, and w = e4m3 × scale.
pub struct Matrix {
    pub bytes: DeviceBuffer,
    pub scales: DeviceBuffer,
    pub w: Vec<f32>,
}

/// A random `[n, k]` FP8 matrix, uploaded.
pub fn upload_matrix(gpu: &Gpu, n: usize, k: usize, seed: u64) -> Matrix {
    let q = random_e4m3(n * k, seed);
    // Scales so the largest weight (448 × scale) is about 1, varying by row.
    let scales: Vec<f32> = (0..n).map(|r| (1.0 + (r % 7) as f32 / 7.0) / 448.0).collect();
    let w = q.iter().enumerate().map(|(i, &b)| e4m3(b) * scales[i / k]).collect();
    Matrix {
        bytes: gpu.upload(&q, "fp8 weights").unwrap(),
        scales: gpu.upload(&scales, "fp8 scales").unwrap(),
        w,
    }
}

fn dot(w: &[f32], x: &[f32]) -> f64 {
    w.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum()
}

fn abs_dot(w: &[f32], x: &[f32]) -> f64 {
    w.iter().zip(x).map(|(a, b)| (*a as f64 * *b as f64).abs()).sum()
}

#[test]
fn fp8_gemvs_and_dequantization_match_the_cpu() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    // An odd row count (a warp's second row missing, tiles of 16 rows cut short), a short row
    // ending in part of a 64-column chunk, and a long row.
    for (n, k) in [(37usize, 784usize), (258, 2816)] {
        let m = upload_matrix(&gpu, 2 * n, k, (n + k) as u64);
        let ctx = format!("n {n} k {k}");

        // Dequantization: exact up to the bf16 rounding of each value.
        let out = gpu.alloc(2 * n * k * 2, "dequant").unwrap();
        let d = Fp8DequantCall {
            w: m.bytes.ptr(),
            scales: m.scales.ptr(),
            out: out.ptr(),
            n: 2 * n as i32,
            k: k as i32,
        };
        // SAFETY: bytes 2n x k, scales 2n, out 2n x k bf16.
        unsafe { d.launch(&gpu, &kernels) }.unwrap();
        let got = read_bf16(&gpu, &out, 2 * n * k);
        for (i, (g, v)) in got.iter().zip(&m.w).enumerate() {
            assert_eq!(*g, bf16_value(bf16_bits(*v)), "{ctx}: dequant of value {i}");
        }

        for t in [1usize, 3, 8] {
            let xb = random_bf16(t * k, 7 + t as u64);
            let x: Vec<f32> = xb.iter().map(|&b| bf16_value(b)).collect();
            let xd = gpu.upload(&xb, "x").unwrap();
            let want = |j: usize, r: usize| dot(&m.w[r * k..(r + 1) * k], &x[j * k..(j + 1) * k]);

            for kind in [Fp8Gemv::Lanes, Fp8Gemv::Mma] {
                let ctx = format!("{ctx} {kind:?}");
                // f32 sums of exact products in another order: a few ulps of the sum of magnitudes
                // (tensor cores: sums of 16 products at a time, with their own rounding).
                let rel = if kind == Fp8Gemv::Mma { 1e-4 } else { 2e-5 };
                let tol = |j: usize, r: usize| rel * abs_dot(&m.w[r * k..(r + 1) * k], &x[j * k..(j + 1) * k]) + 1e-30;

                // Plain, f32 out into a wider output (ld = 2n + 5).
                let ld = 2 * n + 5;
                let y = gpu.alloc(t * ld * 4, "y").unwrap();
                gpu.zero(&y, 0, t * ld * 4).unwrap();
                let plain = Fp8GemvCall {
                    w: m.bytes.ptr(),
                    scales: m.scales.ptr(),
                    x: xd.ptr(),
                    y: y.ptr(),
                    n: 2 * n as i32,
                    k: k as i32,
                    t: t as i32,
                    ld: ld as i32,
                    out_f32: 1,
                    norm_in: 0,
                    eps: 0.0,
                    kind,
                };
                // SAFETY: bytes 2n x k, x t x k bf16, y t x ld f32.
                unsafe { plain.launch(&gpu, &kernels) }.unwrap();
                let mut got = vec![0f32; t * ld];
                gpu.read(&y, 0, &mut got).unwrap();
                for j in 0..t {
                    for r in 0..2 * n {
                        let (a, b) = (got[j * ld + r] as f64, want(j, r));
                        assert!(
                            (a - b).abs() <= tol(j, r),
                            "{ctx} t {t}: gemv row {r} token {j}: {a} vs {b}"
                        );
                    }
                    assert_eq!(got[j * ld + 2 * n], 0.0, "{ctx}: wrote past its rows");
                }

                // Gate (rows 0..n) and up (n..2n) with SiLU, bf16 out.
                let act = gpu.alloc(t * n * 2, "act").unwrap();
                let silu = Fp8GemvSiluCall {
                    w: m.bytes.ptr(),
                    scales: m.scales.ptr(),
                    x: xd.ptr(),
                    out: act.ptr(),
                    inter: n as i32,
                    k: k as i32,
                    t: t as i32,
                    norm_in: 0,
                    eps: 0.0,
                    kind,
                };
                // SAFETY: as above; act t x n bf16.
                unsafe { silu.launch(&gpu, &kernels) }.unwrap();
                let got = read_bf16(&gpu, &act, t * n);
                for j in 0..t {
                    for r in 0..n {
                        let (g, u) = (want(j, r), want(j, n + r));
                        let s = g / (1.0 + (-g).exp()) * u;
                        let a = got[j * n + r] as f64;
                        let bound = 1e-2 * s.abs() + (tol(j, r) + tol(j, n + r)) * (u.abs() + g.abs() + 1.0);
                        assert!(
                            (a - s).abs() <= bound,
                            "{ctx} t {t}: silu row {r} token {j}: {a} vs {s}"
                        );
                    }
                }

                // Residual over all 2n rows, times the next norm's weights, with its sums.
                let case = ResidualCase::new(&gpu, t, 2 * n);
                let residual = Fp8GemvResidualCall {
                    w: m.bytes.ptr(),
                    scales: m.scales.ptr(),
                    x: xd.ptr(),
                    res: case.res.ptr(),
                    res_bf16: case.res_bf16.ptr(),
                    norm_out: case.sums.ptr(),
                    next_norm: case.next_norm_on_gpu.ptr(),
                    n: 2 * n as i32,
                    k: k as i32,
                    t: t as i32,
                    kind,
                };
                // SAFETY: res t x 2n f32, res_bf16 t x 2n bf16, sums t slots, g 2n f32.
                unsafe { residual.launch(&gpu, &kernels) }.unwrap();
                case.check(&gpu, want, |j, r| tol(j, r) + 1e-6, &format!("{ctx} t {t}"));
            }
        }
    }
}

#[test]
fn fp8_tensor_core_products_match_the_cpu_within_activation_rounding() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    if gpu.info.compute_capability < (8, 9) {
        eprintln!(
            "skipped: compute capability {:?} has no FP8 tensor cores (strata runs FP8 weight-only there)",
            gpu.info.compute_capability
        );
        return;
    }
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    let mut gemm = Gemm::new(&gpu, GemmOperands::Fp8E4m3).unwrap();
    for (n, k, t) in [(64usize, 768usize, 24usize), (256, 2816, 100)] {
        let m = upload_matrix(&gpu, n, k, (n * t) as u64);
        let xb = random_bf16(t * k, t as u64);
        let x: Vec<f32> = xb.iter().map(|&b| bf16_value(b)).collect();
        let xd = gpu.upload(&xb, "x").unwrap();
        let act = gpu.alloc(t * k, "fp8 activations").unwrap();
        let act_scales = gpu.alloc(t * 4, "activation scales").unwrap();
        let quantize = Fp8QuantizeRowsCall {
            x: xd.ptr(),
            out: act.ptr(),
            scales: act_scales.ptr(),
            k: k as i32,
            rows: t,
        };
        // SAFETY: x t x k bf16, act t x k bytes, scales t f32.
        unsafe { quantize.launch(&gpu, &kernels) }.unwrap();
        // Each activation within half an E4M3 step of its row's scale (2^-4 relative for normals).
        let mut q = vec![0u8; t * k];
        gpu.read(&act, 0, &mut q).unwrap();
        let mut s = vec![0f32; t];
        gpu.read(&act_scales, 0, &mut s).unwrap();
        for j in 0..t {
            let row = &x[j * k..(j + 1) * k];
            let amax = row.iter().fold(0f32, |a, v| a.max(v.abs()));
            assert_eq!(s[j], amax / 448.0, "token {j}: its scale");
            for (c, (&v, &b)) in row.iter().zip(&q[j * k..(j + 1) * k]).enumerate() {
                let back = e4m3(b) * s[j];
                assert!(
                    (back - v).abs() <= (v.abs() / 16.0).max(s[j] / 1024.0) * 1.0001,
                    "token {j} column {c}: {v} quantized to {back}"
                );
            }
        }
        for out in [GemmOut::Bf16, GemmOut::F32] {
            let elem = out.bytes();
            let y = gpu.alloc(t * n * elem, "y").unwrap();
            // SAFETY: bytes n x k E4M3, act t x k E4M3, y t x n of `out`.
            unsafe { gemm.matmul(&gpu, m.bytes.ptr(), act.ptr(), y.ptr(), (n, k, t), out) }.unwrap();
            let scale = Fp8ScaleOutputCall {
                y: y.ptr(),
                out_f32: (out == GemmOut::F32) as i32,
                row_scales: act_scales.ptr(),
                col_scales: m.scales.ptr(),
                n: n as i32,
                t: t as i32,
            };
            // SAFETY: y t x n, scales t and n f32.
            unsafe { scale.launch(&gpu, &kernels) }.unwrap();
            // The same product scaled by cuBLASLt itself, where it takes outer-vector scales
            // (cuBLASLt 13.0 on an H200 refused them: the opt-in path falls back, and so does
            // this check).
            let y_scaled = gpu.alloc(t * n * elem, "y scaled").unwrap();
            let scales = (m.scales.ptr(), act_scales.ptr());
            // SAFETY: as above, scales of n and t f32.
            let scaled =
                unsafe { gemm.matmul_scaled(&gpu, m.bytes.ptr(), act.ptr(), y_scaled.ptr(), (n, k, t), out, scales) };
            if let Err(e) = &scaled {
                eprintln!(
                    "cuBLASLt scales no FP8 product on {:?}: {e}",
                    gpu.info.compute_capability
                );
            }
            let read = |y: &DeviceBuffer| -> Vec<f32> {
                if out == GemmOut::F32 {
                    let mut v = vec![0f32; t * n];
                    gpu.read(y, 0, &mut v).unwrap();
                    v
                } else {
                    read_bf16(&gpu, y, t * n)
                }
            };
            let mut outputs = vec![("scaled after", read(&y))];
            if scaled.is_ok() {
                outputs.push(("scaled by cuBLASLt", read(&y_scaled)));
            }
            for (how, got) in &outputs {
                for j in 0..t {
                    let xr = &x[j * k..(j + 1) * k];
                    for r in 0..n {
                        let wr = &m.w[r * k..(r + 1) * k];
                        let (a, b) = (got[j * n + r] as f64, dot(wr, xr));
                        // The activations' rounding (1/16 of each product at most), then bf16 twice.
                        let bound = abs_dot(wr, xr) / 16.0 + 2.0 * b.abs() / 256.0;
                        assert!(
                            (a - b).abs() <= bound,
                            "n {n} k {k} {out:?} {how}: token {j} row {r}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}

/// The bytes of `b` (`len` of them).
fn read_bytes<T: Copy + Default>(gpu: &Gpu, b: &DeviceBuffer, len: usize) -> Vec<T> {
    let mut v = vec![T::default(); len];
    gpu.read(b, 0, &mut v).unwrap();
    v
}

/// `fp8_quantize_rows` of t rows of k bf16 at `x`: the E4M3 bytes and the scales.
fn quantized_rows(gpu: &Gpu, kernels: &Kernels, x: &DeviceBuffer, k: usize, t: usize) -> (Vec<u8>, Vec<f32>) {
    let (q, s) = (gpu.alloc(t * k, "q").unwrap(), gpu.alloc(t * 4, "q scales").unwrap());
    let call = Fp8QuantizeRowsCall {
        x: x.ptr(),
        out: q.ptr(),
        scales: s.ptr(),
        k: k as i32,
        rows: t,
    };
    // SAFETY: x t x k bf16, q t x k bytes, s t f32.
    unsafe { call.launch(gpu, kernels) }.unwrap();
    (read_bytes(gpu, &q, t * k), read_bytes(gpu, &s, t))
}

#[test]
fn the_fused_fp8_norms_write_what_norm_then_quantize_write() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    for (n, t) in [(576usize, 3usize), (3584, 37), (8192, 5)] {
        // Rows of mixed size (one all zero), so each row's scale differs.
        let mut x = random_f32(t * n, n as u64);
        for (j, row) in x.chunks_mut(n).enumerate() {
            row.iter_mut()
                .for_each(|v| *v *= if j == 1 { 0.0 } else { (j + 1) as f32 * 3.0 });
        }
        let delta = random_f32(t * n, 7);
        let weight = random_f32(n, 9);
        for op_add in [false, true] {
            let d = gpu.upload(&delta, "delta").unwrap();
            let g = gpu.upload(&weight, "weight").unwrap();
            let run = |fp8: bool| {
                let xd = gpu.upload(&x, "x").unwrap();
                let out = gpu.alloc(t * n * 2, "xn").unwrap();
                let (q, qs) = (gpu.alloc(t * n, "q").unwrap(), gpu.alloc(t * 4, "q scales").unwrap());
                let call = NormCall {
                    op: if op_add {
                        NormOp::AddNorm {
                            delta: d.ptr(),
                            splits: 1,
                        }
                    } else {
                        NormOp::Norm
                    },
                    x: xd.ptr(),
                    weight: g.ptr(),
                    out: out.ptr(),
                    n: n as i32,
                    eps: 1e-6,
                    rows: t,
                    float32: false,
                    fp8: fp8.then_some((q.ptr(), qs.ptr())),
                };
                // SAFETY: x and delta t x n f32, weight n f32, out t x n bf16, q t x n bytes, qs t f32.
                unsafe { call.launch(&gpu, &kernels) }.unwrap();
                let fused = fp8.then(|| (read_bytes::<u8>(&gpu, &q, t * n), read_bytes::<f32>(&gpu, &qs, t)));
                (
                    read_bytes::<f32>(&gpu, &xd, t * n),
                    read_bytes::<u16>(&gpu, &out, t * n),
                    fused,
                    out,
                )
            };
            let (x_plain, xn_plain, _, out_plain) = run(false);
            let (x_fused, xn_fused, fused, _) = run(true);
            let ctx = format!("n {n} t {t} add {op_add}");
            assert_eq!(x_plain, x_fused, "{ctx}: the residual");
            assert_eq!(xn_plain, xn_fused, "{ctx}: the bf16 rows");
            let (q, qs) = fused.unwrap();
            let (q_want, qs_want) = quantized_rows(&gpu, &kernels, &out_plain, n, t);
            assert_eq!(qs, qs_want, "{ctx}: the row scales");
            if !op_add {
                assert_eq!(qs[1], 1.0, "{ctx}: a zero row's scale");
            }
            assert_eq!(q, q_want, "{ctx}: the E4M3 rows");
        }
    }
}

#[test]
fn silu_mul_fp8_writes_what_scale_silu_and_quantize_write() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    // SmolLM2's, a 7B's and a 32B's widths: one to four pieces a thread.
    for (inter, t) in [(1536usize, 4usize), (18944, 9), (27648, 3)] {
        let gate_up = random_bf16(t * 2 * inter, inter as u64);
        let tok_scales: Vec<f32> = (0..t).map(|j| 0.01 * (j + 1) as f32).collect();
        let col_scales: Vec<f32> = random_f32(2 * inter, 5).iter().map(|v| v.abs() * 4.0 + 0.5).collect();
        let cols = gpu.upload(&col_scales, "col scales").unwrap();
        // The unfused kernels, as fp8_matmul and the MLP ran them.
        let y = gpu.upload(&gate_up, "gate_up").unwrap();
        let toks = gpu.upload(&tok_scales, "token scales").unwrap();
        let scale = Fp8ScaleOutputCall {
            y: y.ptr(),
            out_f32: 0,
            row_scales: toks.ptr(),
            col_scales: cols.ptr(),
            n: (2 * inter) as i32,
            t: t as i32,
        };
        let act_want = gpu.alloc(t * inter * 2, "act").unwrap();
        let silu = SiluMulCall {
            gate_up: y.ptr(),
            out: act_want.ptr(),
            inter: inter as i32,
            tokens: t,
            float32: false,
        };
        // SAFETY: y t x 2 inter bf16, scales t and 2 inter f32, act t x inter bf16.
        unsafe {
            scale.launch(&gpu, &kernels).unwrap();
            silu.launch(&gpu, &kernels).unwrap();
        }
        let (q_want, qs_want) = quantized_rows(&gpu, &kernels, &act_want, inter, t);
        // The fused kernel, its scales written over the token scales it reads.
        let y = gpu.upload(&gate_up, "gate_up").unwrap();
        let scales = gpu.upload(&tok_scales, "token scales, then the rows'").unwrap();
        let act = gpu.alloc(t * inter * 2, "act").unwrap();
        let q = gpu.alloc(t * inter, "q").unwrap();
        let fused = SiluMulFp8Call {
            gate_up: y.ptr(),
            tok_scales: scales.ptr(),
            col_scales: cols.ptr(),
            out: act.ptr(),
            q: q.ptr(),
            q_scales: scales.ptr(),
            inter: inter as i32,
            tokens: t,
        };
        // SAFETY: as above; q t x inter bytes.
        unsafe { fused.launch(&gpu, &kernels) }.unwrap();
        let ctx = format!("inter {inter} t {t}");
        assert_eq!(
            read_bytes::<u16>(&gpu, &act, t * inter),
            read_bytes::<u16>(&gpu, &act_want, t * inter),
            "{ctx}: the bf16 activations"
        );
        assert_eq!(read_bytes::<f32>(&gpu, &scales, t), qs_want, "{ctx}: the row scales");
        assert_eq!(read_bytes::<u8>(&gpu, &q, t * inter), q_want, "{ctx}: the E4M3 rows");
    }
}
