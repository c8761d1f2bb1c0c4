// SiLU-and-multiply of the fused gate/up projection: out = silu(gate) * up, bf16 in and out
// (`silu_mul_f32`: the same for `--dtype float32`, f32 in and out).

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
        packed[i] = (u32)f2bf(silu_times(g[2 * i], u[2 * i])) | ((u32)f2bf(silu_times(g[2 * i + 1], u[2 * i + 1])) << 16);
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
