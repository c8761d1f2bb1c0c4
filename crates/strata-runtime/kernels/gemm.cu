// Matrix products in one fixed summation order (`--deterministic`): y[t, n] = x[t, k] · w[n, k]ᵀ,
// every output element summed the same way whatever n, t, or the TP split of k.
//
// k is cut into `chunks` equal parts (a power of two, at most FO_MAX_CHUNKS; k / chunks a
// multiple of 8). One warp per output row and group of up to FO_TOKENS tokens: lane l sums
// elements 8l..8l+7, +256, ... of each chunk in order, the warp adds its lanes by a butterfly,
// and the chunk sums are added as a pairwise tree. A TP rank holding chunks [r*c, (r+1)*c) of a
// row-parallel weight computes the subtree of its chunks; `sum_ranks` adds the ranks' subtrees
// as the tree's top levels, so the result equals one GPU's bit for bit.

#define FO_TOKENS 8
#define FO_MAX_CHUNKS 8
#define FO_WARPS 8

__device__ __forceinline__ void unpack8(uint4 v, float* out) {
    const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

// Adds vals[0..count) (count a power of two, at most FO_MAX_CHUNKS) as a pairwise tree into vals[0].
__device__ __forceinline__ void tree_sum(float* vals, int count) {
#pragma unroll
    for (int s = 1; s < FO_MAX_CHUNKS; s <<= 1) {
#pragma unroll
        for (int c = 0; c + s < FO_MAX_CHUNKS; c += 2 * s) {
            if (c + s < count) vals[c] += vals[c + s];
        }
    }
}

// Grid (ceil(n / FO_WARPS), ceil(t / FO_TOKENS)), FO_WARPS * 32 threads. y is bf16 unless out_f32.
extern "C" __global__ void __launch_bounds__(FO_WARPS * 32)
    gemm_fixed_order(const bf16* __restrict__ w, const bf16* __restrict__ x, void* __restrict__ y, int n, int k,
                     int t, int chunks, int out_f32) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int row = blockIdx.x * FO_WARPS + warp;
    const int t0 = blockIdx.y * FO_TOKENS;
    if (row >= n) return;
    const int nt = min(FO_TOKENS, t - t0);
    const int kc = k / chunks;
    const bf16* wr = w + (size_t)row * k;
    const bf16* xr = x + (size_t)t0 * k;
    float sums[FO_TOKENS][FO_MAX_CHUNKS];
#pragma unroll
    for (int c = 0; c < FO_MAX_CHUNKS; c++) {
        if (c >= chunks) break;
        float acc[FO_TOKENS];
#pragma unroll
        for (int j = 0; j < FO_TOKENS; j++) acc[j] = 0.0f;
        for (int off = lane * 8; off < kc; off += 256) {
            const int e = c * kc + off;
            float wf[8];
            unpack8(*(const uint4*)(wr + e), wf);
#pragma unroll
            for (int j = 0; j < FO_TOKENS; j++) {
                if (j < nt) {
                    float xf[8];
                    unpack8(*(const uint4*)(xr + (size_t)j * k + e), xf);
#pragma unroll
                    for (int d = 0; d < 8; d++) acc[j] = fmaf(wf[d], xf[d], acc[j]);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < FO_TOKENS; j++) sums[j][c] = warp_sum(acc[j]);
    }
    if (lane != 0) return;
#pragma unroll
    for (int j = 0; j < FO_TOKENS; j++) {
        if (j < nt) {
            tree_sum(sums[j], chunks);
            const size_t at = (size_t)(t0 + j) * n + row;
            if (out_f32) {
                ((float*)y)[at] = sums[j][0];
            } else {
                ((bf16*)y)[at] = f2bf(sums[j][0]);
            }
        }
    }
}

// out[i] = the pairwise tree over ranks of parts[r * count + i] (ranks a power of two, at most
// FO_MAX_CHUNKS): the top levels of gemm_fixed_order's chunk tree across TP ranks.
extern "C" __global__ void sum_ranks(const float* __restrict__ parts, float* __restrict__ out, long long count,
                                     int ranks) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (long long)gridDim.x * blockDim.x) {
        float vals[FO_MAX_CHUNKS];
#pragma unroll
        for (int r = 0; r < FO_MAX_CHUNKS; r++) vals[r] = r < ranks ? parts[r * count + i] : 0.0f;
        tree_sum(vals, ranks);
        out[i] = vals[0];
    }
}
