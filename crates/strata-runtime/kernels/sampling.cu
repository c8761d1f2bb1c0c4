// Sampling on the GPU: per-row argmax (greedy), temperature sampling with top-k / top-p / min-p by
// the Gumbel-max trick, and the f32 logits of rows the host samples itself, so only token ids, or
// only those rows, cross the bus.

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

// A standard Gumbel variate for element i of the stream `seed`: -log(e), e = -log(u) exponential,
// u = (k + 0.5) / 2^23 uniform in (0, 1) from 23 bits of the splitmix64 finalizer of seed + i.
// Precise logs, and -log(u) for u >= 1/2 as -log1p(u - 1) (u - 1 exact): u near 1 must not give
// e = 0 (a variate of +inf, which would draw a token of any weight).
__device__ __forceinline__ float gumbel(u64 seed, u32 i) {
    u64 z = seed + (u64)(i + 1) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const float u = ((float)(u32)(z >> 41) + 0.5f) * (1.0f / 8388608.0f);
    const float e = u < 0.5f ? -logf(u) : -log1pf(u - 1.0f);
    return -logf(e);
}

// A sampled row's parameters (the host's InputLayout::sampling): 1 / temperature (f32 bits, 0 for
// the plain argmax), the seed's low and high words, top_k (0 = off), top_p and min_p (f32 bits).
#define SAMPLING_WORDS 6

// Top-k, top-p and min-p keep the tokens nearest the row's best logit: those whose distance
// (best - logit) / temperature is at most a limit. A distance is a 6.26 fixed-point key (ascending
// key = descending probability; 64 and beyond, -inf and NaN are all NO_LIMIT) and a token's
// weight exp(-distance) a 32-bit fixed-point integer, so sums do not depend on the order of
// the atomics that make them.
#define NO_LIMIT 0xffffffffu
#define LIMIT_THREADS 512
#define LIMIT_HISTS 8

__device__ __forceinline__ float sampling_distance(float logit, float best, float inv_t) {
    return __fmul_rn(__fsub_rn(best, logit), inv_t);
}

__device__ __forceinline__ u32 sampling_key(float distance) {
    return distance < 64.0f ? (u32)__fmul_rn(distance, 67108864.0f) : NO_LIMIT;
}

__device__ __forceinline__ u64 sampling_weight(float distance) {
    return distance < 64.0f ? (u64)(expf(-distance) * 4294967296.0f) : 0ull;
}

// The histograms of one 8-bit digit of the keys (one per pair of warps, against atomics' contention)
// and what warp 0's scan of them hands the block.
struct LimitScan {
    u64 weight[LIMIT_HISTS][256];
    u32 count[LIMIT_HISTS][256];
    u64 below, target;
    u32 bin, whole;
};

// The smallest key K such that the tokens with keys in (.., K], among those at most `within`,
// reach `target`: a count, or with by_mass a weight (target 0: top_p of all their weight). Found
// 8 bits at a time from the highest, stopping early when a whole bin is in (it holds one token,
// or the count is met exactly). Every thread of the block returns it.
__device__ u32 select_limit(const float* __restrict__ row, int vocab, float best, float inv_t, u32 within, bool by_mass,
                            u64 target, float top_p, LimitScan& sh) {
    u32 prefix = 0;
    u64 below = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const u32 high = shift == 24 ? 0u : NO_LIMIT << (shift + 8);
        for (int i = threadIdx.x; i < LIMIT_HISTS * 256; i += blockDim.x) {
            (&sh.weight[0][0])[i] = 0;
            (&sh.count[0][0])[i] = 0;
        }
        __syncthreads();
        const int h = (threadIdx.x >> 5) % LIMIT_HISTS;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float d = sampling_distance(row[i], best, inv_t);
            const u32 key = sampling_key(d);
            if (key > within || (key & high) != prefix) continue;
            const int b = (key >> shift) & 255;
            atomicAdd(&sh.count[h][b], 1u);
            if (by_mass) atomicAdd(&sh.weight[h][b], sampling_weight(d));
        }
        __syncthreads();
        // Warp 0 merges the histograms and finds the bin where the target is reached: lane l owns
        // bins 8l..8l+7.
        if (threadIdx.x < 32) {
            const int lane = threadIdx.x;
            u64 m[8];
            u32 c[8];
            u64 sum = 0;
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int b = 8 * lane + j;
                u32 cb = 0;
                u64 mb = 0;
#pragma unroll
                for (int k = 0; k < LIMIT_HISTS; k++) {
                    cb += sh.count[k][b];
                    mb += sh.weight[k][b];
                }
                c[j] = cb;
                m[j] = by_mass ? mb : cb;
                sum += m[j];
            }
            u64 upto = sum;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u64 t = __shfl_up_sync(FULL_MASK, upto, o);
                if (lane >= o) upto += t;
            }
            if (by_mass && target == 0) {
                const u64 total = __shfl_sync(FULL_MASK, upto, 31);
                target = (u64)ceil((double)top_p * (double)total);
                target = target < 1 ? 1 : (target > total ? total : target);
            }
            const unsigned hit = __ballot_sync(FULL_MASK, below + upto >= target);
            // No bin reaches it (it cannot happen): keep everything left.
            const int at = hit ? __ffs(hit) - 1 : 31;
            if (lane == at) {
                u64 acc = below + upto - sum;
                int j = 0;
                while (j < 7 && acc + m[j] < target) acc += m[j++];
                sh.bin = 8 * lane + j;
                sh.below = acc;
                sh.target = target;
                sh.whole = !hit || c[j] <= 1 || (!by_mass && acc + m[j] == target);
            }
        }
        __syncthreads();
        prefix |= sh.bin << shift;
        below = sh.below;
        target = sh.target;
        if (sh.whole) return prefix | ((1u << shift) - 1);
    }
    return prefix;
}

// Grid rows, LIMIT_THREADS threads: limits[row] = (the row's best logit as f32 bits, the largest key
// a token may have to be drawn), NO_LIMIT for rows without top-k, top-p or min-p. The rule is the
// CPU sampler's: the top_k best, then those with at least min_p of the best one's probability,
// then the fewest best ones holding top_p of what is left; tokens tied with the last one kept
// are kept too.
extern "C" __global__ void __launch_bounds__(LIMIT_THREADS)
    sampling_limits(const float* __restrict__ logits, int vocab, const u32* __restrict__ sampling, u32* __restrict__ limits) {
    wait_for_previous_kernel();
    __shared__ LimitScan sh;
    const float* row = logits + (size_t)blockIdx.x * vocab;
    const u32* s = sampling + SAMPLING_WORDS * blockIdx.x;
    const float inv_t = __uint_as_float(s[0]), top_p = __uint_as_float(s[4]), min_p = __uint_as_float(s[5]);
    const u32 top_k = s[3];
    const bool by_count = top_k > 0 && top_k < (u32)vocab;
    if (inv_t == 0.0f || (!by_count && top_p >= 1.0f && min_p <= 0.0f)) {
        if (threadIdx.x == 0) limits[2 * blockIdx.x + 1] = NO_LIMIT;
        return;
    }
    float best = NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) best = fmaxf(best, row[i]);
    best = block_max(best);
    u32 within = min_p > 0.0f ? sampling_key(-logf(min_p)) : NO_LIMIT;
    if (by_count) within = min(within, select_limit(row, vocab, best, inv_t, NO_LIMIT, false, top_k, 1.0f, sh));
    if (top_p < 1.0f) within = min(within, select_limit(row, vocab, best, inv_t, within, true, 0, top_p, sh));
    if (threadIdx.x == 0) {
        limits[2 * blockIdx.x] = __float_as_uint(best);
        limits[2 * blockIdx.x + 1] = within;
    }
}

// Grid (rows, ARGMAX_SLICES), 256 threads: part_vals/part_ids[row * ARGMAX_SLICES + slice].
// sampling: per row SAMPLING_WORDS parameters, or null; limits: sampling_limits' output for them.
// A row with 1 / temperature 0 takes the plain argmax; any other the argmax, over the tokens
// within its limit, of logit / temperature plus a Gumbel variate per id (of the whole vocabulary:
// vocab_start + i), which is a draw from softmax(logits / temperature) over those tokens.
extern "C" __global__ void argmax_slices(const float* __restrict__ logits, int vocab, float* __restrict__ part_vals,
                                         int* __restrict__ part_ids, const u32* __restrict__ sampling,
                                         const u32* __restrict__ limits, int vocab_start) {
    wait_for_previous_kernel();
    const float* row = logits + (size_t)blockIdx.x * vocab;
    const int per = (vocab + ARGMAX_SLICES - 1) / ARGMAX_SLICES;
    const int begin = blockIdx.y * per, end = min(vocab, begin + per);
    const u32* s = sampling ? sampling + SAMPLING_WORDS * blockIdx.x : nullptr;
    const float inv_t = s ? __uint_as_float(s[0]) : 0.0f;
    const u64 seed = s ? ((u64)s[2] << 32) | s[1] : 0ull;
    const u32 limit = inv_t != 0.0f ? limits[2 * blockIdx.x + 1] : NO_LIMIT;
    const float row_best = limit != NO_LIMIT ? __uint_as_float(limits[2 * blockIdx.x]) : 0.0f;
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
            for (int u = 0; u < 4; u++) {
                const bool kept = limit == NO_LIMIT || sampling_key(sampling_distance(v[u], row_best, inv_t)) <= limit;
                v[u] = kept ? v[u] * inv_t + gumbel(seed, (u32)(vocab_start + i + u * blockDim.x)) : NEG_INF;
            }
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

// Logit bias and grammar masks (constrained decoding) on the rows that have them, before their
// token is chosen: row r's slot is row_slot[r] (-1: none). A slot is ADJUST_HEADER words
// (has_mask, n_bias), mask_words words of allowed-token bits (bit id % 32 of word id / 32, over
// global ids; ids past them are forbidden), then max_bias (id, f32 bits) pairs. Forbidden
// tokens go to -inf; allowed ones get their bias (as the host: bias, then mask). Grid (rows,
// ADJUST_SLICES): each block a slice of the row; slice 0 also adds the biases.
#define ADJUST_HEADER 2

__device__ __forceinline__ bool token_allowed(const u32* __restrict__ mask, int mask_words, u32 id) {
    return (id >> 5) < (u32)mask_words && ((mask[id >> 5] >> (id & 31)) & 1u);
}

extern "C" __global__ void apply_row_adjust(float* __restrict__ logits, int vocab, const int* __restrict__ row_slot,
                                            const u32* __restrict__ slots, int mask_words, int max_bias,
                                            int vocab_start) {
    wait_for_previous_kernel();
    const int slot = row_slot[blockIdx.x];
    if (slot < 0) return;
    const u32* s = slots + (size_t)slot * (ADJUST_HEADER + mask_words + 2 * max_bias);
    const bool has_mask = s[0] != 0;
    const int n_bias = min((int)s[1], max_bias);
    const u32* mask = s + ADJUST_HEADER;
    const u32* bias = mask + mask_words;
    float* row = logits + (size_t)blockIdx.x * vocab;
    if (has_mask) {
        for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < vocab; i += gridDim.y * blockDim.x) {
            if (!token_allowed(mask, mask_words, (u32)(vocab_start + i))) row[i] = NEG_INF;
        }
    }
    if (blockIdx.y != 0) return;
    for (int k = threadIdx.x; k < n_bias; k += blockDim.x) {
        const u32 id = bias[2 * k];
        const int i = (int)id - vocab_start;
        // Only allowed tokens: the slices write -inf to the others, with no order between them.
        if (i >= 0 && i < vocab && (!has_mask || token_allowed(mask, mask_words, id))) {
            atomicAdd(&row[i], __uint_as_float(bias[2 * k + 1]));
        }
    }
}
