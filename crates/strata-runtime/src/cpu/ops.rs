//! Element-wise and row-wise CPU ops of a transformer layer: RMSNorm, RoPE, SiLU-gating, softmax.
//! Plain loops written so the compiler vectorizes them; each works on one row or one token.

/// How the rotary embedding pairs up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(2i, 2i+1)` (GGML "normal"; GGUF llama checkpoints, whose Q/K rows
    /// the converter permuted).
    Interleaved,
    /// Halves `(i, i + d/2)` (GPT-NeoX / HF `rotate_half`; Qwen, HF Llama safetensors).
    Neox,
}

/// `out = x / rms(x) * weight` over one row.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let mut sum = 0.0f32;
    for &v in x {
        sum += v * v;
    }
    let scale = 1.0 / (sum / n as f32 + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        *o = v * scale * w;
    }
}

/// RMSNorm in place over one row.
pub fn rms_norm_inplace(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = x.len();
    let mut sum = 0.0f32;
    for &v in x.iter() {
        sum += v * v;
    }
    let scale = 1.0 / (sum / n as f32 + eps).sqrt();
    for (v, &w) in x.iter_mut().zip(weight) {
        *v = *v * scale * w;
    }
}

/// Applies rotary embeddings to every head of `x` (`n_heads * head_dim` values), rotating the
/// first `cos.len() * 2` dimensions of each head by the angles whose cosines and sines are given.
pub fn rope(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32], layout: RopeLayout) {
    let half = cos.len();
    for head in x.chunks_exact_mut(head_dim) {
        for i in 0..half {
            let (c, s) = (cos[i], sin[i]);
            let (a, b) = match layout {
                RopeLayout::Interleaved => (2 * i, 2 * i + 1),
                RopeLayout::Neox => (i, i + half),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * c - x1 * s;
            head[b] = x0 * s + x1 * c;
        }
    }
}

/// `gate[i] = silu(gate[i]) * up[i]`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let v = *g;
        *g = v / (1.0 + (-v).exp()) * u;
    }
}

/// `x += y`.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// In-place softmax of one row.
pub fn softmax_inplace(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Dot product of two equal-length rows, with 8 independent accumulators so it vectorizes.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut sum = acc.iter().sum::<f32>();
    for i in chunks * 8..a.len() {
        sum += a[i] * b[i];
    }
    sum
}

/// `y += a * x`.
#[inline(always)]
pub fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (o, &v) in y.iter_mut().zip(x) {
        *o += a * v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rows() {
        let x = [3.0f32, 4.0];
        let mut out = [0.0; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let rms = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6 && (out[1] - 8.0 / rms).abs() < 1e-6);
    }

    #[test]
    fn rope_layouts_rotate_the_same_pairs_differently() {
        let cos = [1.0f32.cos(), 0.5f32.cos()];
        let sin = [1.0f32.sin(), 0.5f32.sin()];
        let base = [1.0f32, 2.0, 3.0, 4.0];
        let mut a = base;
        rope(&mut a, 4, &cos, &sin, RopeLayout::Interleaved);
        // pair (0,1) by angle 1, pair (2,3) by angle 0.5
        let (c, s) = (1.0f32.cos(), 1.0f32.sin());
        assert!((a[0] - (1.0 * c - 2.0 * s)).abs() < 1e-6);
        let mut b = base;
        rope(&mut b, 4, &cos, &sin, RopeLayout::Neox);
        // pair (0,2) by angle 1
        assert!((b[0] - (1.0 * c - 3.0 * s)).abs() < 1e-6);
        assert!((b[2] - (1.0 * s + 3.0 * c)).abs() < 1e-6);
        // position 0 is the identity
        let mut z = base;
        rope(&mut z, 4, &[1.0, 1.0], &[0.0, 0.0], RopeLayout::Neox);
        assert_eq!(z, base);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = [1.0f32, 2.0, 3.0, -1000.0];
        softmax_inplace(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(x[3], 0.0);
    }
}
