// SiLU-and-multiply of the fused gate/up projection: out = silu(gate) * up, bf16 in and out.

// gate_up: [tokens, 2 * inter] (gate first); out: [tokens, inter].
extern "C" __global__ void silu_mul(const bf16* __restrict__ gate_up, bf16* __restrict__ out, int inter,
                                    long long total) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / inter, j = i % inter;
        const float g = bf2f(gate_up[t * 2 * inter + j]);
        const float u = bf2f(gate_up[t * 2 * inter + inter + j]);
        out[i] = f2bf(g / (1.0f + __expf(-g)) * u);
    }
}
