// Post-processing of the fused QKV projection, in place: bias (Qwen2), per-head RMSNorm of q and
// k (Qwen3), then rotary embeddings in either layout. One block per token.

// qkv: [tokens, (n_heads + 2 * n_kv) * head_dim] bf16. bias: f32 of that width, or null.
// q_norm / k_norm: f32 [head_dim] or null. inv_freq: f32 [rot_dim / 2]. neox: 1 for halves,
// 0 for adjacent pairs.
extern "C" __global__ void qkv_rope(bf16* __restrict__ qkv, const float* __restrict__ bias,
                                    const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                    const int* __restrict__ positions, const float* __restrict__ inv_freq,
                                    int n_heads, int n_kv, int head_dim, int rot_dim, int neox, float eps) {
    extern __shared__ float row[];  // (n_heads + n_kv) * head_dim: q and k of this token
    const int t = blockIdx.x;
    const int width = (n_heads + 2 * n_kv) * head_dim;
    const int qk = (n_heads + n_kv) * head_dim;
    bf16* x = qkv + (size_t)t * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = bf2f(x[i]);
        if (bias) v += bias[i];
        if (i < qk) row[i] = v;
        else if (bias) x[i] = f2bf(v);  // v: only the bias
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    if (q_norm) {
        for (int h = warp; h < n_heads + n_kv; h += warps) {
            float* hr = row + h * head_dim;
            const float* w = h < n_heads ? q_norm : k_norm;
            float ss = 0.0f;
            for (int i = lane; i < head_dim; i += 32) ss += hr[i] * hr[i];
            const float scale = rsqrtf(warp_sum(ss) / (float)head_dim + eps);
            for (int i = lane; i < head_dim; i += 32) hr[i] = hr[i] * scale * w[i];
        }
        __syncthreads();
    }
    const int half = rot_dim / 2;
    const float pos = (float)positions[t];
    for (int j = threadIdx.x; j < (n_heads + n_kv) * head_dim; j += blockDim.x) {
        const int h = j / head_dim, d = j % head_dim;
        float v = row[j];
        if (d < rot_dim) {
            int i, partner;
            bool first;
            if (neox) {
                first = d < half;
                i = first ? d : d - half;
                partner = first ? d + half : d - half;
            } else {
                first = (d & 1) == 0;
                i = d >> 1;
                partner = first ? d + 1 : d - 1;
            }
            float s, c;
            sincosf(pos * inv_freq[i], &s, &c);
            const float o = row[h * head_dim + partner];
            v = first ? v * c - o * s : o * s + v * c;
        }
        x[j] = f2bf(v);
    }
}
