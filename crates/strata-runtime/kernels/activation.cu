// SiLU-and-multiply of the fused gate/up projection: out = silu(gate) * up, bf16 in and out
// (`silu_mul_f32`: the same for `--dtype float32`, f32 in and out; `silu_mul_fp8`: from an FP8
// GEMM's unscaled output to the next FP8 GEMM's input).

// gate_up: [tokens, 2 * inter] (gate first); out: [tokens, inter]; inter a multiple of 8.
// Grid (ceil(inter / 8 / blockDim.x), tokens): each thread does 8 values with 16-byte accesses.
extern "C" __global__ void silu_mul(const bf16* __restrict__ gate_up, bf16* __restrict__ out, int inter) {
    wait_for_previous_kernel();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= (inter >> 3)) return;
    const size_t t = blockIdx.y;
    const uint4 gv = ((const uint4*)(gate_up + t * 2 * inter))[c];
    const uint4 uv = ((const uint4*)(gate_up + t * 2 * inter + inter))[c];
    float g[8], u[8];
    unpack8(gv, g);
    unpack8(uv, u);
    u32 packed[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        packed[i] = f2bf2(silu_times(g[2 * i], u[2 * i]), silu_times(g[2 * i + 1], u[2 * i + 1]));
    }
    ((uint4*)(out + t * inter))[c] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
}

// The same shapes and grid; each thread's 8 values are two float4s of gate, of up and of out.
extern "C" __global__ void silu_mul_f32(const float* __restrict__ gate_up, float* __restrict__ out, int inter) {
    wait_for_previous_kernel();
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= (inter >> 3)) return;
    const size_t t = blockIdx.y;
    float g[8], u[8], o[8];
    load_vals(gate_up + t * 2 * inter + 8 * c, 8, g);
    load_vals(gate_up + t * 2 * inter + inter + 8 * c, 8, u);
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = silu_times(g[i], u[i]);
    store_vals(out + t * inter + 8 * c, 8, o);
}

// 8-value pieces a thread of silu_mul_fp8 holds: inter is at most 8 * SILU_FP8_PIECES * blockDim.x.
#define SILU_FP8_PIECES 4

// Between the FP8 gate/up and down GEMMs, one block a token row t, fusing three kernels bit for bit:
// gate and up as cuBLASLt left them (bf16, unscaled) times tok_scales[t] * col_scales[col], rounded
// to bf16 (fp8_scale_output); silu(gate) * up rounded to bf16 into out (silu_mul); and that row as
// E4M3 with the scale max |x| / 448 into q [tokens, inter] and q_scales[t] (fp8_quantize_rows).
// q_scales may be tok_scales: each block reads its own entry before it writes it.
extern "C" __global__ void silu_mul_fp8(const bf16* __restrict__ gate_up, const float* tok_scales,
                                        const float* __restrict__ col_scales, bf16* __restrict__ out,
                                        fp8* __restrict__ q, float* q_scales, int inter) {
    wait_for_previous_kernel();
    const size_t t = blockIdx.x;
    const float ts = tok_scales[t];
    const int pieces = inter >> 3;
    uint4 act[SILU_FP8_PIECES];
    float amax = 0.0f;
#pragma unroll
    for (int p = 0; p < SILU_FP8_PIECES; p++) {
        const int c = threadIdx.x + p * blockDim.x;
        act[p] = make_uint4(0u, 0u, 0u, 0u);
        if (c >= pieces) continue;
        float g[8], u[8];
        unpack8(((const uint4*)(gate_up + t * 2 * inter))[c], g);
        unpack8(((const uint4*)(gate_up + t * 2 * inter + inter))[c], u);
        const float* gs = col_scales + 8 * c;
        const float* us = col_scales + inter + 8 * c;
        u32 packed[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float o[2];
#pragma unroll
            for (int e = 0; e < 2; e++) {
                const int j = 2 * i + e;
                const float gj = bf2f(f2bf(g[j] * (ts * gs[j]))), uj = bf2f(f2bf(u[j] * (ts * us[j])));
                o[e] = bf2f(f2bf(silu_times(gj, uj)));
                amax = fmaxf(amax, fabsf(o[e]));
            }
            packed[i] = f2bf2(o[0], o[1]);
        }
        act[p] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
        ((uint4*)(out + t * inter))[c] = act[p];
    }
    amax = block_max(amax);
    const float qs = e4m3_row_scale(amax);
    const float inv = 1.0f / qs;
    if (threadIdx.x == 0) q_scales[t] = qs;
#pragma unroll
    for (int p = 0; p < SILU_FP8_PIECES; p++) {
        const int c = threadIdx.x + p * blockDim.x;
        if (c >= pieces) continue;
        float v[8];
        unpack8(act[p], v);
        ((uint2*)(q + t * inter))[c] = make_uint2(e4m3x4(v, inv), e4m3x4(v + 4, inv));
    }
}
