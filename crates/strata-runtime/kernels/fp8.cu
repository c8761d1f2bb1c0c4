// FP8 E4M3 matrices, a byte a weight and an f32 scale a row: decode GEMVs that read the bytes
// where they lie, dequantization to bf16 (weight-only products on sm_80/86, --deterministic),
// and the two small kernels around cuBLASLt's FP8 tensor-core GEMM on sm_89+ (activations to
// E4M3 with a scale per token; the product's rows and columns times their scales).
//
// Layout (strata-model's weights.rs writes it): w[n, k] row-major E4M3 bytes, k a multiple of
// 16; scales[n] f32; value = e4m3 × scales[row]. Normed inputs carry the norm's weights in x,
// as quant.cu's do (norm kernels with weights, or the residual GEMV scaling res_bf16).
//
// E4M3 to f32: on sm_89+ by the conversion unit (cvt e4m3x2 to f16x2, then f16 to f32); before
// sm_89, which has no such cvt, by integer instructions: the byte moved to the top of a word,
// shifted down 4 arithmetically and masked leaves its sign at bit 31 and its exponent and
// mantissa in the f32's low exponent and high mantissa bits, the value times 2^-120 exactly,
// subnormals included (the kernels run without flush-to-zero); FP8_DECODED folds the 2^120 into
// each row's scale. On an H200 the integer path decoded slower (2.93 against 2.61 ms a token on
// a Qwen2.5-7B shape, bench/NOTES.md, FP8 v2); STRATA_KERNEL_DEFINES="FP8_CVT=0" selects it
// there too, for measurements and to check the fallback.

typedef unsigned char u8;

#ifndef FP8_CVT
#define FP8_CVT 1
#endif

#if FP8_CVT && __CUDA_ARCH__ >= 890
#define FP8_DECODED 1.0f
#else
#define FP8_DECODED 0x1p120f
#endif

// 16-byte loads in flight per lane and row (STRATA_KERNEL_DEFINES="FP8_LOADS=4" for measurements).
#ifndef FP8_LOADS
#define FP8_LOADS 4
#endif

// Sixteen E4M3 bytes as f32 (times 1 / FP8_DECODED).
__device__ __forceinline__ void fp8x16_to_f32(uint4 q, float (&v)[16]) {
    const u32 words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
#if FP8_CVT && __CUDA_ARCH__ >= 890
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 pair;
            asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(pair) : "h"((unsigned short)((words[i] >> (16 * h)) & 0xffffu)));
            float lo, hi;
            asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((unsigned short)(pair & 0xffffu)));
            asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((unsigned short)(pair >> 16)));
            v[4 * i + 2 * h] = lo;
            v[4 * i + 2 * h + 1] = hi;
        }
#else
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const int top = (int)__byte_perm(words[i], 0u, 0x0444u | ((u32)b << 12));
            v[4 * i + b] = __uint_as_float((u32)(top >> 4) & 0x87f00000u);
        }
#endif
    }
}

// ---- Decode GEMVs: t <= 8 tokens, bound by reading w once. ----
// A block computes R rows (gate/up: a gate row and its up row; QKV: rows RoPE pairs), as
// gemm.cu's bf16 GEMVs do: thread i takes the 16-byte pieces i, i + 128, ... of each row,
// FP8_LOADS of them a row in flight at once, streamed past L1; x (16 bf16 a piece and token)
// comes through L1 and is shared by the R rows; the warps meet in shared memory
// (block_sum_rows). A block, not a warp, a row pair: a 3,584-row product is 1,792 blocks, not 448
// (3 or 4 an SM), 4.2 % faster FP8 single stream (bench/NOTES.md, FP8 v8). Weight loads start
// before the wait for the previous kernel.

// acc[r][j] = (w[rows[r]] · x[j]) / FP8_DECODED for j < t, summed over the block (valid in
// thread 0). after_wait() runs right after the wait for the previous kernel. LOADS pieces a row
// are in flight a thread; a thread's pieces and the order it sums them do not depend on LOADS.
template <int T, int R, int LOADS = FP8_LOADS, typename AfterWait>
__device__ __forceinline__ void fp8_rows(const u8* __restrict__ w, int k, const bf16* __restrict__ x, int t,
                                         const int (&rows)[R], float (&acc)[R][T], AfterWait&& after_wait) {
    const int pieces = k >> 4;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < T; j++) acc[r][j] = 0.0f;
    bool waited = false;
    for (int base = threadIdx.x; base < pieces; base += GEMV_THREADS * LOADS) {
        uint4 q[R][LOADS];
#pragma unroll
        for (int u = 0; u < LOADS; u++) {
            const int i = base + GEMV_THREADS * u;
#pragma unroll
            for (int r = 0; r < R; r++)
                q[r][u] = i < pieces ? load_streaming(w + (size_t)rows[r] * k + (size_t)i * 16) : make_uint4(0u, 0u, 0u, 0u);
        }
        wait_once(waited, after_wait);
#pragma unroll
        for (int u = 0; u < LOADS; u++) {
            const int i = base + GEMV_THREADS * u;
            if (i >= pieces) break;
            float v[R][16];
#pragma unroll
            for (int r = 0; r < R; r++) fp8x16_to_f32(q[r][u], v[r]);
#pragma unroll
            for (int j = 0; j < T; j++) {
                if (j < t) {
                    const uint4* xv = (const uint4*)(x + (size_t)j * k + (size_t)i * 16);
                    float xf[16];
                    unpack8(__ldg(xv), xf);
                    unpack8(__ldg(xv + 1), xf + 8);
#pragma unroll
                    for (int r = 0; r < R; r++)
#pragma unroll
                        for (int e = 0; e < 16; e++) acc[r][j] = fmaf(v[r][e], xf[e], acc[r][j]);
                }
            }
        }
    }
    wait_once(waited, after_wait);
    block_sum_rows<T, R>(acc);
}

// fp8_rows, and each token's norm scale s from `norm_in` (NormIn; 1 when null), as gemm.cu's
// gemv_rows_normed. True in thread 0, which holds both; every other thread is done.
template <int T, int R, int LOADS = FP8_LOADS>
__device__ __forceinline__ bool fp8_rows_normed(const u8* __restrict__ w, int k, const bf16* __restrict__ x, int t,
                                                const int (&rows)[R], const u64* __restrict__ norm_in, float eps,
                                                float (&acc)[R][T], float (&s)[T]) {
    NormIn<T> norm{norm_in};
    fp8_rows<T, R, LOADS>(w, k, x, t, rows, acc, [&] { norm.load(t); });
    if (threadIdx.x >= 32) return false;
    norm.scales(t, k, eps, s);
    return threadIdx.x == 0;
}

// Rows a plain or residual GEMV block computes.
#define FP8_ROWS 2

// y[j * ld + row] = (x[j] · w[row]) * scales[row] * s[j] (bf16, or f32 when out_f32), s the norm
// scale of `norm_in` (NormIn; 1 when null). Grid ceil(n / FP8_ROWS).
template <int T>
__device__ void fp8_gemv(const u8* __restrict__ w, const float* __restrict__ scales, const bf16* __restrict__ x,
                         void* __restrict__ y, int n, int k, int t, int ld, int out_f32, const u64* __restrict__ norm_in,
                         float eps) {
    const int row = blockIdx.x * FP8_ROWS;
    if (row >= n) return;
    const bool pair = row + 1 < n;
    const int rows[FP8_ROWS] = {row, pair ? row + 1 : row};
    float acc[FP8_ROWS][T], s[T];
    if (!fp8_rows_normed<T, FP8_ROWS>(w, k, x, t, rows, norm_in, eps, acc, s)) return;
#pragma unroll
    for (int r = 0; r < FP8_ROWS; r++) {
        if (r == 1 && !pair) break;
        const float ws = scales[row + r] * FP8_DECODED;
#pragma unroll
        for (int j = 0; j < T; j++) {
            if (j < t) {
                const size_t at = (size_t)j * ld + row + r;
                const float v = acc[r][j] * ws * s[j];
                if (out_f32) ((float*)y)[at] = v;
                else ((bf16*)y)[at] = f2bf(v);
            }
        }
    }
}

// Gate/up with SiLU: w holds the gate rows, then the up rows (2 * inter); out[j, row] =
// silu(gate) * up, each rounded to bf16 first as the unfused path does. Grid inter, a block a
// gate row and its up row.
template <int T>
__device__ void fp8_gemv_silu(const u8* __restrict__ w, const float* __restrict__ scales, const bf16* __restrict__ x,
                              bf16* __restrict__ out, int inter, int k, int t, const u64* __restrict__ norm_in,
                              float eps) {
    const int row = blockIdx.x;
    if (row >= inter) return;
    const int rows[2] = {row, row + inter};
    float acc[2][T], s[T];
    if (!fp8_rows_normed<T, 2>(w, k, x, t, rows, norm_in, eps, acc, s)) return;
    const float gs = scales[row] * FP8_DECODED, us = scales[row + inter] * FP8_DECODED;
#pragma unroll
    for (int j = 0; j < T; j++) {
        if (j < t) {
            const float g = bf2f(f2bf(acc[0][j] * gs * s[j])), u = bf2f(f2bf(acc[1][j] * us * s[j]));
            out[(size_t)j * inter + row] = f2bf(silu_times(g, u));
        }
    }
}

// RoPE pairs a QKV GEMV block of T tokens computes (fp8_call.rs: qkv_block_pairs). At one token
// 3, with a load a row in flight (6 rows, not 2 x 4): Qwen2.5-7B's 2,304 pairs are then 768
// blocks, one wave on an H100, so every block's loads start before the wait for the norm, as
// FP8_RES_ROWS does for o and down. One pair past one token, where the sums take the registers.
#define FP8_QKV_PAIRS(T) ((T) == 1 ? 3 : 1)

// The QKV projection with rope.cu's work folded in, as gemm.cu's gemv_qkv_rope over FP8 rows: a
// block computes FP8_QKV_PAIRS(T) pairs of rows (gemv.cuh's QkvRopePair), rounds them to bf16 as
// fp8_gemv would, and rotates and stores them (qkv_rope_store). Grid ceil(width / 2 / pairs).
template <int T>
__device__ void fp8_gemv_qkv_rope(const u8* __restrict__ w, const float* __restrict__ scales,
                                  const bf16* __restrict__ x, bf16* __restrict__ qkv, int k, int t,
                                  const float* __restrict__ bias, const int* __restrict__ positions,
                                  const float2* __restrict__ rope_table, int n_heads, int n_kv, int head_dim,
                                  int rot_dim, int neox, const int* __restrict__ slots, bf16* __restrict__ k_cache,
                                  bf16* __restrict__ v_cache, int block_size, const u64* __restrict__ norm_in,
                                  float eps) {
    constexpr int P = FP8_QKV_PAIRS(T);
    const int pairs = (n_heads + 2 * n_kv) * head_dim / 2, first = blockIdx.x * P;
    if (first >= pairs) return;
    // Pairs past the last repeat it (their sums are not stored).
    int rows[2 * P];
#pragma unroll
    for (int q = 0; q < P; q++) {
        const QkvRopePair p(first + q < pairs ? first + q : first, n_heads, n_kv, head_dim, rot_dim, neox);
        rows[2 * q] = p.rows[0];
        rows[2 * q + 1] = p.rows[1];
    }
    float acc[2 * P][T], s[T];
    if (!fp8_rows_normed<T, 2 * P, FP8_LOADS * 2 / (2 * P)>(w, k, x, t, rows, norm_in, eps, acc, s)) return;
#pragma unroll
    for (int q = 0; q < P; q++) {
        if (first + q >= pairs) break;
        const QkvRopePair p(first + q, n_heads, n_kv, head_dim, rot_dim, neox);
        const float ws0 = scales[p.rows[0]] * FP8_DECODED, ws1 = scales[p.rows[1]] * FP8_DECODED;
#pragma unroll
        for (int j = 0; j < T; j++) {
            if (j >= t) break;
            const float v0 = bf2f(f2bf(acc[2 * q][j] * ws0 * s[j])), v1 = bf2f(f2bf(acc[2 * q + 1][j] * ws1 * s[j]));
            qkv_rope_store(p, j, v0, v1, qkv, bias, positions, rope_table, n_heads, n_kv, head_dim, rot_dim, slots,
                           k_cache, v_cache, block_size);
        }
    }
}

// Rows a residual GEMV block of T tokens computes (fp8_call.rs: residual_block_rows). At one
// token 4, with half the loads a row in flight of the pairs': o's 3,584 rows are then 896
// blocks, all resident at once on an H100 (8 an SM), so every block's weight loads start before
// the wait for attention. Pairs past one token, where 4 rows took 159 registers, not 92, at 2.
#define FP8_RES_ROWS(T) ((T) == 1 ? 4 : FP8_ROWS)

// The o and down projections on one GPU, as quant.cu's qgemv_residual: res += x · wᵀ (f32), the
// new rows' squares into `norm_out`, and res_bf16 = the new rows times the next norm's weights
// `next_norm` (the input of the FP8 matrix after it). Grid ceil(n / FP8_RES_ROWS(T)).
template <int T>
__device__ void fp8_gemv_residual(const u8* __restrict__ w, const float* __restrict__ scales,
                                  const bf16* __restrict__ x, float* __restrict__ res, bf16* __restrict__ res_bf16,
                                  u64* __restrict__ norm_out, const float* __restrict__ next_norm, int n, int k,
                                  int t) {
    constexpr int R = FP8_RES_ROWS(T);
    const int row = blockIdx.x * R;
    if (row >= n) return;
    // Rows past n repeat the first (their sums are not stored).
    int rows[R];
#pragma unroll
    for (int r = 0; r < R; r++) rows[r] = row + r < n ? row + r : row;
    const bool first = threadIdx.x == 0;
    float acc[R][T], before[R][T];
    auto load_before = [&] {
        if (!first) return;
#pragma unroll
        for (int r = 0; r < R; r++)
#pragma unroll
            for (int j = 0; j < T; j++)
                if (j < t) before[r][j] = res[(size_t)j * n + rows[r]];
    };
    fp8_rows<T, R, FP8_LOADS * 2 / R>(w, k, x, t, rows, acc, load_before);
    if (!first) return;
    float ss[T];
#pragma unroll
    for (int j = 0; j < T; j++) ss[j] = 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (row + r >= n) break;
        const float ws = scales[row + r] * FP8_DECODED;
        const float g = next_norm ? next_norm[row + r] : 1.0f;
#pragma unroll
        for (int j = 0; j < T; j++) {
            if (j >= t) break;
            const size_t at = (size_t)j * n + row + r;
            const float v = before[r][j] + acc[r][j] * ws;
            res[at] = v;
            res_bf16[at] = f2bf(v * g);
            ss[j] += v * v;
        }
    }
#pragma unroll
    for (int j = 0; j < T; j++)
        if (j < t) norm_add(norm_out, j, ss[j]);
}

// ---- Decode GEMVs on tensor cores (STRATA_FP8_GEMV=mma; the lanes' GEMVs above by default) ----
// The GEMVs above spend 1.5 conversions a weight (E4M3 pair to f16 pair, then each f16 to f32), and
// the conversion unit, not memory, sets their speed (bench/NOTES.md, FP8 v2). These take the
// products on tensor cores instead: mma.sync m16n8k16 with f16 operands and f32 sums, the weights
// as A (an E4M3 pair to an f16 pair, exact, and nothing more a weight), the tokens as the 8
// columns of B (x in f16, zero past t), so one conversion serves two weights.
// A block of FP8M_WARPS warps computes FP8M_TILES tiles of 16 rows; warp w takes the 64-column
// chunks w, w + FP8M_WARPS, ... (split k, so a 3,584-row matrix still gives 112 blocks of 8
// warps), FP8M_LOADS chunks in flight, and the warps' sums meet in shared memory in a fixed
// order. Lane (g, c) = (lane / 4, lane % 4) loads 16 bytes of rows g and g + 8 of each tile at
// column 64 chunk + 16 c, and x[g] at the same columns. A dot product may take its columns in any
// order as long as A and B agree: mma step s (0..3) takes bytes 4s..4s + 3 of the lane's pieces
// as its k = 2c, 2c + 1 (bytes 4s, 4s + 1) and 2c + 8, 2c + 9 (bytes 4s + 2, 4s + 3).

#define FP8M_WARPS 8
#define FP8M_TILES 2
#define FP8M_ROWS (16 * FP8M_TILES)
// Chunks of 64 columns in flight per warp (STRATA_KERNEL_DEFINES="FP8M_LOADS=4" for measurements).
#ifndef FP8M_LOADS
#define FP8M_LOADS 2
#endif

// Where there is no E4M3 cvt, the integer decode below gives each value times 2^-8.
#if FP8_CVT && __CUDA_ARCH__ >= 890
#define FP8M_DECODED 1.0f
#else
#define FP8M_DECODED 256.0f
#endif

// E4M3 bytes 2h and 2h + 1 of `w` as an f16 pair (lower byte in the lower half), times
// 1 / FP8M_DECODED.
__device__ __forceinline__ u32 fp8x2_to_f16x2(u32 w, int h) {
#if FP8_CVT && __CUDA_ARCH__ >= 890
    u32 r;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"((unsigned short)((w >> (16 * h)) & 0xffffu)));
    return r;
#else
    // Each byte at the top of its half; its sign stays at bit 15 and its exponent and mantissa
    // move to f16's low exponent and top mantissa bits: the value times 2^-8, subnormals included.
    const u32 p = __byte_perm(w, 0u, h ? 0x3424u : 0x1404u);
    return (p & 0x80008000u) | ((p >> 1) & 0x3f803f80u);
#endif
}

// A pair of bf16 activations as an f16 pair, clamped to f16's range (sm_80+, as the GEMVs
// that use it: strata runs the lanes' GEMVs below that).
__device__ __forceinline__ u32 bf16x2_to_f16x2(u32 v) {
#if __CUDA_ARCH__ >= 800
    const float lo = fminf(fmaxf(__uint_as_float(v << 16), -65504.0f), 65504.0f);
    const float hi = fminf(fmaxf(__uint_as_float(v & 0xffff0000u), -65504.0f), 65504.0f);
    return pack_pair<true>(lo, hi);
#else
    return 0u;
#endif
}

// The block's products: rows first[tile] .. first[tile] + 15 of w (rows at or past end[tile]
// read as zero) times x's t tokens. Returns true in warp 0, whose lane (g, c) then holds in
// sums[tile][r] row first[tile] + g + 8 (r / 2), token 2c + r % 2, times 1 / FP8M_DECODED.
// after_wait() runs right after the wait for the previous kernel.
template <typename AfterWait>
__device__ __forceinline__ bool fp8_mma_sums(const u8* __restrict__ w, int k, const bf16* __restrict__ x, int t,
                                             const int (&first)[FP8M_TILES], const int (&end)[FP8M_TILES],
                                             float (&sums)[FP8M_TILES][4], AfterWait&& after_wait) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    float acc[FP8M_TILES][4];
    const u8* rows[FP8M_TILES][2];
    bool live[FP8M_TILES][2];
#pragma unroll
    for (int tile = 0; tile < FP8M_TILES; tile++) {
#pragma unroll
        for (int r = 0; r < 4; r++) acc[tile][r] = 0.0f;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int row = first[tile] + g + 8 * h;
            live[tile][h] = row < end[tile];
            rows[tile][h] = w + (size_t)(live[tile][h] ? row : 0) * k + 16 * c;
        }
    }
    const int chunks = (k + 63) >> 6;
    const bool has_x = g < t;
    const bf16* xr = x + (size_t)(has_x ? g : 0) * k + 16 * c;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    bool waited = false;
    for (int base = warp; base < chunks; base += FP8M_WARPS * FP8M_LOADS) {
        uint4 q[FP8M_LOADS][FP8M_TILES][2];
#pragma unroll
        for (int u = 0; u < FP8M_LOADS; u++) {
            const int col = (base + FP8M_WARPS * u) * 64;
            const bool in = base + FP8M_WARPS * u < chunks && col + 16 * c < k;
#pragma unroll
            for (int tile = 0; tile < FP8M_TILES; tile++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    q[u][tile][h] = in && live[tile][h] ? load_streaming(rows[tile][h] + col) : zero;
        }
        wait_once(waited, after_wait);
#pragma unroll
        for (int u = 0; u < FP8M_LOADS; u++) {
            const int chunk = base + FP8M_WARPS * u;
            if (chunk >= chunks) break;
            const int col = chunk * 64;
            uint4 x0 = zero, x1 = zero;
            if (has_x && col + 16 * c < k) {
                x0 = __ldg((const uint4*)(xr + col));
                x1 = __ldg((const uint4*)(xr + col) + 1);
            }
            const u32 xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
            for (int s = 0; s < 4; s++) {
                const u32 b0 = bf16x2_to_f16x2(xw[2 * s]), b1 = bf16x2_to_f16x2(xw[2 * s + 1]);
#pragma unroll
                for (int tile = 0; tile < FP8M_TILES; tile++) {
                    const u32 lo[4] = {q[u][tile][0].x, q[u][tile][0].y, q[u][tile][0].z, q[u][tile][0].w};
                    const u32 hi[4] = {q[u][tile][1].x, q[u][tile][1].y, q[u][tile][1].z, q[u][tile][1].w};
                    mma_16x8x16<true>(acc[tile], fp8x2_to_f16x2(lo[s], 0), fp8x2_to_f16x2(hi[s], 0),
                                      fp8x2_to_f16x2(lo[s], 1), fp8x2_to_f16x2(hi[s], 1), b0, b1);
                }
            }
        }
    }
    wait_once(waited, after_wait);
    __shared__ float partial[FP8M_WARPS][FP8M_TILES][4][32];
#pragma unroll
    for (int tile = 0; tile < FP8M_TILES; tile++)
#pragma unroll
        for (int r = 0; r < 4; r++) partial[warp][tile][r][lane] = acc[tile][r];
    __syncthreads();
    if (warp != 0) return false;
#pragma unroll
    for (int tile = 0; tile < FP8M_TILES; tile++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            float v = partial[0][tile][r][lane];
#pragma unroll
            for (int p = 1; p < FP8M_WARPS; p++) v += partial[p][tile][r][lane];
            sums[tile][r] = v;
        }
    return true;
}

// This block's tiles of an n-row matrix: FP8M_ROWS consecutive rows.
__device__ __forceinline__ void fp8_mma_block_tiles(int n, int (&first)[FP8M_TILES], int (&end)[FP8M_TILES]) {
#pragma unroll
    for (int tile = 0; tile < FP8M_TILES; tile++) {
        first[tile] = blockIdx.x * FP8M_ROWS + 16 * tile;
        end[tile] = n;
    }
}

// The row and token of accumulator r (0..3) of this lane in a tile whose first row is `first`:
// mma.sync's C layout, lane (g, c) holding rows g and g + 8, tokens 2c and 2c + 1.
struct MmaOut {
    int row, token;
};
__device__ __forceinline__ MmaOut fp8_mma_out(int first, int r) {
    const int lane = threadIdx.x & 31;
    return {first + (lane >> 2) + 8 * (r >> 1), 2 * (lane & 3) + (r & 1)};
}

// s[j] for a token j < t <= T (s from NormIn::scales).
template <int T>
__device__ __forceinline__ float token_scale(const float (&s)[T], int j) {
    float v = 1.0f;
#pragma unroll
    for (int i = 0; i < T; i++)
        if (i == j) v = s[i];
    return v;
}

// fp8_mma_sums for a GEMV that reads normed rows: also each token's norm scale s[j] (1 without
// a norm), in warp 0, the only warp that returns true.
template <int T>
__device__ __forceinline__ bool fp8_mma_normed_sums(const u8* __restrict__ w, int k, const bf16* __restrict__ x,
                                                    int t, const int (&first)[FP8M_TILES],
                                                    const int (&end)[FP8M_TILES], const u64* __restrict__ norm_in,
                                                    float eps, float (&sums)[FP8M_TILES][4], float (&s)[T]) {
    NormIn<T> norm{norm_in};
    if (!fp8_mma_sums(w, k, x, t, first, end, sums, [&] {
            if (threadIdx.x < 32) norm.load_in_each_warp(t);
        }))
        return false;
    norm.scales(t, k, eps, s);
    return true;
}

// fp8_gemv's product on tensor cores. Grid ceil(n / FP8M_ROWS), FP8M_WARPS warps a block.
template <int T>
__device__ void fp8_mma_gemv(const u8* __restrict__ w, const float* __restrict__ scales, const bf16* __restrict__ x,
                             void* __restrict__ y, int n, int k, int t, int ld, int out_f32,
                             const u64* __restrict__ norm_in, float eps) {
    int first[FP8M_TILES], end[FP8M_TILES];
    fp8_mma_block_tiles(n, first, end);
    float sums[FP8M_TILES][4], s[T];
    if (!fp8_mma_normed_sums(w, k, x, t, first, end, norm_in, eps, sums, s)) return;
#pragma unroll
    for (int tile = 0; tile < FP8M_TILES; tile++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const auto [row, j] = fp8_mma_out(first[tile], r);
            if (row >= n || j >= t) continue;
            const size_t at = (size_t)j * ld + row;
            const float v = sums[tile][r] * scales[row] * FP8M_DECODED * token_scale(s, j);
            if (out_f32) ((float*)y)[at] = v;
            else ((bf16*)y)[at] = f2bf(v);
        }
}

// fp8_gemv_silu's product on tensor cores: tile 0 holds 16 gate rows, tile 1 their up rows.
// Grid ceil(inter / 16), FP8M_WARPS warps a block.
template <int T>
__device__ void fp8_mma_gemv_silu(const u8* __restrict__ w, const float* __restrict__ scales,
                                  const bf16* __restrict__ x, bf16* __restrict__ out, int inter, int k, int t,
                                  const u64* __restrict__ norm_in, float eps) {
    const int row0 = blockIdx.x * 16;
    const int first[FP8M_TILES] = {row0, inter + row0}, end[FP8M_TILES] = {inter, 2 * inter};
    float sums[FP8M_TILES][4], s[T];
    if (!fp8_mma_normed_sums(w, k, x, t, first, end, norm_in, eps, sums, s)) return;
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const auto [row, j] = fp8_mma_out(row0, r);
        if (row >= inter || j >= t) continue;
        const float sj = token_scale(s, j) * FP8M_DECODED;
        const float gate = bf2f(f2bf(sums[0][r] * scales[row] * sj));
        const float up = bf2f(f2bf(sums[1][r] * scales[row + inter] * sj));
        out[(size_t)j * inter + row] = f2bf(silu_times(gate, up));
    }
}

// fp8_gemv_residual's product on tensor cores. Grid ceil(n / FP8M_ROWS), FP8M_WARPS warps a block.
template <int T>
__device__ void fp8_mma_gemv_residual(const u8* __restrict__ w, const float* __restrict__ scales,
                                      const bf16* __restrict__ x, float* __restrict__ res,
                                      bf16* __restrict__ res_bf16, u64* __restrict__ norm_out,
                                      const float* __restrict__ next_norm, int n, int k, int t) {
    int first[FP8M_TILES], end[FP8M_TILES];
    fp8_mma_block_tiles(n, first, end);
    float sums[FP8M_TILES][4];
    if (!fp8_mma_sums(w, k, x, t, first, end, sums, [] {})) return;
    // This lane's share of the sums of squares of its two tokens (accumulators r % 2 == 0, 1).
    float ss[2] = {0.0f, 0.0f};
#pragma unroll
    for (int tile = 0; tile < FP8M_TILES; tile++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            const auto [row, j] = fp8_mma_out(first[tile], r);
            if (row >= n || j >= t) continue;
            const size_t at = (size_t)j * n + row;
            const float v = res[at] + sums[tile][r] * scales[row] * FP8M_DECODED;
            res[at] = v;
            res_bf16[at] = f2bf(v * (next_norm ? next_norm[row] : 1.0f));
            ss[r & 1] += v * v;
        }
#pragma unroll
    for (int i = 0; i < 2; i++) {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) ss[i] += __shfl_xor_sync(FULL_MASK, ss[i], o);
        // Lanes 0-3 (row 0 of a tile at 0) add their tokens' totals.
        const auto [row, j] = fp8_mma_out(0, i);
        if (row == 0 && j < t) norm_add(norm_out, j, ss[i]);
    }
}

#define FP8_GEMVS(T)                                                                                            \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) fp8_gemv_t##T(                                   \
        const u8* w, const float* scales, const bf16* x, void* y, int n, int k, int t, int ld, int out_f32,     \
        const u64* norm_in, float eps) {                                                                        \
        fp8_gemv<T>(w, scales, x, y, n, k, t, ld, out_f32, norm_in, eps);                                       \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) fp8_gemv_silu_t##T(                              \
        const u8* w, const float* scales, const bf16* x, bf16* out, int inter, int k, int t, const u64* norm_in, \
        float eps) {                                                                                            \
        fp8_gemv_silu<T>(w, scales, x, out, inter, k, t, norm_in, eps);                                         \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) fp8_gemv_residual_t##T(                          \
        const u8* w, const float* scales, const bf16* x, float* res, bf16* res_bf16, u64* norm_out,             \
        const float* next_norm, int n, int k, int t) {                                                          \
        fp8_gemv_residual<T>(w, scales, x, res, res_bf16, norm_out, next_norm, n, k, t);                        \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) fp8_gemv_qkv_rope_t##T(                          \
        const u8* w, const float* scales, const bf16* x, bf16* qkv, int k, int t, const float* bias,            \
        const int* positions, const float2* rope_table, int n_heads, int n_kv, int head_dim, int rot_dim,       \
        int neox, const int* slots, bf16* k_cache, bf16* v_cache, int block_size, const u64* norm_in,          \
        float eps) {                                                                                            \
        fp8_gemv_qkv_rope<T>(w, scales, x, qkv, k, t, bias, positions, rope_table, n_heads, n_kv, head_dim,     \
                             rot_dim, neox, slots, k_cache, v_cache, block_size, norm_in, eps);                \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(FP8M_WARPS * 32) fp8_mma_gemv_t##T(                             \
        const u8* w, const float* scales, const bf16* x, void* y, int n, int k, int t, int ld, int out_f32,     \
        const u64* norm_in, float eps) {                                                                        \
        fp8_mma_gemv<T>(w, scales, x, y, n, k, t, ld, out_f32, norm_in, eps);                                   \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(FP8M_WARPS * 32) fp8_mma_gemv_silu_t##T(                        \
        const u8* w, const float* scales, const bf16* x, bf16* out, int inter, int k, int t, const u64* norm_in, \
        float eps) {                                                                                            \
        fp8_mma_gemv_silu<T>(w, scales, x, out, inter, k, t, norm_in, eps);                                     \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(FP8M_WARPS * 32) fp8_mma_gemv_residual_t##T(                    \
        const u8* w, const float* scales, const bf16* x, float* res, bf16* res_bf16, u64* norm_out,             \
        const float* next_norm, int n, int k, int t) {                                                          \
        fp8_mma_gemv_residual<T>(w, scales, x, res, res_bf16, norm_out, next_norm, n, k, t);                    \
    }

FP8_GEMVS(1)
FP8_GEMVS(2)
FP8_GEMVS(4)
FP8_GEMVS(8)

// out[row * k + col] = w[row, col] * scales[row] in bf16, for cuBLASLt's bf16 GEMM (weight-only
// products) and the fixed-order GEMM. A thread 16 values.
extern "C" __global__ void fp8_dequant(const u8* __restrict__ w, const float* __restrict__ scales,
                                       bf16* __restrict__ out, int n, int k) {
    const int pieces = k >> 4;
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const bool mine = i < (long long)n * pieces;
    const int row = mine ? (int)(i / pieces) : 0, piece = mine ? (int)(i % pieces) : 0;
    uint4 q = make_uint4(0u, 0u, 0u, 0u);
    if (mine) q = load_streaming(w + (size_t)row * k + (size_t)piece * 16);
    // `out` may still be read by the product before this one.
    wait_for_previous_kernel();
    if (!mine) return;
    float v[16];
    fp8x16_to_f32(q, v);
    const float s = scales[row] * FP8_DECODED;
#pragma unroll
    for (int e = 0; e < 16; e++) v[e] *= s;
    bf16* o = out + (size_t)row * k + (size_t)piece * 16;
    store_bf16s(o, 8, *(const float(*)[8])v);
    store_bf16s(o + 8, 8, *(const float(*)[8])(v + 8));
}

// Activations for the FP8 GEMM: row r of x (bf16 [rows, k]) as E4M3 with the scale max |x| / 448
// (1 for a zero row) into out[r * k ..] and scales[r] (common.cuh's f2e4m3, the CPU cache's
// rounding). One block a row.
extern "C" __global__ void fp8_quantize_rows(const bf16* __restrict__ x, u8* __restrict__ out,
                                             float* __restrict__ scales, int k) {
    wait_for_previous_kernel();
    const bf16* row = x + (size_t)blockIdx.x * k;
    float amax = 0.0f;
    for (int c = threadIdx.x * 8; c < k; c += blockDim.x * 8) {
        float v[8];
        load_bf16s(row + c, min(8, k - c), v);
#pragma unroll
        for (int e = 0; e < 8; e++) amax = fmaxf(amax, fabsf(v[e]));
    }
    amax = block_max(amax);
    const float scale = e4m3_row_scale(amax);
    const float inv = 1.0f / scale;
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
    u8* o = out + (size_t)blockIdx.x * k;
    for (int c = threadIdx.x * 8; c < k; c += blockDim.x * 8) {
        float v[8];
        const int m = min(8, k - c);
        load_bf16s(row + c, m, v);
        if (m == 8) {
            *(uint2*)(o + c) = make_uint2(e4m3x4(v, inv), e4m3x4(v + 4, inv));
        } else {
            for (int e = 0; e < m; e++) o[c + e] = f2e4m3(v[e] * inv);
        }
    }
}

// p[0..8) *= s[0..8) in place, in p's type (bf16 rounded once).
template <typename T>
__device__ __forceinline__ void scale_vals(T* __restrict__ p, const float (&s)[8]) {
    float v[8];
    load_vals(p, 8, v);
#pragma unroll
    for (int e = 0; e < 8; e++) v[e] *= s[e];
    store_vals(p, 8, v);
}

// After the FP8 GEMM: y[j, col] *= row_scales[j] * col_scales[col] in place (bf16, or f32 when
// out_f32): the activations' per-token and the weights' per-row scales. Grid (ceil(n / 8 /
// blockDim.x), t): a thread scales 8 values of token blockIdx.y with 16-byte accesses (n a
// multiple of 8, as the tensor-core path's multiple of 16 is).
extern "C" __global__ void fp8_scale_output(void* __restrict__ y, int out_f32, const float* __restrict__ row_scales,
                                            const float* __restrict__ col_scales, int n, int t) {
    wait_for_previous_kernel();
    const int c = 8 * (blockIdx.x * blockDim.x + threadIdx.x);
    if (c >= n) return;
    const size_t at = (size_t)blockIdx.y * n + c;
    const float rs = row_scales[blockIdx.y];
    float s[8];
    load_vals(col_scales + c, 8, s);
#pragma unroll
    for (int e = 0; e < 8; e++) s[e] = rs * s[e];
    if (out_f32) scale_vals((float*)y + at, s);
    else scale_vals((bf16*)y + at, s);
}
