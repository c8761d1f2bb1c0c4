// Paged attention over block tables for a flat batch of query tokens (prefill chunks and decodes
// mixed): causal, grouped-query, optionally split over the context with a second reduce kernel.
//
// Compiled per model with HEAD_DIM (a multiple of 32, at most 256) and GROUP (query heads per KV
// head, at most 8) defined. One block of ATTN_WARPS warps per (token, kv head, context part); a
// token's context is cut into gridDim.z equal parts at run time, so a captured graph splits
// every context evenly whatever its length;
// each warp walks tiles of 32 keys with an online softmax for all GROUP query heads at once (a
// key is read once for its whole group), then the warps merge in shared memory.
// `paged_attention_f32` and `attention_reduce_f32`: the same for `--dtype float32`, q, out and
// the cache in f32 (CUDA cores only; the tensor-core kernels are bf16 and fp8).

#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef GROUP
#define GROUP 4
#endif
#define ATTN_WARPS 4
// Blocks of the tensor-core kernels an SM must hold (launch bounds; benchmark variants).
#ifndef ATTN_MIN_BLOCKS
#define ATTN_MIN_BLOCKS 1
#endif
#ifndef STAGED_MIN_BLOCKS
#define STAGED_MIN_BLOCKS 2
#endif
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
// before any is used, so the loads are in flight together. The cache holds T (bf16 or f32) unless
// FP8.
template <typename T, bool FP8>
struct ValueSlice {
    static constexpr int ELEM = FP8 ? 1 : (int)sizeof(T);
    static constexpr int BYTES = PER_LANE * ELEM;
    static constexpr int WORDS = BYTES >= 4 ? BYTES / 4 : 1;
    u32 w[WORDS];

    __device__ __forceinline__ void load(const void* cache, size_t vec, int lane) {
        const unsigned char* p = (const unsigned char*)cache + (vec * HEAD_DIM + lane * PER_LANE) * ELEM;
        if (ELEM == 4 && PER_LANE % 4 == 0) {
            // f32, PER_LANE a multiple of 4: p is 16-byte aligned.
#pragma unroll
            for (int i = 0; i < WORDS / 4; i++) {
                const uint4 q = ((const uint4*)p)[i];
                w[4 * i] = q.x, w[4 * i + 1] = q.y, w[4 * i + 2] = q.z, w[4 * i + 3] = q.w;
            }
        } else if (BYTES >= 4) {
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
        if (ELEM == 4) {
#pragma unroll
            for (int d = 0; d < PER_LANE; d++) out[d] = __uint_as_float(w[d]);
        } else if (FP8) {
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
// every query head g of the group (q pre-scaled, in shared memory). The cache holds T unless FP8.
template <typename T, bool FP8>
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
    } else if (sizeof(T) == 4) {
        const float4* kp = (const float4*)((const float*)cache + vec * HEAD_DIM);
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; c++) {
            const float4 k0 = kp[2 * c], k1 = kp[2 * c + 1];
#pragma unroll
            for (int g = 0; g < GROUP; g++) {
                const float4 q0 = *(const float4*)&s_q[g][c * 8];
                const float4 q1 = *(const float4*)&s_q[g][c * 8 + 4];
                s[g] += q0.x * k0.x + q0.y * k0.y + q0.z * k0.z + q0.w * k0.w + q1.x * k1.x + q1.y * k1.y +
                        q1.z * k1.z + q1.w * k1.w;
            }
        }
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

// The cache vector of key j of a sequence (its block table `table`) for KV head kvh.
__device__ __forceinline__ size_t cache_vec(const int* table, int j, int kvh, int n_kv, int block_size) {
    return ((size_t)table[j / block_size] * n_kv + kvh) * block_size + (j % block_size);
}

// Per-warp results of a block, for the merge: each warp's output sums of every query head of the
// group over its keys, and their running maximum and denominator.
struct WarpResults {
    float acc[ATTN_WARPS][GROUP][HEAD_DIM];
    float m[ATTN_WARPS][GROUP], l[ATTN_WARPS][GROUP];
};

// The end of both attention kernels, once every warp has filled its part of `r`: the warps merge
// and the block writes the normalised output as T (parts == 1) or its context part's partial sums.
template <typename T>
__device__ __forceinline__ void merge_warps_and_store(const WarpResults& r, int t, int kvh, int part, int parts,
                                                      int n_kv, T* __restrict__ out, float* __restrict__ part_acc,
                                                      float* __restrict__ part_ml) {
    const int n_heads = n_kv * GROUP;
    __syncthreads();
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float mx = NEG_INF;
        for (int w = 0; w < ATTN_WARPS; w++) mx = fmaxf(mx, r.m[w][g]);
        float num = 0.0f, den = 0.0f;
        if (mx != NEG_INF) {
            for (int w = 0; w < ATTN_WARPS; w++) {
                const float f = __expf(r.m[w][g] - mx);
                num += r.acc[w][g][d] * f;
                den += r.l[w][g] * f;
            }
        }
        const int head = kvh * GROUP + g;
        if (parts == 1) {
            out[(size_t)t * n_heads * HEAD_DIM + head * HEAD_DIM + d] = from_f32<T>(den > 0.0f ? num / den : 0.0f);
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

// q: [tokens, q_stride] (heads at h * HEAD_DIM). token_seq[t]: row of t's block table;
// positions[t]: t attends keys 0..=positions[t]. Writes out [tokens, n_heads * HEAD_DIM] when
// parts == 1, else partial results (unnormalised sums, maxima, denominators) per part.
//
// Each warp takes tiles of 32 consecutive keys (tile i of the part goes to warp i % ATTN_WARPS).
// Scores: lane l reads key l of the tile whole and scores it against every query head of the
// group, so a tile's keys are all in flight at once and no sum crosses lanes. Values: lane l
// owns dims l*PER_LANE.., and each key's probability reaches the lanes by a shuffle.
// q and out hold T (bf16 or f32), and so does the cache unless FP8.
template <typename T, bool FP8>
__device__ void paged_attention(const T* __restrict__ q, int q_stride, const void* __restrict__ k_cache,
                                const void* __restrict__ v_cache, const float* __restrict__ k_scale,
                                const float* __restrict__ v_scale, const int* __restrict__ block_tables,
                                int max_blocks, const int* __restrict__ token_seq,
                                const int* __restrict__ positions, T* __restrict__ out, float* __restrict__ part_acc,
                                float* __restrict__ part_ml, int n_kv, int block_size, float scale) {
    const int t = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z, parts = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int ctx = positions[t] + 1;
    const int part_len = (ctx + parts - 1) / parts;
    const int start = part * part_len;
    const int end = min(ctx, start + part_len);
    const int* table = block_tables + (size_t)token_seq[t] * max_blocks;

    __shared__ __align__(16) float s_q[GROUP][HEAD_DIM];
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        s_q[g][d] = to_f32(q[(size_t)t * q_stride + (kvh * GROUP + g) * HEAD_DIM + d]) * scale;
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
        const size_t vec = cache_vec(table, j, kvh, n_kv, block_size);
        float s[GROUP], p[GROUP];
        key_scores<T, FP8>(k_cache, k_scale, vec, s_q, s);
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
        constexpr int V_BATCH = ValueSlice<T, FP8>::WORDS <= 2 ? 32 : 16;
        const int n_keys = min(32, end - j0);
#pragma unroll
        for (int kb = 0; kb < 32; kb += V_BATCH) {
            if (kb >= n_keys) break;
            ValueSlice<T, FP8> vals[V_BATCH];
#pragma unroll
            for (int kk = 0; kk < V_BATCH; kk++) {
                const int jk = j0 + min(kb + kk, n_keys - 1);
                const size_t vk = cache_vec(table, jk, kvh, n_kv, block_size);
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

    __shared__ WarpResults r;
#pragma unroll
    for (int g = 0; g < GROUP; g++) {
#pragma unroll
        for (int d = 0; d < PER_LANE; d++) r.acc[warp][g][lane * PER_LANE + d] = acc[g][d];
        if (lane == 0) {
            r.m[warp][g] = m[g];
            r.l[warp][g] = l[g];
        }
    }
    merge_warps_and_store(r, t, kvh, part, parts, n_kv, out, part_acc, part_ml);
}

// The kernels' arguments, q and out of element type T.
#define ATTENTION_ARGS(T)                                                                                     \
    const T *q, int q_stride, const void *k_cache, const void *v_cache, const float *k_scale,                \
        const float *v_scale, const int *block_tables, int max_blocks, const int *token_seq, const int *positions, \
        T *out, float *part_acc, float *part_ml, int n_kv, int block_size, float scale
#define ATTENTION_CALL                                                                                     \
    q, q_stride, k_cache, v_cache, k_scale, v_scale, block_tables, max_blocks, token_seq, positions, out, \
        part_acc, part_ml, n_kv, block_size, scale

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) paged_attention_bf16(ATTENTION_ARGS(bf16)) {
    wait_for_previous_kernel();
    paged_attention<bf16, false>(ATTENTION_CALL);
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) paged_attention_fp8(ATTENTION_ARGS(bf16)) {
    wait_for_previous_kernel();
    paged_attention<bf16, true>(ATTENTION_CALL);
}

// k_scale and v_scale unused (pass null).
extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32) paged_attention_f32(ATTENTION_ARGS(float)) {
    wait_for_previous_kernel();
    paged_attention<float, false>(ATTENTION_CALL);
}

// ---- Tensor-core attention (HEAD_DIM 64 or 128; bf16 from sm_80, fp8 e4m3 from sm_89) ----
// The same grid, blocks and results as the kernels above, but each warp takes tiles of 16 keys and
// computes both products with mma.sync m16n8k16 (f32 sums), keys as the 16 rows and the group's
// query heads as the 8 columns (padded with zeros), so no product pads its rows:
// Sᵀ = K Qᵀ, then Oᵀ += Vᵀ Pᵀ with Pᵀ from Sᵀ's accumulator registers by one 8x8 transpose a half.
// Lane (g, c) = (lane / 4, lane % 4). A dot product may sum its dims in any order and Vᵀ Pᵀ its
// keys in any order, as long as both operands agree: so each lane loads whole pieces (K: dims
// 32i + 8c.. of keys g and g + 8, Q the same dims of head g; V: dims g * LANE_DIMS.. of keys 2c,
// 2c + 1, 2c + 8, 2c + 9) and the fragments are their words as they come (V's paired by key).
// bf16 cache: both products in bf16. fp8 cache: K is widened to bf16 (exact) and S scaled by each
// key's scale; V is widened to f16 (exact) and Vᵀ Pᵀ runs in f16, each key's V scale folded into P.

// Dims of O a lane holds for each of its query heads, and of V it loads for each of its keys:
// rows g and g + 8 of each of the LANE_DIMS / 2 m-tiles of Oᵀ (dims g * LANE_DIMS + 2u and
// + 2u + 1 of m-tile u).
#define LANE_DIMS (HEAD_DIM / 8)

#if __CUDA_ARCH__ >= 800
// The warp's 8x8 matrix of 16-bit pairs (lane (g, c) holds row g, columns 2c and 2c + 1),
// transposed in the same layout.
__device__ __forceinline__ u32 transpose_8x8(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}
#endif

#if __CUDA_ARCH__ >= 890
// Two e4m3 bytes (low first) as an f16 pair: exact.
__device__ __forceinline__ u32 e4m3x2_to_f16x2(u32 two) {
    u32 r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)(two & 0xffffu)));
    return r;
}

// Four e4m3 bytes (low first) as two bf16 pairs: exact (every e4m3 value is a bf16).
__device__ __forceinline__ void e4m3x4_to_bf16x2(u32 four, u32& lo, u32& hi) {
    float f[4];
    e4m3x4_to_f32(four, f);
    lo = pack_pair<false>(f[0], f[1]);
    hi = pack_pair<false>(f[2], f[3]);
}
#endif

// ---- Staged tensor-core attention (batches of many tokens) ----
// The same products, but a warp's tiles come through shared memory: cp.async copies the K and V
// of the next `stages` - 1 tiles (and fp8 scales) while the warp computes the current one, so a
// warp keeps up to 16 KB in flight instead of the 8 KB it holds in registers above, and the
// registers those loads took are free. Each warp owns its stages (no block barrier in the loop).
// A stage: K then V of 16 keys, each key's vector as ROW_CH 16-byte chunks, XOR-swizzled by key
// so the fragment reads below hit distinct banks; then (fp8) 16 K and 16 V scales.
template <bool FP8>
struct KvStage {
    static constexpr int ROW_CH = HEAD_DIM * (FP8 ? 1 : 2) / 16;
    static constexpr int TILE_CH = 16 * ROW_CH;
    // In 16-byte chunks: K, V, then the scales (32 floats).
    static constexpr int CHUNKS = 2 * TILE_CH + (FP8 ? 8 : 0);
    // Chunk `ch` of key `key` (0..15) within a K or V tile.
    static __device__ __forceinline__ int at(int key, int ch) {
        const int f = ((key >> 1) & 1) | ((((key >> 2) ^ key) & 1) << 2);
        return key * ROW_CH + (ch ^ (f & (ROW_CH - 1)));
    }
};

// STAGED: tiles come through `stages` (2 to 4) shared-memory stages a warp (dynamic shared
// memory: ATTN_WARPS * stages * KvStage<FP8>::CHUNKS * 16 bytes); otherwise straight from global
// memory into registers.
template <bool FP8, bool STAGED>
__device__ void paged_attention_mma(const bf16* __restrict__ q, int q_stride, const void* __restrict__ k_cache,
                                    const void* __restrict__ v_cache, const float* __restrict__ k_scale,
                                    const float* __restrict__ v_scale, const int* __restrict__ block_tables,
                                    int max_blocks, const int* __restrict__ token_seq,
                                    const int* __restrict__ positions, bf16* __restrict__ out,
                                    float* __restrict__ part_acc, float* __restrict__ part_ml, int n_kv,
                                    int block_size, float scale, int stages) {
#if (HEAD_DIM == 64 || HEAD_DIM == 128) && __CUDA_ARCH__ >= 800
#if __CUDA_ARCH__ < 890
    if (FP8) return;  // not launched there: the host picks the CUDA-core kernel
#endif
    constexpr int ELEM = FP8 ? 1 : 2;
    const int t = blockIdx.x, kvh = blockIdx.y, part = blockIdx.z, parts = gridDim.z;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    const int ctx = positions[t] + 1;
    // Parts of whole 16-key tiles.
    const int part_len = (((ctx + parts - 1) / parts) + 15) & ~15;
    const int start = min(ctx, part * part_len);
    const int end = min(ctx, start + part_len);
    const int* table = block_tables + (size_t)token_seq[t] * max_blocks;
    const unsigned char* kc = (const unsigned char*)k_cache;
    const unsigned char* vc = (const unsigned char*)v_cache;

    // Query head g's dims 32i + 8c .. + 8 (zero past the group's heads).
    uint4 qf[HEAD_DIM / 32];
    const bf16* qh = q + (size_t)t * q_stride + (size_t)(kvh * GROUP + g) * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 32; i++)
        qf[i] = g < GROUP ? *(const uint4*)(qh + 32 * i + 8 * c) : make_uint4(0u, 0u, 0u, 0u);

    // acc[u]: Oᵀ's C fragment of m-tile u: dims g * LANE_DIMS + 2u ([0], [1]) and + 2u + 1 ([2], [3])
    // of query heads 2c ([0], [2]) and 2c + 1 ([1], [3]). m[h]: head 2c + h's running maximum (the
    // same on the 8 lanes of a c); l[h]: this lane's keys' share of its denominator.
    float acc[LANE_DIMS / 2][4];
#pragma unroll
    for (int u = 0; u < LANE_DIMS / 2; u++) acc[u][0] = acc[u][1] = acc[u][2] = acc[u][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    // The keys of this lane's value loads, as offsets from a tile's first: A's columns 2c, 2c + 1,
    // 2c + 8, 2c + 9 in Vᵀ Pᵀ.
    const int own[4] = {2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9};
    // Value words per key: LANE_DIMS elements of the cache type.
    constexpr int VW = LANE_DIMS * ELEM / 4;

    using Stage = KvStage<FP8>;
    extern __shared__ uint4 staged[];
    uint4* my_stages = staged + (size_t)warp * (STAGED ? stages : 0) * Stage::CHUNKS;
    // Starts the copy of the tile at key j into its stage (tile n of this warp: stage n % stages)
    // and closes a cp.async group either way. A tile lies in one cache block when the block size
    // is a multiple of 16 (tiles start at multiples of 16); keys past the end are zeros (their
    // scores are masked and their values then count 0).
    auto issue = [&](int j) {
        if (j < end) {
            uint4* st = my_stages + (size_t)(((j - start) / (ATTN_WARPS * 16)) % stages) * Stage::CHUNKS;
            const bool one_block = block_size % 16 == 0;
            const size_t first = cache_vec(table, j, kvh, n_kv, block_size);
#pragma unroll
            for (int r = 0; r < Stage::TILE_CH / 32; r++) {
                const int idx = lane + 32 * r, key = idx / Stage::ROW_CH, ch = idx % Stage::ROW_CH;
                const size_t off =
                    one_block ? first * HEAD_DIM * ELEM + 16 * (size_t)idx
                              : cache_vec(table, min(j + key, end - 1), kvh, n_kv, block_size) * HEAD_DIM * ELEM + 16 * ch;
                const int bytes = j + key < end ? 16 : 0;
                cp_async16(st + Stage::at(key, ch), kc + off, bytes);
                cp_async16(st + Stage::TILE_CH + Stage::at(key, ch), vc + off, bytes);
            }
            if (FP8) {
                const int key = lane & 15;
                const size_t v = one_block ? first + key : cache_vec(table, min(j + key, end - 1), kvh, n_kv, block_size);
                float* sc = (float*)(st + 2 * Stage::TILE_CH);
                cp_async4(sc + lane, (lane < 16 ? k_scale : v_scale) + v, j + key < end ? 4 : 0);
            }
        }
        cp_async_commit();
    };
    if (STAGED) {
        for (int n = 0; n < stages - 1; n++) issue(start + warp * 16 + n * ATTN_WARPS * 16);
    }

    for (int j0 = start + warp * 16; j0 < end; j0 += ATTN_WARPS * 16) {
        uint4 kfa[HEAD_DIM / 32], kfb[HEAD_DIM / 32];
        uint2 k8a[HEAD_DIM / 32], k8b[HEAD_DIM / 32];
        u32 vf[4][VW];
        // fp8: the scales of keys g and g + 8 (the rows of Sᵀ this lane holds).
        float ks[2] = {1.0f, 1.0f}, vs[2] = {1.0f, 1.0f};
        if (STAGED) {
            issue(j0 + (stages - 1) * ATTN_WARPS * 16);
            cp_async_wait(stages - 1);
            __syncwarp();
            const uint4* st = my_stages + (size_t)(((j0 - start) / (ATTN_WARPS * 16)) % stages) * Stage::CHUNKS;
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 32; i++) {
                if (FP8) {
                    k8a[i] = ((const uint2*)&st[Stage::at(g, 2 * i + (c >> 1))])[c & 1];
                    k8b[i] = ((const uint2*)&st[Stage::at(g + 8, 2 * i + (c >> 1))])[c & 1];
                } else {
                    kfa[i] = st[Stage::at(g, 4 * i + c)];
                    kfb[i] = st[Stage::at(g + 8, 4 * i + c)];
                }
            }
            // This lane's value piece: bytes g * LANE_DIMS * ELEM.. of each of its keys.
            constexpr int VBYTES = LANE_DIMS * ELEM;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const uint4* vt = st + Stage::TILE_CH;
                if (VW >= 4) {
#pragma unroll
                    for (int u = 0; u < VW; u += 4)
                        *(uint4*)&vf[k][u] = vt[Stage::at(own[k], g * VBYTES / 16 + u / 4)];
                } else {
                    *(uint2*)&vf[k][0] = ((const uint2*)&vt[Stage::at(own[k], g * VBYTES / 16)])[(g * VBYTES / 8) & 1];
                }
            }
            if (FP8) {
                const float* sc = (const float*)(st + 2 * Stage::TILE_CH);
#pragma unroll
                for (int k = 0; k < 2; k++) {
                    ks[k] = sc[g + 8 * k];
                    vs[k] = sc[16 + g + 8 * k];
                }
            }
        } else {
            // Keys past the end are read as the last key (finite values) and masked.
            const size_t va = cache_vec(table, min(j0 + g, end - 1), kvh, n_kv, block_size);
            const size_t vb = cache_vec(table, min(j0 + g + 8, end - 1), kvh, n_kv, block_size);
            size_t vown[4];
#pragma unroll
            for (int k = 0; k < 4; k++) vown[k] = cache_vec(table, min(j0 + own[k], end - 1), kvh, n_kv, block_size);
            // Every load of the tile is issued before any is used.
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 32; i++) {
                const size_t off = (size_t)(32 * i + 8 * c) * ELEM;
                if (FP8) {
                    k8a[i] = *(const uint2*)(kc + va * HEAD_DIM + off);
                    k8b[i] = *(const uint2*)(kc + vb * HEAD_DIM + off);
                } else {
                    kfa[i] = *(const uint4*)(kc + va * HEAD_DIM * 2 + off);
                    kfb[i] = *(const uint4*)(kc + vb * HEAD_DIM * 2 + off);
                }
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const u32* vr = (const u32*)(vc + (vown[k] * HEAD_DIM + g * LANE_DIMS) * ELEM);
                if (VW >= 4) {
#pragma unroll
                    for (int u = 0; u < VW; u += 4) *(uint4*)&vf[k][u] = *(const uint4*)(vr + u);
                } else {
                    *(uint2*)&vf[k][0] = *(const uint2*)vr;
                }
            }
            if (FP8) {
                ks[0] = k_scale[va];
                ks[1] = k_scale[vb];
                vs[0] = v_scale[va];
                vs[1] = v_scale[vb];
            }
        }
#if __CUDA_ARCH__ >= 890
        if (FP8) {
#pragma unroll
            for (int i = 0; i < HEAD_DIM / 32; i++) {
                e4m3x4_to_bf16x2(k8a[i].x, kfa[i].x, kfa[i].y);
                e4m3x4_to_bf16x2(k8a[i].y, kfa[i].z, kfa[i].w);
                e4m3x4_to_bf16x2(k8b[i].x, kfb[i].x, kfb[i].y);
                e4m3x4_to_bf16x2(k8b[i].y, kfb[i].z, kfb[i].w);
            }
        }
#endif
        // Sᵀ (keys g and g + 8 in this lane's rows, heads 2c and 2c + 1 in its columns); two
        // accumulators halve the chain of dependent products.
        float sa[4] = {0.0f, 0.0f, 0.0f, 0.0f}, sb[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 32; i++) {
            mma_16x8x16<false>(sa, kfa[i].x, kfb[i].x, kfa[i].y, kfb[i].y, qf[i].x, qf[i].y);
            mma_16x8x16<false>(sb, kfa[i].z, kfb[i].z, kfa[i].w, kfb[i].w, qf[i].z, qf[i].w);
        }
        // s[2r + h]: key g + 8r, head 2c + h.
        float s[4];
#pragma unroll
        for (int k = 0; k < 4; k++) s[k] = j0 + g + 8 * (k >> 1) < end ? (sa[k] + sb[k]) * scale * ks[k >> 1] : NEG_INF;
        // Each head's maximum over the tile: this lane's two keys, then the 8 lanes of its c.
        float corr[2], p[4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float mx = fmaxf(s[h], s[2 + h]);
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 16));
            // Key j0 is valid, so m_new is finite.
            const float m_new = fmaxf(m[h], mx);
            corr[h] = __expf(m[h] - m_new);
            p[h] = __expf(s[h] - m_new);
            p[2 + h] = __expf(s[2 + h] - m_new);
            l[h] = l[h] * corr[h] + (p[h] + p[2 + h]);
            m[h] = m_new;
        }
        // Pᵀ as B (keys 2c, 2c + 1 and 2c + 8, 2c + 9 of head g), each key's value scale folded in.
        const u32 pb0 = transpose_8x8(pack_pair<FP8>(p[0] * vs[0], p[1] * vs[0]));
        const u32 pb1 = transpose_8x8(pack_pair<FP8>(p[2] * vs[1], p[3] * vs[1]));
#pragma unroll
        for (int u = 0; u < LANE_DIMS / 2; u++) {
            // Dims 2u, 2u + 1 of this lane's value pieces, per key (fp8: widened to an f16 pair);
            // A's rows g and g + 8 are those dims, its columns the keys, so pairs of keys per dim.
            u32 w[4];
#pragma unroll
            for (int k = 0; k < 4; k++) {
#if __CUDA_ARCH__ >= 890
                if (FP8) {
                    w[k] = e4m3x2_to_f16x2(vf[k][u / 2] >> (16 * (u & 1)));
                    continue;
                }
#endif
                w[k] = vf[k][u];
            }
            float d[4] = {acc[u][0] * corr[0], acc[u][1] * corr[1], acc[u][2] * corr[0], acc[u][3] * corr[1]};
            mma_16x8x16<FP8>(d, __byte_perm(w[0], w[1], 0x5410u), __byte_perm(w[0], w[1], 0x7632u),
                             __byte_perm(w[2], w[3], 0x5410u), __byte_perm(w[2], w[3], 0x7632u), pb0, pb1);
#pragma unroll
            for (int e = 0; e < 4; e++) acc[u][e] = d[e];
        }
        // Every lane is done with this stage before the next issue refills it.
        if (STAGED) __syncwarp();
    }
    __shared__ WarpResults r;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 4);
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 8);
        l[h] += __shfl_xor_sync(FULL_MASK, l[h], 16);
        const int head = 2 * c + h;
        if (head < GROUP) {
#pragma unroll
            for (int u = 0; u < LANE_DIMS / 2; u++) {
                r.acc[warp][head][g * LANE_DIMS + 2 * u] = acc[u][h];
                r.acc[warp][head][g * LANE_DIMS + 2 * u + 1] = acc[u][2 + h];
            }
            if (g == 0) {
                r.m[warp][head] = m[h];
                r.l[warp][head] = l[h];
            }
        }
    }
    merge_warps_and_store(r, t, kvh, part, parts, n_kv, out, part_acc, part_ml);
#endif
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32, ATTN_MIN_BLOCKS) paged_attention_mma_bf16(ATTENTION_ARGS(bf16)) {
    wait_for_previous_kernel();
    paged_attention_mma<false, false>(ATTENTION_CALL, 0);
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32, ATTN_MIN_BLOCKS) paged_attention_mma_fp8(ATTENTION_ARGS(bf16)) {
    wait_for_previous_kernel();
    paged_attention_mma<true, false>(ATTENTION_CALL, 0);
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32, STAGED_MIN_BLOCKS) paged_attention_staged_bf16(ATTENTION_ARGS(bf16), int stages) {
    wait_for_previous_kernel();
    paged_attention_mma<false, true>(ATTENTION_CALL, stages);
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32, STAGED_MIN_BLOCKS) paged_attention_staged_fp8(ATTENTION_ARGS(bf16), int stages) {
    wait_for_previous_kernel();
    paged_attention_mma<true, true>(ATTENTION_CALL, stages);
}

// ---- Prompt attention: a tile of query tokens a block (bf16 or fp8 cache, HEAD_DIM a multiple
// of 16 up to 128) ----
// The kernels above give each query token its own blocks, so a prompt chunk's context is read
// once a token: from L2, which bounds them there. Here a block takes a tile of up to PF_TOKENS
// consecutive tokens of one sequence (tiles[blockIdx.x] = first token << 5 | count, laid out by
// the host) and one KV head, and its GROUP warps share each PF_KEYS-key slice of K and V, copied
// into shared memory once (cp.async, two stages). Warp w computes query head kvh * GROUP + w for
// the tile's tokens as the 16 rows of mma.sync m16n8k16: S = Q Kᵀ (f32 sums), an online
// softmax a row, then O += P V with P rounded to bf16, as the kernels above round it.
// fp8 cache: the slices come as stored (e4m3 and a scale a vector) and the block widens them
// into one bf16 stage, K to bf16 and V to f16 (both exact); S is scaled by each key's K scale
// and P V runs in f16 with each key's V scale folded into P, as paged_attention_mma_fp8 does.
#define PF_TOKENS 16
#define PF_KEYS 32
// A key's row in shared memory: HEAD_DIM values and 16 bytes more, so that the 8 rows of an
// ldmatrix phase start 4 banks apart.
#define PF_ROW (HEAD_DIM + 8)
#define PF_CHUNKS (HEAD_DIM / 8)
#define PF_ENABLED (HEAD_DIM % 16 == 0 && HEAD_DIM <= 128)

#if PF_ENABLED && __CUDA_ARCH__ >= 800
struct PrefillStage {
    bf16 k[PF_KEYS][PF_ROW];
    bf16 v[PF_KEYS][PF_ROW];
};

// One slice of an fp8 cache as stored: e4m3 K and V vectors, then their scales.
struct PrefillRawStage {
    unsigned char k[PF_KEYS][HEAD_DIM];
    unsigned char v[PF_KEYS][HEAD_DIM];
    float k_scale[PF_KEYS];
    float v_scale[PF_KEYS];
};

// Shared memory of either cache type: two bf16 stages, or two raw fp8 stages and the bf16 stage
// they are widened into.
union PrefillShared {
    PrefillStage bf16_stages[2];
    struct {
        PrefillStage wide;
        PrefillRawStage raw[2];
    } fp8;
};

// Starts the copies of keys j0 .. j0 + PF_KEYS - 1 of KV head kvh into `st` (keys past the
// context repeat its last one; their scores are masked).
__device__ __forceinline__ void prefill_stage_load(PrefillStage& st, const bf16* __restrict__ k_cache,
                                                   const bf16* __restrict__ v_cache, const int* __restrict__ table,
                                                   int j0, int ctx, int kvh, int n_kv, int block_size) {
    for (int i = threadIdx.x; i < 2 * PF_KEYS * PF_CHUNKS; i += blockDim.x) {
        const bool is_v = i >= PF_KEYS * PF_CHUNKS;
        const int r = is_v ? i - PF_KEYS * PF_CHUNKS : i;
        const int key = r / PF_CHUNKS, c = r % PF_CHUNKS;
        const size_t vec = cache_vec(table, min(j0 + key, ctx - 1), kvh, n_kv, block_size);
        cp_async16((is_v ? st.v[key] : st.k[key]) + c * 8, (is_v ? v_cache : k_cache) + vec * HEAD_DIM + c * 8, 16);
    }
}

// The same for an fp8 cache: the e4m3 vectors in 16-byte pieces, then the scales.
__device__ __forceinline__ void prefill_raw_load(PrefillRawStage& st, const unsigned char* __restrict__ k_cache,
                                                 const unsigned char* __restrict__ v_cache,
                                                 const float* __restrict__ k_scale, const float* __restrict__ v_scale,
                                                 const int* __restrict__ table, int j0, int ctx, int kvh, int n_kv,
                                                 int block_size) {
    constexpr int CH = HEAD_DIM / 16, VECTORS = 2 * PF_KEYS * CH;
    for (int i = threadIdx.x; i < VECTORS + 2 * PF_KEYS; i += blockDim.x) {
        const int r = i < VECTORS ? i % (PF_KEYS * CH) : i - VECTORS;
        const bool is_v = i < VECTORS ? i >= PF_KEYS * CH : r >= PF_KEYS;
        const int key = i < VECTORS ? r / CH : r % PF_KEYS;
        const size_t vec = cache_vec(table, min(j0 + key, ctx - 1), kvh, n_kv, block_size);
        if (i < VECTORS) {
            const int c = r % CH;
            cp_async16((is_v ? st.v[key] : st.k[key]) + c * 16, (is_v ? v_cache : k_cache) + vec * HEAD_DIM + c * 16, 16);
        } else {
            cp_async4((is_v ? st.v_scale : st.k_scale) + key, (is_v ? v_scale : k_scale) + vec, 4);
        }
    }
}

// Widens a raw fp8 slice into `st`: K to bf16 pairs, V to f16 pairs (exact), four values a step.
__device__ __forceinline__ void prefill_widen(PrefillStage& st, const PrefillRawStage& raw) {
    constexpr int W = HEAD_DIM / 4;
    for (int i = threadIdx.x; i < 2 * PF_KEYS * W; i += blockDim.x) {
        const bool is_v = i >= PF_KEYS * W;
        const int r = is_v ? i - PF_KEYS * W : i;
        const int key = r / W, w = r % W;
        float f[4];
        e4m3x4_to_f32(*(const u32*)((is_v ? raw.v[key] : raw.k[key]) + 4 * w), f);
        const uint2 pairs = is_v ? make_uint2(pack_pair<true>(f[0], f[1]), pack_pair<true>(f[2], f[3]))
                                 : make_uint2(pack_pair<false>(f[0], f[1]), pack_pair<false>(f[2], f[3]));
        *(uint2*)((is_v ? st.v[key] : st.k[key]) + 4 * w) = pairs;
    }
}
#endif

// q: [tokens, q_stride] (heads at h * HEAD_DIM), out [tokens, n_heads * HEAD_DIM]; a tile's tokens
// have consecutive positions, its last the largest. Grid (tiles, n_kv), GROUP warps a block.
template <bool FP8>
__device__ void prompt_attention(const bf16* __restrict__ q, int q_stride, const void* __restrict__ k_cache,
                                 const void* __restrict__ v_cache, const float* __restrict__ k_scale,
                                 const float* __restrict__ v_scale, const int* __restrict__ block_tables,
                                 int max_blocks, const int* __restrict__ token_seq, const int* __restrict__ positions,
                                 bf16* __restrict__ out, int n_kv, int block_size, float scale,
                                 const int* __restrict__ tiles) {
#if __CUDA_ARCH__ >= 800 && PF_ENABLED
    constexpr int KS = HEAD_DIM / 16, NT = HEAD_DIM / 8, KT = PF_KEYS / 8;
    __shared__ __align__(16) PrefillShared sh;
    const int tile = tiles[blockIdx.x];
    const int tok0 = tile >> 5, count = tile & 31;
    const int kvh = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, c = lane & 3;
    const int head = kvh * GROUP + warp;
    const int* table = block_tables + (size_t)token_seq[tok0] * max_blocks;
    // Rows g and g + 8 are tokens tok0 + g and tok0 + g + 8; rows past the tile repeat its last
    // token and are never stored.
    const int t0 = tok0 + min(g, count - 1), t1 = tok0 + min(g + 8, count - 1);
    const int pos0 = positions[t0], pos1 = positions[t1];
    const int ctx = positions[tok0 + count - 1] + 1;
    const int slices = (ctx + PF_KEYS - 1) / PF_KEYS;
    // Starts slice sl's copies into its stage.
    auto load = [&](int sl) {
        if (FP8) {
            prefill_raw_load(sh.fp8.raw[sl & 1], (const unsigned char*)k_cache, (const unsigned char*)v_cache, k_scale,
                             v_scale, table, sl * PF_KEYS, ctx, kvh, n_kv, block_size);
        } else {
            prefill_stage_load(sh.bf16_stages[sl & 1], (const bf16*)k_cache, (const bf16*)v_cache, table, sl * PF_KEYS,
                               ctx, kvh, n_kv, block_size);
        }
    };
    load(0);
    cp_async_commit();

    // Q's A fragments: rows g and g + 8, dims 16s + 2c (+ 1) and 16s + 8 + 2c (+ 1).
    u32 qa[KS][4];
    const bf16* q0 = q + (size_t)t0 * q_stride + head * HEAD_DIM + 2 * c;
    const bf16* q1 = q + (size_t)t1 * q_stride + head * HEAD_DIM + 2 * c;
#pragma unroll
    for (int s = 0; s < KS; s++) {
        qa[s][0] = *(const u32*)(q0 + 16 * s);
        qa[s][1] = *(const u32*)(q1 + 16 * s);
        qa[s][2] = *(const u32*)(q0 + 16 * s + 8);
        qa[s][3] = *(const u32*)(q1 + 16 * s + 8);
    }
    float o[NT][4];
#pragma unroll
    for (int n = 0; n < NT; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    // Running maxima (in log2 units) and this lane's share of the denominators, rows g and g + 8.
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    const float scale2 = scale * 1.4426950408889634f;
    const int mtx = lane >> 3, row = lane & 7;

    for (int sl = 0; sl < slices; sl++) {
        if (sl + 1 < slices) load(sl + 1);
        cp_async_commit();
        cp_async_wait(1);
        __syncthreads();
        if (FP8) {
            prefill_widen(sh.fp8.wide, sh.fp8.raw[sl & 1]);
            __syncthreads();
        }
        const PrefillStage& sg = FP8 ? sh.fp8.wide : sh.bf16_stages[sl & 1];
        // The slice's scales (fp8; the raw stage is not refilled before the barrier at the end).
        const float* ks = sh.fp8.raw[sl & 1].k_scale;
        const float* vs = sh.fp8.raw[sl & 1].v_scale;
        // S: 16 rows by PF_KEYS keys, KT n-tiles of 8 keys; B from K's rows (key-major = col-major B).
        float sc[KT][4];
#pragma unroll
        for (int n = 0; n < KT; n++) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.0f;
#pragma unroll
        for (int s = 0; s < KS; s++) {
#pragma unroll
            for (int np = 0; np < KT / 2; np++) {
                // Matrices: keys 16np.. by dims 16s.., by dims 16s + 8.., then keys 16np + 8.. by each.
                const uint4 b = ldmatrix_x4(&sg.k[16 * np + (mtx >> 1) * 8 + row][16 * s + (mtx & 1) * 8]);
                mma_16x8x16<false>(sc[2 * np], qa[s][0], qa[s][1], qa[s][2], qa[s][3], b.x, b.y);
                mma_16x8x16<false>(sc[2 * np + 1], qa[s][0], qa[s][1], qa[s][2], qa[s][3], b.z, b.w);
            }
        }
        // Causal mask and the new maxima: lane (g, c) holds keys 8n + 2c (+ 1) of rows g and g + 8.
        const int j0 = sl * PF_KEYS;
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int n = 0; n < KT; n++) {
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int key = 8 * n + 2 * c + e, j = j0 + key;
                const float kscale = FP8 ? scale2 * ks[key] : scale2;
                sc[n][e] = j <= pos0 ? sc[n][e] * kscale : NEG_INF;
                sc[n][2 + e] = j <= pos1 ? sc[n][2 + e] * kscale : NEG_INF;
                mx0 = fmaxf(mx0, sc[n][e]);
                mx1 = fmaxf(mx1, sc[n][2 + e]);
            }
        }
#pragma unroll
        for (int x = 1; x < 4; x <<= 1) {
            mx0 = fmaxf(mx0, __shfl_xor_sync(FULL_MASK, mx0, x));
            mx1 = fmaxf(mx1, __shfl_xor_sync(FULL_MASK, mx1, x));
        }
        // Key 0 is in every row's context, so both maxima are finite from the first slice on.
        const float corr0 = exp2f(m0 - mx0), corr1 = exp2f(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        l0 *= corr0;
        l1 *= corr1;
#pragma unroll
        for (int n = 0; n < NT; n++) {
            o[n][0] *= corr0;
            o[n][1] *= corr0;
            o[n][2] *= corr1;
            o[n][3] *= corr1;
        }
        // P as A fragments (the accumulators of n-tiles 2np and 2np + 1 are the m16n8k16 A layout
        // of keys 16np..), then O += P V with V's B fragments by transposed ldmatrix. The
        // denominators sum P as computed; only P V's operand carries the V scales.
#pragma unroll
        for (int np = 0; np < KT / 2; np++) {
            float p[2][4];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                p[h][0] = exp2f(sc[2 * np + h][0] - m0);
                p[h][1] = exp2f(sc[2 * np + h][1] - m0);
                p[h][2] = exp2f(sc[2 * np + h][2] - m1);
                p[h][3] = exp2f(sc[2 * np + h][3] - m1);
                l0 += p[h][0] + p[h][1];
                l1 += p[h][2] + p[h][3];
                if (FP8) {
                    const float v0 = vs[16 * np + 8 * h + 2 * c], v1 = vs[16 * np + 8 * h + 2 * c + 1];
                    p[h][0] *= v0;
                    p[h][1] *= v1;
                    p[h][2] *= v0;
                    p[h][3] *= v1;
                }
            }
            const u32 a0 = pack_pair<FP8>(p[0][0], p[0][1]), a1 = pack_pair<FP8>(p[0][2], p[0][3]);
            const u32 a2 = pack_pair<FP8>(p[1][0], p[1][1]), a3 = pack_pair<FP8>(p[1][2], p[1][3]);
#pragma unroll
            for (int dp = 0; dp < NT / 2; dp++) {
                // Matrices: keys 16np.. and 16np + 8.. by dims 16dp.., then both by dims 16dp + 8...
                const uint4 b = ldmatrix_x4_trans(&sg.v[16 * np + (mtx & 1) * 8 + row][16 * dp + (mtx >> 1) * 8]);
                mma_16x8x16<FP8>(o[2 * dp], a0, a1, a2, a3, b.x, b.y);
                mma_16x8x16<FP8>(o[2 * dp + 1], a0, a1, a2, a3, b.z, b.w);
            }
        }
        // Every warp is done with this stage before the next slice's copies (or widening)
        // overwrite it.
        __syncthreads();
    }
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
        l0 += __shfl_xor_sync(FULL_MASK, l0, x);
        l1 += __shfl_xor_sync(FULL_MASK, l1, x);
    }
    const int n_heads = n_kv * GROUP;
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
#pragma unroll
    for (int n = 0; n < NT; n++) {
        const int d = head * HEAD_DIM + 8 * n + 2 * c;
        if (g < count) *(u32*)(out + (size_t)(tok0 + g) * n_heads * HEAD_DIM + d) = pack_pair<false>(o[n][0] * inv0, o[n][1] * inv0);
        if (g + 8 < count) *(u32*)(out + (size_t)(tok0 + g + 8) * n_heads * HEAD_DIM + d) = pack_pair<false>(o[n][2] * inv1, o[n][3] * inv1);
    }
#endif
}

#define PROMPT_ATTENTION_ARGS                                                                                     \
    const bf16 *__restrict__ q, int q_stride, const void *__restrict__ k_cache, const void *__restrict__ v_cache, \
        const float *__restrict__ k_scale, const float *__restrict__ v_scale, const int *__restrict__ block_tables, \
        int max_blocks, const int *__restrict__ token_seq, const int *__restrict__ positions, bf16 *__restrict__ out, \
        int n_kv, int block_size, float scale, const int *__restrict__ tiles
#define PROMPT_ATTENTION_CALL \
    q, q_stride, k_cache, v_cache, k_scale, v_scale, block_tables, max_blocks, token_seq, positions, out, n_kv, \
        block_size, scale, tiles

extern "C" __global__ void __launch_bounds__(GROUP * 32) paged_attention_prefill_bf16(PROMPT_ATTENTION_ARGS) {
    wait_for_previous_kernel();
    prompt_attention<false>(PROMPT_ATTENTION_CALL);
}
extern "C" __global__ void __launch_bounds__(GROUP * 32) paged_attention_prefill_fp8(PROMPT_ATTENTION_ARGS) {
    wait_for_previous_kernel();
    prompt_attention<true>(PROMPT_ATTENTION_CALL);
}

// Merges the context parts of each (token, head) into out as T. Up to 32 parts, each warp loads
// every part's maximum and denominator at once (a lane a part) and its threads' sums of all parts
// without waiting on one another, instead of two passes of one load after another; the sums are
// added in part order as before, so the output is the same. The loads go to L2 (__ldcg), where
// the attention kernel wrote the parts.
template <typename T>
__device__ __forceinline__ void reduce_parts(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                             T* __restrict__ out, int parts) {
    const int t = blockIdx.x, head = blockIdx.y, n_heads = gridDim.y, d = threadIdx.x;
    const size_t base = ((size_t)t * n_heads + head) * parts;
    float num = 0.0f, den = 0.0f;
    if (parts <= 32) {
        const int lane = threadIdx.x & 31;
        const float pm = lane < parts ? __ldcg(part_ml + 2 * (base + lane)) : NEG_INF;
        const float pl = lane < parts ? __ldcg(part_ml + 2 * (base + lane) + 1) : 0.0f;
        float mx = pm;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        // Part p's weight: 0 where it saw no key (and everywhere when no part did).
        const float f = pm == NEG_INF ? 0.0f : __expf(pm - mx);
#pragma unroll 8
        for (int p = 0; p < parts; p++) {
            const float fp = __shfl_sync(0xffffffffu, f, p);
            num += __ldcg(part_acc + (base + p) * HEAD_DIM + d) * fp;
            den += __shfl_sync(0xffffffffu, pl, p) * fp;
        }
    } else {
        float mx = NEG_INF;
        for (int p = 0; p < parts; p++) mx = fmaxf(mx, __ldcg(part_ml + 2 * (base + p)));
        if (mx != NEG_INF) {
            for (int p = 0; p < parts; p++) {
                const float pm = __ldcg(part_ml + 2 * (base + p));
                if (pm == NEG_INF) continue;
                const float f = __expf(pm - mx);
                num += __ldcg(part_acc + (base + p) * HEAD_DIM + d) * f;
                den += __ldcg(part_ml + 2 * (base + p) + 1) * f;
            }
        }
    }
    out[((size_t)t * n_heads + head) * HEAD_DIM + d] = from_f32<T>(den > 0.0f ? num / den : 0.0f);
}

// Grid (tokens, n_heads), HEAD_DIM threads.
extern "C" __global__ void attention_reduce(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                            bf16* __restrict__ out, int parts) {
    wait_for_previous_kernel();
    reduce_parts(part_acc, part_ml, out, parts);
}
extern "C" __global__ void attention_reduce_f32(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                                float* __restrict__ out, int parts) {
    wait_for_previous_kernel();
    reduce_parts(part_acc, part_ml, out, parts);
}
