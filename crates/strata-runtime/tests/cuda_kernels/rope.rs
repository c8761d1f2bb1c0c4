//! rope.cu's bias, q/k norms, rotation and cache write against the CPU backend's rotation, and
//! the QKV GEMVs with the RoPE folded in (gemm.cu's over bf16 rows, fp8.cu's over E4M3 rows)
//! against the plain GEMV then rope.cu, and rope.cu summing a quantized QKV product's k splits
//! against `qgemm_reduce` then rope.cu.

use strata_runtime::cpu::ops::{rms_norm_inplace, rope, RopeLayout};
use strata_runtime::cuda::{
    DeviceBuffer, Fp8Gemv, Fp8GemvCall, Fp8GemvQkvRopeCall, GemvCall, GemvQkvRopeCall, KernelSpec, Kernels,
    QuantGemmReduceCall, RopeCall, RopeKernel,
};

use crate::common::{
    bf16_bits, bf16_value, first_gpu, inv_freq, random_bf16, random_f32, read_bf16, rms_norm_rows_of, rope_cos_sin,
    rope_cos_sin_table, worst_relative,
};

#[test]
fn qkv_gemv_with_rope_equals_the_gemv_then_the_rope_kernel() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    let (bs, blocks) = (16usize, 8usize);
    // (heads, kv heads, head dim, rotary dims, halves layout, bias, k): SmolLM2, Llama-3-8B,
    // adjacent pairs with a bias (Qwen2-style), partial rotary.
    for (n_heads, n_kv, hd, rot, neox, with_bias, k) in [
        (9usize, 3usize, 64usize, 64usize, 1i32, false, 576usize),
        (32, 8, 128, 128, 1, false, 4096),
        (4, 2, 64, 64, 0, true, 256),
        (4, 1, 128, 64, 1, true, 512),
    ] {
        let width = (n_heads + 2 * n_kv) * hd;
        let w = gpu.upload(&random_bf16(width * k, 41), "w").unwrap();
        let w8 = crate::fp8::upload_matrix(&gpu, width, k, 44);
        let bias = gpu.upload(&random_f32(width, 42), "bias").unwrap();
        let norm = gpu.upload(&random_f32(k, 43), "norm weight").unwrap();
        // Positions below reach 5 + 997 * 7.
        let rope_table = gpu
            .upload(&rope_cos_sin_table(&inv_freq(rot), 7000), "rope table")
            .unwrap();
        let cache_elems = blocks * n_kv * bs * hd;
        for (t, fp8) in [1usize, 3, 8].into_iter().flat_map(|t| [(t, false), (t, true)]) {
            // A GEMV input as rms_norm writes it (bf16) from a residual stream (f32).
            let x = gpu.upload(&random_f32(t * k, 50 + t as u64), "x").unwrap();
            let xn = rms_norm_rows_of(&gpu, &kernels, &x, &norm, t, k);
            let positions: Vec<i32> = (0..t as i32).map(|j| 5 + 997 * j).collect();
            let slots: Vec<i32> = (0..t as i32).map(|j| 3 + 7 * j).collect();
            let (pos, sl) = (
                gpu.upload(&positions, "positions").unwrap(),
                gpu.upload(&slots, "slots").unwrap(),
            );
            let zeros = vec![0u16; cache_elems];
            // Caches and outputs of the GEMV then rope.cu, and of the fused kernel.
            let caches: Vec<DeviceBuffer> = (0..4).map(|_| gpu.upload(&zeros, "cache").unwrap()).collect();
            let outs: Vec<DeviceBuffer> = (0..2).map(|_| gpu.alloc(t * width * 2, "qkv").unwrap()).collect();
            let bp = if with_bias { bias.ptr() } else { 0 };
            let (nh, nk, hd32, rot32, bs32, eps) =
                (n_heads as i32, n_kv as i32, hd as i32, rot as i32, bs as i32, 1e-5f32);
            let gemv = GemvCall {
                w: w.ptr(),
                x: xn.ptr(),
                y: outs[0].ptr(),
                n: width as i32,
                k: k as i32,
                t: t as i32,
                out_f32: 0,
                norm_in: 0,
                eps,
            };
            let gemv8 = Fp8GemvCall {
                w: w8.bytes.ptr(),
                scales: w8.scales.ptr(),
                x: xn.ptr(),
                y: outs[0].ptr(),
                n: width as i32,
                k: k as i32,
                t: t as i32,
                ld: width as i32,
                out_f32: 0,
                norm_in: 0,
                eps,
                kind: Fp8Gemv::Lanes,
            };
            let then_rope = RopeCall {
                qkv: outs[0].ptr(),
                parts: 0,
                splits: 0,
                bias: bp,
                q_norm: 0,
                k_norm: 0,
                positions: pos.ptr(),
                rope_table: rope_table.ptr(),
                n_heads: nh,
                n_kv: nk,
                head_dim: hd32,
                rot_dim: rot32,
                neox,
                eps,
                slots: sl.ptr(),
                k_cache: caches[0].ptr(),
                v_cache: caches[1].ptr(),
                k_scale: 0,
                v_scale: 0,
                block_size: bs32,
                tokens: t,
                kernel: RopeKernel::Bf16,
            };
            let fused = GemvQkvRopeCall {
                w: w.ptr(),
                x: xn.ptr(),
                qkv: outs[1].ptr(),
                k: k as i32,
                t: t as i32,
                bias: bp,
                positions: pos.ptr(),
                rope_table: rope_table.ptr(),
                n_heads: nh,
                n_kv: nk,
                head_dim: hd32,
                rot_dim: rot32,
                neox,
                slots: sl.ptr(),
                k_cache: caches[2].ptr(),
                v_cache: caches[3].ptr(),
                block_size: bs32,
                norm_in: 0,
                eps,
            };
            let fused8 = Fp8GemvQkvRopeCall {
                rope: GemvQkvRopeCall {
                    w: w8.bytes.ptr(),
                    ..fused
                },
                scales: w8.scales.ptr(),
            };
            // SAFETY: buffers sized as above (the FP8 matrix width x k bytes and width scales).
            unsafe {
                if fp8 {
                    gemv8.launch(&gpu, &kernels).unwrap();
                } else {
                    gemv.launch(&gpu, &kernels).unwrap();
                }
                then_rope.launch(&gpu, &kernels).unwrap();
                if fp8 {
                    fused8.launch(&gpu, &kernels).unwrap();
                } else {
                    fused.launch(&gpu, &kernels).unwrap();
                }
            }
            let shape =
                format!("heads {n_heads}/{n_kv} x {hd}, rot {rot}, neox {neox}, bias {with_bias}, t {t}, fp8 {fp8}");
            let want = [
                read_bf16(&gpu, &outs[0], t * width),
                read_bf16(&gpu, &caches[0], cache_elems),
                read_bf16(&gpu, &caches[1], cache_elems),
            ];
            assert!(
                want[1].iter().any(|&v| v != 0.0),
                "{shape}: nothing written to the cache"
            );
            let got = [
                read_bf16(&gpu, &outs[1], t * width),
                read_bf16(&gpu, &caches[2], cache_elems),
                read_bf16(&gpu, &caches[3], cache_elems),
            ];
            for (what, (g, w)) in ["q/k/v", "k cache", "v cache"].iter().zip(got.iter().zip(&want)) {
                // One bf16 step of the largest value at most: the rotation's products may
                // contract to FMAs differently.
                let rel = worst_relative(g, w);
                assert!(rel <= 1.0 / 128.0, "{shape}: {what} off by {rel}");
            }
        }
    }
}

/// One case of `qkv_rope_kv_write_*`: (heads, kv heads, head dim, rotary dims, halves layout,
/// bias, q/k norms).
type RopeCase = (usize, usize, usize, usize, bool, bool, bool);

/// What rope.cu should leave for `case`: the rewritten q/k/v rows of `t` tokens and each
/// token's K and V heads (kv head-major), from the CPU backend's norm and rotation on the
/// same roundings (v rounded after its bias, q/k once after the rotation).
fn rope_reference(
    case: RopeCase,
    qkv: &[f32],
    bias: &[f32],
    norms: (&[f32], &[f32]),
    positions: &[i32],
    inv_freq: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (n_heads, n_kv, hd, _, neox, with_bias, with_norms) = case;
    let width = (n_heads + 2 * n_kv) * hd;
    let round = |v: f32| bf16_value(bf16_bits(v));
    let layout = if neox {
        RopeLayout::Neox
    } else {
        RopeLayout::Interleaved
    };
    let (mut out, mut k_heads, mut v_heads) = (qkv.to_vec(), Vec::new(), Vec::new());
    for (t, &pos) in positions.iter().enumerate() {
        let row = &mut out[t * width..(t + 1) * width];
        if with_bias {
            row.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
        }
        let (cos, sin): (Vec<f32>, Vec<f32>) = rope_cos_sin(inv_freq, pos as usize).unzip();
        for (h, head) in row.chunks_exact_mut(hd).enumerate() {
            if h >= n_heads + n_kv {
                head.iter_mut().for_each(|v| *v = round(*v));
                continue;
            }
            if with_norms {
                rms_norm_inplace(head, if h < n_heads { norms.0 } else { norms.1 }, 1e-6);
            }
            rope(head, hd, &cos, &sin, layout);
            head.iter_mut().for_each(|v| *v = round(*v));
        }
        for kvh in 0..n_kv {
            k_heads.extend_from_slice(&row[(n_heads + kvh) * hd..(n_heads + kvh + 1) * hd]);
            v_heads.extend_from_slice(&row[(n_heads + n_kv + kvh) * hd..(n_heads + n_kv + kvh + 1) * hd]);
        }
    }
    (out, k_heads, v_heads)
}

/// The f32 an fp8 e4m3 byte holds (the model's `e4m3_to_f32`: no infinities, S.1111.111 NaN).
fn e4m3_value(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (((b >> 3) & 0xF) as i32, (b & 7) as f32);
    match (e, b & 7) {
        (15, 7) => f32::NAN,
        (0, _) => sign * m / 512.0,
        _ => sign * (1.0 + m / 8.0) * 2f32.powi(e - 7),
    }
}

#[test]
fn e4m3_bytes_decode_to_their_values() {
    assert_eq!(
        [0x00, 0x01, 0x08, 0x38, 0x7e, 0xbc, 0xfe].map(e4m3_value),
        [0.0, 1.0 / 512.0, 1.0 / 64.0, 1.0, 448.0, -1.5, -448.0]
    );
    assert!(e4m3_value(0x7f).is_nan() && e4m3_value(0xff).is_nan());
}

#[test]
fn rope_and_cache_write_match_the_cpu_rotation() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    let (bs, blocks, t) = (16usize, 8usize, 5usize);
    // SmolLM2, Llama-3-8B, Qwen2 (bias), Qwen3 (q/k norms), partial rotary, adjacent pairs with
    // one dim a lane (head_dim 32) and with a bias, head_dim 256.
    let cases: [RopeCase; 8] = [
        (9, 3, 64, 64, true, false, false),
        (32, 8, 128, 128, true, false, false),
        (28, 4, 128, 128, true, true, false),
        (16, 8, 128, 128, true, false, true),
        (4, 1, 128, 64, true, true, false),
        (4, 2, 32, 32, false, false, true),
        (4, 2, 64, 64, false, true, false),
        (8, 1, 256, 256, true, false, false),
    ];
    for case in cases {
        let (n_heads, n_kv, hd, rot, neox, with_bias, with_norms) = case;
        let width = (n_heads + 2 * n_kv) * hd;
        let qkv_bits = random_bf16(t * width, 71);
        let qkv_f32: Vec<f32> = qkv_bits.iter().map(|&b| bf16_value(b)).collect();
        let bias = random_f32(width, 72);
        let (q_norm, k_norm): (Vec<f32>, Vec<f32>) = (
            random_f32(hd, 73).into_iter().map(|v| 0.5 + v.abs()).collect(),
            random_f32(hd, 74).into_iter().map(|v| 0.5 + v.abs()).collect(),
        );
        let inv = inv_freq(rot);
        let positions: Vec<i32> = (0..t as i32).map(|j| 3 + 211 * j).collect();
        let slots: Vec<i32> = (0..t as i32).map(|j| 1 + 19 * j).collect();
        let (want_qkv, want_k, want_v) = rope_reference(case, &qkv_f32, &bias, (&q_norm, &k_norm), &positions, &inv);
        let shape =
            format!("heads {n_heads}/{n_kv} x {hd}, rot {rot}, neox {neox}, bias {with_bias}, norms {with_norms}");
        for fp8 in [false, true] {
            let elem = if fp8 { 1 } else { 2 };
            let cache_bytes = blocks * n_kv * bs * hd * elem;
            let up = |v: &[f32], what: &'static str| gpu.upload(v, what).unwrap();
            let (b_buf, qn_buf, kn_buf, table_buf) = (
                up(&bias, "bias"),
                up(&q_norm, "q_norm"),
                up(&k_norm, "k_norm"),
                up(
                    &rope_cos_sin_table(&inv, 1 + *positions.last().unwrap() as usize),
                    "rope table",
                ),
            );
            let qkv = gpu.upload(&qkv_bits, "qkv").unwrap();
            let (pos, sl) = (
                gpu.upload(&positions, "positions").unwrap(),
                gpu.upload(&slots, "slots").unwrap(),
            );
            let zeros = vec![0u8; cache_bytes];
            let (kc, vc) = (
                gpu.upload(&zeros, "k cache").unwrap(),
                gpu.upload(&zeros, "v cache").unwrap(),
            );
            let scales = vec![0f32; blocks * n_kv * bs];
            let (ks, vs) = (
                gpu.upload(&scales, "k scales").unwrap(),
                gpu.upload(&scales, "v scales").unwrap(),
            );
            let (q_norm_at, k_norm_at) = if with_norms {
                (qn_buf.ptr(), kn_buf.ptr())
            } else {
                (0, 0)
            };
            let call = RopeCall {
                qkv: qkv.ptr(),
                parts: 0,
                splits: 0,
                bias: if with_bias { b_buf.ptr() } else { 0 },
                q_norm: q_norm_at,
                k_norm: k_norm_at,
                positions: pos.ptr(),
                rope_table: table_buf.ptr(),
                n_heads: n_heads as i32,
                n_kv: n_kv as i32,
                head_dim: hd as i32,
                rot_dim: rot as i32,
                neox: neox as i32,
                eps: 1e-6,
                slots: sl.ptr(),
                k_cache: kc.ptr(),
                v_cache: vc.ptr(),
                k_scale: ks.ptr(),
                v_scale: vs.ptr(),
                block_size: bs as i32,
                tokens: t,
                kernel: if fp8 { RopeKernel::Fp8 } else { RopeKernel::Bf16 },
            };
            // SAFETY: buffers sized as above.
            unsafe { call.launch(&gpu, &kernels) }.unwrap();
            let got_qkv = read_bf16(&gpu, &qkv, t * width);
            let rel = worst_relative(&got_qkv, &want_qkv);
            // One bf16 step of the largest value at most: the rotation's products and the
            // norm's sum may round differently from the CPU's in the last bits.
            assert!(rel <= 1.0 / 128.0, "{shape}: q/k/v off by {rel}");
            // Each token's K and V heads from their cache slots.
            let read_bytes = |b: &DeviceBuffer| {
                let mut v = vec![0u8; cache_bytes];
                gpu.read(b, 0, &mut v).unwrap();
                v
            };
            let (k_raw, v_raw) = (read_bytes(&kc), read_bytes(&vc));
            let (mut k_sc, mut v_sc) = (scales.clone(), scales.clone());
            gpu.read(&ks, 0, &mut k_sc).unwrap();
            gpu.read(&vs, 0, &mut v_sc).unwrap();
            // Element i of a cache as f32: e4m3 times its vector's scale, or bf16.
            let value = |raw: &[u8], sc: &[f32], i: usize, vec: usize| {
                if fp8 {
                    e4m3_value(raw[i]) * sc[vec]
                } else {
                    bf16_value(u16::from_le_bytes([raw[2 * i], raw[2 * i + 1]]))
                }
            };
            let (mut cache_k, mut cache_v) = (Vec::new(), Vec::new());
            for &s in &slots {
                let (block, slot) = (s as usize / bs, s as usize % bs);
                for kvh in 0..n_kv {
                    let vec = (block * n_kv + kvh) * bs + slot;
                    for d in 0..hd {
                        let i = vec * hd + d;
                        cache_k.push(value(&k_raw, &k_sc, i, vec));
                        cache_v.push(value(&v_raw, &v_sc, i, vec));
                    }
                }
            }
            // e4m3 keeps 3 bits of mantissa: half a step is 1/16 of a value, at most the largest.
            let tol = if fp8 { 1.0 / 16.0 } else { 1.0 / 128.0 };
            for (what, got, want) in [("k cache", &cache_k, &want_k), ("v cache", &cache_v, &want_v)] {
                let rel = worst_relative(got, want);
                assert!(rel <= tol, "{shape}, fp8 {fp8}: {what} off by {rel}");
            }
        }
    }
}

#[test]
fn rope_sums_the_k_splits_as_qgemm_reduce_does() {
    let Some(gpu) = first_gpu() else {
        return;
    };
    let kernels = Kernels::load(&gpu, KernelSpec { head_dim: 64, group: 3 }).unwrap();
    // A quantized QKV product that split k leaves [splits, t, width] f32 sums, which rope.cu adds
    // itself. It must leave the bits qgemm_reduce into qkv then rope.cu leave: qkv (v included),
    // both caches and the fp8 scales. Qwen2.5-7B's heads, with its bias.
    let (n_heads, n_kv, hd, bs, blocks) = (28usize, 4usize, 128usize, 16usize, 9usize);
    let width = (n_heads + 2 * n_kv) * hd;
    let bias = gpu.upload(&random_f32(width, 81), "bias").unwrap();
    let table = gpu
        .upload(&rope_cos_sin_table(&inv_freq(hd), 4096), "rope table")
        .unwrap();
    for (t, splits) in [(1usize, 2usize), (7, 4), (130, 3)] {
        // Parts of mixed magnitudes, so the order of the additions shows in the bits.
        let parts: Vec<f32> = random_f32(splits * t * width, 82 + t as u64)
            .iter()
            .enumerate()
            .map(|(i, v)| v * [1.0, 3e4, 1e-3, 7.0][i % 4])
            .collect();
        let p = gpu.upload(&parts, "parts").unwrap();
        let positions: Vec<i32> = (0..t as i32).map(|j| 3 + 29 * j).collect();
        let slots: Vec<i32> = (0..t as i32).map(|j| 5 + j).collect();
        let (pos, sl) = (
            gpu.upload(&positions, "positions").unwrap(),
            gpu.upload(&slots, "slots").unwrap(),
        );
        for kernel in [RopeKernel::Bf16, RopeKernel::Fp8, RopeKernel::F32] {
            let (elem, cache_elem) = match kernel {
                RopeKernel::Bf16 => (2, 2),
                RopeKernel::Fp8 => (2, 1),
                RopeKernel::F32 => (4, 4),
            };
            let vectors = blocks * n_kv * bs;
            let run = |reduce_first: bool| {
                let qkv = gpu.alloc(t * width * elem, "qkv").unwrap();
                let cache = vec![0u8; vectors * hd * cache_elem];
                let bufs = [
                    qkv,
                    gpu.upload(&cache, "k cache").unwrap(),
                    gpu.upload(&cache, "v cache").unwrap(),
                    gpu.upload(&vec![0f32; vectors], "k scales").unwrap(),
                    gpu.upload(&vec![0f32; vectors], "v scales").unwrap(),
                ];
                let reduce = QuantGemmReduceCall {
                    parts: p.ptr(),
                    y: bufs[0].ptr(),
                    n: width as i32,
                    t: t as i32,
                    ld: width as i32,
                    splits: splits as i32,
                    out_f32: (kernel == RopeKernel::F32) as i32,
                };
                let (parts, splits) = if reduce_first { (0, 0) } else { (p.ptr(), splits as i32) };
                let fp8 = kernel == RopeKernel::Fp8;
                let call = RopeCall {
                    qkv: bufs[0].ptr(),
                    parts,
                    splits,
                    bias: bias.ptr(),
                    q_norm: 0,
                    k_norm: 0,
                    positions: pos.ptr(),
                    rope_table: table.ptr(),
                    n_heads: n_heads as i32,
                    n_kv: n_kv as i32,
                    head_dim: hd as i32,
                    rot_dim: hd as i32,
                    neox: 1,
                    eps: 1e-6,
                    slots: sl.ptr(),
                    k_cache: bufs[1].ptr(),
                    v_cache: bufs[2].ptr(),
                    k_scale: if fp8 { bufs[3].ptr() } else { 0 },
                    v_scale: if fp8 { bufs[4].ptr() } else { 0 },
                    block_size: bs as i32,
                    tokens: t,
                    kernel,
                };
                // SAFETY: parts holds splits x t x width f32, qkv t x width elements, the caches
                // and scales `vectors` vectors of hd elements and one f32 each.
                unsafe {
                    if reduce_first {
                        reduce.launch(&gpu, &kernels).unwrap();
                    }
                    call.launch(&gpu, &kernels).unwrap();
                }
                bufs.map(|b| {
                    let mut v = vec![0u8; b.bytes()];
                    gpu.read(&b, 0, &mut v).unwrap();
                    v
                })
            };
            let (want, got) = (run(true), run(false));
            let case = format!("t {t}, {splits} splits, {kernel:?}");
            assert!(want[1].iter().any(|&b| b != 0), "{case}: nothing written to the cache");
            for (what, (g, w)) in ["qkv", "k cache", "v cache", "k scales", "v scales"]
                .iter()
                .zip(got.iter().zip(&want))
            {
                assert!(g == w, "{case}: {what} differs from qgemm_reduce's then rope.cu's");
            }
        }
    }
}
