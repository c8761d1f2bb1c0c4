// Paged attention over block tables for a flat batch of query tokens (prefill chunks and decodes
// mixed): causal, grouped-query, optionally split over the context with a second reduce kernel.
//
// Compiled per model with HEAD_DIM (a multiple of 32, at most 256) and GROUP (query heads per KV
// head, at most 8) defined. One block of ATTN_WARPS warps per (token, kv head, context part); a
// token's context is cut into gridDim.z equal parts at run time, so a captured graph splits
// every context evenly whatever its length;
// each warp walks tiles of 32 keys with an online softmax for all GROUP query heads at once (a
// key is read once for its whole group), then the warps merge in shared memory.

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4
#endif
#define ATTN_WARPS 4
#define PER_LANE (HEAD_DIM / 32)

// Four fp8 e4m3 values (bytes of w, lowest first) as f32: the hardware conversion where there is one.
__device__ __forceinline__ void e4m3x4_to_f32(u32 w, float* out) {
#if __CUDA_ARCH__ >= 890
    u32 lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"((unsigned short)(w & 0xffffu)));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"((unsigned short)(w >> 16)));
    float f0, f1, f2, f3;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f0) : "h"((unsigned short)(lo & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f1) : "h"((unsigned short)(lo >> 16)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f2) : "h"((unsigned short)(hi & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(f3) : "h"((unsigned short)(hi >> 16)));
    out[0] = f0;
    out[1] = f1;
    out[2] = f2;
    out[3] = f3;
#else
#pragma unroll
    for (int b = 0; b < 4; b++) out[b] = e4m32f((fp8)(w >> (8 * b)));
#endif
}

// Lane `lane`'s PER_LANE elements of a value vector, undecoded: loaded for a whole batch of keys
// before any is used, so the loads are in flight together.
template <bool FP8>
struct ValueSlice {
    static constexpr int BYTES = PER_LANE * (FP8 ? 1 : 2);
    static constexpr int WORDS = BYTES >= 4 ? BYTES / 4 : 1;
    u32 w[WORDS];

    __device__ __forceinline__ void load(const void* cache, size_t vec, int lane) {
        const unsigned char* p = (const unsigned char*)cache + (vec * HEAD_DIM + lane * PER_LANE) * (FP8 ? 1 : 2);
        if (BYTES >= 4) {
#pragma unroll
            for (int i = 0; i < WORDS; i++) w[i] = ((const u32*)p)[i];
        } else if (BYTES == 2) {
            w[0] = *(const unsigned short*)p;
        } else {
            w[0] = *p;
        }
    }

    // The PER_LANE values as f32 (fp8 unscaled: the caller folds the scale in).
    __device__ __forceinline__ void decode(float* out) const {
        if (FP8) {
            if (BYTES >= 4) {
#pragma unroll
                for (int i = 0; i < WORDS; i++) e4m3x4_to_f32(w[i], out + 4 * i);
            } else {
#pragma unroll
                for (int d = 0; d < PER_LANE; d++) out[d] = e4m32f((fp8)(w[0] >> (8 * d)));
            }
        } else {
#pragma unroll
            for (int d = 0; d < PER_LANE; d++) out[d] = __uint_as_float(((w[d / 2] >> (16 * (d % 2))) & 0xffffu) << 16);
        }
    }
};

// s[g] = q_g · k for the whole key vector `vec` (read by this lane alone, 16 bytes at a time) and
// every query head g of the group (q pre-scaled, in shared memory).
template <bool FP8>
__device__ __forceinline__ void key_scores(const void* cache, const float* scales, size_t vec,
                                           const float (*s_q)[HEAD_DIM], float* s) {
#pragma unroll
    for (int g = 0; g < GROUP; g++) s[g] = 0.0f;
    if (FP8) {
        const uint4* kp = (const uint4*)((const fp8*)cache + vec * HEAD_DIM);
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 16; c++) {
            const uint4 w = kp[c];
            const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float kf[4];
                e4m3x4_to_f32(words[i], kf);
#pragma unroll
                for (int g = 0; g < GROUP; g++) {
                    const float4 qv = *(const float4*)&s_q[g][c * 16 + i * 4];
                    s[g] += qv.x * kf[0] + qv.y * kf[1] + qv.z * kf[2] + qv.w * kf[3];
                }
            }
        }
        const float ks = scales[vec];
#pragma unroll
        for (int g = 0; g < GROUP; g++) s[g] *= ks;
    } else {
        const uint4* kp = (const uint4*)((const bf16*)cache + vec * HEAD_DIM);
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; c++) {
            float kf[8];
            unpack8(kp[c], kf);
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
                const float4 q0 = *(const float4*)&s_q[g][c * 8];
                const float4 q1 = *(const float4*)&s_q[g][c * 8 + 4];
                s[g] += q0.x * kf[0] + q0.y * kf[1] + q0.z * kf[2] + q0.w * kf[3] + q1.x * kf[4] + q1.y * kf[5] +
                        q1.z * kf[6] + q1.w * kf[7];
            }
        }
    }
}

// q: [tokens, q_stride] (heads at h * HEAD_DIM). token_seq[t]: row of t's block table;
// positions[t]: t attends keys 0..=positions[t]. Writes out [tokens, n_heads * HEAD_DIM] when
// parts == 1, else partial results (unnormalised sums, maxima, denominators) per part.
//
// Each warp takes tiles of 32 consecutive keys (tile i of the part goes to warp i % ATTN_WARPS).
// Scores: lane l reads key l of the tile whole and scores it against every query head of the
// group, so a tile's keys are all in flight at once and no sum crosses lanes. Values: lane l
// owns dims l*PER_LANE.., and each key's probability reaches the lanes by a shuffle.
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

    __shared__ __align__(16) float s_q[GROUP][HEAD_DIM];
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        s_q[g][d] = bf2f(q[(size_t)t * q_stride + (kvh * GROUP + g) * HEAD_DIM + d]) * scale;
    }
    __syncthreads();

    // m: the running maximum (the same on every lane); l: this lane's keys' share of the denominator.
    float acc[GROUP][PER_LANE], m[GROUP], l[GROUP];
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
#pragma unroll
        for (int d = 0; d < PER_LANE; d++) acc[g][d] = 0.0f;
        m[g] = NEG_INF;
        l[g] = 0.0f;
    }
    for (int j0 = start + warp * 32; j0 < end; j0 += ATTN_WARPS * 32) {
        const int j = min(j0 + lane, end - 1);
        const bool valid = j0 + lane < end;
        const size_t vec = ((size_t)table[j / block_size] * n_kv + kvh) * block_size + (j % block_size);
        float s[GROUP], p[GROUP];
        key_scores<FP8>(k_cache, k_scale, vec, s_q, s);
#pragma unroll
        for (int g = 0; g < GROUP; g++) {
            const float sg = valid ? s[g] : NEG_INF;
            const float m_new = fmaxf(m[g], warp_max(sg));
            const float corr = __expf(m[g] - m_new);
            p[g] = valid ? __expf(sg - m_new) : 0.0f;
            l[g] = l[g] * corr + p[g];
#pragma unroll
            for (int d = 0; d < PER_LANE; d++) acc[g][d] *= corr;
            m[g] = m_new;
        }
        // fp8: each key's value scale rides on its probability (lane l holds key l's).
        if (FP8) {
            const float vs = valid ? v_scale[vec] : 0.0f;
#pragma unroll
            for (int g = 0; g < GROUP; g++) p[g] *= vs;
        }
        // Values in batches of V_BATCH keys, every load of a batch issued before its first use.
        constexpr int V_BATCH = ValueSlice<FP8>::WORDS <= 2 ? 32 : 16;
        const int n_keys = min(32, end - j0);
#pragma unroll
        for (int kb = 0; kb < 32; kb += V_BATCH) {
            if (kb >= n_keys) break;
            ValueSlice<FP8> vals[V_BATCH];
#pragma unroll
            for (int kk = 0; kk < V_BATCH; kk++) {
                const int jk = j0 + min(kb + kk, n_keys - 1);
                const size_t vk = ((size_t)table[jk / block_size] * n_kv + kvh) * block_size + (jk % block_size);
                vals[kk].load(v_cache, vk, lane);
            }
#pragma unroll
            for (int kk = 0; kk < V_BATCH; kk++) {
                float vv[PER_LANE];
                vals[kk].decode(vv);
#pragma unroll
                for (int g = 0; g < GROUP; g++) {
                    // Keys past n_keys have p = 0 (their lanes were not valid).
                    const float pk = __shfl_sync(FULL_MASK, p[g], kb + kk);
#pragma unroll
                    for (int d = 0; d < PER_LANE; d++) acc[g][d] = fmaf(pk, vv[d], acc[g][d]);
                }
            }
        }
    }
#pragma unroll
    for (int g = 0; g < GROUP; g++) l[g] = warp_sum(l[g]);

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
