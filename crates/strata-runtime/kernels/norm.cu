// RMSNorm over rows of the f32 residual stream into bf16 GEMM inputs, alone or fused with the
// residual add of an f32 projection output (f32 so tensor-parallel partial sums add exactly), or
// of the `splits` partial sums a quantized GEMM split along k left unsummed ([splits, rows, n]);
// `*_f32`: the same for `--dtype float32`, writing f32 GEMM inputs.
// One block (at most 1024 threads) per row; a row of n floats (n a multiple of 4, at most
// 16 * blockDim.x) is read once, 16 bytes at a time, and kept in registers between its sum of
// squares and its scaling.

#define NORM_VECS 4

// v * scale * w as four bf16s.
__device__ __forceinline__ uint2 norm_bf16x4(const float4& v, float scale, const float4& w) {
    uint2 packed;
    packed.x = f2bf2(v.x * scale * w.x, v.y * scale * w.y);
    packed.y = f2bf2(v.z * scale * w.z, v.w * scale * w.w);
    return packed;
}

// Stores v * scale * w at out[4c..4c + 4): bf16 rounded (8 bytes), or f32 (16 bytes).
__device__ __forceinline__ void norm_store4(bf16* __restrict__ out, int c, const float4& v, float scale,
                                            const float4& w) {
    ((uint2*)out)[c] = norm_bf16x4(v, scale, w);
}
__device__ __forceinline__ void norm_store4(float* __restrict__ out, int c, const float4& v, float scale,
                                            const float4& w) {
    ((float4*)out)[c] = make_float4(v.x * scale * w.x, v.y * scale * w.y, v.z * scale * w.z, v.w * scale * w.w);
}

// Writes rms_norm(v) * weight as T (bf16 or f32; weight null: the layers' norms, folded into the
// matrices after them by weights.rs), where v holds this thread's float4s of the row (float4
// index threadIdx.x + i * blockDim.x) and ss its share of the row's sum of squares.
template <typename T>
__device__ __forceinline__ void norm_store(const float4 (&v)[NORM_VECS], float ss, const float* __restrict__ weight,
                                           T* __restrict__ out, int n, float eps) {
    const float scale = rsqrtf(block_sum(ss) / (float)n + eps);
    const int n4 = n >> 2;
#pragma unroll
    for (int i = 0; i < NORM_VECS; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < n4) {
            const float4 w = weight ? ((const float4*)weight)[c] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
            norm_store4(out, c, v[i], scale, w);
        }
    }
}

// delta's float4 c summed over its `splits` arrays, `stride` floats apart, in order from 0 (as
// qgemm_reduce adds them).
__device__ __forceinline__ float4 split_sum4(const float* __restrict__ delta, int splits, size_t stride, int c) {
    float4 d = ((const float4*)delta)[c];
    for (int z = 1; z < splits; z++) {
        const float4 p = ((const float4*)(delta + z * stride))[c];
        d.x += p.x;
        d.y += p.y;
        d.z += p.z;
        d.w += p.w;
    }
    return d;
}

// Loads row `row` (plus `delta`'s row summed over its splits when given, written back to x) into
// v; returns the thread's share of its sum of squares.
__device__ __forceinline__ float norm_load(float* __restrict__ row, const float* __restrict__ delta, int splits,
                                           size_t stride, int n, float4 (&v)[NORM_VECS]) {
    const int n4 = n >> 2;
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_VECS; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        if (c < n4) {
            float4 a = ((const float4*)row)[c];
            if (delta) {
                const float4 d = split_sum4(delta, splits, stride, c);
                a.x += d.x;
                a.y += d.y;
                a.z += d.z;
                a.w += d.w;
                ((float4*)row)[c] = a;
            }
            v[i] = a;
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
        }
    }
    return ss;
}

// Normalises one row (after adding delta's row to it, written back, when delta is given) into out.
// delta holds `splits` arrays `stride` floats apart, summed first.
template <typename T>
__device__ __forceinline__ void norm_row(float* __restrict__ row, const float* __restrict__ delta, int splits,
                                         size_t stride, const float* __restrict__ weight, T* __restrict__ out, int n,
                                         float eps) {
    float4 v[NORM_VECS];
    const float ss = norm_load(row, delta, splits, stride, n, v);
    norm_store(v, ss, weight, out, n, eps);
}

// norm_row into bf16 `out`, and that row (as written) for the FP8 GEMM after it: E4M3 with the
// scale max |x| / 448 (1 for a zero row) into q[n] and *q_scale, as fp8_quantize_rows would
// write from `out`, bit for bit, without its launch and its two reads of the row.
__device__ __forceinline__ void norm_row_fp8(float* __restrict__ row, const float* __restrict__ delta, int splits,
                                             size_t stride, const float* __restrict__ weight,
                                             bf16* __restrict__ out, fp8* __restrict__ q, float* __restrict__ q_scale,
                                             int n, float eps) {
    float4 v[NORM_VECS];
    const float ss = norm_load(row, delta, splits, stride, n, v);
    const float scale = rsqrtf(block_sum(ss) / (float)n + eps);
    const int n4 = n >> 2;
    // Each float4's values as written (bf16-rounded), for the row's maximum and its bytes.
    float held[NORM_VECS][4];
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < NORM_VECS; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < n4) {
            const float4 w = weight ? ((const float4*)weight)[c] : make_float4(1.0f, 1.0f, 1.0f, 1.0f);
            const uint2 packed = norm_bf16x4(v[i], scale, w);
            ((uint2*)out)[c] = packed;
            const u32 h[4] = {packed.x & 0xffffu, packed.x >> 16, packed.y & 0xffffu, packed.y >> 16};
#pragma unroll
            for (int e = 0; e < 4; e++) {
                held[i][e] = bf2f((bf16)h[e]);
                amax = fmaxf(amax, fabsf(held[i][e]));
            }
        }
    }
    amax = block_max(amax);
    const float qs = e4m3_row_scale(amax);
    const float inv = 1.0f / qs;
    if (threadIdx.x == 0) *q_scale = qs;
#pragma unroll
    for (int i = 0; i < NORM_VECS; i++) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < n4) ((u32*)q)[c] = e4m3x4(held[i], inv);
    }
}

extern "C" __global__ void rms_norm(float* __restrict__ x, const float* __restrict__ weight, bf16* __restrict__ out,
                                    int n, float eps) {
    wait_for_previous_kernel();
    norm_row(x + (size_t)blockIdx.x * n, nullptr, 1, 0, weight, out + (size_t)blockIdx.x * n, n, eps);
}
extern "C" __global__ void rms_norm_f32(float* __restrict__ x, const float* __restrict__ weight,
                                        float* __restrict__ out, int n, float eps) {
    wait_for_previous_kernel();
    norm_row(x + (size_t)blockIdx.x * n, nullptr, 1, 0, weight, out + (size_t)blockIdx.x * n, n, eps);
}

// x += delta (the sum of its `splits` arrays of [rows, n]); out = rms_norm(x) * weight.
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ delta, int splits,
                                        const float* __restrict__ weight, bf16* __restrict__ out, int n,
                                        float eps) {
    wait_for_previous_kernel();
    const size_t r = (size_t)blockIdx.x * n;
    norm_row(x + r, delta + r, splits, (size_t)gridDim.x * n, weight, out + r, n, eps);
}
extern "C" __global__ void add_rms_norm_f32(float* __restrict__ x, const float* __restrict__ delta, int splits,
                                            const float* __restrict__ weight, float* __restrict__ out, int n,
                                            float eps) {
    wait_for_previous_kernel();
    const size_t r = (size_t)blockIdx.x * n;
    norm_row(x + r, delta + r, splits, (size_t)gridDim.x * n, weight, out + r, n, eps);
}

// rms_norm and add_rms_norm that also write their rows as E4M3 for an FP8 GEMM (norm_row_fp8):
// q [rows, n], q_scales [rows].
extern "C" __global__ void rms_norm_fp8(float* __restrict__ x, const float* __restrict__ weight,
                                        bf16* __restrict__ out, int n, float eps, fp8* __restrict__ q,
                                        float* __restrict__ q_scales) {
    wait_for_previous_kernel();
    const size_t r = (size_t)blockIdx.x * n;
    norm_row_fp8(x + r, nullptr, 1, 0, weight, out + r, q + r, q_scales + blockIdx.x, n, eps);
}
extern "C" __global__ void add_rms_norm_fp8(float* __restrict__ x, const float* __restrict__ delta, int splits,
                                            const float* __restrict__ weight, bf16* __restrict__ out, int n,
                                            float eps, fp8* __restrict__ q, float* __restrict__ q_scales) {
    wait_for_previous_kernel();
    const size_t r = (size_t)blockIdx.x * n;
    norm_row_fp8(x + r, delta + r, splits, (size_t)gridDim.x * n, weight, out + r, q + r, q_scales + blockIdx.x, n,
                 eps);
}

// x += delta, summed over its `splits` arrays (the last layer's MLP output, before the final norm
// of only the rows with logits).
extern "C" __global__ void add_residual(float* __restrict__ x, const float* __restrict__ delta, int splits, int n) {
    wait_for_previous_kernel();
    const size_t r = blockIdx.x;
    float4* xr = (float4*)(x + r * n);
    const float* dr = delta + r * n;
    const size_t stride = (size_t)gridDim.x * n;
    for (int c = threadIdx.x; c < (n >> 2); c += blockDim.x) {
        float4 a = xr[c];
        const float4 d = split_sum4(dr, splits, stride, c);
        a.x += d.x;
        a.y += d.y;
        a.z += d.z;
        a.w += d.w;
        xr[c] = a;
    }
}

// out[i] = rms_norm(x[rows[i]]) * weight: the final norm of the rows whose logits are wanted.
extern "C" __global__ void rms_norm_rows(float* __restrict__ x, const int* __restrict__ rows,
                                         const float* __restrict__ weight, bf16* __restrict__ out, int n,
                                         float eps) {
    wait_for_previous_kernel();
    norm_row(x + (size_t)rows[blockIdx.x] * n, nullptr, 1, 0, weight, out + (size_t)blockIdx.x * n, n, eps);
}
extern "C" __global__ void rms_norm_rows_f32(float* __restrict__ x, const int* __restrict__ rows,
                                             const float* __restrict__ weight, float* __restrict__ out, int n,
                                             float eps) {
    wait_for_previous_kernel();
    norm_row(x + (size_t)rows[blockIdx.x] * n, nullptr, 1, 0, weight, out + (size_t)blockIdx.x * n, n, eps);
}
