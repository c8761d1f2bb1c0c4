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

// acc[r][j] = w[rows[r]] · x[j] for j < t, summed over the whole block (valid in thread 0).
// after_wait() runs right after the wait for the previous kernel: loads of what that kernel
// wrote, issued there, arrive while the block computes.
template <int T, int R, typename AfterWait>
__device__ __forceinline__ void gemv_rows(const bf16* __restrict__ w, const bf16* __restrict__ x, int k, int t,
                                          const int (&rows)[R], float (&acc)[R][T], AfterWait&& after_wait) {
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
        wait_once(waited, after_wait);
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
    wait_once(waited, after_wait);
    block_sum_rows<T, R>(acc);
}

// gemv_rows over two rows, and each token's norm scale s from `norm_in` (NormIn; 1 when null).
// True in thread 0, which holds both; every other thread is done.
template <int T>
__device__ __forceinline__ bool gemv_rows_normed(const bf16* __restrict__ w, const bf16* __restrict__ x, int k, int t,
                                                 const int (&rows)[2], const u64* __restrict__ norm_in, float eps,
                                                 float (&acc)[2][T], float (&s)[T]) {
    NormIn<T> norm{norm_in};
    gemv_rows<T, 2>(w, x, k, t, rows, acc, [&] { norm.load(t); });
    if (threadIdx.x >= 32) return false;
    norm.scales(t, k, eps, s);
    return threadIdx.x == 0;
}

// y[t, n] (bf16, or f32 when out_f32), times the norm scale of `norm_in` (see NormIn) when
// given. Grid ceil(n / 2), GEMV_THREADS threads.
template <int T>
__device__ void gemv(const bf16* __restrict__ w, const bf16* __restrict__ x, void* __restrict__ y, int n, int k,
                     int t, int out_f32, const u64* __restrict__ norm_in, float eps) {
    const int row = 2 * blockIdx.x;
    const bool pair = row + 1 < n;
    const int rows[2] = {row, pair ? row + 1 : row};
    float acc[2][T], s[T];
    if (!gemv_rows_normed<T>(w, x, k, t, rows, norm_in, eps, acc, s)) return;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (r == 1 && !pair) break;
#pragma unroll
        for (int j = 0; j < T; j++) {
            if (j < t) {
                const size_t at = (size_t)j * n + row + r;
                const float v = acc[r][j] * s[j];
                if (out_f32) ((float*)y)[at] = v;
                else ((bf16*)y)[at] = f2bf(v);
            }
        }
    }
}

// The o and down projections on one GPU: res[t, n] += x · wᵀ (f32, as add_rms_norm adds an f32
// projection), res_bf16 = the new rows in bf16 (the next GEMV's input), and their squares added
// into `norm_out` (norm_add). Grid ceil(n / 2), GEMV_THREADS threads.
template <int T>
__device__ void gemv_residual(const bf16* __restrict__ w, const bf16* __restrict__ x, float* __restrict__ res,
                              bf16* __restrict__ res_bf16, u64* __restrict__ norm_out, int n, int k, int t) {
    const int row = 2 * blockIdx.x;
    const bool pair = row + 1 < n;
    const int rows[2] = {row, pair ? row + 1 : row};
    float acc[2][T];
    float before[2][T];
    gemv_rows<T, 2>(w, x, k, t, rows, acc, [&] {
        if (threadIdx.x != 0) return;
#pragma unroll
        for (int j = 0; j < T; j++)
            if (j < t)
#pragma unroll
                for (int r = 0; r < 2; r++) before[r][j] = res[(size_t)j * n + rows[r]];
    });
    if (threadIdx.x != 0) return;
#pragma unroll
    for (int j = 0; j < T; j++) {
        if (j >= t) break;
        float ss = 0.0f;
#pragma unroll
        for (int r = 0; r < 2; r++) {
            if (r == 1 && !pair) break;
            const size_t at = (size_t)j * n + row + r;
            const float v = before[r][j] + acc[r][j];
            res[at] = v;
            res_bf16[at] = f2bf(v);
            ss += v * v;
        }
        norm_add(norm_out, j, ss);
    }
}

// The QKV projection with rope.cu's work folded in (gemv.cuh's QkvRopePair and qkv_rope_store):
// a block computes one pair of rows, rounds them to bf16 as the plain GEMV would, and rotates and
// stores them. Grid width / 2.
template <int T>
__device__ void gemv_qkv_rope(const bf16* __restrict__ w, const bf16* __restrict__ x, bf16* __restrict__ qkv, int k,
                              int t, const float* __restrict__ bias, const int* __restrict__ positions,
                              const float2* __restrict__ rope_table, int n_heads, int n_kv, int head_dim, int rot_dim,
                              int neox, const int* __restrict__ slots, bf16* __restrict__ k_cache,
                              bf16* __restrict__ v_cache, int block_size, const u64* __restrict__ norm_in,
                              float eps) {
    const QkvRopePair p(blockIdx.x, n_heads, n_kv, head_dim, rot_dim, neox);
    float acc[2][T], s[T];
    if (!gemv_rows_normed<T>(w, x, k, t, p.rows, norm_in, eps, acc, s)) return;
#pragma unroll
    for (int j = 0; j < T; j++) {
        if (j >= t) break;
        const float v0 = bf2f(f2bf(acc[0][j] * s[j])), v1 = bf2f(f2bf(acc[1][j] * s[j]));
        qkv_rope_store(p, j, v0, v1, qkv, bias, positions, rope_table, n_heads, n_kv, head_dim, rot_dim, slots,
                       k_cache, v_cache, block_size);
    }
}

// The fused gate/up projection and its activation: w holds [gate; up], each `inter` rows, and
// out[t, inter] = silu(gate) * up (bf16, gate and up rounded to bf16 first as the unfused path
// does). Grid `inter`, GEMV_THREADS threads.
template <int T>
__device__ void gemv_silu(const bf16* __restrict__ w, const bf16* __restrict__ x, bf16* __restrict__ out, int inter,
                          int k, int t, const u64* __restrict__ norm_in, float eps) {
    const int row = blockIdx.x;
    const int rows[2] = {row, row + inter};
    float acc[2][T], s[T];
    if (!gemv_rows_normed<T>(w, x, k, t, rows, norm_in, eps, acc, s)) return;
#pragma unroll
    for (int j = 0; j < T; j++) {
        if (j < t) {
            const float g = bf2f(f2bf(acc[0][j] * s[j])), u = bf2f(f2bf(acc[1][j] * s[j]));
            out[(size_t)j * inter + row] = f2bf(silu_times(g, u));
        }
    }
}

// One-token GEMVs are held to 64 registers a thread, 8 blocks an SM: the weights in flight.
#define GEMV_MIN_BLOCKS(T) ((T) == 1 ? 8 : 1)

#define GEMV_KERNELS(T)                                                                                       \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS(T)) gemv_t##T(                                     \
        const bf16* w, const bf16* x, void* y, int n, int k, int t, int out_f32, const u64* norm_in, float eps) { \
        gemv<T>(w, x, y, n, k, t, out_f32, norm_in, eps);                                                     \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS(T)) gemv_residual_t##T(                            \
        const bf16* w, const bf16* x, float* res, bf16* res_bf16, u64* norm_out, int n, int k, int t) {        \
        gemv_residual<T>(w, x, res, res_bf16, norm_out, n, k, t);                                             \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS(T)) gemv_silu_t##T(                                \
        const bf16* w, const bf16* x, bf16* out, int inter, int k, int t, const u64* norm_in, float eps) {     \
        gemv_silu<T>(w, x, out, inter, k, t, norm_in, eps);                                                   \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS, GEMV_MIN_BLOCKS(T)) gemv_qkv_rope_t##T(                            \
        const bf16* w, const bf16* x, bf16* qkv, int k, int t, const float* bias, const int* positions,        \
        const float2* rope_table, int n_heads, int n_kv, int head_dim, int rot_dim, int neox, const int* slots, \
        bf16* k_cache, bf16* v_cache, int block_size, const u64* norm_in, float eps) {                         \
        gemv_qkv_rope<T>(w, x, qkv, k, t, bias, positions, rope_table, n_heads, n_kv, head_dim, rot_dim, neox,  \
                         slots, k_cache, v_cache, block_size, norm_in, eps);                                  \
    }
GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV_KERNELS(4)
GEMV_KERNELS(8)
