// RMSNorm over rows of the f32 residual stream into bf16 GEMM inputs, alone or fused with the
// residual add of an f32 projection output (f32 so tensor-parallel partial sums add exactly). One block per row.

extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ weight,
                                    bf16* __restrict__ out, int n, float eps) {
    const size_t r = blockIdx.x;
    const float* xr = x + r * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    const float scale = rsqrtf(block_sum(ss) / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[r * n + i] = f2bf(xr[i] * scale * weight[i]);
}

// x += delta; out = rms_norm(x) * weight.
extern "C" __global__ void add_rms_norm(float* __restrict__ x, const float* __restrict__ delta,
                                        const float* __restrict__ weight, bf16* __restrict__ out, int n,
                                        float eps) {
    const size_t r = blockIdx.x;
    float* xr = x + r * n;
    const float* dr = delta + r * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xr[i] + dr[i];
        xr[i] = v;
        ss += v * v;
    }
    const float scale = rsqrtf(block_sum(ss) / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[r * n + i] = f2bf(xr[i] * scale * weight[i]);
}

// x += delta (the last layer's MLP output, before the final norm of only the rows with logits).
extern "C" __global__ void add_residual(float* __restrict__ x, const float* __restrict__ delta, int n) {
    const size_t r = blockIdx.x;
    for (int i = threadIdx.x; i < n; i += blockDim.x) x[r * n + i] += delta[r * n + i];
}

// out[i] = rms_norm(x[rows[i]]) * weight: the final norm of the rows whose logits are wanted.
extern "C" __global__ void rms_norm_rows(const float* __restrict__ x, const int* __restrict__ rows,
                                         const float* __restrict__ weight, bf16* __restrict__ out, int n,
                                         float eps) {
    const float* xr = x + (size_t)rows[blockIdx.x] * n;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
    const float scale = rsqrtf(block_sum(ss) / (float)n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        out[(size_t)blockIdx.x * n + i] = f2bf(xr[i] * scale * weight[i]);
}
