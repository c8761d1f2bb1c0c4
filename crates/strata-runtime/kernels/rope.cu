// Post-processing of the fused QKV projection, one block per (token, KV head): bias (Qwen2),
// per-head RMSNorm of q and k (Qwen3), rotary embeddings in either layout, then the write of the
// token's K and V into its slot of the paged cache (bf16 as is, or fp8 e4m3 with one scale per
// (token, head)). Cache layout per layer: [block][kv_head][slot][dim].

// qkv: [tokens, (n_heads + 2 * n_kv) * head_dim] bf16, rewritten in place. bias: f32 of that
// width, or null. q_norm / k_norm: f32 [head_dim] or null. inv_freq: f32 [rot_dim / 2]. neox: 1
// for halves, 0 for adjacent pairs. slots[t] = block * block_size + slot.
// Block (t, h) handles KV head h: its group's query heads, then its k head, then its v head, in
// shared memory as local heads 0..group+1, plus the rotated k as written.
template <bool FP8>
__device__ void qkv_rope_kv_write(bf16* __restrict__ qkv, const float* __restrict__ bias,
                                  const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                  const int* __restrict__ positions, const float* __restrict__ inv_freq, int n_heads,
                                  int n_kv, int head_dim, int rot_dim, int neox, float eps,
                                  const int* __restrict__ slots, void* __restrict__ k_cache,
                                  void* __restrict__ v_cache, float* __restrict__ k_scale,
                                  float* __restrict__ v_scale, int block_size) {
    extern __shared__ float row[];
    const int t = blockIdx.x, kvh = blockIdx.y;
    const int group = n_heads / n_kv;
    const int width = (n_heads + 2 * n_kv) * head_dim;
    const int local_heads = group + 2;
    float* krot = row + local_heads * head_dim;
    bf16* x = qkv + (size_t)t * width;
    // The offset in the token's row of local head lh.
    auto head_at = [&](int lh) {
        const int h = lh < group ? kvh * group + lh : (lh == group ? n_heads + kvh : n_heads + n_kv + kvh);
        return h * head_dim;
    };
    for (int i = threadIdx.x; i < local_heads * head_dim; i += blockDim.x) {
        const int lh = i / head_dim, gi = head_at(lh) + i % head_dim;
        float v = bf2f(x[gi]);
        if (bias) v += bias[gi];
        if (lh <= group) {
            row[i] = v;
        } else {
            if (bias) x[gi] = f2bf(v);
            row[i] = bf2f(f2bf(v));
        }
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
    if (q_norm) {
        for (int lh = warp; lh <= group; lh += warps) {
            float* hr = row + lh * head_dim;
            const float* w = lh < group ? q_norm : k_norm;
            float ss = 0.0f;
            for (int i = lane; i < head_dim; i += 32) ss += hr[i] * hr[i];
            const float scale = rsqrtf(warp_sum(ss) / (float)head_dim + eps);
            for (int i = lane; i < head_dim; i += 32) hr[i] = hr[i] * scale * w[i];
        }
        __syncthreads();
    }
    const int half = rot_dim / 2;
    const float pos = (float)positions[t];
    for (int j = threadIdx.x; j < (group + 1) * head_dim; j += blockDim.x) {
        const int lh = j / head_dim, d = j % head_dim;
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
            const float o = row[lh * head_dim + partner];
            v = first ? v * c - o * s : o * s + v * c;
        }
        const bf16 b = f2bf(v);
        x[head_at(lh) + d] = b;
        if (lh == group) krot[d] = bf2f(b);
    }
    __syncthreads();
    const int s = slots[t];
    const int block = s / block_size, slot = s % block_size;
    const size_t vec = ((size_t)block * n_kv + kvh) * block_size + slot;
    const float* vrow = row + (group + 1) * head_dim;
    if (!FP8) {
        for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
            ((bf16*)k_cache)[vec * head_dim + d] = f2bf(krot[d]);
            ((bf16*)v_cache)[vec * head_dim + d] = f2bf(vrow[d]);
        }
        return;
    }
    // fp8: warp 0 encodes K, warp 1 V (the same warp both in a one-warp block): amax,
    // scale = amax / 448, encode.
    for (int job = warp; job < 2; job += warps) {
        const bool is_v = job == 1;
        const float* src = is_v ? vrow : krot;
        float amax = 0.0f;
        for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(src[d]));
        amax = warp_max(amax);
        const float scale = (amax > 0.0f && isfinite(amax)) ? amax / 448.0f : 1.0f;
        const float inv = 1.0f / scale;
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

// Grid (tokens, n_kv); shared memory: (n_heads / n_kv + 3) * head_dim floats.
extern "C" __global__ void qkv_rope_kv_write_bf16(ROPE_ARGS) {
    wait_for_previous_kernel();
    qkv_rope_kv_write<false>(ROPE_CALL);
}
extern "C" __global__ void qkv_rope_kv_write_fp8(ROPE_ARGS) {
    wait_for_previous_kernel();
    qkv_rope_kv_write<true>(ROPE_CALL);
}
