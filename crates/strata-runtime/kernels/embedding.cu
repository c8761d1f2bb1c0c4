// Token embedding lookup: one block per token gathers its bf16 row into the f32 residual stream.

extern "C" __global__ void embedding_lookup(const bf16* __restrict__ table, const u32* __restrict__ tokens,
                                            float* __restrict__ out, int hidden) {
    const int t = blockIdx.x;
    const bf16* row = table + (size_t)tokens[t] * hidden;
    float* o = out + (size_t)t * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = bf2f(row[i]);
}
