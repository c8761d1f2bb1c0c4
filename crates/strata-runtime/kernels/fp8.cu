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
// A warp computes R rows (gate/up: a gate row and its up row) and a block GEMV_WARPS warps: lane
// l takes the 16-byte pieces l, l + 32, ... of each row, FP8_LOADS of them a row in flight at
// once, streamed past L1; x (16 bf16 a piece and token) comes through L1 and is shared by the R
// rows; the lanes meet by a butterfly. Weight loads start before the wait for the previous kernel.

// acc[r][j] = (w[rows[r]] · x[j]) / FP8_DECODED for j < t, summed over the warp (every lane
// holds it). after_wait() runs right after the wait for the previous kernel.
template <int T, int R, typename AfterWait>
__device__ __forceinline__ void fp8_rows(const u8* __restrict__ w, int k, const bf16* __restrict__ x, int t,
                                         const int (&rows)[R], float (&acc)[R][T], AfterWait&& after_wait) {
    const int lane = threadIdx.x & 31;
    const int pieces = k >> 4;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < T; j++) acc[r][j] = 0.0f;
    bool waited = false;
    for (int base = lane; base < pieces; base += 32 * FP8_LOADS) {
        uint4 q[R][FP8_LOADS];
#pragma unroll
        for (int u = 0; u < FP8_LOADS; u++) {
            const int i = base + 32 * u;
#pragma unroll
            for (int r = 0; r < R; r++)
                q[r][u] = i < pieces ? load_streaming(w + (size_t)rows[r] * k + (size_t)i * 16) : make_uint4(0u, 0u, 0u, 0u);
        }
        if (!waited) {
            wait_for_previous_kernel();
            after_wait();
            waited = true;
        }
#pragma unroll
        for (int u = 0; u < FP8_LOADS; u++) {
            const int i = base + 32 * u;
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
    if (!waited) {
        wait_for_previous_kernel();
        after_wait();
    }
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < T; j++) acc[r][j] = warp_sum(acc[r][j]);
}

// This warp's first row: warps take FP8_ROWS consecutive rows each.
#define FP8_ROWS 2
__device__ __forceinline__ int fp8_warp_row() { return (blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5)) * FP8_ROWS; }

// y[j * ld + row] = (x[j] · w[row]) * scales[row] * s[j] (bf16, or f32 when out_f32), s the norm
// scale of `norm_in` (NormIn; 1 when null). Grid ceil(n / (GEMV_WARPS * FP8_ROWS)).
template <int T>
__device__ void fp8_gemv(const u8* __restrict__ w, const float* __restrict__ scales, const bf16* __restrict__ x,
                         void* __restrict__ y, int n, int k, int t, int ld, int out_f32, const u64* __restrict__ norm_in,
                         float eps) {
    const int row = fp8_warp_row();
    if (row >= n) return;
    const bool pair = row + 1 < n;
    const int rows[FP8_ROWS] = {row, pair ? row + 1 : row};
    NormIn<T> norm{norm_in};
    float acc[FP8_ROWS][T], s[T];
    fp8_rows<T, FP8_ROWS>(w, k, x, t, rows, acc, [&] { norm.load_in_each_warp(t); });
    norm.scales(t, k, eps, s);
    if ((threadIdx.x & 31) != 0) return;
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
// silu(gate) * up, each rounded to bf16 first as the unfused path does. Grid
// ceil(inter / GEMV_WARPS), a warp a gate row and its up row.
template <int T>
__device__ void fp8_gemv_silu(const u8* __restrict__ w, const float* __restrict__ scales, const bf16* __restrict__ x,
                              bf16* __restrict__ out, int inter, int k, int t, const u64* __restrict__ norm_in,
                              float eps) {
    const int row = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (row >= inter) return;
    const int rows[2] = {row, row + inter};
    NormIn<T> norm{norm_in};
    float acc[2][T], s[T];
    fp8_rows<T, 2>(w, k, x, t, rows, acc, [&] { norm.load_in_each_warp(t); });
    norm.scales(t, k, eps, s);
    if ((threadIdx.x & 31) != 0) return;
    const float gs = scales[row] * FP8_DECODED, us = scales[row + inter] * FP8_DECODED;
#pragma unroll
    for (int j = 0; j < T; j++) {
        if (j < t) {
            const float g = bf2f(f2bf(acc[0][j] * gs * s[j])), u = bf2f(f2bf(acc[1][j] * us * s[j]));
            out[(size_t)j * inter + row] = f2bf(silu_times(g, u));
        }
    }
}

// The o and down projections on one GPU, as quant.cu's qgemv_residual: res += x · wᵀ (f32), the
// new rows' squares into `norm_out`, and res_bf16 = the new rows times the next norm's weights
// `next_norm` (the input of the FP8 matrix after it). Grid ceil(n / (GEMV_WARPS * FP8_ROWS)).
template <int T>
__device__ void fp8_gemv_residual(const u8* __restrict__ w, const float* __restrict__ scales,
                                  const bf16* __restrict__ x, float* __restrict__ res, bf16* __restrict__ res_bf16,
                                  u64* __restrict__ norm_out, const float* __restrict__ next_norm, int n, int k,
                                  int t) {
    const int row = fp8_warp_row();
    if (row >= n) return;
    const bool pair = row + 1 < n;
    const int rows[FP8_ROWS] = {row, pair ? row + 1 : row};
    const bool first = (threadIdx.x & 31) == 0;
    float acc[FP8_ROWS][T], before[FP8_ROWS][T];
    fp8_rows<T, FP8_ROWS>(w, k, x, t, rows, acc, [&] {
        if (!first) return;
#pragma unroll
        for (int r = 0; r < FP8_ROWS; r++)
#pragma unroll
            for (int j = 0; j < T; j++)
                if (j < t) before[r][j] = res[(size_t)j * n + rows[r]];
    });
    if (!first) return;
    float ss[T];
#pragma unroll
    for (int j = 0; j < T; j++) ss[j] = 0.0f;
#pragma unroll
    for (int r = 0; r < FP8_ROWS; r++) {
        if (r == 1 && !pair) break;
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
    const float scale = amax > 0.0f && isfinite(amax) ? amax / 448.0f : 1.0f;
    const float inv = 1.0f / scale;
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
    u8* o = out + (size_t)blockIdx.x * k;
    for (int c = threadIdx.x * 8; c < k; c += blockDim.x * 8) {
        float v[8];
        const int m = min(8, k - c);
        load_bf16s(row + c, m, v);
        if (m == 8) {
            u32 lo = 0u, hi = 0u;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                lo |= (u32)f2e4m3(v[e] * inv) << (8 * e);
                hi |= (u32)f2e4m3(v[e + 4] * inv) << (8 * e);
            }
            *(uint2*)(o + c) = make_uint2(lo, hi);
        } else {
            for (int e = 0; e < m; e++) o[c + e] = f2e4m3(v[e] * inv);
        }
    }
}

// After the FP8 GEMM: y[j, col] *= row_scales[j] * col_scales[col] in place (bf16, or f32 when
// out_f32): the activations' per-token and the weights' per-row scales. A thread a value.
extern "C" __global__ void fp8_scale_output(void* __restrict__ y, int out_f32, const float* __restrict__ row_scales,
                                            const float* __restrict__ col_scales, int n, int t) {
    wait_for_previous_kernel();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n * t) return;
    const float s = row_scales[i / n] * col_scales[i % n];
    if (out_f32) ((float*)y)[i] *= s;
    else ((bf16*)y)[i] = f2bf(bf2f(((bf16*)y)[i]) * s);
}
