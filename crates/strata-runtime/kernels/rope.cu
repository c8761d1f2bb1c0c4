// Post-processing of the fused QKV projection, one block per token: bias (Qwen2), per-head RMSNorm
// of q and k (Qwen3), rotary embeddings in either layout, then the write of the token's K and V
// into its slot of the paged cache (bf16 as is, or fp8 e4m3 with one scale per (token, head)).
// Cache layout per layer: [block][kv_head][slot][dim].

// qkv: [tokens, (n_heads + 2 * n_kv) * head_dim] bf16, rewritten in place. bias: f32 of that
// width, or null. q_norm / k_norm: f32 [head_dim] or null. inv_freq: f32 [rot_dim / 2]. neox: 1
// for halves, 0 for adjacent pairs. slots[t] = block * block_size + slot.
template <bool FP8>
__device__ void qkv_rope_kv_write(bf16* __restrict__ qkv, const float* __restrict__ bias,
                                  const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                  const int* __restrict__ positions, const float* __restrict__ inv_freq, int n_heads,
                                  int n_kv, int head_dim, int rot_dim, int neox, float eps,
                                  const int* __restrict__ slots, void* __restrict__ k_cache,
                                  void* __restrict__ v_cache, float* __restrict__ k_scale,
                                  float* __restrict__ v_scale, int block_size) {
    // q, k and v of this token, then the rotated k (each value as the bf16 written back).
    extern __shared__ float row[];
    const int t = blockIdx.x;
    const int width = (n_heads + 2 * n_kv) * head_dim;
    const int qk = (n_heads + n_kv) * head_dim;
    const int kv_width = n_kv * head_dim;
    float* krot = row + width;
    bf16* x = qkv + (size_t)t * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = bf2f(x[i]);
        if (bias) v += bias[i];
        if (i < qk) {
            row[i] = v;
        } else {
            if (bias) x[i] = f2bf(v);
            row[i] = bf2f(f2bf(v));
        }
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
    for (int j = threadIdx.x; j < qk; j += blockDim.x) {
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
        const bf16 b = f2bf(v);
        x[j] = b;
        if (j >= n_heads * head_dim) krot[j - n_heads * head_dim] = bf2f(b);
    }
    __syncthreads();
    const int s = slots[t];
    const int block = s / block_size, slot = s % block_size;
    const float* vrow = row + qk;
    if (!FP8) {
        for (int i = threadIdx.x; i < kv_width; i += blockDim.x) {
            const int h = i / head_dim, d = i % head_dim;
            const size_t o = (((size_t)block * n_kv + h) * block_size + slot) * head_dim + d;
            ((bf16*)k_cache)[o] = f2bf(krot[i]);
            ((bf16*)v_cache)[o] = f2bf(vrow[i]);
        }
        return;
    }
    // fp8: one warp per (kv head, K or V): amax, scale = amax / 448, encode.
    for (int job = warp; job < 2 * n_kv; job += warps) {
        const int h = job % n_kv;
        const bool is_v = job >= n_kv;
        const float* src = (is_v ? vrow : krot) + h * head_dim;
        float amax = 0.0f;
        for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(src[d]));
        amax = warp_max(amax);
        const float scale = (amax > 0.0f && isfinite(amax)) ? amax / 448.0f : 1.0f;
        const float inv = 1.0f / scale;
        const size_t vec = ((size_t)block * n_kv + h) * block_size + slot;
        fp8* dst = (fp8*)(is_v ? v_cache : k_cache) + vec * head_dim;
        for (int d = lane; d < head_dim; d += 32) dst[d] = f2e4m3(src[d] * inv);
        if (lane == 0) (is_v ? v_scale : k_scale)[vec] = scale;
    }
}

#define ROPE_ARGS                                                                                              \
    bf16 *qkv, const float *bias, const float *q_norm, const float *k_norm, const int *positions,             \
        const float *inv_freq, int n_heads, int n_kv, int head_dim, int rot_dim, int neox, float eps,          \
        const int *slots, void *k_cache, void *v_cache, float *k_scale, float *v_scale, int block_size
#define ROPE_CALL                                                                                              \
    qkv, bias, q_norm, k_norm, positions, inv_freq, n_heads, n_kv, head_dim, rot_dim, neox, eps, slots,      \
        k_cache, v_cache, k_scale, v_scale, block_size

// Shared memory: ((n_heads + 3 * n_kv) * head_dim) floats.
extern "C" __global__ void qkv_rope_kv_write_bf16(ROPE_ARGS) {
    wait_for_previous_kernel();
    qkv_rope_kv_write<false>(ROPE_CALL);
}
extern "C" __global__ void qkv_rope_kv_write_fp8(ROPE_ARGS) {
    wait_for_previous_kernel();
    qkv_rope_kv_write<true>(ROPE_CALL);
}
