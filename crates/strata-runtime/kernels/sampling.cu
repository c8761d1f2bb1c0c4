// Sampling on the GPU: per-row argmax (greedy), temperature sampling by the Gumbel-max trick, and
// the f32 logits of rows the host samples itself, so only token ids, or only those rows, cross the bus.

// Argmax in two kernels, ties to the lowest id as on the CPU: ARGMAX_SLICES blocks a row each
// find the best of one slice of the vocabulary (one block alone would read a 128k-word row at a
// single SM's speed), then one warp a row merges the slices.
#define ARGMAX_SLICES 32

__device__ __forceinline__ void keep_best(float& best, int& best_i, float v, int i) {
    if (v > best || (v == best && i < best_i)) { best = v; best_i = i; }
}

// The best of the warp's (best, best_i), in every lane.
__device__ __forceinline__ void warp_keep_best(float& best, int& best_i) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, best, o);
        const int oi = __shfl_xor_sync(FULL_MASK, best_i, o);
        keep_best(best, best_i, ov, oi);
    }
}

// A standard Gumbel variate for element i of the stream `seed`: -log(-log(u)), u uniform in (0, 1)
// from the splitmix64 finalizer of seed + i (24 bits).
__device__ __forceinline__ float gumbel(u64 seed, u32 i) {
    u64 z = seed + (u64)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = ((float)(u32)(z >> 40) + 0.5f) * (1.0f / 16777216.0f);
    return -__logf(-__logf(u));
}

// Grid (rows, ARGMAX_SLICES), 256 threads: part_vals/part_ids[row * ARGMAX_SLICES + slice].
// sampling: per row (1 / temperature as f32 bits, seed low word, seed high word), or null. A row
// with 1 / temperature 0 takes the plain argmax; any other the argmax of logit / temperature plus
// a Gumbel variate per id (of the whole vocabulary: vocab_start + i), which is a draw from
// softmax(logits / temperature).
extern "C" __global__ void argmax_slices(const float* __restrict__ logits, int vocab, float* __restrict__ part_vals,
                                         int* __restrict__ part_ids, const u32* __restrict__ sampling,
                                         int vocab_start) {
    wait_for_previous_kernel();
    const float* row = logits + (size_t)blockIdx.x * vocab;
    const int per = (vocab + ARGMAX_SLICES - 1) / ARGMAX_SLICES;
    const int begin = blockIdx.y * per, end = min(vocab, begin + per);
    const u32* s = sampling ? sampling + 3 * blockIdx.x : nullptr;
    const float inv_t = s ? __uint_as_float(s[0]) : 0.0f;
    const u64 seed = s ? ((u64)s[2] << 32) | s[1] : 0ull;
    float best = NEG_INF;
    int best_i = 0x7fffffff;
    // Four loads in flight a thread.
    for (int i = begin + threadIdx.x; i < end; i += 4 * blockDim.x) {
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            const int at = i + u * blockDim.x;
            v[u] = at < end ? row[at] : NEG_INF;
        }
        if (inv_t != 0.0f) {
#pragma unroll
            for (int u = 0; u < 4; u++) v[u] = v[u] * inv_t + gumbel(seed, (u32)(vocab_start + i + u * blockDim.x));
        }
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (i + u * (int)blockDim.x < end) keep_best(best, best_i, v[u], i + u * blockDim.x);
    }
    warp_keep_best(best, best_i);
    __shared__ float sv[32];
    __shared__ int si[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { sv[warp] = best; si[warp] = best_i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) keep_best(best, best_i, sv[w], si[w]);
        const size_t at = (size_t)blockIdx.x * ARGMAX_SLICES + blockIdx.y;
        part_vals[at] = best;
        part_ids[at] = best_i;
    }
}

// Grid rows, 32 threads: ids[row] (0 when every logit is NaN) and its logit (for sampled rows,
// the logit / temperature plus its Gumbel variate).
extern "C" __global__ void argmax_merge(const float* __restrict__ part_vals, const int* __restrict__ part_ids,
                                        u32* __restrict__ ids, float* __restrict__ vals) {
    wait_for_previous_kernel();
    float best = NEG_INF;
    int best_i = 0x7fffffff;
    for (int s = threadIdx.x; s < ARGMAX_SLICES; s += 32) {
        const size_t at = (size_t)blockIdx.x * ARGMAX_SLICES + s;
        keep_best(best, best_i, part_vals[at], part_ids[at]);
    }
    warp_keep_best(best, best_i);
    if (threadIdx.x == 0) {
        ids[blockIdx.x] = best_i == 0x7fffffff ? 0u : (u32)best_i;
        vals[blockIdx.x] = best;
    }
}

// Overlapped decoding: a decode step starts before the host has read the step before it, so its
// input tokens are that step's chosen ids (argmax or sampled), taken here on the device. The host staged the
// row of each token's sequence in the step before in place of the token: tokens[i] = ids[tokens[i]]
// for i < n (ids as argmax_merge writes them, still those of the step before). One thread a token.
extern "C" __global__ void tokens_from_argmax(int* __restrict__ tokens, const unsigned* __restrict__ ids, int n) {
    wait_for_previous_kernel();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) tokens[i] = (int)ids[tokens[i]];
}
