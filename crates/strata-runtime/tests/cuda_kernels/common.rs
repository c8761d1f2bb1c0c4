//! Helpers shared by the kernel tests: the GPU (or why there is none), seeded inputs, bf16
//! rounding and reading, the RoPE table, and the norm kernel that makes a GEMV's input.

use strata_runtime::cuda::libraries::{candidate_dirs, search};
use strata_runtime::cuda::{DeviceBuffer, Gpu, Kernels, NormCall, NormOp};

/// GPU 0, or `None` (with the reason printed) without a GPU.
pub fn first_gpu() -> Option<Gpu> {
    let libs = search(&candidate_dirs());
    match Gpu::count(&libs) {
        Ok(n) if n > 0 => Some(Gpu::open(0, &libs).expect("GPU 0 opens")),
        Ok(_) => {
            eprintln!("skipped: no CUDA GPU");
            None
        }
        Err(e) => {
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// A xorshift generator from a fixed seed.
pub fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut state = seed.wrapping_mul(0x9e3779b97f4a7c15) | 1;
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    }
}

/// `count` bf16 values uniform in [-1, 1) from a fixed seed, as bits.
pub fn random_bf16(count: usize, seed: u64) -> Vec<u16> {
    let mut next = xorshift(seed);
    (0..count)
        .map(|_| {
            let v = (next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
            (v.to_bits() >> 16) as u16
        })
        .collect()
}

/// `count` f32 values uniform in [-1, 1) from a fixed seed (bf16-exact).
pub fn random_f32(count: usize, seed: u64) -> Vec<f32> {
    random_bf16(count, seed).into_iter().map(bf16_value).collect()
}

/// The bf16 bits of `v`, rounded to nearest even (the kernels' f2bf).
pub fn bf16_bits(v: f32) -> u16 {
    let u = v.to_bits();
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// The f32 a bf16 holds (exact).
pub fn bf16_value(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// The first `n` bf16 values of `b`, as f32.
pub fn read_bf16(gpu: &Gpu, b: &DeviceBuffer, n: usize) -> Vec<f32> {
    let mut v = vec![0u16; n];
    gpu.read(b, 0, &mut v).unwrap();
    v.into_iter().map(bf16_value).collect()
}

/// Largest difference between `got` and `want`, over the largest magnitude of `want`.
pub fn worst_relative(got: &[f32], want: &[f32]) -> f32 {
    let largest = want.iter().fold(0f32, |m, v| m.max(v.abs()));
    let worst = got.iter().zip(want).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    worst / largest.max(f32::MIN_POSITIVE)
}

/// The smallest GEMV token count compiled for `t` tokens (gemm.cu's `gemv_t{T}`).
pub fn compiled_tokens(t: usize) -> usize {
    strata_runtime::cuda::gemv_kernels(t).expect("a GEMV-sized step").tokens
}

/// RoPE's (cos, sin) of each rotated pair at `pos` (the model's `rope_cos_sin`).
pub fn rope_cos_sin(inv_freq: &[f32], pos: usize) -> impl Iterator<Item = (f32, f32)> + '_ {
    inv_freq.iter().map(move |&f| {
        let angle = pos as f64 * f as f64;
        (angle.cos() as f32, angle.sin() as f32)
    })
}

/// [`rope_cos_sin`] of every position below `positions`, as `[position][pair][cos, sin]`: the
/// table the kernels rotate by.
pub fn rope_cos_sin_table(inv_freq: &[f32], positions: usize) -> Vec<f32> {
    (0..positions)
        .flat_map(|pos| rope_cos_sin(inv_freq, pos).flat_map(|(c, s)| [c, s]))
        .collect()
}

/// The inverse frequencies of `rot` rotary dims (base 10000).
pub fn inv_freq(rot: usize) -> Vec<f32> {
    (0..rot / 2)
        .map(|i| 10000f32.powf(-2.0 * i as f32 / rot as f32))
        .collect()
}

/// Runs `rms_norm` (norm.cu) over the t rows of the f32 `x`, weight `g`, into a new bf16 buffer.
pub fn rms_norm_rows_of(
    gpu: &Gpu,
    kernels: &Kernels,
    x: &DeviceBuffer,
    g: &DeviceBuffer,
    t: usize,
    k: usize,
) -> DeviceBuffer {
    let xn = gpu.alloc(t * k * 2, "xn").unwrap();
    let call = NormCall {
        op: NormOp::Norm,
        x: x.ptr(),
        weight: g.ptr(),
        out: xn.ptr(),
        n: k as i32,
        eps: 1e-5,
        rows: t,
        float32: false,
        fp8: None,
    };
    // SAFETY: x holds t x k f32, g k f32, xn t x k bf16.
    unsafe { call.launch(gpu, kernels) }.unwrap();
    xn
}

/// Token `j`'s sum of squares from the carried norm sums `raw` (NORM_SLOTS slots of {coarse,
/// fine} a token), by gemv.cuh's rule: the coarse sum (2^-8) once it reaches 2^22, else the fine (2^-40).
pub fn carried_norm_total(raw: &[u64], j: usize) -> f64 {
    let slots = strata_runtime::cuda::gemm_call::NORM_SLOTS;
    let sum = |f: usize| -> u64 { (0..slots).map(|s| raw[(j * slots + s) * 2 + f]).sum() };
    let coarse = sum(0) as f64 / 256.0;
    if coarse >= (1u64 << 22) as f64 {
        coarse
    } else {
        sum(1) as f64 / (1u64 << 40) as f64
    }
}

/// The buffers of a residual GEMV over `rows` rows and `t` tokens (gemv.cuh's carried norm):
/// the f32 residual (random before), its bf16 copy times the next norm's weights (random), and
/// the norm's sums (zeroed).
pub struct ResidualCase {
    pub before: Vec<f32>,
    pub next_norm: Vec<f32>,
    pub res: DeviceBuffer,
    pub res_bf16: DeviceBuffer,
    pub next_norm_on_gpu: DeviceBuffer,
    pub sums: DeviceBuffer,
    t: usize,
    rows: usize,
}

impl ResidualCase {
    pub fn new(gpu: &Gpu, t: usize, rows: usize) -> ResidualCase {
        let before = random_f32(t * rows, 99);
        let next_norm = random_f32(rows, 98);
        let sums_bytes = t * strata_runtime::cuda::gemm_call::NORM_SLOTS * 2 * 8;
        let sums = gpu.alloc(sums_bytes, "sums").unwrap();
        gpu.zero(&sums, 0, sums_bytes).unwrap();
        ResidualCase {
            res: gpu.upload(&before, "res").unwrap(),
            res_bf16: gpu.alloc(t * rows * 2, "res_bf16").unwrap(),
            next_norm_on_gpu: gpu.upload(&next_norm, "next norm").unwrap(),
            sums,
            before,
            next_norm,
            t,
            rows,
        }
    }

    /// After the GEMV: each new residual value within `tol(j, r)` of before + `want(j, r)`, its
    /// bf16 copy that value times the next norm's weight exactly, and each token's sum of squares
    /// within 1e-5.
    pub fn check(&self, gpu: &Gpu, want: impl Fn(usize, usize) -> f64, tol: impl Fn(usize, usize) -> f64, ctx: &str) {
        let (t, rows) = (self.t, self.rows);
        let mut new = vec![0f32; t * rows];
        gpu.read(&self.res, 0, &mut new).unwrap();
        let new_bf16 = read_bf16(gpu, &self.res_bf16, t * rows);
        let mut raw = vec![0u64; t * strata_runtime::cuda::gemm_call::NORM_SLOTS * 2];
        gpu.read(&self.sums, 0, &mut raw).unwrap();
        for j in 0..t {
            let mut squares = 0f64;
            for r in 0..rows {
                let v = self.before[j * rows + r] as f64 + want(j, r);
                let a = new[j * rows + r] as f64;
                assert!(
                    (a - v).abs() <= tol(j, r),
                    "{ctx}: residual row {r} token {j}: {a} vs {v}"
                );
                let b = new_bf16[j * rows + r];
                let want_b = bf16_value(bf16_bits(a as f32 * self.next_norm[r]));
                assert_eq!(b, want_b, "{ctx}: res_bf16 row {r} token {j}");
                squares += a * a;
            }
            let total = carried_norm_total(&raw, j);
            assert!(
                (total - squares).abs() <= 1e-5 * squares,
                "{ctx}: norm sums {total} vs {squares}"
            );
        }
    }
}
