// Shared by every kernel family: bf16 and fp8 e4m3 conversions (inline PTX or bit manipulation,
// so NVRTC needs no CUDA headers), warp reductions. Prepended to each .cu source before compiling.
typedef unsigned short bf16;
typedef unsigned char fp8;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

// Programmatic dependent launch (sm_90 on; strata launches every kernel with it there): a kernel
// may start while the one before it finishes. Each kernel calls this before it reads anything an
// earlier kernel wrote or writes anything (only weight reads, which no kernel writes, may come
// first). It first lets the next kernel launch, so a chain of small kernels (RoPE, attention,
// its merge) has the GEMV after it resident and loading weights while they run; the wait then
// blocks until the previous kernel has finished and its writes are visible, so the order of
// every kernel's reads and writes is the stream's. STRATA_PDL=late (kernels.rs) lets the next
// kernel launch only after the wait, for measurements.
__device__ __forceinline__ void wait_for_previous_kernel() {
#if __CUDA_ARCH__ >= 900
#ifdef LAUNCH_NEXT_LATE
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#else
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
#endif
}

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((u32)x) << 16); }

// Round to nearest even; NaN stays NaN. One cvt on sm_80 and later, where the integer rounding
// took five instructions a value; sm_75 (compute_75, a Turing card) keeps the integer rounding.
__device__ __forceinline__ bf16 f2bf(float f) {
#if __CUDA_ARCH__ >= 800
    unsigned short b;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(b) : "f"(f));
    return (bf16)b;
#else
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
#endif
}

// lo and hi rounded as f2bf does and packed, lo in the low half: one cvt for the pair.
__device__ __forceinline__ u32 f2bf2(float lo, float hi) {
#if __CUDA_ARCH__ >= 800
    u32 b;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(b) : "f"(hi), "f"(lo));
    return b;
#else
    return (u32)f2bf(lo) | ((u32)f2bf(hi) << 16);
#endif
}

// silu(g) * u, the activation of a gate/up pair (the division approximate: one reciprocal).
__device__ __forceinline__ float silu_times(float g, float u) { return __fdividef(g, 1.0f + __expf(-g)) * u; }

// Eight bf16 packed in 16 bytes (lowest first) as f32.
__device__ __forceinline__ void unpack8(uint4 v, float* out) {
    const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        out[2 * i] = __uint_as_float(words[i] << 16);
        out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
    }
}

// Eight f32 rounded to bf16 (f2bf2) and packed in 16 bytes, lowest first: unpack8's inverse.
__device__ __forceinline__ uint4 pack8(const float (&v)[8]) {
    return make_uint4(f2bf2(v[0], v[1]), f2bf2(v[2], v[3]), f2bf2(v[4], v[5]), f2bf2(v[6], v[7]));
}

// n (at most 8) consecutive bf16 at p as f32 into out[0..n): one 16-, 8- or 4-byte load when n is
// 8, 4 or 2 (p then aligned to 2n bytes), one load a value otherwise.
__device__ __forceinline__ void load_bf16s(const bf16* __restrict__ p, int n, float (&out)[8]) {
    u32 w[4] = {0u, 0u, 0u, 0u};
    if (n == 8) {
        const uint4 q = *(const uint4*)p;
        w[0] = q.x, w[1] = q.y, w[2] = q.z, w[3] = q.w;
    } else if (n == 4) {
        const uint2 q = *(const uint2*)p;
        w[0] = q.x, w[1] = q.y;
    } else if (n == 2) {
        w[0] = *(const u32*)p;
    } else {
#pragma unroll
        for (int e = 0; e < 8; e++)
            if (e < n) w[e >> 1] |= (u32)p[e] << (16 * (e & 1));
    }
#pragma unroll
    for (int e = 0; e < 8; e++) out[e] = __uint_as_float((e & 1) ? (w[e >> 1] & 0xffff0000u) : (w[e >> 1] << 16));
}

// in[0..n) rounded to bf16 and stored at p, as load_bf16s reads them.
__device__ __forceinline__ void store_bf16s(bf16* __restrict__ p, int n, const float (&in)[8]) {
    if (n == 8) {
        *(uint4*)p = pack8(in);
        return;
    }
    u32 w[4];
#pragma unroll
    for (int i = 0; i < 4; i++) w[i] = 2 * i < n ? f2bf2(in[2 * i], in[2 * i + 1]) : 0u;
    if (n == 4) {
        *(uint2*)p = make_uint2(w[0], w[1]);
    } else if (n == 2) {
        *(u32*)p = w[0];
    } else {
#pragma unroll
        for (int e = 0; e < 8; e++)
            if (e < n) p[e] = (bf16)(w[e >> 1] >> (16 * (e & 1)));
    }
}

// Activations of either element type T (bf16, or float for `--dtype float32`), one overload each.
// A value of T as f32.
__device__ __forceinline__ float to_f32(bf16 x) { return bf2f(x); }
__device__ __forceinline__ float to_f32(float x) { return x; }

// f32 as a T: rounded to bf16, or as is.
template <typename T>
__device__ T from_f32(float v);
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float v) { return f2bf(v); }
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }

// v as a T would hold it, back in f32: bf16-rounded, or v itself.
template <typename T>
__device__ __forceinline__ float held_as(float v) { return to_f32(from_f32<T>(v)); }

// n (at most 8) consecutive values of T at p as f32 into out[0..n): bf16 as load_bf16s; float
// with one 32-, 16- or 8-byte load when n is 8, 4 or 2 (p then aligned to 4n bytes, 16 for n 8),
// one load a value otherwise. out[n..8) is zero.
__device__ __forceinline__ void load_vals(const bf16* __restrict__ p, int n, float (&out)[8]) { load_bf16s(p, n, out); }
__device__ __forceinline__ void load_vals(const float* __restrict__ p, int n, float (&out)[8]) {
#pragma unroll
    for (int e = 0; e < 8; e++) out[e] = 0.0f;
    if (n == 8) {
        const float4 a = ((const float4*)p)[0], b = ((const float4*)p)[1];
        out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
        out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
    } else if (n == 4) {
        const float4 a = *(const float4*)p;
        out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    } else if (n == 2) {
        const float2 a = *(const float2*)p;
        out[0] = a.x, out[1] = a.y;
    } else {
#pragma unroll
        for (int e = 0; e < 8; e++)
            if (e < n) out[e] = p[e];
    }
}

// in[0..n) stored at p as T, as load_vals reads them (bf16: store_bf16s, rounded).
__device__ __forceinline__ void store_vals(bf16* __restrict__ p, int n, const float (&in)[8]) { store_bf16s(p, n, in); }
__device__ __forceinline__ void store_vals(float* __restrict__ p, int n, const float (&in)[8]) {
    if (n == 8) {
        ((float4*)p)[0] = make_float4(in[0], in[1], in[2], in[3]);
        ((float4*)p)[1] = make_float4(in[4], in[5], in[6], in[7]);
    } else if (n == 4) {
        *(float4*)p = make_float4(in[0], in[1], in[2], in[3]);
    } else if (n == 2) {
        *(float2*)p = make_float2(in[0], in[1]);
    } else {
#pragma unroll
        for (int e = 0; e < 8; e++)
            if (e < n) p[e] = in[e];
    }
}

// The rotary embedding of one element of a pair: v rotated by the angle whose (cos, sin) is cs,
// its partner in the pair being `partner`; `first` for the pair's first element.
__device__ __forceinline__ float rope_rotate(float v, float partner, bool first, float2 cs) {
    return first ? v * cs.x - partner * cs.y : partner * cs.y + v * cs.x;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// warp_op (warp_sum, warp_max) over the whole block (blockDim.x a multiple of 32, at most 1024),
// `none` its identity; every thread gets it.
template <float (*warp_op)(float)>
__device__ float block_reduce(float v, float none) {
    __shared__ float partial[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_op(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float s = lane < (int)(blockDim.x >> 5) ? partial[lane] : none;
        s = warp_op(s);
        if (lane == 0) total = s;
    }
    __syncthreads();
    float r = total;
    __syncthreads();
    return r;
}

__device__ float block_sum(float v) { return block_reduce<warp_sum>(v, 0.0f); }
__device__ float block_max(float v) { return block_reduce<warp_max>(v, NEG_INF); }

// FP8 E4M3 (OCP "fn": no infinities, max 448), ties to even, saturating: the CPU cache's rule.
__device__ __forceinline__ fp8 f2e4m3(float x) {
    u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
    float a = fabsf(x);
    if (isnan(a)) return (fp8)(sign | 0x7fu);
    if (a >= 448.0f) return (fp8)(sign | 0x7eu);
    if (a < 1.0f / 64.0f) return (fp8)(sign | (u32)rintf(a * 512.0f));
    u32 bits = __float_as_uint(a);
    u32 exp = (bits >> 23) + 7u - 127u;
    u32 mant = bits & 0x7fffffu;
    u32 m3 = mant >> 20;
    u32 rem = mant & 0xfffffu;
    if (rem > 0x80000u || (rem == 0x80000u && (m3 & 1u))) {
        m3 += 1u;
        if (m3 == 8u) { m3 = 0u; exp += 1u; }
    }
    return (fp8)(sign | (exp << 3) | m3);
}

// The scale of a row of activations quantized to E4M3 for an FP8 GEMM: max |x| / 448, or 1 for a
// zero or non-finite maximum (fp8_quantize_rows and the kernels that fuse it).
__device__ __forceinline__ float e4m3_row_scale(float amax) {
    return amax > 0.0f && isfinite(amax) ? amax / 448.0f : 1.0f;
}

// v[0..4) times inv as four E4M3 bytes, v[0] lowest.
__device__ __forceinline__ u32 e4m3x4(const float* v, float inv) {
    u32 bytes = 0u;
#pragma unroll
    for (int e = 0; e < 4; e++) bytes |= (u32)f2e4m3(v[e] * inv) << (8 * e);
    return bytes;
}

__device__ __forceinline__ float e4m32f(fp8 b) {
    u32 e = (b >> 3) & 0xfu, m = b & 7u;
    float v = e == 0u ? (float)m * (1.0f / 512.0f) : __uint_as_float(((e + 120u) << 23) | (m << 20));
    return (b & 0x80u) ? -v : v;
}

// d += a b for one m16n8k16 tile of bf16 (or f16) operands (A row-major, B column-major).
template <bool F16>
__device__ __forceinline__ void mma_16x8x16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#if __CUDA_ARCH__ >= 800
    if (F16) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
            "{%0, %1, %2, %3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    }
#endif
}

#if __CUDA_ARCH__ >= 800
// Two f32 as a bf16 (or f16) pair, lo in the low half, round to nearest even.
template <bool F16>
__device__ __forceinline__ u32 pack_pair(float lo, float hi) {
    u32 r;
    if (F16) {
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    } else {
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    }
    return r;
}
#endif

// ---- cp.async (sm_80 on): global to shared memory without passing through registers ----
// 16 bytes from global to shared memory, asynchronously; `bytes` 0 writes zeros instead.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(bytes) : "memory");
}
// 4 bytes from global to shared memory, asynchronously; `bytes` 0 writes zeros instead.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, int bytes) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(s), "l"(gmem), "r"(bytes) : "memory");
}
// Four 8x8 matrices of 16-bit values from shared memory (ldmatrix .x4): lane l gives the address
// of row l % 8 of matrix l / 8 (16 bytes, 16-byte aligned); register i holds matrix i, lane l
// its row l / 4, values 2 (l % 4) and 2 (l % 4) + 1: an mma.sync A or B fragment as it wants them.
__device__ __forceinline__ uint4 ldmatrix_x4(const void* smem) {
    uint4 r;
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "r"(a));
    return r;
}

// ldmatrix_x4 transposed (.trans): lane l's register i holds matrix i's column l / 4, rows
// 2 (l % 4) and 2 (l % 4) + 1: a B fragment from a row-major [k][n] tile.
__device__ __forceinline__ uint4 ldmatrix_x4_trans(const void* smem) {
    uint4 r;
    const unsigned a = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "r"(a));
    return r;
}

// A TMA tensor map (CUtensorMap, tma.rs's TmaMap), as a `__grid_constant__` kernel parameter.
struct __align__(64) TmaMap {
    unsigned long long words[16];
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// wgmma (sm_90a only: quant.cu compiles for it on a 9.0 GPU, every family under
// STRATA_KERNEL_ARCH=compute_90a).
// A shared-memory operand of 8-row groups of 128-byte rows, 16-byte chunk c of row r stored at
// c ^ (r % 8) (the 128-byte swizzle), K-major, the groups 1,024 bytes apart, from a 1,024-byte
// aligned base; k16 steps advance the start by 32 bytes.
__device__ __forceinline__ unsigned long long wgmma_desc_sw128(const void* smem) {
    const unsigned long long a = (unsigned)__cvta_generic_to_shared(smem);
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}
// The 1,024-byte aligned start of a kernel's dynamic shared memory `dynamic` (wgmma's 128-byte
// swizzle wants it), after checking the launch gave at least `needed` bytes and `threads`
// threads a block: a launch with less traps.
__device__ __forceinline__ unsigned char* aligned_dynamic_shared(unsigned char* dynamic, unsigned needed,
                                                                unsigned threads) {
    const unsigned at = (unsigned)__cvta_generic_to_shared(dynamic);
    unsigned bytes;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
    if (bytes < needed || blockDim.x != threads) __trap();
    return dynamic + ((1024 - (at & 1023)) & 1023);
}
// Orders the accumulators' register writes before the warpgroup's next wgmma.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Keeps the compiler from moving reads or writes of the accumulators across the wgmma in flight
// (no instruction: the registers are only marked read and written here).
template <int N>
__device__ __forceinline__ void wgmma_hold(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
// mbarriers in shared memory (addresses from __cvta_generic_to_shared), for warps that hand
// shared-memory stages to each other without a block barrier.
__device__ __forceinline__ void mbarrier_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive(unsigned bar) {
    unsigned long long state;
    asm volatile("mbarrier.arrive.shared::cta.b64 %0, [%1];" : "=l"(state) : "r"(bar) : "memory");
}
// Arrives on `bar` once this thread's cp.async copies so far have landed (counted in the
// barrier's init count: .noinc).
__device__ __forceinline__ void mbarrier_arrive_after_copies(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
// Waits until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(unsigned bar, unsigned parity) {
    asm volatile("{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 "@!done bra WAIT;\n}\n" ::"r"(bar),
                 "r"(parity)
                 : "memory");
}
// Arrives on `bar` and adds `bytes` to the transactions its phase waits for (TMA copies).
__device__ __forceinline__ void mbarrier_expect_tx(unsigned bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
// Makes mbarrier initializations visible to the async proxy (TMA) before their first use.
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
// TMA: the box at coordinates (c0 innermost, c1) of the tensor `map` describes, into `smem`
// as the map lays it out, completing its bytes on mbarrier `bar`.
__device__ __forceinline__ void tma_load_2d(void* smem, const TmaMap* map, int c0, int c1, unsigned bar) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
            "r"(dst),
        "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(bar)
        : "memory");
}
// Makes this thread's shared-memory stores (plain and cp.async) visible to wgmma's reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// d += A (64 x 16, bf16) B (16 x 128, bf16), both K-major in shared memory: thread i of the
// warpgroup holds rows 16 (i / 32) + (i % 32) / 4 (+ 8) and columns 8 j + 2 (i % 4) (+ 1) of
// each n8 chunk j in d[4 j .. 4 j + 3], as an m16n8 accumulator.
__device__ __forceinline__ void wgmma_m64n128k16_bf16(float (&d)[64], unsigned long long a, unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, %64, %65, p, 1, 1, 0, 0;\n}\n"
                 :
                   "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "l"(a), "l"(b), "r"(1));
}
// d = A (64 x 16) B (16 x 256) + (accumulate ? d : 0), both bf16 K-major in shared memory, d as
// wgmma_m64n256k16_bf16_rs.
__device__ __forceinline__ void wgmma_m64n256k16_bf16(float (&d)[128], unsigned long long a, unsigned long long b,
                                                      int accumulate = 1) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
                 "}, %128, %129, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
                   "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "l"(a), "l"(b), "r"(accumulate));
}
// Waits until at most one of the warpgroup's committed wgmma groups is still in flight.
__device__ __forceinline__ void wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
// d += A (64 x 16, bf16, from registers) B (16 x 256, bf16, K-major in shared memory): warp w of
// the warpgroup gives rows 16 w.. of A as an mma.sync m16n8k16 A fragment (a[0]: row g, columns
// 2c, 2c + 1; a[1]: row g + 8; a[2], a[3]: the same rows, columns + 8; g = lane / 4, c = lane % 4),
// and holds d as wgmma_m64n128k16_bf16 does, for 32 n8 chunks. a must stay unchanged until the
// group that holds this product has been waited for.
__device__ __forceinline__ void wgmma_m64n256k16_bf16_rs(float (&d)[128], const u32 (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, "
                 "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, "
                 "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
                 "}, {%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
                   "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
                   "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
                   "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
                   "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
// The same over 64, 128 and 192 tokens of B (the narrower wide tiles): d as above, for 8, 16
// and 24 n8 chunks.
__device__ __forceinline__ void wgmma_m64n64k16_bf16_rs(float (&d)[32], const u32 (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
                 "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
__device__ __forceinline__ void wgmma_m64n128k16_bf16_rs(float (&d)[64], const u32 (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
                 "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
__device__ __forceinline__ void wgmma_m64n192k16_bf16_rs(float (&d)[96], const u32 (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %101, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n192k16.f32.bf16.bf16 {"
                 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
                 "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
                 "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
                 "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, "
                 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, "
                 "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
                 "}, {%96, %97, %98, %99}, %100, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
                   "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
                   "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
                   "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
                   "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
                   "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
                   "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
                   "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
                   "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
                   "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
// wgmma_m64n{NT}k16_bf16_rs by the tile's tokens.
template <int NT>
__device__ __forceinline__ void wgmma_bf16_rs(float (&d)[NT / 2], const u32 (&a)[4], unsigned long long b) {
    if constexpr (NT == 64) {
        wgmma_m64n64k16_bf16_rs(d, a, b);
    } else if constexpr (NT == 128) {
        wgmma_m64n128k16_bf16_rs(d, a, b);
    } else if constexpr (NT == 192) {
        wgmma_m64n192k16_bf16_rs(d, a, b);
    } else {
        static_assert(NT == 256, "wgmma tiles of 64, 128, 192 or 256 tokens");
        wgmma_m64n256k16_bf16_rs(d, a, b);
    }
}
#endif

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// Waits until at most `pending` (0 to 3) of this thread's groups are still in flight.
__device__ __forceinline__ void cp_async_wait(int pending) {
    if (pending <= 0) {
        asm volatile("cp.async.wait_group 0;" ::: "memory");
    } else if (pending >= 3) {
        asm volatile("cp.async.wait_group 3;" ::: "memory");
    } else if (pending == 2) {
        asm volatile("cp.async.wait_group 2;" ::: "memory");
    } else {
        asm volatile("cp.async.wait_group 1;" ::: "memory");
    }
}
