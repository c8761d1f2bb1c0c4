// Token embedding lookup: one block per token gathers its bf16 row into the f32 residual stream.
// Under tensor parallelism each GPU holds the rows vocab_start..vocab_start+vocab_rows and writes
// zeros for other tokens; the all-reduce that follows fills them in.

extern "C" __global__ void embedding_lookup(const bf16* __restrict__ table, const u32* __restrict__ tokens,
                                            float* __restrict__ out, int hidden, int vocab_start,
                                            int vocab_rows) {
    wait_for_previous_kernel();
    const int t = blockIdx.x;
    const int local = (int)tokens[t] - vocab_start;
    float* o = out + (size_t)t * hidden;
    if (local < 0 || local >= vocab_rows) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = 0.0f;
        return;
    }
    const bf16* row = table + (size_t)local * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = bf2f(row[i]);
}
