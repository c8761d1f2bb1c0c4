// The decode GEMVs' common parts, shared by gemm.cu (bf16 weights) and quant.cu (quantized
// weights): block shape, streaming loads, the block's fixed-order row sums and the carried RMSNorm.

#define GEMV_WARPS 4
#define GEMV_THREADS (GEMV_WARPS * 32)
#define GEMV_LOADS 4

__device__ __forceinline__ uint4 load_streaming(const void* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// The wait for the previous kernel, then after_wait(), the first time only: a GEMV issues its
// first weight loads before it waits (they do not depend on the previous kernel).
template <typename AfterWait>
__device__ __forceinline__ void wait_once(bool& waited, AfterWait&& after_wait) {
    if (waited) return;
    wait_for_previous_kernel();
    after_wait();
    waited = true;
}

// Sums each thread's acc over the block, in a fixed order (lanes by a butterfly, warps in
// shared memory); the result is valid in thread 0.
template <int T, int R>
__device__ __forceinline__ void block_sum_rows(float (&acc)[R][T]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __shared__ float partial[GEMV_WARPS][R][T];
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < T; j++) {
            const float v = warp_sum(acc[r][j]);
            if (lane == 0) partial[warp][r][j] = v;
        }
    __syncthreads();
    if (threadIdx.x == 0) {
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int j = 0; j < T; j++) {
                float v = partial[0][r][j];
#pragma unroll
                for (int p = 1; p < GEMV_WARPS; p++) v += partial[p][r][j];
                acc[r][j] = v;
            }
    }
}

// ---- RMSNorm carried across the decode GEMVs (one GPU, no norm kernels between them). ----
// The per-layer norm weights are folded into the columns of the bf16 matrices that read normed
// rows (weights.rs: w' = w · diag(g); quantized matrices take x · diag(g) instead, quant.cu),
// so (rms_norm(x) * g) · wᵀ = s · (x · w'ᵀ) with
// s = 1 / sqrt(mean(x²) + eps) per token. A GEMV that adds into the residual (gemv_residual: the
// o and down projections) writes the new residual in f32 and bf16 and adds its rows' squares
// into the next norm's sums; the GEMV that reads it (QKV, gate/up) multiplies its dot products
// by s. The sums are integers (fixed point) so that any order of the atomic adds gives the same
// bits and graph steps equal eager ones: a fine sum at 2^-40, and a coarse one at 2^-8 used once
// the total reaches 2^22, past which the fine one may wrap. A token's sums sit in NORM_SLOTS
// slots of {coarse, fine} (block b adds into slot b % NORM_SLOTS), zeroed before each step.

#define NORM_SLOTS 32
#define NORM_FINE 1099511627776.0
#define NORM_COARSE 256.0
#define NORM_SWITCH 4194304.0

// A norm's sums as a GEMV that reads the residual takes them: warp 0 loads them right after the
// wait (lane l: slot l of each token), and scales() turns them into each token's s.
template <int T>
struct NormIn {
    const u64* sums;  // null: no norm, s = 1
    ulonglong2 v[T];

    __device__ __forceinline__ void load(int t) { load_slot(t, threadIdx.x); }

    // Every warp its own copy (lane l: slot l), for kernels whose warps compute rows alone.
    __device__ __forceinline__ void load_in_each_warp(int t) { load_slot(t, threadIdx.x & 31); }

    __device__ __forceinline__ void load_slot(int t, int slot) {
        if (!sums || slot >= NORM_SLOTS) return;
#pragma unroll
        for (int j = 0; j < T; j++)
            if (j < t) v[j] = ((const ulonglong2*)sums)[j * NORM_SLOTS + slot];
    }

    // A warp that loaded them (warp 0 after load()), all lanes; valid in lane 0.
    __device__ __forceinline__ void scales(int t, int k, float eps, float (&s)[T]) const {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int j = 0; j < T; j++) {
            s[j] = 1.0f;
            if (!sums || j >= t) continue;
            u64 coarse = lane < NORM_SLOTS ? v[j].x : 0, fine = lane < NORM_SLOTS ? v[j].y : 0;
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                coarse += __shfl_xor_sync(FULL_MASK, coarse, o);
                fine += __shfl_xor_sync(FULL_MASK, fine, o);
            }
            const double c = (double)coarse / NORM_COARSE;
            const double total = c >= NORM_SWITCH ? c : (double)fine / NORM_FINE;
            s[j] = rsqrtf((float)(total / (double)k) + eps);
        }
    }
};

// Adds one block's share ss (>= 0) of token j's sum of squares into its slot.
__device__ __forceinline__ void norm_add(u64* __restrict__ sums, int j, float ss) {
    u64* slot = sums + ((size_t)j * NORM_SLOTS + blockIdx.x % NORM_SLOTS) * 2;
    atomicAdd((unsigned long long*)slot, (unsigned long long)__double2ull_rn((double)ss * NORM_COARSE));
    atomicAdd((unsigned long long*)slot + 1, (unsigned long long)__double2ull_rn((double)ss * NORM_FINE));
}

// The QKV GEMVs with rope.cu's work folded in (gemm.cu's gemv_qkv_rope, fp8.cu's
// fp8_gemv_qkv_rope), for a bf16 cache and no per-head norm. Pair p of the QKV rows is the two
// rows of one head that RoPE rotates together: d and d + rot/2 (halves) or 2i and 2i + 1
// (adjacent pairs), or two unrotated dims past rot_dim; v heads are never rotated.
struct QkvRopePair {
    int head, m, d0, d1, rows[2];
    bool rotated;
    __device__ QkvRopePair(int p, int n_heads, int n_kv, int head_dim, int rot_dim, int neox) {
        const int pairs_per_head = head_dim >> 1, half = rot_dim >> 1;
        head = p / pairs_per_head;
        m = p % pairs_per_head;
        rotated = m < half && head < n_heads + n_kv;
        if (m >= half) {
            d0 = rot_dim + 2 * (m - half);
            d1 = d0 + 1;
        } else if (neox) {
            d0 = m;
            d1 = m + half;
        } else {
            d0 = 2 * m;
            d1 = d0 + 1;
        }
        rows[0] = head * head_dim + d0;
        rows[1] = head * head_dim + d1;
    }
};

// Token j's two values of the pair as the plain GEMV rounds them (v0, v1): adds the bias, rotates
// query and key rows, writes q and k (and v) back to qkv and k, v into the token's cache slot:
// qkv_rope_kv_write_bf16's work for the pair.
__device__ __forceinline__ void qkv_rope_store(const QkvRopePair& p, int j, float v0, float v1, bf16* __restrict__ qkv,
                                               const float* __restrict__ bias, const int* __restrict__ positions,
                                               const float2* __restrict__ rope_table, int n_heads, int n_kv,
                                               int head_dim, int rot_dim, const int* __restrict__ slots,
                                               bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                               int block_size) {
    const int width = (n_heads + 2 * n_kv) * head_dim, half = rot_dim >> 1;
    if (bias) {
        v0 += bias[p.rows[0]];
        v1 += bias[p.rows[1]];
    }
    if (p.rotated) {
        const float2 cs = rope_table[(size_t)positions[j] * half + p.m];
        const float r0 = rope_rotate(v0, v1, true, cs), r1 = rope_rotate(v1, v0, false, cs);
        v0 = r0;
        v1 = r1;
    }
    const bf16 b0 = f2bf(v0), b1 = f2bf(v1);
    qkv[(size_t)j * width + p.rows[0]] = b0;
    qkv[(size_t)j * width + p.rows[1]] = b1;
    if (p.head >= n_heads) {
        const bool is_v = p.head >= n_heads + n_kv;
        const int kvh = p.head - n_heads - (is_v ? n_kv : 0);
        const int sl = slots[j];
        const size_t vec = ((size_t)(sl / block_size) * n_kv + kvh) * block_size + sl % block_size;
        bf16* cache = is_v ? v_cache : k_cache;
        cache[vec * head_dim + p.d0] = b0;
        cache[vec * head_dim + p.d1] = b1;
    }
}
