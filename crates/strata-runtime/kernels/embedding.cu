// Token embedding lookup: one block per token gathers its row of the table into the f32 residual
// stream (`embedding_lookup`: a bf16 table; `embedding_lookup_f32`: the same for `--dtype
// float32`, an f32 table). Under tensor parallelism each GPU holds the rows
// vocab_start..vocab_start+vocab_rows and writes zeros for other tokens; the all-reduce that
// follows fills them in.

template <typename T>
__device__ __forceinline__ void embedding_rows(const T* __restrict__ table, const u32* __restrict__ tokens,
                                               float* __restrict__ out, int hidden, int vocab_start, int vocab_rows) {
    const int t = blockIdx.x;
    const int local = (int)tokens[t] - vocab_start;
    float* o = out + (size_t)t * hidden;
    if (local < 0 || local >= vocab_rows) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = 0.0f;
        return;
    }
    const T* row = table + (size_t)local * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = to_f32(row[i]);
}

extern "C" __global__ void embedding_lookup(const bf16* __restrict__ table, const u32* __restrict__ tokens,
                                            float* __restrict__ out, int hidden, int vocab_start,
                                            int vocab_rows) {
    wait_for_previous_kernel();
    embedding_rows(table, tokens, out, hidden, vocab_start, vocab_rows);
}

extern "C" __global__ void embedding_lookup_f32(const float* __restrict__ table, const u32* __restrict__ tokens,
                                                float* __restrict__ out, int hidden, int vocab_start,
                                                int vocab_rows) {
    wait_for_previous_kernel();
    embedding_rows(table, tokens, out, hidden, vocab_start, vocab_rows);
}
