// Writes each new token's K and V into its slot of the paged cache: bf16 as is, or fp8 e4m3
// with one scale per (token, head) vector. Cache layout per layer: [block][kv_head][slot][dim].

// qkv: [tokens, (n_heads + 2 * n_kv) * head_dim], K at column k_col, V right after.
// slots[t] = block * block_size + slot. One block per token.
extern "C" __global__ void kv_write_bf16(const bf16* __restrict__ qkv, int width, int k_col,
                                         const int* __restrict__ slots, bf16* __restrict__ k_cache,
                                         bf16* __restrict__ v_cache, int n_kv, int head_dim, int block_size) {
    const int t = blockIdx.x;
    const int s = slots[t];
    const int block = s / block_size, slot = s % block_size;
    const bf16* k = qkv + (size_t)t * width + k_col;
    const bf16* v = k + n_kv * head_dim;
    for (int i = threadIdx.x; i < n_kv * head_dim; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        const size_t o = (((size_t)block * n_kv + h) * block_size + slot) * head_dim + d;
        k_cache[o] = k[i];
        v_cache[o] = v[i];
    }
}

// One warp per (token, kv head, K or V): amax, scale = amax / 448, encode.
extern "C" __global__ void kv_write_fp8(const bf16* __restrict__ qkv, int width, int k_col,
                                        const int* __restrict__ slots, fp8* __restrict__ k_cache,
                                        fp8* __restrict__ v_cache, float* __restrict__ k_scale,
                                        float* __restrict__ v_scale, int n_kv, int head_dim, int block_size) {
    const int t = blockIdx.x;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    const int s = slots[t];
    const int block = s / block_size, slot = s % block_size;
    for (int job = warp; job < 2 * n_kv; job += warps) {
        const int h = job % n_kv;
        const bool is_v = job >= n_kv;
        const bf16* src = qkv + (size_t)t * width + k_col + (is_v ? n_kv * head_dim : 0) + h * head_dim;
        float amax = 0.0f;
        for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(bf2f(src[d])));
        amax = warp_max(amax);
        const float scale = (amax > 0.0f && isfinite(amax)) ? amax / 448.0f : 1.0f;
        const float inv = 1.0f / scale;
        const size_t vec = ((size_t)block * n_kv + h) * block_size + slot;
        fp8* dst = (is_v ? v_cache : k_cache) + vec * head_dim;
        for (int d = lane; d < head_dim; d += 32) dst[d] = f2e4m3(bf2f(src[d]) * inv);
        if (lane == 0) (is_v ? v_scale : k_scale)[vec] = scale;
    }
}
