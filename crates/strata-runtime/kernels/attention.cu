// Paged attention over block tables for a flat batch of query tokens (prefill chunks and decodes
// mixed): causal, grouped-query, optionally split over the context with a second reduce kernel.
//
// Compiled per model with HEAD_DIM (a multiple of 32, at most 256) and GROUP (query heads per KV
// head, at most 8) defined. One block of ATTN_WARPS warps per (token, kv head, context part); a
// token's context is cut into gridDim.z equal parts at run time, so a captured graph splits
// every context evenly whatever its length;
// each warp walks every ATTN_WARPS-th key with an online softmax for all GROUP query heads
// at once (a key is read once for its whole group), then the warps merge in shared memory.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4
#endif
#define ATTN_WARPS 4
#define PER_LANE (HEAD_DIM / 32)

template <bool FP8>
__device__ __forceinline__ void load_vec(const void* cache, const float* scales, size_t vec, int lane,
                                         float* out) {
    if (FP8) {
        const fp8* p = (const fp8*)cache + vec * HEAD_DIM + lane * PER_LANE;
        const float s = scales[vec];
#pragma unroll
        for (int d = 0; d < PER_LANE; d++) out[d] = e4m32f(p[d]) * s;
    } else {
        const bf16* p = (const bf16*)cache + vec * HEAD_DIM + lane * PER_LANE;
#pragma unroll
        for (int d = 0; d < PER_LANE; d++) out[d] = bf2f(p[d]);
    }
}

// q: [tokens, q_stride] (heads at h * HEAD_DIM). token_seq[t]: row of t's block table;
// positions[t]: t attends keys 0..=positions[t]. Writes out [tokens, n_heads * HEAD_DIM] when
// parts == 1, else partial results (unnormalised sums, maxima, denominators) per part.
template <bool FP8>
__device__ void paged_attention(const bf16* __restrict__ q, int q_stride, const void* __restrict__ k_cache,
                                const void* __restrict__ v_cache, const float* __restrict__ k_scale,
                                const float* __restrict__ v_scale, const int* __restrict__ block_tables,
                                int max_blocks, const int* __restrict__ token_seq,
                                const int* __restrict__ positions, bf16* __restrict__ out, float* __restrict__ part_acc,
                                float* __restrict__ part_ml, int n_kv, int block_size, float scale) {
    const int t = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z, parts = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n_heads = n_kv * GROUP;
    const int ctx = positions[t] + 1;
    const int part_len = (ctx + parts - 1) / parts;
    const int start = part * part_len;
    const int end = min(ctx, start + part_len);
    const int* table = block_tables + (size_t)token_seq[t] * max_blocks;

    float qv[GROUP][PER_LANE], acc[GROUP][PER_LANE], m[GROUP], l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
        const bf16* qh = q + (size_t)t * q_stride + (kvh * GROUP + g) * HEAD_DIM + lane * PER_LANE;
#pragma unroll
        for (int d = 0; d < PER_LANE; d++) {
            qv[g][d] = bf2f(qh[d]) * scale;
            acc[g][d] = 0.0f;
        }
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
    for (int j = start + warp; j < end; j += ATTN_WARPS) {
        const size_t vec = ((size_t)table[j / block_size] * n_kv + kvh) * block_size + (j % block_size);
        float kv[PER_LANE], vv[PER_LANE];
        load_vec<FP8>(k_cache, k_scale, vec, lane, kv);
        load_vec<FP8>(v_cache, v_scale, vec, lane, vv);
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            float s = 0.0f;
#pragma unroll
            for (int d = 0; d < PER_LANE; d++) s += qv[g][d] * kv[d];
            s = warp_sum(s);
            const float m_new = fmaxf(m[g], s);
            const float corr = __expf(m[g] - m_new);
            const float p = __expf(s - m_new);
            l[g] = l[g] * corr + p;
#pragma unroll
            for (int d = 0; d < PER_LANE; d++) acc[g][d] = acc[g][d] * corr + p * vv[d];
            m[g] = m_new;
        }
    }

    __shared__ float s_acc[ATTN_WARPS][GROUP][HEAD_DIM];
    __shared__ float s_m[ATTN_WARPS][GROUP], s_l[ATTN_WARPS][GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
#pragma unroll
        for (int d = 0; d < PER_LANE; d++) s_acc[warp][g][lane * PER_LANE + d] = acc[g][d];
        if (lane == 0) {
            s_m[warp][g] = m[g];
            s_l[warp][g] = l[g];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float mx = NEG_INF;
        for (int w = 0; w < ATTN_WARPS; w++) mx = fmaxf(mx, s_m[w][g]);
        float num = 0.0f, den = 0.0f;
        if (mx != NEG_INF) {
            for (int w = 0; w < ATTN_WARPS; w++) {
                const float f = __expf(s_m[w][g] - mx);
                num += s_acc[w][g][d] * f;
                den += s_l[w][g] * f;
            }
        }
        const int head = kvh * GROUP + g;
        if (parts == 1) {
            out[(size_t)t * n_heads * HEAD_DIM + head * HEAD_DIM + d] = f2bf(den > 0.0f ? num / den : 0.0f);
        } else {
            const size_t p = ((size_t)t * n_heads + head) * parts + part;
            part_acc[p * HEAD_DIM + d] = num;
            if (d == 0) {
                part_ml[2 * p] = mx;
                part_ml[2 * p + 1] = den;
            }
        }
    }
}

#define ATTENTION_ARGS                                                                                        \
    const bf16 *q, int q_stride, const void *k_cache, const void *v_cache, const float *k_scale,             \
        const float *v_scale, const int *block_tables, int max_blocks, const int *token_seq, const int *positions, \
        bf16 *out, float *part_acc, float *part_ml, int n_kv, int block_size, float scale
#define ATTENTION_CALL                                                                                     \
    q, q_stride, k_cache, v_cache, k_scale, v_scale, block_tables, max_blocks, token_seq, positions, out, \
        part_acc, part_ml, n_kv, block_size, scale

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) paged_attention_bf16(ATTENTION_ARGS) {
    paged_attention<false>(ATTENTION_CALL);
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) paged_attention_fp8(ATTENTION_ARGS) {
    paged_attention<true>(ATTENTION_CALL);
}

// Merges the context parts of each (token, head): grid (tokens, n_heads), HEAD_DIM threads.
extern "C" __global__ void attention_reduce(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                            bf16* __restrict__ out, int parts) {
    const int t = blockIdx.x, head = blockIdx.y, n_heads = gridDim.y, d = threadIdx.x;
    const size_t base = ((size_t)t * n_heads + head) * parts;
    float mx = NEG_INF;
    for (int p = 0; p < parts; p++) mx = fmaxf(mx, part_ml[2 * (base + p)]);
    float num = 0.0f, den = 0.0f;
    if (mx != NEG_INF) {
        for (int p = 0; p < parts; p++) {
            const float pm = part_ml[2 * (base + p)];
            if (pm == NEG_INF) continue;
            const float f = __expf(pm - mx);
            num += part_acc[(base + p) * HEAD_DIM + d] * f;
            den += part_ml[2 * (base + p) + 1] * f;
        }
    }
    out[((size_t)t * n_heads + head) * HEAD_DIM + d] = f2bf(den > 0.0f ? num / den : 0.0f);
}
