// strata's own matrix products, y[t, n] = x[t, k] · w[n, k]ᵀ with bf16 w and x: decode-sized GEMVs
// that stream the weights at the memory's speed, and the fixed-order GEMM of `--deterministic`.
//
// Fixed order: every output element is summed the same way whatever n, t, or the TP split of k.
// k is cut into `chunks` equal parts (a power of two, at most FO_MAX_CHUNKS; k / chunks a
// multiple of 8). One warp per output row and group of up to FO_TOKENS tokens: lane l sums
// elements 8l..8l+7, +256, ... of each chunk in order, the warp adds its lanes by a butterfly,
// and the chunk sums are added as a pairwise tree. A TP rank holding chunks [r*c, (r+1)*c) of a
// row-parallel weight computes the subtree of its chunks; `sum_ranks` adds the ranks' subtrees
// as the tree's top levels, so the result equals one GPU's bit for bit.

#define FO_TOKENS 8
#define FO_MAX_CHUNKS 8
#define FO_WARPS 8

// Adds vals[0..count) (count a power of two, at most FO_MAX_CHUNKS) as a pairwise tree into vals[0].
__device__ __forceinline__ void tree_sum(float* vals, int count) {
#pragma unroll
    for (int s = 1; s < FO_MAX_CHUNKS; s <<= 1) {
#pragma unroll
        for (int c = 0; c + s < FO_MAX_CHUNKS; c += 2 * s) {
            if (c + s < count) vals[c] += vals[c + s];
        }
    }
}

// Grid (ceil(n / FO_WARPS), ceil(t / FO_TOKENS)), FO_WARPS * 32 threads. y is bf16 unless out_f32.
extern "C" __global__ void __launch_bounds__(FO_WARPS * 32)
    gemm_fixed_order(const bf16* __restrict__ w, const bf16* __restrict__ x, void* __restrict__ y, int n, int k,
                     int t, int chunks, int out_f32) {
    wait_for_previous_kernel();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * FO_WARPS + warp;
    const int t0 = blockIdx.y * FO_TOKENS;
    if (row >= n) return;
    const int nt = min(FO_TOKENS, t - t0);
    const int kc = k / chunks;
    const bf16* wr = w + (size_t)row * k;
    const bf16* xr = x + (size_t)t0 * k;
    float sums[FO_TOKENS][FO_MAX_CHUNKS];
#pragma unroll
    for (int c = 0; c < FO_MAX_CHUNKS; c++) {
        if (c >= chunks) break;
        float acc[FO_TOKENS];
#pragma unroll
        for (int j = 0; j < FO_TOKENS; j++) acc[j] = 0.0f;
        for (int off = lane * 8; off < kc; off += 256) {
            const int e = c * kc + off;
            float wf[8];
            unpack8(*(const uint4*)(wr + e), wf);
#pragma unroll
            for (int j = 0; j < FO_TOKENS; j++) {
                if (j < nt) {
                    float xf[8];
                    unpack8(*(const uint4*)(xr + (size_t)j * k + e), xf);
#pragma unroll
                    for (int d = 0; d < 8; d++) acc[j] = fmaf(wf[d], xf[d], acc[j]);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < FO_TOKENS; j++) sums[j][c] = warp_sum(acc[j]);
    }
    if (lane != 0) return;
#pragma unroll
    for (int j = 0; j < FO_TOKENS; j++) {
        if (j < nt) {
            tree_sum(sums[j], chunks);
            const size_t at = (size_t)(t0 + j) * n + row;
            if (out_f32) {
                ((float*)y)[at] = sums[j][0];
            } else {
                ((bf16*)y)[at] = f2bf(sums[j][0]);
            }
        }
    }
}

// out[i] = the pairwise tree over ranks of parts[r * count + i] (ranks a power of two, at most
// FO_MAX_CHUNKS): the top levels of gemm_fixed_order's chunk tree across TP ranks.
extern "C" __global__ void sum_ranks(const float* __restrict__ parts, float* __restrict__ out, long long count,
                                     int ranks) {
    wait_for_previous_kernel();
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        float vals[FO_MAX_CHUNKS];
#pragma unroll
        for (int r = 0; r < FO_MAX_CHUNKS; r++) vals[r] = r < ranks ? parts[r * count + i] : 0.0f;
        tree_sum(vals, ranks);
        out[i] = vals[0];
    }
}

// ---- Decode GEMVs: t <= 8 tokens, bound by reading w once. ----
// One block per two output rows (or a gate/up row pair), all its GEMV_WARPS warps splitting k:
// thread i takes the 16-byte pieces i, i + 128, ... of each row, GEMV_LOADS of them in flight at
// once (streamed past L1); x is read through L1; a warp's lanes meet by a butterfly, the warps in
// shared memory in a fixed order. Four loads a row cover a 4096-wide row in one round and keep a
// thread at ~64 registers (8 blocks an SM); 8 (118 registers) measured slower on every row
// length. Weight loads start before the wait for the previous kernel (see
// wait_for_previous_kernel). k must be a multiple of 8.

#define GEMV_WARPS 4
#define GEMV_THREADS (GEMV_WARPS * 32)
#define GEMV_LOADS 4

__device__ __forceinline__ uint4 load_streaming(const bf16* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// acc[r][j] = w[rows[r]] · x[j] for j < t, summed over the whole block (valid in thread 0).
template <int T, int R>
__device__ __forceinline__ void gemv_rows(const bf16* __restrict__ w, const bf16* __restrict__ x, int k, int t,
                                          const int (&rows)[R], float (&acc)[R][T]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int k8 = k >> 3;
    const uint4* xv = (const uint4*)x;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < T; j++) acc[r][j] = 0.0f;
    // The first weights are in flight before x (the previous kernel's output) is waited for.
    bool waited = false;
    for (int base = threadIdx.x; base < k8; base += GEMV_THREADS * GEMV_LOADS) {
        uint4 wv[R][GEMV_LOADS];
#pragma unroll
        for (int u = 0; u < GEMV_LOADS; u++) {
            const int i = base + u * GEMV_THREADS;
#pragma unroll
            for (int r = 0; r < R; r++)
                wv[r][u] = i < k8 ? load_streaming(w + (size_t)rows[r] * k + (size_t)i * 8) : make_uint4(0u, 0u, 0u, 0u);
        }
        if (!waited) {
            wait_for_previous_kernel();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < GEMV_LOADS; u++) {
            const int i = base + u * GEMV_THREADS;
            if (i < k8) {
#pragma unroll
                for (int j = 0; j < T; j++) {
                    if (j < t) {
                        float xf[8];
                        unpack8(__ldg(xv + (size_t)j * k8 + i), xf);
#pragma unroll
                        for (int r = 0; r < R; r++) {
                            float wf[8];
                            unpack8(wv[r][u], wf);
#pragma unroll
                            for (int d = 0; d < 8; d++) acc[r][j] = fmaf(wf[d], xf[d], acc[r][j]);
                        }
                    }
                }
            }
        }
    }
    if (!waited) wait_for_previous_kernel();
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

// y[t, n] (bf16, or f32 when out_f32). Grid ceil(n / 2), GEMV_THREADS threads.
template <int T>
__device__ void gemv(const bf16* __restrict__ w, const bf16* __restrict__ x, void* __restrict__ y, int n, int k,
                     int t, int out_f32) {
    const int row = 2 * blockIdx.x;
    const bool pair = row + 1 < n;
    const int rows[2] = {row, pair ? row + 1 : row};
    float acc[2][T];
    gemv_rows<T, 2>(w, x, k, t, rows, acc);
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (r == 1 && !pair) break;
#pragma unroll
        for (int j = 0; j < T; j++) {
            if (j < t) {
                const size_t at = (size_t)j * n + row + r;
                if (out_f32) ((float*)y)[at] = acc[r][j];
                else ((bf16*)y)[at] = f2bf(acc[r][j]);
            }
        }
    }
}

// The QKV projection with rope.cu's work folded in, for a bf16 cache and no per-head norm: a
// block computes two rows of one head that RoPE pairs (d and d + rot/2 for halves, 2i and 2i + 1
// for adjacent pairs; two unrotated dims past rot_dim), rounds them to bf16 as the plain GEMV
// would, adds the bias, rotates query and key rows, writes q and k (and v) back to qkv and k, v
// into the token's cache slot: qkv_rope_kv_write_bf16 without its kernel. Grid width / 2.
template <int T>
__device__ void gemv_qkv_rope(const bf16* __restrict__ w, const bf16* __restrict__ x, bf16* __restrict__ qkv, int k,
                              int t, const float* __restrict__ bias, const int* __restrict__ positions,
                              const float* __restrict__ inv_freq, int n_heads, int n_kv, int head_dim, int rot_dim,
                              int neox, const int* __restrict__ slots, bf16* __restrict__ k_cache,
                              bf16* __restrict__ v_cache, int block_size) {
    const int pairs_per_head = head_dim >> 1, half = rot_dim >> 1;
    const int head = blockIdx.x / pairs_per_head, m = blockIdx.x % pairs_per_head;
    const bool rotated = m < half && head < n_heads + n_kv;
    int d0, d1;
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
    const int rows[2] = {head * head_dim + d0, head * head_dim + d1};
    float acc[2][T];
    gemv_rows<T, 2>(w, x, k, t, rows, acc);
    if (threadIdx.x != 0) return;
    const int width = (n_heads + 2 * n_kv) * head_dim;
#pragma unroll
    for (int j = 0; j < T; j++) {
        if (j >= t) break;
        float v0 = bf2f(f2bf(acc[0][j])), v1 = bf2f(f2bf(acc[1][j]));
        if (bias) {
            v0 += bias[rows[0]];
            v1 += bias[rows[1]];
        }
        if (rotated) {
            float s, c;
            sincosf((float)positions[j] * inv_freq[m], &s, &c);
            const float r0 = v0 * c - v1 * s, r1 = v0 * s + v1 * c;
            v0 = r0;
            v1 = r1;
        }
        const bf16 b0 = f2bf(v0), b1 = f2bf(v1);
        qkv[(size_t)j * width + rows[0]] = b0;
        qkv[(size_t)j * width + rows[1]] = b1;
        if (head >= n_heads) {
            const bool is_v = head >= n_heads + n_kv;
            const int kvh = head - n_heads - (is_v ? n_kv : 0);
            const int sl = slots[j];
            const size_t vec = ((size_t)(sl / block_size) * n_kv + kvh) * block_size + sl % block_size;
            bf16* cache = is_v ? v_cache : k_cache;
            cache[vec * head_dim + d0] = b0;
            cache[vec * head_dim + d1] = b1;
        }
    }
}

// The fused gate/up projection and its activation: w holds [gate; up], each `inter` rows, and
// out[t, inter] = silu(gate) * up (bf16, gate and up rounded to bf16 first as the unfused path
// does). Grid `inter`, GEMV_THREADS threads.
template <int T>
__device__ void gemv_silu(const bf16* __restrict__ w, const bf16* __restrict__ x, bf16* __restrict__ out, int inter,
                          int k, int t) {
    const int row = blockIdx.x;
    const int rows[2] = {row, row + inter};
    float acc[2][T];
    gemv_rows<T, 2>(w, x, k, t, rows, acc);
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int j = 0; j < T; j++) {
        if (j < t) {
            const float g = bf2f(f2bf(acc[0][j])), u = bf2f(f2bf(acc[1][j]));
            out[(size_t)j * inter + row] = f2bf(g / (1.0f + __expf(-g)) * u);
        }
    }
}

#define GEMV_KERNELS(T)                                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                                \
        gemv_t##T(const bf16* w, const bf16* x, void* y, int n, int k, int t, int out_f32) {                  \
        gemv<T>(w, x, y, n, k, t, out_f32);                                                                   \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS)                                                \
        gemv_silu_t##T(const bf16* w, const bf16* x, bf16* out, int inter, int k, int t) {                    \
        gemv_silu<T>(w, x, out, inter, k, t);                                                                 \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) gemv_qkv_rope_t##T(                            \
        const bf16* w, const bf16* x, bf16* qkv, int k, int t, const float* bias, const int* positions,        \
        const float* inv_freq, int n_heads, int n_kv, int head_dim, int rot_dim, int neox, const int* slots,   \
        bf16* k_cache, bf16* v_cache, int block_size) {                                                       \
        gemv_qkv_rope<T>(w, x, qkv, k, t, bias, positions, inv_freq, n_heads, n_kv, head_dim, rot_dim, neox,  \
                         slots, k_cache, v_cache, block_size);                                                \
    }
GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV_KERNELS(4)
GEMV_KERNELS(8)
