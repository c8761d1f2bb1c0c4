// Sampling support on the GPU: per-row argmax (greedy) and the f32 logits of rows the host
// samples itself, so only token ids, or only the rows that need them, cross the bus.

// One block per row of bf16/f32 logits; ties go to the lowest id, as on the CPU.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab, u32* __restrict__ ids,
                                       float* __restrict__ vals) {
    wait_for_previous_kernel();
    const float* row = logits + (size_t)blockIdx.x * vocab;
    float best = NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = row[i];
        if (v > best || (v == best && i < best_i)) { best = v; best_i = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, best, o);
        const int oi = __shfl_xor_sync(FULL_MASK, best_i, o);
        if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
    }
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = best_i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++)
            if (sv[w] > best || (sv[w] == best && si[w] < best_i)) { best = sv[w]; best_i = si[w]; }
        ids[blockIdx.x] = best_i == 0x7fffffff ? 0u : (u32)best_i;
        vals[blockIdx.x] = best;
    }
}
