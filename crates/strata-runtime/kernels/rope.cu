// Post-processing of the fused QKV projection, one warp per head of a (token, KV head): bias
// (Qwen2), per-head RMSNorm of q and k (Qwen3), rotary embeddings in either layout, then the write
// of the token's K and V into its slot of the paged cache (bf16 as is, or fp8 e4m3 with one scale
// per (token, head)). Cache layout per layer: [block][kv_head][slot][dim].
// `qkv_rope_kv_write_f32`: the same for `--dtype float32`, qkv and cache in f32 (no scales, no
// rounding to bf16 anywhere).

// qkv: [tokens, (n_heads + 2 * n_kv) * head_dim] of T (bf16 or f32), rewritten in place. When
// splits > 0 the projection is still the k splits a quantized GEMM left in parts ([splits, tokens,
// width] f32): summed in order and rounded to T here, as qgemm_reduce would into qkv. bias:
// f32 of that width, or null. q_norm / k_norm: f32 [head_dim] or null. rope_table:
// [position][rot_dim / 2] (cos, sin) of each rotated pair. neox: 1 for halves, 0 for adjacent
// pairs. slots[t] = block * block_size + slot.
// Block (t, h) has group + 2 warps for KV head h: its group's query heads, then its k head, then
// its v head. Lane l holds dims l * per .. (per = head_dim / 32) in registers, read and written in
// one access, so a rotation's partner is in the same lane or (halves) in lane l ± half / per, which
// the host checks is whole (rot_dim a multiple of 2 * per); nothing goes through shared memory.
// The cache holds T unless FP8.
template <typename T, bool FP8>
__device__ void qkv_rope_kv_write(T* __restrict__ qkv, const float* __restrict__ parts, int splits,
                                  const float* __restrict__ bias,
                                  const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                  const int* __restrict__ positions, const float2* __restrict__ rope_table, int n_heads,
                                  int n_kv, int head_dim, int rot_dim, int neox, float eps,
                                  const int* __restrict__ slots, void* __restrict__ k_cache,
                                  void* __restrict__ v_cache, float* __restrict__ k_scale,
                                  float* __restrict__ v_scale, int block_size) {
    const int t = blockIdx.x, kvh = blockIdx.y;
    const int group = n_heads / n_kv;
    const int lh = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lh >= group + 2) return;
    const bool is_k = lh == group, is_v = lh == group + 1;
    const int per = head_dim >> 5;
    const int h = lh < group ? kvh * group + lh : (is_k ? n_heads + kvh : n_heads + n_kv + kvh);
    const int width = (n_heads + 2 * n_kv) * head_dim;
    T* x = qkv + (size_t)t * width + h * head_dim + lane * per;
    const float* b = bias ? bias + h * head_dim + lane * per : nullptr;

    float v[8];
    if (splits > 0) {
        const size_t count = (size_t)gridDim.x * width;
        const float* p = parts + (size_t)t * width + h * head_dim + lane * per;
        load_vals(p, per, v);
        for (int z = 1; z < splits; z++) {
            float pz[8];
            load_vals(p + z * count, per, pz);
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] += pz[e];
        }
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = held_as<T>(v[e]);
    } else {
        load_vals(x, per, v);
    }
    if (b) {
#pragma unroll
        for (int e = 0; e < 8; e++)
            if (e < per) v[e] += b[e];
    }
    if (is_v) {
        // v as the cache and attention will see it: rounded once (bf16), after the bias.
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = held_as<T>(v[e]);
        // qkv's v as the reduce would leave it (attention reads v from the cache).
        if (b || splits > 0) store_vals(x, per, v);
    } else {
        const float* w = is_k ? k_norm : q_norm;
        if (w) {
            float ss = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (e < per) ss += v[e] * v[e];
            const float scale = rsqrtf(warp_sum(ss) / (float)head_dim + eps);
#pragma unroll
            for (int e = 0; e < 8; e++)
                if (e < per) v[e] = v[e] * scale * w[lane * per + e];
        }
        const int half = rot_dim / 2;
        const float2* cs = rope_table + (size_t)positions[t] * half;
        const int d0 = lane * per;
        // Halves: every dim of this lane is in the same half, so its partners are in one lane.
        const bool first_half = d0 < half;
        const int src = (neox && d0 < rot_dim) ? (first_half ? lane + half / per : lane - half / per) : lane;
        float o[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            if (e < per) {
                if (neox) {
                    o[e] = __shfl_sync(FULL_MASK, v[e], src);
                } else {
                    // Adjacent pairs: the partner is the neighbouring dim, in this lane unless a
                    // lane holds one dim (head_dim 32; per is even otherwise, the host checks).
                    o[e] = per == 1 ? __shfl_xor_sync(FULL_MASK, v[e], 1) : v[e ^ 1];
                }
            }
        }
#pragma unroll
        for (int e = 0; e < 8; e++) {
            const int d = d0 + e;
            if (e < per && d < rot_dim) {
                const bool first = neox ? first_half : (d & 1) == 0;
                v[e] = rope_rotate(v[e], o[e], first, cs[neox ? (first ? d : d - half) : d >> 1]);
            }
        }
#pragma unroll
        for (int e = 0; e < 8; e++) v[e] = held_as<T>(v[e]);
        store_vals(x, per, v);
        if (!is_k) return;
    }
    // The k warp and the v warp write their head into the cache.
    const int s = slots[t];
    const int block = s / block_size, slot = s % block_size;
    const size_t vec = ((size_t)block * n_kv + kvh) * block_size + slot;
    const size_t at = vec * head_dim + lane * per;
    if (!FP8) {
        store_vals((T*)(is_v ? v_cache : k_cache) + at, per, v);
        return;
    }
    // fp8: amax over the head, scale = amax / 448, encode.
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; e++)
        if (e < per) amax = fmaxf(amax, fabsf(v[e]));
    amax = warp_max(amax);
    const float scale = (amax > 0.0f && isfinite(amax)) ? amax / 448.0f : 1.0f;
    const float inv = 1.0f / scale;
    fp8* dst = (fp8*)(is_v ? v_cache : k_cache) + at;
#pragma unroll
    for (int e = 0; e < 8; e++)
        if (e < per) dst[e] = f2e4m3(v[e] * inv);
    if (lane == 0) (is_v ? v_scale : k_scale)[vec] = scale;
}

// The kernels' arguments, qkv of element type T.
#define ROPE_ARGS(T)                                                                                           \
    T *qkv, const float *parts, int splits, const float *bias, const float *q_norm, const float *k_norm,       \
        const int *positions, const float2 *rope_table, int n_heads, int n_kv, int head_dim, int rot_dim,      \
        int neox, float eps, const int *slots, void *k_cache, void *v_cache, float *k_scale, float *v_scale,   \
        int block_size
#define ROPE_CALL                                                                                              \
    qkv, parts, splits, bias, q_norm, k_norm, positions, rope_table, n_heads, n_kv, head_dim, rot_dim, neox,   \
        eps, slots, k_cache, v_cache, k_scale, v_scale, block_size

// Grid (tokens, n_kv), (n_heads / n_kv + 2) * 32 threads, no shared memory.
extern "C" __global__ void qkv_rope_kv_write_bf16(ROPE_ARGS(bf16)) {
    wait_for_previous_kernel();
    qkv_rope_kv_write<bf16, false>(ROPE_CALL);
}
extern "C" __global__ void qkv_rope_kv_write_fp8(ROPE_ARGS(bf16)) {
    wait_for_previous_kernel();
    qkv_rope_kv_write<bf16, true>(ROPE_CALL);
}
// k_scale and v_scale unused (pass null).
extern "C" __global__ void qkv_rope_kv_write_f32(ROPE_ARGS(float)) {
    wait_for_previous_kernel();
    qkv_rope_kv_write<float, false>(ROPE_CALL);
}
