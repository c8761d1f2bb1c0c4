// Quantized GGUF matrices read where they lie: block decoders for Q4_0, Q4_1, Q8_0, Q4_K, Q5_K
// and Q6_K, the decode GEMVs over them, dequantization to bf16 and the embedding lookup.
//
// Layout (strata-model's weights.rs writes it): a segment of n rows and k columns (k a multiple
// of the block) holds its rows' blocks row after row. Q4_K and Q5_K keep the file's blocks (144
// and 176 bytes, so 16-byte aligned). Q4_0, Q4_1, Q8_0 and Q6_K move each block's f16 fields
// into a plane after all the blocks' other bytes (their bodies, then 16-byte aligned): the
// file's bytes, repacked, the same size.
//
// A thread takes a unit at a time: a Q4_0/Q4_1/Q8_0 block (32 values), a Q4_K/Q5_K pair of
// sub-blocks that share quant bytes (64), or a quarter of a Q6_K block (64). The GEMVs multiply
// its integer quants with int8 activations four at a time (`dot`, dp4a: quantize_q8 turns x into
// 32-value blocks first, as llama.cpp's MMVQ does); dequantization and the embedding decode it to
// floats (`decode`), 8 consecutive columns at a time. Normed inputs carry the norm's weights in x
// (norm kernels with weights, or the residual GEMV scaling res_bf16): quantized matrices cannot
// fold them in.

typedef unsigned char u8;
typedef signed char int8_t;

// ---- int8 activations: what the GEMVs read as x ----
// quantize_q8 cuts x (bf16 [t, k], k a multiple of 32) into blocks of 32 values: q = round(x *
// 127 / amax) as int8, and per block {amax / 127, the sum of its x}. A weight block's offset or
// min then costs one multiply by that sum, exactly; only the products round x. Two-pass (the
// `high` activation precision, as the CPU's): a second int8 block quantizes what the first left
// (x - scale * q), so x carries ~14 bits, at twice the dp4a work; its blocks follow the first
// pass's ([t, k] bytes after [t, k] bytes, [t, k / 32] scales after the pairs).

#define QK8 32

struct Q8Rows {
    const int8_t* q;   // [t, k]
    const float2* s;   // [t, k / QK8]: {scale, sum of x}
    const int8_t* q2;  // the residual pass, or null
    const float* s2;   // its scales
    int k;

    __device__ static Q8Rows of(const int8_t* xq, const float2* xs, int k, int t, int two_pass) {
        const size_t values = (size_t)t * k;
        return {xq, xs, two_pass ? xq + values : nullptr, two_pass ? (const float*)(xs + values / QK8) : nullptr, k};
    }
    // The block of token j holding column col.
    __device__ __forceinline__ float2 scale(int j, int col) const { return __ldg(s + ((size_t)j * k + col) / QK8); }
    // Σ a · x over the 16 values of token j from col (a's bytes as signed; minus 32 each when
    // minus_32: Q6_K's offset by a second dp4a), in x's units.
    __device__ __forceinline__ float dot16(const int (&a)[4], int j, int col, bool minus_32) const;
    // Σ a · x over the block of token j at col, lo its first 16 values and hi the rest.
    __device__ __forceinline__ float dot32(const int (&lo)[4], const int (&hi)[4], int j, int col) const;
};

// c + the sum of the four byte products of a and b, as signed bytes.
__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// sum over i of a[i] · b's word i, from c.
__device__ __forceinline__ int dp16(const int (&a)[4], int4 b, int c) {
    return dp4a(a[3], b.w, dp4a(a[2], b.z, dp4a(a[1], b.y, dp4a(a[0], b.x, c))));
}

// Each byte q (0..15) of v as the signed byte q - 8: q ^ 8 is q - 8 as a 4-bit two's complement,
// and bit 3 copied into bits 4..7 extends its sign (8 * 30 = 0xF0 carries into no other byte).
__device__ __forceinline__ int minus8(u32 v) {
    const u32 t = v ^ 0x08080808u;
    return (int)(t | ((t & 0x08080808u) * 30u));
}

// Each byte q (0..63) of v as the signed byte q - 32, the same way from 6 bits (32 * 6 = 0xC0).
__device__ __forceinline__ int minus32(u32 v) {
    const u32 t = v ^ 0x20202020u;
    return (int)(t | ((t & 0x20202020u) * 6u));
}

__device__ __forceinline__ float Q8Rows::dot16(const int (&a)[4], int j, int col, bool minus_32) const {
    const int thirty_two[4] = {0x20202020, 0x20202020, 0x20202020, 0x20202020};
    const size_t at = (size_t)j * k + col;
    const int4 w = __ldg((const int4*)(q + at));
    int p = dp16(a, w, 0);
    if (minus_32) p -= dp16(thirty_two, w, 0);
    float r = __ldg(s + at / QK8).x * (float)p;
    if (q2) {
        const int4 w2 = __ldg((const int4*)(q2 + at));
        int p2 = dp16(a, w2, 0);
        if (minus_32) p2 -= dp16(thirty_two, w2, 0);
        r = fmaf(__ldg(s2 + at / QK8), (float)p2, r);
    }
    return r;
}

__device__ __forceinline__ float Q8Rows::dot32(const int (&lo)[4], const int (&hi)[4], int j, int col) const {
    const size_t at = (size_t)j * k + col;
    float r = __ldg(s + at / QK8).x *
              (float)dp16(hi, __ldg((const int4*)(q + at + 16)), dp16(lo, __ldg((const int4*)(q + at)), 0));
    if (q2) {
        const int p2 = dp16(hi, __ldg((const int4*)(q2 + at + 16)), dp16(lo, __ldg((const int4*)(q2 + at)), 0));
        r = fmaf(__ldg(s2 + at / QK8), (float)p2, r);
    }
    return r;
}

// 0x4B000000 | q is the float 2^23 + q: a byte to a float by one permute and one add.
#define MAGIC 8388608.0f

__device__ __forceinline__ float half_to_f32(u32 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(h & 0xffffu)));
    return f;
}

// Byte j of w (0..255) less `offset`, as a float: one permute and one add.
__device__ __forceinline__ float byte_as_float(u32 w, int j, float offset = 0.0f) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, j | 0x7540)) - (MAGIC + offset);
}

// v[0..4) = (byte j of m - offset) * scale + bias, each byte at most 255.
__device__ __forceinline__ void four_values(u32 m, float offset, float scale, float bias, float* v) {
#pragma unroll
    for (int j = 0; j < 4; j++) {
        v[j] = fmaf(byte_as_float(m, j, offset), scale, bias);
    }
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K block from its packed bytes
// q0 (bytes 0..3), q1 (4..7) and q2 (8..11): ggml's get_scale_min_k4.
__device__ __forceinline__ void k4_scale_min(u32 q0, u32 q1, u32 q2, int j, float& sc, float& mn) {
    if (j < 4) {
        sc = (float)((q0 >> (8 * j)) & 63u);
        mn = (float)((q1 >> (8 * j)) & 63u);
    } else {
        const int s = 8 * (j - 4);
        sc = (float)(((q2 >> s) & 0xFu) | (((q0 >> (s + 6)) & 3u) << 4));
        mn = (float)(((q2 >> (s + 4)) & 0xFu) | (((q1 >> (s + 6)) & 3u) << 4));
    }
}

// The scales of a format's `Slice32` (its `scales32`), worked out once for the slice's four
// `eight_of` units: a scale and an offset, or (Q6_K) the two halves' scales.
struct Scales32 {
    float a, b;
};

// Sub-block `sub`'s scale d * sc and offset -(dmin * mn) from a Q4_K/Q5_K block's first 16
// bytes `head` (f16 d, f16 dmin, the packed 6-bit scales and mins).
__device__ __forceinline__ Scales32 k4_sub_scales(const uint4& head, int sub) {
    float sc, mn;
    k4_scale_min(head.y, head.z, head.w, sub, sc, mn);
    return {half_to_f32(head.x) * sc, -(half_to_f32(head.x >> 16) * mn)};
}

// The wide tiles' decode (qgemm_wide): 1 (the default) in bf16 pairs, where one permute and a
// LOP3 make (128 + q) in both halves (q in the mantissa's low bits: bit 7 is the exponent's) and
// two bf16 fmas make (q - offset) * scale + bias, the scale and bias rounded to bf16 first; 0 (STRATA_KERNEL_DEFINES="QWIDE_BF16X2=0", the A/B) in f32 as
// `eight_of`, the value rounded once (bench/NOTES.md v35).
#ifndef QWIDE_BF16X2
#define QWIDE_BF16X2 1
#endif
#define BF16X2_ONE 0x3F803F80u
__device__ __forceinline__ u32 bf16x2_fma(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// (a & mask) | bits in one LOP3 (the compiler splits it in two when both are constants).
template <u32 MASK>
__device__ __forceinline__ u32 and_or(u32 a, u32 bits) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "n"(MASK), "r"(bits));
    return d;
}
// A Q4_K/Q5_K row's scales for step c4 (0..3) of a block's four 64-column steps, as bf16 pairs:
// sub-block 2 c4's scale and bias, and sub-block 2 c4 + 1's. The 6-bit fields unpack four at a
// time (k4_scale_min's rule, bytewise).
struct PairScales {
    u32 s_lo, b_lo, s_hi, b_hi;
};
__device__ __forceinline__ PairScales k4_pair_scales(const uint4& head, int c4) {
    const u32 q0 = head.y, q1 = head.z, q2 = head.w;
    const bool upper = c4 >= 2;
    const u32 sc = upper ? (q2 & 0x0F0F0F0Fu) | ((q0 >> 2) & 0x30303030u) : q0 & 0x3F3F3F3Fu;
    const u32 mn = upper ? ((q2 >> 4) & 0x0F0F0F0Fu) | ((q1 >> 2) & 0x30303030u) : q1 & 0x3F3F3F3Fu;
    const int j = (2 * c4) & 3;
    const float d = half_to_f32(head.x), dmin = half_to_f32(head.x >> 16);
    const float s0 = d * byte_as_float(sc, j), b0 = -(dmin * byte_as_float(mn, j));
    const float s1 = d * byte_as_float(sc, j + 1), b1 = -(dmin * byte_as_float(mn, j + 1));
    return {pack_pair<false>(s0, s0), pack_pair<false>(b0, b0), pack_pair<false>(s1, s1), pack_pair<false>(b1, b1)};
}

// Bytes 8u..8u + 7 of the 32 in a and b (u = 0..3) as two words, for the `eight_of` decoders:
// the bytes of a unit's eight values u (u & 1 of a 16-byte nibble plane: pass it as a and b).
__device__ __forceinline__ void unit_words(const uint4& a, const uint4& b, int u, u32& w0, u32& w1) {
    const uint4& h = u < 2 ? a : b;
    w0 = u & 1 ? h.z : h.x;
    w1 = u & 1 ? h.w : h.y;
}

// 1 (the default): the wide tiles' weights in planes, one thread copying each step's planes by
// TMA (the kernel's w_maps: plane p of the segment's rows as bytes, boxes of the plane's width x
// 128 rows, rows past n as zeros) on the stage's mbarrier, instead of each lane's two to four
// 16-byte cp.async of half a row, which ncu found half-using their sectors and throttling the MIO
// queue (bench/NOTES.md v41, v42: 0.8 ms off the 256-user decode step). Q6_K's words of d stay
// the lanes' copies (their rows are not 16-byte strided). 0 (STRATA_KERNEL_DEFINES=
// "QWIDE_W_TMA=0"): the lanes' copies into interleaved rows.
#ifndef QWIDE_W_TMA
#define QWIDE_W_TMA 1
#endif

// Under QWIDE_W_TMA the wide tiles' stages hold a step's bytes of 128 rows in planes, one per
// field, rows WIDTH bytes apart. Byte `at` of row r sits where TMA's swizzle for that width (none,
// 32B, 64B) puts it: the 16-byte piece's index XOR bit 2 (32-byte rows) or bits 2..1 (64-byte rows)
// of r, so a warp's reads of 8 rows hit distinct banks.
template <int WIDTH>
__device__ __forceinline__ int plane_at(int r, int at) {
    if constexpr (WIDTH == 64) {
        return r * 64 + (at ^ (((r >> 1) & 3) << 4));
    } else if constexpr (WIDTH == 32) {
        return r * 32 + (at ^ (((r >> 2) & 1) << 4));
    } else {
        return r * WIDTH + at;
    }
}

// Where byte `at` of field P of row r sits in a wide tile's stage: in the row (the lanes' copies,
// F::WIDE_ROW bytes a row) or, under QWIDE_W_TMA, in the field's plane.
template <class F, int P>
__device__ __forceinline__ int wide_at(int r, int at) {
#if QWIDE_W_TMA
    return F::WIDE_PLANE_AT[P] + plane_at<F::WIDE_WIDTH[P]>(r, at);
#else
    return r * F::WIDE_ROW + F::WIDE_FIELD_AT[P] + at;
#endif
}

// A lane's reads of field P of row r: the word at byte 16 j + w of the field (w past the lane's
// byte within a 16-byte piece) is at at0 + ((16 j) ^ x) + w, x the plane's swizzle of row r (0 in
// rows). The swizzle touches only the piece index, so a piece's address is one LOP and an add,
// and w is the load's immediate.
template <class F, int P>
struct FieldRow {
    const u8* at0;
    int x;
    __device__ __forceinline__ FieldRow(const u8* stage, int r, int lane_byte) {
        x = QWIDE_W_TMA ? plane_at<F::WIDE_WIDTH[P]>(r, 0) - r * F::WIDE_WIDTH[P] : 0;
        at0 = stage + wide_at<F, P>(r, 0) - x + lane_byte;
    }
    __device__ __forceinline__ u32 word(int j, int w) const { return *(const u32*)(at0 + ((16 * j) ^ x) + w); }
};

// Q4_0: f16 d, 16 bytes of nibbles; value i = d * (nibble - 8), low nibbles first.
struct FmtQ4_0 {
    static constexpr int BLOCK = 32, UNIT = 32, BODY = 16, FIELDS = 2;
    struct Raw {
        uint4 q;
        u32 f;
    };
    __device__ static Raw load(const u8* w, int n, int kb, int row, int unit) {
        const size_t b = (size_t)row * kb + unit;
        return {load_streaming(w + b * BODY), __ldg((const unsigned short*)(w + (size_t)n * kb * BODY + b * FIELDS))};
    }
    template <int T>
    __device__ static void dot(const Raw& r, int unit, const Q8Rows& x, int t, float (&acc)[T]) {
        const float d = half_to_f32(r.f);
        const u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        int lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo[i] = minus8(q[i] & 0x0F0F0F0Fu);
            hi[i] = minus8((q[i] >> 4) & 0x0F0F0F0Fu);
        }
        const int col = unit * 32;
#pragma unroll
        for (int j = 0; j < T; j++) {
            if (j >= t) break;
            acc[j] = fmaf(d, x.dot32(lo, hi, j, col), acc[j]);
        }
    }
    template <typename Eat>
    __device__ static void decode(const Raw& r, int unit, Eat&& eat) {
        const float d = half_to_f32(r.f);
        const u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float v[8];
            const int shift = 4 * (e >> 1), w0 = 2 * (e & 1);
            four_values((q[w0] >> shift) & 0x0F0F0F0Fu, 8.0f, d, 0.0f, v);
            four_values((q[w0 + 1] >> shift) & 0x0F0F0F0Fu, 8.0f, d, 0.0f, v + 4);
            eat(unit * 32 + 8 * e, v);
        }
    }
    // Values col..col + 7 of row (col a multiple of 8), for the tensor-core GEMM: `slice` loads
    // what they need, `eight` decodes it (split so the GEMM can load the next slices early).
    struct Slice {
        uint2 q;
        unsigned short f;
    };
    __device__ static Slice slice(const u8* w, int n, int kb, int row, int col) {
        const size_t b = (size_t)row * kb + col / 32;
        return {__ldg((const uint2*)(w + b * BODY + (col & 15))),
                __ldg((const unsigned short*)(w + (size_t)n * kb * BODY + b * FIELDS))};
    }
    __device__ static void eight(const Slice& s, int col, float (&v)[8]) {
        const float d = half_to_f32(s.f);
        four_values((s.q.x >> (col & 16 ? 4 : 0)) & 0x0F0F0F0Fu, 8.0f, d, 0.0f, v);
        four_values((s.q.y >> (col & 16 ? 4 : 0)) & 0x0F0F0F0Fu, 8.0f, d, 0.0f, v + 4);
    }
    // The 32 values col..col + 31 of row (col a multiple of 32), for the tiled GEMM: `slice32`
    // loads their bytes and the block's fields once, `eight_of` decodes values 8u..8u + 7.
    struct Slice32 {
        uint4 q;
        unsigned short f;
    };
    __device__ static Slice32 slice32(const u8* w, int n, int kb, int row, int col) {
        const size_t b = (size_t)row * kb + col / 32;
        return {__ldg((const uint4*)(w + b * BODY)), __ldg((const unsigned short*)(w + (size_t)n * kb * BODY + b * FIELDS))};
    }
    __device__ static Scales32 scales32(const Slice32& s, int) { return {half_to_f32(s.f), 0.0f}; }
    // Values 0..15 are the low nibbles of bytes 0..15, 16..31 the high ones.
    __device__ static void eight_of(const Slice32& s, const Scales32& k, int, int u, float (&v)[8]) {
        u32 w0, w1;
        unit_words(s.q, s.q, u & 1, w0, w1);
        four_values((w0 >> (u & 2 ? 4 : 0)) & 0x0F0F0F0Fu, 8.0f, k.a, 0.0f, v);
        four_values((w1 >> (u & 2 ? 4 : 0)) & 0x0F0F0F0Fu, 8.0f, k.a, 0.0f, v + 4);
    }
};

// Q4_1: f16 d, f16 m, 16 bytes of nibbles; value i = d * nibble + m.
struct FmtQ4_1 {
    static constexpr int BLOCK = 32, UNIT = 32, BODY = 16, FIELDS = 4;
    struct Raw {
        uint4 q;
        u32 f;
    };
    __device__ static Raw load(const u8* w, int n, int kb, int row, int unit) {
        const size_t b = (size_t)row * kb + unit;
        return {load_streaming(w + b * BODY), __ldg((const u32*)(w + (size_t)n * kb * BODY + b * FIELDS))};
    }
    template <int T>
    __device__ static void dot(const Raw& r, int unit, const Q8Rows& x, int t, float (&acc)[T]) {
        const float d = half_to_f32(r.f), m = half_to_f32(r.f >> 16);
        const u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
        int lo[4], hi[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo[i] = (int)(q[i] & 0x0F0F0F0Fu);
            hi[i] = (int)((q[i] >> 4) & 0x0F0F0F0Fu);
        }
        const int col = unit * 32;
#pragma unroll
        for (int j = 0; j < T; j++) {
            if (j >= t) break;
            acc[j] = fmaf(d, x.dot32(lo, hi, j, col), fmaf(m, x.scale(j, col).y, acc[j]));
        }
    }
    template <typename Eat>
    __device__ static void decode(const Raw& r, int unit, Eat&& eat) {
        const float d = half_to_f32(r.f), m = half_to_f32(r.f >> 16);
        const u32 q[4] = {r.q.x, r.q.y, r.q.z, r.q.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float v[8];
            const int shift = 4 * (e >> 1), w0 = 2 * (e & 1);
            four_values((q[w0] >> shift) & 0x0F0F0F0Fu, 0.0f, d, m, v);
            four_values((q[w0 + 1] >> shift) & 0x0F0F0F0Fu, 0.0f, d, m, v + 4);
            eat(unit * 32 + 8 * e, v);
        }
    }
    // Values col..col + 7 of row (col a multiple of 8), for the tensor-core GEMM: `slice` loads
    // what they need, `eight` decodes it (split so the GEMM can load the next slices early).
    struct Slice {
        uint2 q;
        u32 f;
    };
    __device__ static Slice slice(const u8* w, int n, int kb, int row, int col) {
        const size_t b = (size_t)row * kb + col / 32;
        return {__ldg((const uint2*)(w + b * BODY + (col & 15))), __ldg((const u32*)(w + (size_t)n * kb * BODY + b * FIELDS))};
    }
    __device__ static void eight(const Slice& s, int col, float (&v)[8]) {
        const float d = half_to_f32(s.f), m = half_to_f32(s.f >> 16);
        four_values((s.q.x >> (col & 16 ? 4 : 0)) & 0x0F0F0F0Fu, 0.0f, d, m, v);
        four_values((s.q.y >> (col & 16 ? 4 : 0)) & 0x0F0F0F0Fu, 0.0f, d, m, v + 4);
    }
    // The 32 values col..col + 31 of row (col a multiple of 32), for the tiled GEMM: `slice32`
    // loads their bytes and the block's fields once, `eight_of` decodes values 8u..8u + 7.
    struct Slice32 {
        uint4 q;
        u32 f;
    };
    __device__ static Slice32 slice32(const u8* w, int n, int kb, int row, int col) {
        const size_t b = (size_t)row * kb + col / 32;
        return {__ldg((const uint4*)(w + b * BODY)), __ldg((const u32*)(w + (size_t)n * kb * BODY + b * FIELDS))};
    }
    __device__ static Scales32 scales32(const Slice32& s, int) {
        return {half_to_f32(s.f), half_to_f32(s.f >> 16)};
    }
    // Values 0..15 are the low nibbles of bytes 0..15, 16..31 the high ones.
    __device__ static void eight_of(const Slice32& s, const Scales32& k, int, int u, float (&v)[8]) {
        u32 w0, w1;
        unit_words(s.q, s.q, u & 1, w0, w1);
        four_values((w0 >> (u & 2 ? 4 : 0)) & 0x0F0F0F0Fu, 0.0f, k.a, k.b, v);
        four_values((w1 >> (u & 2 ? 4 : 0)) & 0x0F0F0F0Fu, 0.0f, k.a, k.b, v + 4);
    }
};

// Q8_0: f16 d, 32 signed bytes; value i = d * q_i.
struct FmtQ8_0 {
    static constexpr int BLOCK = 32, UNIT = 32, BODY = 32, FIELDS = 2;
    struct Raw {
        uint4 q0, q1;
        u32 f;
    };
    __device__ static Raw load(const u8* w, int n, int kb, int row, int unit) {
        const size_t b = (size_t)row * kb + unit;
        return {load_streaming(w + b * BODY), load_streaming(w + b * BODY + 16),
                __ldg((const unsigned short*)(w + (size_t)n * kb * BODY + b * FIELDS))};
    }
    template <int T>
    __device__ static void dot(const Raw& r, int unit, const Q8Rows& x, int t, float (&acc)[T]) {
        const float d = half_to_f32(r.f);
        const int a[4] = {(int)r.q0.x, (int)r.q0.y, (int)r.q0.z, (int)r.q0.w};
        const int b[4] = {(int)r.q1.x, (int)r.q1.y, (int)r.q1.z, (int)r.q1.w};
        const int col = unit * 32;
#pragma unroll
        for (int j = 0; j < T; j++) {
            if (j >= t) break;
            acc[j] = fmaf(d, x.dot32(a, b, j, col), acc[j]);
        }
    }
    template <typename Eat>
    __device__ static void decode(const Raw& r, int unit, Eat&& eat) {
        const float d = half_to_f32(r.f);
        const u32 q[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w};
#pragma unroll
        for (int e = 0; e < 4; e++) {
            float v[8];
            // Flipping the sign bits maps -128..127 to 0..255.
            four_values(q[2 * e] ^ 0x80808080u, 128.0f, d, 0.0f, v);
            four_values(q[2 * e + 1] ^ 0x80808080u, 128.0f, d, 0.0f, v + 4);
            eat(unit * 32 + 8 * e, v);
        }
    }
    // Values col..col + 7 of row (col a multiple of 8), for the tensor-core GEMM: `slice` loads
    // what they need, `eight` decodes it (split so the GEMM can load the next slices early).
    struct Slice {
        uint2 q;
        unsigned short f;
    };
    __device__ static Slice slice(const u8* w, int n, int kb, int row, int col) {
        const size_t b = (size_t)row * kb + col / 32;
        return {__ldg((const uint2*)(w + b * BODY + (col & 31))),
                __ldg((const unsigned short*)(w + (size_t)n * kb * BODY + b * FIELDS))};
    }
    __device__ static void eight(const Slice& s, int, float (&v)[8]) {
        const float d = half_to_f32(s.f);
        four_values(s.q.x ^ 0x80808080u, 128.0f, d, 0.0f, v);
        four_values(s.q.y ^ 0x80808080u, 128.0f, d, 0.0f, v + 4);
    }
    // The 32 values col..col + 31 of row (col a multiple of 32), for the tiled GEMM: `slice32`
    // loads their bytes and the block's fields once, `eight_of` decodes values 8u..8u + 7.
    struct Slice32 {
        uint4 q0, q1;
        unsigned short f;
    };
    __device__ static Slice32 slice32(const u8* w, int n, int kb, int row, int col) {
        const size_t b = (size_t)row * kb + col / 32;
        return {__ldg((const uint4*)(w + b * BODY)), __ldg((const uint4*)(w + b * BODY + 16)),
                __ldg((const unsigned short*)(w + (size_t)n * kb * BODY + b * FIELDS))};
    }
    __device__ static Scales32 scales32(const Slice32& s, int) { return {half_to_f32(s.f), 0.0f}; }
    __device__ static void eight_of(const Slice32& s, const Scales32& k, int, int u, float (&v)[8]) {
        u32 w0, w1;
        unit_words(s.q0, s.q1, u, w0, w1);
        four_values(w0 ^ 0x80808080u, 128.0f, k.a, 0.0f, v);
        four_values(w1 ^ 0x80808080u, 128.0f, k.a, 0.0f, v + 4);
    }
};

// The products of a Q4_K/Q5_K unit: two sub-blocks from column col, their quants as words
// (sub[h][0]: values 0..16, sub[h][1]: 16..32), scales dl and mins ml; the mins take x's sums.
template <int T>
__device__ __forceinline__ void k_pair_dot(const int (&sub)[2][2][4], const float (&dl)[2], const float (&ml)[2],
                                           int col, const Q8Rows& x, int t, float (&acc)[T]) {
#pragma unroll
    for (int j = 0; j < T; j++) {
        if (j >= t) break;
        const float p0 = x.dot32(sub[0][0], sub[0][1], j, col), p1 = x.dot32(sub[1][0], sub[1][1], j, col + 32);
        acc[j] += dl[0] * p0 - ml[0] * x.scale(j, col).y + dl[1] * p1 - ml[1] * x.scale(j, col + 32).y;
    }
}

// Q4_K (file layout, 144 bytes): f16 d, f16 dmin, 12 packed bytes of 6-bit scales and mins, 128
// bytes of nibbles; sub-blocks 2c and 2c + 1 are the low and high nibbles of bytes 32c..32c+32;
// value = d * scale * q - dmin * min. A unit is such a pair.
struct FmtQ4_K {
    static constexpr int BLOCK = 256, UNIT = 64, BYTES = 144;
    struct Raw {
        uint4 head, q0, q1;
        int c;
    };
    __device__ static Raw load(const u8* w, int, int kb, int row, int unit) {
        const u8* blk = w + ((size_t)row * kb + (unit >> 2)) * BYTES;
        const int c = unit & 3;
        // The header is the same for a block's four units, neighbours in a warp: one load.
        return {__ldg((const uint4*)blk), load_streaming(blk + 16 + 32 * c), load_streaming(blk + 32 + 32 * c), c};
    }
    template <int T>
    __device__ static void dot(const Raw& r, int unit, const Q8Rows& x, int t, float (&acc)[T]) {
        const float d = half_to_f32(r.head.x), dmin = half_to_f32(r.head.x >> 16);
        const u32 q[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w};
        float dl[2], ml[2];
        int sub[2][2][4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float sc, mn;
            k4_scale_min(r.head.y, r.head.z, r.head.w, 2 * r.c + h, sc, mn);
            dl[h] = d * sc;
            ml[h] = dmin * mn;
#pragma unroll
            for (int i = 0; i < 8; i++) sub[h][i >> 2][i & 3] = (int)((q[i] >> (4 * h)) & 0x0F0F0F0Fu);
        }
        k_pair_dot<T>(sub, dl, ml, unit * 64, x, t, acc);
    }
    template <typename Eat>
    __device__ static void decode(const Raw& r, int unit, Eat&& eat) {
        const float d = half_to_f32(r.head.x), dmin = half_to_f32(r.head.x >> 16);
        const u32 q[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float sc, mn;
            k4_scale_min(r.head.y, r.head.z, r.head.w, 2 * r.c + h, sc, mn);
            const float dl = d * sc, ml = -(dmin * mn);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float v[8];
                four_values((q[2 * e] >> (4 * h)) & 0x0F0F0F0Fu, 0.0f, dl, ml, v);
                four_values((q[2 * e + 1] >> (4 * h)) & 0x0F0F0F0Fu, 0.0f, dl, ml, v + 4);
                eat(unit * 64 + 32 * h + 8 * e, v);
            }
        }
    }
    // Values col..col + 7 of row (col a multiple of 8), for the tensor-core GEMM: `slice` loads
    // what they need, `eight` decodes it (split so the GEMM can load the next slices early).
    struct Slice {
        uint4 head;
        uint2 q;
    };
    __device__ static Slice slice(const u8* w, int, int kb, int row, int col) {
        const u8* blk = w + ((size_t)row * kb + col / 256) * BYTES;
        const int c = col & 255;
        return {__ldg((const uint4*)blk), __ldg((const uint2*)(blk + 16 + 32 * (c >> 6) + (c & 31)))};
    }
    __device__ static void eight(const Slice& s, int col, float (&v)[8]) {
        const int sub = (col & 255) >> 5;
        const Scales32 k = k4_sub_scales(s.head, sub);
        const float dl = k.a, ml = k.b;
        const int shift = 4 * (sub & 1);
        four_values((s.q.x >> shift) & 0x0F0F0F0Fu, 0.0f, dl, ml, v);
        four_values((s.q.y >> shift) & 0x0F0F0F0Fu, 0.0f, dl, ml, v + 4);
    }
    // The 32 values col..col + 31 of row (col a multiple of 32), for the tiled GEMM: `slice32`
    // loads their bytes and the block's fields once, `eight_of` decodes values 8u..8u + 7.
    struct Slice32 {
        uint4 head, q0, q1;
    };
    __device__ static Slice32 slice32(const u8* w, int, int kb, int row, int col) {
        const u8* blk = w + ((size_t)row * kb + col / 256) * BYTES;
        const u8* q = blk + 16 + 32 * ((col & 255) >> 6);
        return {__ldg((const uint4*)blk), __ldg((const uint4*)q), __ldg((const uint4*)(q + 16))};
    }
    __device__ static Scales32 scales32(const Slice32& s, int col) { return k4_sub_scales(s.head, (col & 255) >> 5); }
    __device__ static void eight_of(const Slice32& s, const Scales32& k, int col, int u, float (&v)[8]) {
        const int shift = 4 * (((col & 255) >> 5) & 1);
        u32 w0, w1;
        unit_words(s.q0, s.q1, u, w0, w1);
        four_values((w0 >> shift) & 0x0F0F0F0Fu, 0.0f, k.a, k.b, v);
        four_values((w1 >> shift) & 0x0F0F0F0Fu, 0.0f, k.a, k.b, v + 4);
    }

    // The wide tiles (qgemm_wide): a stage holds a row's 16-byte head (field 0) and the 32 nibble
    // bytes of the step's 64 columns (field 1), 48 bytes a row, or (QWIDE_W_TMA) the fields in
    // planes. Field p of row r for step s starts at byte wide_col(p, s) of the row's blocks.
    // `wide_copy` copies half `half` of a row for step s into `dst` from the row whose first block
    // is at `row` (block index `blk0` in the segment).
    static constexpr int WIDE_BLOCK_BYTES = BYTES, WIDE_ROW = 48, WIDE_FIELDS = 2, WIDE_WORDS_AT = 0;
    static constexpr bool WIDE_WORD = false;
    static constexpr int WIDE_WIDTH[3] = {16, 32, 0}, WIDE_FIELD_AT[3] = {0, 16, 0}, WIDE_PLANE_AT[3] = {0, 2048, 0};
    __device__ static int wide_col(int p, int s) { return (s >> 2) * BYTES + (p == 0 ? 0 : 16 + 32 * (s & 3)); }
    __device__ static void wide_copy(u8* dst, u8*, const u8*, int, int, size_t, const u8* row, int s, int half) {
        const u8* q = row + wide_col(1, s);
        if (half == 0) {
            cp_async16(dst, row + wide_col(0, s), 16);
            cp_async16(dst + 16, q, 16);
        } else {
            cp_async16(dst + 32, q + 16, 16);
        }
    }
    // Lane (g, c)'s A fragment registers for row r of step s (ri 0: row g, 1: row g + 8): the
    // values at columns 16 kk + 2c (+ 1) and + 8 of k16 step kk. Those are the low nibbles of
    // bytes 2c, 2c + 1 of each 8-byte group m (kk = m / 2, + 8 where m is odd; sub-block 2 (s % 4))
    // and their high nibbles (kk + 2, the next sub-block). Same f32 arithmetic as `eight_of`.
    __device__ static void wide_fragment(const u8* stage, int r, u32, int s, int c, int ri, u32 (&a)[4][4], int) {
        const uint4 head = *(const uint4*)(stage + wide_at<FmtQ4_K, 0>(r, 0));
        const FieldRow<FmtQ4_K, 1> q(stage, r, 4 * (c >> 1));
#if QWIDE_BF16X2
        // Bytes 2c, 2c + 1 of a word pair into halves 0 and 1 (bits 0-7 and 16-23).
        const u32 spread = c & 1 ? 0x4342u : 0x4140u;
        const PairScales k = k4_pair_scales(head, s & 3);
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const u32 p = __byte_perm(q.word(m >> 1, 8 * (m & 1)), 0u, spread);
            const u32 lo = bf16x2_fma(and_or<0x000F000Fu>(p, 0x43004300u), BF16X2_ONE, 0xC300C300u);
            const u32 hi = bf16x2_fma(and_or<0x000F000Fu>(p >> 4, 0x43004300u), BF16X2_ONE, 0xC300C300u);
            a[m >> 1][ri + 2 * (m & 1)] = bf16x2_fma(lo, k.s_lo, k.b_lo);
            a[2 + (m >> 1)][ri + 2 * (m & 1)] = bf16x2_fma(hi, k.s_hi, k.b_hi);
        }
#else
        const int sub = 2 * (s & 3);
        const Scales32 lo = k4_sub_scales(head, sub), hi = k4_sub_scales(head, sub + 1);
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const u32 pair = q.word(m >> 1, 8 * (m & 1)) >> (16 * (c & 1));
            float v[4], u[4];
            four_values(pair & 0x0F0Fu, 0.0f, lo.a, lo.b, v);
            four_values((pair >> 4) & 0x0F0Fu, 0.0f, hi.a, hi.b, u);
            a[m >> 1][ri + 2 * (m & 1)] = pack_pair<false>(v[0], v[1]);
            a[2 + (m >> 1)][ri + 2 * (m & 1)] = pack_pair<false>(u[0], u[1]);
        }
#endif
    }
};

// Q5_K (file layout, 176 bytes): as Q4_K with 32 bytes of fifth bits after the scales (bit s of
// byte l: value 32s + l) and the nibbles after them.
struct FmtQ5_K {
    static constexpr int BLOCK = 256, UNIT = 64, BYTES = 176;
    struct Raw {
        uint4 head, h0, h1, q0, q1;
        int c;
    };
    __device__ static Raw load(const u8* w, int, int kb, int row, int unit) {
        const u8* blk = w + ((size_t)row * kb + (unit >> 2)) * BYTES;
        const int c = unit & 3;
        return {__ldg((const uint4*)blk),
                __ldg((const uint4*)(blk + 16)),
                __ldg((const uint4*)(blk + 32)),
                load_streaming(blk + 48 + 32 * c),
                load_streaming(blk + 64 + 32 * c),
                c};
    }
    template <int T>
    __device__ static void dot(const Raw& r, int unit, const Q8Rows& x, int t, float (&acc)[T]) {
        const float d = half_to_f32(r.head.x), dmin = half_to_f32(r.head.x >> 16);
        const u32 q[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w};
        const u32 hb[8] = {r.h0.x, r.h0.y, r.h0.z, r.h0.w, r.h1.x, r.h1.y, r.h1.z, r.h1.w};
        float dl[2], ml[2];
        int sub[2][2][4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int sb = 2 * r.c + h;
            float sc, mn;
            k4_scale_min(r.head.y, r.head.z, r.head.w, sb, sc, mn);
            dl[h] = d * sc;
            ml[h] = dmin * mn;
#pragma unroll
            for (int i = 0; i < 8; i++)
                sub[h][i >> 2][i & 3] = (int)(((q[i] >> (4 * h)) & 0x0F0F0F0Fu) | (((hb[i] >> sb) & 0x01010101u) << 4));
        }
        k_pair_dot<T>(sub, dl, ml, unit * 64, x, t, acc);
    }
    template <typename Eat>
    __device__ static void decode(const Raw& r, int unit, Eat&& eat) {
        const float d = half_to_f32(r.head.x), dmin = half_to_f32(r.head.x >> 16);
        const u32 q[8] = {r.q0.x, r.q0.y, r.q0.z, r.q0.w, r.q1.x, r.q1.y, r.q1.z, r.q1.w};
        const u32 hb[8] = {r.h0.x, r.h0.y, r.h0.z, r.h0.w, r.h1.x, r.h1.y, r.h1.z, r.h1.w};
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int sub = 2 * r.c + h;
            float sc, mn;
            k4_scale_min(r.head.y, r.head.z, r.head.w, sub, sc, mn);
            const float dl = d * sc, ml = -(dmin * mn);
#pragma unroll
            for (int e = 0; e < 4; e++) {
                float v[8];
#pragma unroll
                for (int p = 0; p < 2; p++) {
                    const int i = 2 * e + p;
                    const u32 m = ((q[i] >> (4 * h)) & 0x0F0F0F0Fu) | (((hb[i] >> sub) & 0x01010101u) << 4);
                    four_values(m, 0.0f, dl, ml, v + 4 * p);
                }
                eat(unit * 64 + 32 * h + 8 * e, v);
            }
        }
    }
    // Values col..col + 7 of row (col a multiple of 8), for the tensor-core GEMM: `slice` loads
    // what they need, `eight` decodes it (split so the GEMM can load the next slices early).
    struct Slice {
        uint4 head;
        uint2 h, q;
    };
    __device__ static Slice slice(const u8* w, int, int kb, int row, int col) {
        const u8* blk = w + ((size_t)row * kb + col / 256) * BYTES;
        const int c = col & 255, l = c & 31;
        return {__ldg((const uint4*)blk), __ldg((const uint2*)(blk + 16 + l)),
                __ldg((const uint2*)(blk + 48 + 32 * (c >> 6) + l))};
    }
    __device__ static void eight(const Slice& s, int col, float (&v)[8]) {
        const int sub = (col & 255) >> 5;
        const Scales32 k = k4_sub_scales(s.head, sub);
        const float dl = k.a, ml = k.b;
        const int shift = 4 * (sub & 1);
        four_values(((s.q.x >> shift) & 0x0F0F0F0Fu) | (((s.h.x >> sub) & 0x01010101u) << 4), 0.0f, dl, ml, v);
        four_values(((s.q.y >> shift) & 0x0F0F0F0Fu) | (((s.h.y >> sub) & 0x01010101u) << 4), 0.0f, dl, ml, v + 4);
    }
    // The 32 values col..col + 31 of row (col a multiple of 32), for the tiled GEMM: `slice32`
    // loads their bytes and the block's fields once, `eight_of` decodes values 8u..8u + 7.
    struct Slice32 {
        uint4 head, h0, h1, q0, q1;
    };
    __device__ static Slice32 slice32(const u8* w, int, int kb, int row, int col) {
        const u8* blk = w + ((size_t)row * kb + col / 256) * BYTES;
        const u8* q = blk + 48 + 32 * ((col & 255) >> 6);
        return {__ldg((const uint4*)blk), __ldg((const uint4*)(blk + 16)), __ldg((const uint4*)(blk + 32)),
                __ldg((const uint4*)q), __ldg((const uint4*)(q + 16))};
    }
    __device__ static Scales32 scales32(const Slice32& s, int col) { return k4_sub_scales(s.head, (col & 255) >> 5); }
    __device__ static void eight_of(const Slice32& s, const Scales32& k, int col, int u, float (&v)[8]) {
        const int sub = (col & 255) >> 5;
        const float dl = k.a, ml = k.b;
        const int shift = 4 * (sub & 1);
        u32 q0, q1, h0, h1;
        unit_words(s.q0, s.q1, u, q0, q1);
        unit_words(s.h0, s.h1, u, h0, h1);
        four_values(((q0 >> shift) & 0x0F0F0F0Fu) | (((h0 >> sub) & 0x01010101u) << 4), 0.0f, dl, ml, v);
        four_values(((q1 >> shift) & 0x0F0F0F0Fu) | (((h1 >> sub) & 0x01010101u) << 4), 0.0f, dl, ml, v + 4);
    }
};

// Q6_K (body 208 bytes: 128 of low nibbles, 64 of 2-bit high parts, 16 signed scales; f16 d in
// the plane): value 128h + 32j + l takes its low nibble from byte 64h + 32(j % 2) + l (high
// nibble for j >= 2), its high bits from bits 2j of byte 128 + 32h + l, and its scale from byte
// 192 + 8h + 2j + l / 16; value = d * scale * (q - 32). A unit is h and a half of l's range.
struct FmtQ6_K {
    static constexpr int BLOCK = 256, UNIT = 64, BODY = 208, FIELDS = 2;
    struct Raw {
        uint4 a, b, hi;
        uint2 sc;
        u32 f;
        int u;
    };
    __device__ static Raw load(const u8* w, int n, int kb, int row, int unit) {
        const size_t blk = (size_t)row * kb + (unit >> 2);
        const u8* body = w + blk * BODY;
        const int u = unit & 3, h = u >> 1, l0 = 16 * (u & 1);
        return {load_streaming(body + 64 * h + l0),
                load_streaming(body + 64 * h + 32 + l0),
                load_streaming(body + 128 + 32 * h + l0),
                __ldg((const uint2*)(body + 192 + 8 * h)),
                __ldg((const unsigned short*)(w + (size_t)n * kb * BODY + blk * FIELDS)),
                u};
    }
    template <int T>
    __device__ static void dot(const Raw& r, int unit, const Q8Rows& x, int t, float (&acc)[T]) {
        const float d = half_to_f32(r.f);
        const int h = r.u >> 1, half = r.u & 1;
        const u32 a[4] = {r.a.x, r.a.y, r.a.z, r.a.w}, b[4] = {r.b.x, r.b.y, r.b.z, r.b.w};
        const u32 hi[4] = {r.hi.x, r.hi.y, r.hi.z, r.hi.w};
        const int col0 = (unit >> 2) * 256 + 128 * h + 16 * half;
        // Group g: the 16 values col0 + 32g.., one scale; its quants q (0..63) stand for q - 32.
        // For a few tokens the 32 goes by a second dp4a with x (cheaper than offsetting each
        // byte), for more by offsetting the bytes once (minus32).
        constexpr bool offset_by_dp4a = T <= 4;
        int g16[4][4];
        float dl[4];
#pragma unroll
        for (int g = 0; g < 4; g++) {
            const int si = half + 2 * g;
            const u32 sw = si < 4 ? r.sc.x : r.sc.y;
            dl[g] = d * (float)(signed char)(sw >> (8 * (si & 3)));
            const u32* lo = (g & 1) ? b : a;
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const u32 q = ((lo[i] >> (4 * (g >> 1))) & 0x0F0F0F0Fu) | (((hi[i] >> (2 * g)) & 0x03030303u) << 4);
                g16[g][i] = offset_by_dp4a ? (int)q : minus32(q);
            }
        }
#pragma unroll
        for (int j = 0; j < T; j++) {
            if (j >= t) break;
            float sum = 0.0f;
#pragma unroll
            for (int g = 0; g < 4; g++) sum = fmaf(dl[g], x.dot16(g16[g], j, col0 + 32 * g, offset_by_dp4a), sum);
            acc[j] += sum;
        }
    }
    template <typename Eat>
    __device__ static void decode(const Raw& r, int unit, Eat&& eat) {
        const float d = half_to_f32(r.f);
        const int h = r.u >> 1, half = r.u & 1;
        const u32 a[4] = {r.a.x, r.a.y, r.a.z, r.a.w}, b[4] = {r.b.x, r.b.y, r.b.z, r.b.w};
        const u32 hi[4] = {r.hi.x, r.hi.y, r.hi.z, r.hi.w};
        const int col0 = (unit >> 2) * 256 + 128 * h + 16 * half;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            const int si = half + 2 * j;
            const u32 sw = si < 4 ? r.sc.x : r.sc.y;
            const float dl = d * (float)(signed char)(sw >> (8 * (si & 3)));
            const u32* lo = (j & 1) ? b : a;
#pragma unroll
            for (int e = 0; e < 2; e++) {
                float v[8];
#pragma unroll
                for (int p = 0; p < 2; p++) {
                    const int i = 2 * e + p;
                    const u32 m = ((lo[i] >> (4 * (j >> 1))) & 0x0F0F0F0Fu) | (((hi[i] >> (2 * j)) & 0x03030303u) << 4);
                    four_values(m, 32.0f, dl, 0.0f, v + 4 * p);
                }
                eat(col0 + 32 * j + 8 * e, v);
            }
        }
    }
    // Values col..col + 7 of row (col a multiple of 8), for the tensor-core GEMM: `slice` loads
    // what they need, `eight` decodes it (split so the GEMM can load the next slices early).
    struct Slice {
        uint2 lo, hi;
        unsigned short d;
        signed char scale;
    };
    __device__ static Slice slice(const u8* w, int n, int kb, int row, int col) {
        const size_t blk = (size_t)row * kb + col / 256;
        const u8* body = w + blk * BODY;
        const int c = col & 255, h = c >> 7, j = (c >> 5) & 3, l = c & 31;
        return {__ldg((const uint2*)(body + 64 * h + 32 * (j & 1) + l)), __ldg((const uint2*)(body + 128 + 32 * h + l)),
                __ldg((const unsigned short*)(w + (size_t)n * kb * BODY + blk * FIELDS)),
                (signed char)__ldg(body + 192 + 8 * h + 2 * j + l / 16)};
    }
    __device__ static void eight(const Slice& s, int col, float (&v)[8]) {
        const int j = (col >> 5) & 3, shift = 4 * (j >> 1);
        const float dl = half_to_f32(s.d) * (float)s.scale;
        four_values(((s.lo.x >> shift) & 0x0F0F0F0Fu) | (((s.hi.x >> (2 * j)) & 0x03030303u) << 4), 32.0f, dl, 0.0f, v);
        four_values(((s.lo.y >> shift) & 0x0F0F0F0Fu) | (((s.hi.y >> (2 * j)) & 0x03030303u) << 4), 32.0f, dl, 0.0f, v + 4);
    }
    // The 32 values col..col + 31 of row (col a multiple of 32), for the tiled GEMM: `slice32`
    // loads their bytes and the block's fields once, `eight_of` decodes values 8u..8u + 7.
    // Two scales: values 0..15 of the 32 take the first, 16..31 the second.
    struct Slice32 {
        uint4 lo0, lo1, hi0, hi1;
        unsigned short d, scales;
    };
    __device__ static Slice32 slice32(const u8* w, int n, int kb, int row, int col) {
        const size_t blk = (size_t)row * kb + col / 256;
        const u8* body = w + blk * BODY;
        const int c = col & 255, h = c >> 7, j = (c >> 5) & 3;
        const u8* lo = body + 64 * h + 32 * (j & 1);
        const u8* hi = body + 128 + 32 * h;
        return {__ldg((const uint4*)lo), __ldg((const uint4*)(lo + 16)), __ldg((const uint4*)hi),
                __ldg((const uint4*)(hi + 16)),
                __ldg((const unsigned short*)(w + (size_t)n * kb * BODY + blk * FIELDS)),
                __ldg((const unsigned short*)(body + 192 + 8 * h + 2 * j))};
    }
    // a: values 0..15's scale, b: 16..31's.
    __device__ static Scales32 scales32(const Slice32& s, int) {
        const float d = half_to_f32(s.d);
        return {d * (float)(signed char)(s.scales & 0xFF), d * (float)(signed char)(s.scales >> 8)};
    }
    __device__ static void eight_of(const Slice32& s, const Scales32& k, int col, int u, float (&v)[8]) {
        const int j = (col >> 5) & 3, shift = 4 * (j >> 1);
        const float dl = u < 2 ? k.a : k.b;
        u32 lo0, lo1, hi0, hi1;
        unit_words(s.lo0, s.lo1, u, lo0, lo1);
        unit_words(s.hi0, s.hi1, u, hi0, hi1);
        four_values(((lo0 >> shift) & 0x0F0F0F0Fu) | (((hi0 >> (2 * j)) & 0x03030303u) << 4), 32.0f, dl, 0.0f, v);
        four_values(((lo1 >> shift) & 0x0F0F0F0Fu) | (((hi1 >> (2 * j)) & 0x03030303u) << 4), 32.0f, dl, 0.0f, v + 4);
    }

    // The wide tiles (qgemm_wide): a stage holds a row's 64 low-bit bytes of the step's half-block
    // (field 0), their 32 high-bit bytes (field 1) and the block's 16 scales (field 2), 112 bytes
    // a row, or (QWIDE_W_TMA) the fields in planes; then the 4-byte words of the fields that hold
    // the rows' d. wide_col and `wide_copy` as FmtQ4_K's: half 0 the low bits, half 1 the rest.
    static constexpr int WIDE_BLOCK_BYTES = BODY, WIDE_ROW = 112, WIDE_FIELDS = 3, WIDE_WORDS_AT = 128 * 112;
    static constexpr bool WIDE_WORD = true;
    static constexpr int WIDE_WIDTH[3] = {64, 32, 16}, WIDE_FIELD_AT[3] = {0, 64, 96};
    static constexpr int WIDE_PLANE_AT[3] = {0, 8192, 12288};
    __device__ static int wide_col(int p, int s) {
        const int h = 64 * ((s >> 1) & 1);
        return (s >> 2) * BODY + (p == 0 ? h : p == 1 ? 128 + h / 2 : 192);
    }
    __device__ static void wide_copy(u8* dst, u8* word, const u8* w, int n, int kb, size_t blk0, const u8* row, int s,
                                     int half) {
        if (half == 0) {
            const u8* lo = row + wide_col(0, s);
#pragma unroll
            for (int p = 0; p < 4; p++) cp_async16(dst + 16 * p, lo + 16 * p, 16);
        } else {
            const u8* hi = row + wide_col(1, s);
            cp_async16(dst + 64, hi, 16);
            cp_async16(dst + 80, hi + 16, 16);
            cp_async16(dst + 96, row + wide_col(2, s), 16);
            wide_copy_word(word, w, n, kb, blk0, s);
        }
    }
    // Into `word`, the word of the fields holding the d of the row's block for step s (4-byte
    // aligned, so it holds the d of a pair of blocks: `dhalf` picks it).
    __device__ static void wide_copy_word(u8* word, const u8* w, int n, int kb, size_t blk0, int s) {
        const size_t blk = blk0 + (s >> 2);
        cp_async4(word, w + (size_t)n * kb * BODY + ((blk * FIELDS) & ~(size_t)3), 4);
    }
    // Lane (g, c)'s A fragment registers for row r of step s (ri 0: row g, 1: row g + 8), as
    // FmtQ4_K's: column 8 m + 2c (+ 1) of the step from low-bit bytes 8 m + 2c.. and high-bit
    // bytes 8 m + 2c.. (bits 4 (s % 2)), column 32 + 8 m + 2c from low-bit bytes 32 + 8 m + 2c..
    // and the same high-bit bytes (bits 4 (s % 2) + 2); k16 step kk takes scale 4 (s % 4) + kk.
    // `word` holds d in its half `dhalf`. Same f32 arithmetic as `eight_of`.
    __device__ static void wide_fragment(const u8* stage, int r, u32 word, int s, int c, int ri, u32 (&a)[4][4],
                                         int dhalf) {
        const float d = half_to_f32(word >> (16 * dhalf));
        const u32 scales = *(const u32*)(stage + wide_at<FmtQ6_K, 2>(r, 4 * (s & 3)));
        const FieldRow<FmtQ6_K, 0> lo(stage, r, 4 * (c >> 1));
        const FieldRow<FmtQ6_K, 1> hb(stage, r, 4 * (c >> 1));
        float dl[4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) dl[kk] = d * (float)(signed char)(scales >> (8 * kk));
        const int odd = 4 * (s & 1);
#if QWIDE_BF16X2
        const u32 spread = c & 1 ? 0x4342u : 0x4140u;
        u32 sl[4];
#pragma unroll
        for (int kk = 0; kk < 4; kk++) sl[kk] = pack_pair<false>(dl[kk], dl[kk]);
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const u32 lo0 = __byte_perm(lo.word(m >> 1, 8 * (m & 1)), 0u, spread) >> odd;
            const u32 lo1 = __byte_perm(lo.word(2 + (m >> 1), 8 * (m & 1)), 0u, spread) >> odd;
            // The high bits of both halves moved to bits 4-5: 4 (s % 2) and 4 (s % 2) + 2 down.
            const u32 hi = __byte_perm(hb.word(m >> 1, 8 * (m & 1)), 0u, spread);
            const u32 v0 = and_or<0x000F000Fu>(lo0, and_or<0x00300030u>(hi << 4 >> odd, 0x43004300u));
            const u32 v1 = and_or<0x000F000Fu>(lo1, and_or<0x00300030u>(hi << 2 >> odd, 0x43004300u));
            // (128 + q) - 160 = q - 32, exact; times the scale, rounded once.
            a[m >> 1][ri + 2 * (m & 1)] = bf16x2_fma(bf16x2_fma(v0, BF16X2_ONE, 0xC320C320u), sl[m >> 1], 0u);
            a[2 + (m >> 1)][ri + 2 * (m & 1)] = bf16x2_fma(bf16x2_fma(v1, BF16X2_ONE, 0xC320C320u), sl[2 + (m >> 1)], 0u);
        }
#else
        const int shift = 16 * (c & 1);
#pragma unroll
        for (int m = 0; m < 4; m++) {
            const u32 lo0 = lo.word(m >> 1, 8 * (m & 1)) >> shift;
            const u32 lo1 = lo.word(2 + (m >> 1), 8 * (m & 1)) >> shift;
            const u32 hi = hb.word(m >> 1, 8 * (m & 1)) >> shift;
            float v[4], u[4];
            four_values(((lo0 >> odd) & 0x0F0Fu) | (((hi >> odd) & 0x0303u) << 4), 32.0f, dl[m >> 1], 0.0f, v);
            four_values(((lo1 >> odd) & 0x0F0Fu) | (((hi >> (odd + 2)) & 0x0303u) << 4), 32.0f, dl[2 + (m >> 1)], 0.0f,
                        u);
            a[m >> 1][ri + 2 * (m & 1)] = pack_pair<false>(v[0], v[1]);
            a[2 + (m >> 1)][ri + 2 * (m & 1)] = pack_pair<false>(u[0], u[1]);
        }
#endif
    }
};

// ---- Decode GEMVs over quantized rows: t <= 8 tokens of int8 x. ----
// A warp computes a row (gate/up: a row of each) and a block GEMV_WARPS rows: lane l takes units
// l, l + 32, ... of the row, QGEMV_LOADS of them in flight at once, and the lanes meet by a
// butterfly; no shared memory, no block barrier. Weight loads start before the wait for the
// previous kernel, as in gemm.cu. (One row per two warps, their halves met in shared memory,
// ran gate/up at 0.8 TB/s on an H200: too little work a block; bench/NOTES.md v22.)

// Units in flight per lane (STRATA_KERNEL_DEFINES="QGEMV_LOADS=4" for measurements).
#ifndef QGEMV_LOADS
#define QGEMV_LOADS 2
#endif

// Gate and up rows in one pass of qgemv_rows, their units in flight together, instead of the
// gate row's pass then the up row's (STRATA_KERNEL_DEFINES="QGEMV_SILU_PAIRS=1" for
// measurements; the sums are the same either way).
#ifndef QGEMV_SILU_PAIRS
#define QGEMV_SILU_PAIRS 0
#endif

// acc[r][j] = w[rows[r]] · x[j] (j < t), summed over the warp (every lane holds it). after_wait()
// runs right after the wait for the previous kernel.
template <class F, int T, int R, typename AfterWait>
__device__ __forceinline__ void qgemv_rows(const u8* __restrict__ w, int n, const Q8Rows& x, int t,
                                           const int (&rows)[R], float (&acc)[R][T], AfterWait&& after_wait) {
    const int lane = threadIdx.x & 31;
    const int kb = x.k / F::BLOCK, units = x.k / F::UNIT;
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < T; j++) acc[r][j] = 0.0f;
    bool waited = false;
    for (int base = lane; base < units; base += 32 * QGEMV_LOADS) {
        typename F::Raw raw[R][QGEMV_LOADS];
#pragma unroll
        for (int u = 0; u < QGEMV_LOADS; u++) {
            const int i = base + 32 * u;
#pragma unroll
            for (int r = 0; r < R; r++)
                if (i < units) raw[r][u] = F::load(w, n, kb, rows[r], i);
        }
        wait_once(waited, after_wait);
#pragma unroll
        for (int u = 0; u < QGEMV_LOADS; u++) {
            const int i = base + 32 * u;
#pragma unroll
            for (int r = 0; r < R; r++)
                if (i < units) F::template dot<T>(raw[r][u], i, x, t, acc[r]);
        }
    }
    wait_once(waited, after_wait);
#pragma unroll
    for (int r = 0; r < R; r++)
#pragma unroll
        for (int j = 0; j < T; j++) acc[r][j] = warp_sum(acc[r][j]);
}

// qgemv_rows over the one row `row`.
template <class F, int T, typename AfterWait>
__device__ __forceinline__ void qgemv_row(const u8* __restrict__ w, int n, const Q8Rows& x, int t, int row,
                                          float (&acc)[T], AfterWait&& after_wait) {
    const int rows[1] = {row};
    float sums[1][T];
    qgemv_rows<F, T, 1>(w, n, x, t, rows, sums, after_wait);
#pragma unroll
    for (int j = 0; j < T; j++) acc[j] = sums[0][j];
}

// This warp's row of the block's GEMV_WARPS.
__device__ __forceinline__ int warp_row() { return blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5); }

// y[j * ld + row] = (x[j] · w[row]) * s[j] (bf16, or f32 when out_f32), s the norm scale of
// `norm_in` (NormIn; 1 when null). Grid ceil(n / GEMV_WARPS).
template <class F, int T>
__device__ void qgemv(const u8* __restrict__ w, Q8Rows x, void* __restrict__ y, int n, int t, int ld, int out_f32,
                      const u64* __restrict__ norm_in, float eps) {
    const int row = warp_row();
    if (row >= n) return;
    NormIn<T> norm{norm_in};
    float acc[T], s[T];
    qgemv_row<F, T>(w, n, x, t, row, acc, [&] { norm.load_in_each_warp(t); });
    norm.scales(t, x.k, eps, s);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int j = 0; j < T; j++) {
        if (j < t) {
            const size_t at = (size_t)j * ld + row;
            const float v = acc[j] * s[j];
            if (out_f32) ((float*)y)[at] = v;
            else ((bf16*)y)[at] = f2bf(v);
        }
    }
}

// Gate/up with SiLU: w holds the gate rows, then the up rows (2 * inter); out[j, row] =
// silu(gate) * up, each rounded to bf16 first as the unfused path does. Grid
// ceil(inter / GEMV_WARPS), a warp a gate row and its up row.
template <class F, int T>
__device__ void qgemv_silu(const u8* __restrict__ w, Q8Rows x, bf16* __restrict__ out, int inter, int t,
                           const u64* __restrict__ norm_in, float eps) {
    const int row = warp_row();
    if (row >= inter) return;
    NormIn<T> norm{norm_in};
    float s[T];
#if QGEMV_SILU_PAIRS
    const int rows[2] = {row, row + inter};
    float sums[2][T];
    qgemv_rows<F, T, 2>(w, 2 * inter, x, t, rows, sums, [&] { norm.load_in_each_warp(t); });
    const float(&gate)[T] = sums[0];
    const float(&up)[T] = sums[1];
#else
    float gate[T], up[T];
    qgemv_row<F, T>(w, 2 * inter, x, t, row, gate, [&] { norm.load_in_each_warp(t); });
    qgemv_row<F, T>(w, 2 * inter, x, t, row + inter, up, [] {});
#endif
    norm.scales(t, x.k, eps, s);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int j = 0; j < T; j++) {
        if (j < t) {
            const float g = bf2f(f2bf(gate[j] * s[j])), u = bf2f(f2bf(up[j] * s[j]));
            out[(size_t)j * inter + row] = f2bf(silu_times(g, u));
        }
    }
}

// The o and down projections on one GPU, as gemm.cu's gemv_residual: res += x · wᵀ (f32), the
// new rows' squares into `norm_out`, and res_bf16 = the new rows times the next norm's weights
// `next_norm` (the input of the quantized matrix after it). Grid ceil(n / GEMV_WARPS).
template <class F, int T>
__device__ void qgemv_residual(const u8* __restrict__ w, Q8Rows x, float* __restrict__ res,
                               bf16* __restrict__ res_bf16, u64* __restrict__ norm_out,
                               const float* __restrict__ next_norm, int n, int t) {
    const int row = warp_row();
    if (row >= n) return;
    const bool first = (threadIdx.x & 31) == 0;
    float acc[T], before[T];
    qgemv_row<F, T>(w, n, x, t, row, acc, [&] {
        if (!first) return;
#pragma unroll
        for (int j = 0; j < T; j++)
            if (j < t) before[j] = res[(size_t)j * n + row];
    });
    if (!first) return;
    const float g = next_norm ? next_norm[row] : 1.0f;
#pragma unroll
    for (int j = 0; j < T; j++) {
        if (j >= t) break;
        const size_t at = (size_t)j * n + row;
        const float v = before[j] + acc[j];
        res[at] = v;
        res_bf16[at] = f2bf(v * g);
        norm_add(norm_out, j, v * v);
    }
}

// x (bf16 [t, k]) as Q8Rows' blocks (and the residual pass's when two_pass): a thread 8 values,
// the 4 threads of a block met by shuffles. Grid ceil(t * k / 8 / 128).
#define QUANTIZE_THREADS 128

// One pass over a thread's 8 values v: their int8 quants (2 words) under the block's amax, met
// with the block's other 3 threads; v becomes what the quants leave. Returns the scale.
__device__ __forceinline__ float quantize_pass(float (&v)[8], unsigned lanes, u32 (&word)[2]) {
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; e++) amax = fmaxf(amax, fabsf(v[e]));
    // xor 1 and 2 stay inside the block's lanes.
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(lanes, amax, o));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f, d = amax / 127.0f;
#pragma unroll
    for (int g = 0; g < 2; g++) {
        u32 packed = 0;
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const int q = __float2int_rn(v[4 * g + b] * inv);
            packed |= ((u32)q & 0xffu) << (8 * b);
            v[4 * g + b] = fmaf(-(float)q, d, v[4 * g + b]);
        }
        word[g] = packed;
    }
    return d;
}

extern "C" __global__ void __launch_bounds__(QUANTIZE_THREADS) quantize_q8(const bf16* __restrict__ x,
                                                                           int8_t* __restrict__ xq,
                                                                           float2* __restrict__ xs, int k, int t,
                                                                           int two_pass) {
    const long long i = (long long)blockIdx.x * QUANTIZE_THREADS + threadIdx.x;
    const long long pieces = (long long)t * k / 8;
    wait_for_previous_kernel();
    // Pieces tile [t, k] row after row, so piece i holds values 8 i..; block b is pieces 4b..4b + 3,
    // 4 aligned lanes of a warp, all in or all out (t * k / 8 is a multiple of 4).
    if (i >= pieces) return;
    const unsigned lanes = __activemask();
    float v[8];
    unpack8(__ldg((const uint4*)(x + i * 8)), v);
    float sum = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; e++) sum += v[e];
#pragma unroll
    for (int o = 1; o < 4; o <<= 1) sum += __shfl_xor_sync(lanes, sum, o);
    u32 word[2];
    const float d = quantize_pass(v, lanes, word);
    *(uint2*)(xq + i * 8) = make_uint2(word[0], word[1]);
    if ((i & 3) == 0) xs[i / 4] = make_float2(d, sum);
    if (!two_pass) return;
    const float d2 = quantize_pass(v, lanes, word);
    *(uint2*)(xq + pieces * 8 + i * 8) = make_uint2(word[0], word[1]);
    if ((i & 3) == 0) ((float*)(xs + pieces / 4))[i / 4] = d2;
}

// out[(row - first) * k + col] = w[row, col] in bf16 for rows first..first + rows of a segment
// of n rows: a quantized matrix (or a slab of it) for cuBLASLt. A thread decodes a unit into
// shared memory and the block then writes its units' values out in 16-byte pieces side by side
// (a block's units are consecutive, and so are their values: whole Q6_K blocks, as the units per
// row and the block's first unit are multiples of 4). Stores straight from each unit's thread,
// 128 bytes apart across a warp, ran at about 1 TB/s on an H200. The tile is stored 16 bytes at a
// time: through a bf16 pointer NVVM split each store into four 32-bit ones, all of a warp's in one
// bank (a 32-way conflict, ~1 TB/s of bf16 out at best; bench/NOTES.md v39).
#define DEQUANT_THREADS 256

// Where piece c (16 bytes) of a dequantization tile sits, for units of PIECES pieces: the piece's
// index within its unit XORed with bits of the unit's index, so that neither a quarter warp's
// stores (8 units' piece e) nor its loads (8 consecutive pieces) share a bank.
template <int PIECES>
__device__ __forceinline__ int dequant_slot(int c) {
    constexpr int spread = PIECES >= 8 ? 1 : 8 / PIECES, mask = (PIECES >= 8 ? 8 : PIECES) - 1;
    return c ^ ((c / PIECES / spread) & mask);
}

template <class F>
__device__ void dequant(const u8* __restrict__ w, bf16* __restrict__ out, int n, int k, int first, int rows) {
    constexpr int PIECES = F::UNIT / 8;
    __shared__ uint4 tile[DEQUANT_THREADS * PIECES];
    const int units = k / F::UNIT;
    const long long total = (long long)rows * units, base = (long long)blockIdx.x * DEQUANT_THREADS;
    const long long i = base + threadIdx.x;
    const bool mine = i < total;
    const int r = mine ? (int)(i / units) : 0, unit = mine ? (int)(i % units) : 0;
    typename F::Raw raw;
    if (mine) raw = F::load(w, n, k / F::BLOCK, first + r, unit);
    if (mine) {
        // This unit's first value within the block's tile.
        const int at = (int)((long long)r * k - base * F::UNIT);
        F::decode(raw, unit, [&](int col, const float(&v)[8]) { tile[dequant_slot<PIECES>((at + col) >> 3)] = pack8(v); });
    }
    __syncthreads();
    // `out` may still be read by the product before this one.
    wait_for_previous_kernel();
    const long long left = total - base;
    const int chunks = (int)(left < DEQUANT_THREADS ? left : DEQUANT_THREADS) * PIECES;
    uint4* dst = (uint4*)(out + base * F::UNIT);
    for (int c = threadIdx.x; c < chunks; c += DEQUANT_THREADS) dst[c] = tile[dequant_slot<PIECES>(c)];
}

// Token embedding from a quantized table (embedding.cu's rule: rows vocab_start.. of this GPU,
// zeros for other tokens). One block a token.
template <class F>
__device__ void embedding_quant(const u8* __restrict__ table, const u32* __restrict__ tokens, float* __restrict__ out,
                                int hidden, int vocab_start, int vocab_rows) {
    wait_for_previous_kernel();
    const int local = (int)tokens[blockIdx.x] - vocab_start;
    float* o = out + (size_t)blockIdx.x * hidden;
    if (local < 0 || local >= vocab_rows) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = 0.0f;
        return;
    }
    for (int unit = threadIdx.x; unit < hidden / F::UNIT; unit += blockDim.x) {
        F::decode(F::load(table, vocab_rows, hidden / F::BLOCK, local, unit), unit, [&](int col, const float(&v)[8]) {
            ((float4*)(o + col))[0] = make_float4(v[0], v[1], v[2], v[3]);
            ((float4*)(o + col))[1] = make_float4(v[4], v[5], v[6], v[7]);
        });
    }
}

// ---- Tensor-core GEMM over quantized rows: steps of more tokens than the GEMVs take. ----
// y[j * ld + row] = x[j] · w[row] for a segment of n rows, the weights decoded to bf16 in
// registers straight into mma.sync m16n8k16 (f32 sums) and never written out, so a step reads
// the file's bytes once per 64-token tile instead of writing and reading a bf16 copy (the
// dequantize-then-cuBLASLt path, bench/NOTES.md v24). A block of QGEMM_WARPS warps takes
// QGEMM_ROWS rows (a warp 32: two m16 tiles) and QGEMM_TOKENS tokens (8 n8 tiles, those past t
// skipped), k in steps of QGEMM_K columns whose x tile cp.async double-buffers in shared memory.
// The weights are mma's A (rows), the tokens its B. Within each 32-column group, lane (g, c)
// takes columns 8c..8c+7: its k slots (2c, 2c+1, 2c+8, 2c+9) of the group's first k16 are
// columns 8c..8c+3 and of the second 8c+4..8c+7, for A and B alike (a dot product takes its
// columns in any order), so a row's eight values come from one decode (`F::eight`) and a
// token's from one 16-byte shared load. Grid (ceil(n / QGEMM_ROWS), ceil(t / QGEMM_TOKENS),
// splits): with splits > 1 block z sums its share of the steps into parts[z][t][n] (f32) and
// qgemm_reduce adds the shares, so a matrix of few rows still fills the GPU.
#define QGEMM_WARPS 4
#define QGEMM_ROWS (32 * QGEMM_WARPS)
#define QGEMM_TOKENS 64
#define QGEMM_K 128
// 16 bytes of padding a row: the 8 tokens of a 16-byte load's quarter-warp hit distinct banks.
#define QGEMM_XSTRIDE (QGEMM_K + 32)
// 1: the next 32-column group's weight slices load while this one decodes and multiplies (across
// steps too), so a weight load's latency hides behind a group's products; 0 loads each group's
// slices when it starts (STRATA_KERNEL_DEFINES="QGEMM_PREFETCH=0" for the A/B).
#ifndef QGEMM_PREFETCH
#define QGEMM_PREFETCH 1
#endif

// The block's share of parts when the grid splits k (its z), else -1.
__device__ __forceinline__ int grid_split() { return gridDim.z > 1 ? (int)blockIdx.z : -1; }

// One of a quantized GEMM's sums for (row, token tok): into split z's share of parts when z >= 0
// (parts [splits, t, n - prow0] holds rows prow0..n - 1), else into y (bf16, or f32 when out_f32).
__device__ __forceinline__ void qgemm_store_to(float v, void* __restrict__ y, float* __restrict__ parts, int n, int t,
                                               int ld, int out_f32, int row, int tok, int z, int prow0) {
    if (z >= 0) {
        parts[((size_t)z * t + tok) * (n - prow0) + row - prow0] = v;
    } else if (out_f32) {
        ((float*)y)[(size_t)tok * ld + row] = v;
    } else {
        ((bf16*)y)[(size_t)tok * ld + row] = f2bf(v);
    }
}
// qgemm_store_to into the k split's share of parts when the grid splits k, else into y.
__device__ __forceinline__ void qgemm_store(float v, void* __restrict__ y, float* __restrict__ parts, int n, int t,
                                            int ld, int out_f32, int row, int tok) {
    qgemm_store_to(v, y, parts, n, t, ld, out_f32, row, tok, grid_split(), 0);
}

// The wgmma sums of multiplying warp w of a tile GEMM's block (tile rows from row0, tokens from
// tok0, `live` of them): lane (g, c) holds tile rows 16 w + g (e 0, 1) and + 8 (e 2, 3), tokens
// 8 j + 2c (+ 1) of n8 chunk j, in acc[4 j + e]. Stored as qgemm_store_to's z and prow0 say.
template <int N>
__device__ __forceinline__ void store_wgmma_sums(const float (&acc)[N], int w, int row0, int tok0, int live,
                                                 void* __restrict__ y, float* __restrict__ parts, int n, int t,
                                                 int ld, int out_f32, int z, int prow0) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
#pragma unroll
    for (int j = 0; j < N / 4; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            const int row = row0 + 16 * w + g + 8 * (e >> 1);
            const int tok = 8 * j + 2 * c + (e & 1);
            if (row < n && tok < live)
                qgemm_store_to(acc[4 * j + e], y, parts, n, t, ld, out_f32, row, tok0 + tok, z, prow0);
        }
}

// A tile GEMM's sums staged in shared memory, then stored by a short loop: `tile` holds
// value (tile row r, token j) at j * QSTAGED_STRIDE + r, rows row0.. of an n-row output, `live`
// tokens from tok0, as qgemm_store_to's z and prow0 say. Unrolled per accumulator (the
// fragments' rows and tokens), the stores were most of qgemm's and the wide tiles' code, which
// every block fetched cold at its end, and wrote 32-byte pieces (bench/NOTES.md v47); here lane
// l of a warp takes rows 4l..4l + 3 of a token, one 16-byte (f32) or 8-byte (bf16) store where
// the output's rows and address allow, else one by one. The same values, so the same bits.
#define QSTAGED_ROWS 128
// 4 floats of padding a token: a fragment's tokens 2c (c = 0..3) fall 8 banks apart.
#define QSTAGED_STRIDE (QSTAGED_ROWS + 4)
// Lane (g, c)'s mma or wgmma fragment sums into the staged tile: acc[j][e] is tile row row + g +
// 8 (e >> 1), token 8 j + 2c + (e & 1). A store's lanes fall in distinct banks.
template <int J>
__device__ __forceinline__ void stage_fragment_sums(const float (&acc)[J][4], float* const tile, int row) {
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    float* const at = tile + 2 * c * QSTAGED_STRIDE + row + g;
#pragma unroll
    for (int j = 0; j < J; j++)
#pragma unroll
        for (int e = 0; e < 4; e++) at[(8 * j + (e & 1)) * QSTAGED_STRIDE + 8 * (e >> 1)] = acc[j][e];
}
template <int WARPS>
__device__ __forceinline__ void store_staged_sums(const float* tile, int row0, int tok0, int live,
                                                  void* __restrict__ y, float* __restrict__ parts, int n, int t,
                                                  int ld, int out_f32, int z, int prow0) {
    const int lane = threadIdx.x & 31, r = 4 * lane, row = row0 + r;
    const size_t width = z >= 0 ? (size_t)(n - prow0) : (size_t)ld;
    const bool whole = width % 4 == 0 && (row0 - prow0) % 4 == 0 &&
                       (z >= 0 || ((size_t)y & (out_f32 ? 15 : 7)) == 0);
    for (int tok = threadIdx.x >> 5; tok < live; tok += WARPS) {
        const float4 v = *(const float4*)(tile + tok * QSTAGED_STRIDE + r);
        if (whole && row + 3 < n) {
            if (z >= 0) {
                *(float4*)(parts + ((size_t)z * t + tok0 + tok) * width + row - prow0) = v;
            } else if (out_f32) {
                *(float4*)((float*)y + (size_t)(tok0 + tok) * ld + row) = v;
            } else {
                *(uint2*)((bf16*)y + (size_t)(tok0 + tok) * ld + row) = make_uint2(f2bf2(v.x, v.y), f2bf2(v.z, v.w));
            }
        } else {
            const float one[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; i++)
                if (row + i < n) qgemm_store_to(one[i], y, parts, n, t, ld, out_f32, row + i, tok0 + tok, z, prow0);
        }
    }
}

template <class F>
__device__ void qgemm(const u8* __restrict__ w, const bf16* __restrict__ x, void* __restrict__ y,
                      float* __restrict__ parts, int n, int k, int t, int ld, int out_f32, int steps_per_split) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) bf16 xs[2][QGEMM_TOKENS * QGEMM_XSTRIDE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int row0 = blockIdx.x * QGEMM_ROWS + 32 * warp, tok0 = blockIdx.y * QGEMM_TOKENS;
    const int steps = k / QGEMM_K, first = blockIdx.z * steps_per_split;
    const int last = min(steps, first + steps_per_split);
    const int live = min(QGEMM_TOKENS, t - tok0), live_nt = (live + 7) >> 3;
    const int kb = k / F::BLOCK;
    // Rows g, g + 8 of the warp's two m16 tiles; rows past n decode row 0 and are never stored.
    int rows[4];
#pragma unroll
    for (int r = 0; r < 4; r++) {
        const int row = row0 + 16 * (r >> 1) + g + 8 * (r & 1);
        rows[r] = row < n ? row : 0;
    }
    float acc[2][8][4] = {};
    // This lane's slices of the 4 rows for the group at column col (the weights are constant, so
    // the first ones load before the wait for the previous kernel).
    typename F::Slice cur[4];
    auto load_slices = [&](int col, typename F::Slice(&to)[4]) {
#pragma unroll
        for (int r = 0; r < 4; r++) to[r] = F::slice(w, n, kb, rows[r], col);
    };
    if (QGEMM_PREFETCH && first < last) load_slices(first * QGEMM_K + 8 * c, cur);
    wait_for_previous_kernel();
    // x tile of step s into buffer b: QGEMM_TOKENS x QGEMM_K bf16 in 16-byte pieces, zeros past t.
    auto load_x = [&](int s, int b) {
        for (int p = threadIdx.x; p < QGEMM_TOKENS * QGEMM_K / 8; p += QGEMM_WARPS * 32) {
            const int tok = p / (QGEMM_K / 8), col = 8 * (p % (QGEMM_K / 8));
            const bool in = tok < live;
            const bf16* src = x + (size_t)(in ? tok0 + tok : 0) * k + s * QGEMM_K + col;
            cp_async16(&xs[b][tok * QGEMM_XSTRIDE + col], src, in ? 16 : 0);
        }
        cp_async_commit();
    };
    if (first < last) load_x(first, 0);
    for (int s = first; s < last; s++) {
        const int b = (s - first) & 1;
        if (s + 1 < last) load_x(s + 1, b ^ 1);
        // x of step s is in once only the next step's copies are pending.
        cp_async_wait(s + 1 < last ? 1 : 0);
        __syncthreads();
#pragma unroll
        for (int grp = 0; grp < QGEMM_K / 32; grp++) {
            const int col = s * QGEMM_K + 32 * grp + 8 * c;
            typename F::Slice next[4];
            if (QGEMM_PREFETCH) {
                // The next group is col + 32, in this step or the next; the very last reloads col.
                load_slices(s + 1 < last || grp + 1 < QGEMM_K / 32 ? col + 32 : col, next);
            } else {
                load_slices(col, cur);
            }
            // A: per m16 tile, the two k16 steps' registers (a0..a3 each).
            u32 a[2][2][4];
#pragma unroll
            for (int r = 0; r < 4; r++) {
                float v[8];
                F::eight(cur[r], col, v);
                const int m = r >> 1, hi = r & 1;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    a[m][h][hi] = pack_pair<false>(v[4 * h], v[4 * h + 1]);
                    a[m][h][2 + hi] = pack_pair<false>(v[4 * h + 2], v[4 * h + 3]);
                }
            }
#pragma unroll
            for (int j = 0; j < 8; j++) {
                if (j >= live_nt) break;
                const uint4 bx = *(const uint4*)&xs[b][(8 * j + g) * QGEMM_XSTRIDE + 32 * grp + 8 * c];
#pragma unroll
                for (int m = 0; m < 2; m++) {
                    mma_16x8x16<false>(acc[m][j], a[m][0][0], a[m][0][1], a[m][0][2], a[m][0][3], bx.x, bx.y);
                    mma_16x8x16<false>(acc[m][j], a[m][1][0], a[m][1][1], a[m][1][2], a[m][1][3], bx.z, bx.w);
                }
            }
            if (QGEMM_PREFETCH) {
#pragma unroll
                for (int r = 0; r < 4; r++) cur[r] = next[r];
            }
        }
        // The next step loads step s + 2 into this buffer: only once every warp has read it.
        __syncthreads();
    }
    // Lane (g, c) holds rows g (e 0, 1) and g + 8 (e 2, 3) of each m16 tile, tokens 2c, 2c + 1,
    // staged in the x buffers, which every warp is done with (the last step's barrier).
    static_assert(QGEMM_ROWS == QSTAGED_ROWS && QGEMM_TOKENS * QSTAGED_STRIDE * 4 <= sizeof(xs),
                  "the staged sums fit the x buffers");
    float* const tile = (float*)&xs[0][0];
#pragma unroll
    for (int m = 0; m < 2; m++) stage_fragment_sums(acc[m], tile, 32 * warp + 16 * m);
    __syncthreads();
    store_staged_sums<QGEMM_WARPS>(tile, blockIdx.x * QGEMM_ROWS, tok0, live, y, parts, n, t, ld, out_f32,
                                   grid_split(), 0);
#endif
}

// ---- The same product in tiles of 128 rows x 128 tokens, for steps of many tokens. ----
// qgemm decodes a weight once per 64 tokens and spends ~13 instructions per mma (bench/NOTES.md
// v26); here a block of 8 warps decodes each step's 128 x 64 weights once into shared memory (a
// thread 32 consecutive values of a row: a block or K-quant sub-block, `slice32`), and each
// warp multiplies 64 rows x 32 tokens of it (4 x 4 m16n8 tiles) with A and B taken by ldmatrix.
// Grid (ceil(n / 128), ceil(t / 128), splits), k split into parts as qgemm's.
#define QTILE_ROWS 128
#define QTILE_TOKENS 128
#define QTILE_K 64
// Threads that decode the weights and copy x (all of a block but on the specialized path).
#define QTILE_DECODERS 256
// 1: a thread's 32 values decode from one `slice32` (the block's fields loaded and unpacked once);
// 0: from 4 of qgemm's 8-value slices (STRATA_KERNEL_DEFINES="QTILE_UNIT32=0" for the A/B).
#ifndef QTILE_UNIT32
#define QTILE_UNIT32 1
#endif
// 1 (the default) where quant.cu compiles for sm_90a (by default on a 9.0 GPU): each of the
// two warpgroups multiplies its 64 rows by the 128 tokens with wgmma, reading the tiles where they
// are; 0 keeps ldmatrix and mma.sync there too (STRATA_KERNEL_DEFINES="QTILE_WGMMA=0", the A/B).
#ifndef QTILE_WGMMA
#define QTILE_WGMMA 1
#endif
#if QTILE_WGMMA && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define QTILE_ON_WGMMA 1
#else
#define QTILE_ON_WGMMA 0
#endif
// 1 on wgmma (STRATA_KERNEL_DEFINES="QTILE_SPECIALIZED=1", opt-in until timed): warp-specialized
// tiles. Two warpgroups decode weights and copy x into a ring of QTILE_STAGES stages; two more
// only multiply, each stage handed over by mbarriers instead of a block barrier per step, so
// the tensor cores need not wait for the slowest decode (bench/NOTES.md v31). 512 threads, one
// block an SM; quant_call.rs (QuantGemmTile::Specialized) launches it so.
#ifndef QTILE_SPECIALIZED
#define QTILE_SPECIALIZED 0
#endif
#if QTILE_ON_WGMMA && QTILE_SPECIALIZED
#define QTILE_ON_SPECIALIZED 1
#define QTILE_THREADS 512
#define QTILE_MIN_BLOCKS 1
#else
#define QTILE_ON_SPECIALIZED 0
#define QTILE_THREADS 256
#define QTILE_MIN_BLOCKS 2
#endif
#define QTILE_STAGES 3
// A tile row of 64 bf16 (128 bytes) in 16-byte chunks, chunk c of row r stored at c ^ (r % 8):
// the 8 rows an ldmatrix phase reads, and a phase of decode or cp.async stores, hit every bank
// once; from a 1,024-byte aligned base it is also wgmma's 128-byte swizzle.
__device__ __forceinline__ int qtile_at(int row, int col) {
    return row * QTILE_K + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// The wgmma path's tiles in dynamic shared memory (kernels.rs: QTILE_WGMMA_SHARED_BYTES, which
// every launch of the compiled kernel gets): two weight tiles and two x tiles, so that each step's
// decode of the next weights runs while the tensor cores multiply this step's; 1,024 bytes of
// slack align the base. A launch with less traps.
#if QTILE_ON_SPECIALIZED
// The specialized path's ring: QTILE_STAGES stages of a weight and an x tile, then a full and an
// empty mbarrier a stage (kernels.rs: QTILE_SPECIALIZED_SHARED_BYTES).
#define QTILE_WGMMA_SHARED (QTILE_STAGES * 4 * QTILE_ROWS * QTILE_K + 1024 + 16 * QTILE_STAGES)
#else
#define QTILE_WGMMA_SHARED (4 * QTILE_ROWS * QTILE_K * 2 + 1024)
#endif
// 1: the decode of step s + 1 overlaps step s's wgmma (one barrier a step); 0: it runs before
// that wgmma is issued, as in v28 (STRATA_KERNEL_DEFINES="QTILE_OVERLAP=0", the A/B).
#ifndef QTILE_OVERLAP
#define QTILE_OVERLAP 1
#endif

template <class F>
__device__ void qgemm_tile(const u8* __restrict__ w, const bf16* __restrict__ x, void* __restrict__ y,
                           float* __restrict__ parts, int n, int k, int t, int ld, int out_f32, int steps_per_split) {
#if __CUDA_ARCH__ >= 800
#if QTILE_ON_WGMMA
    extern __shared__ unsigned char qtile_dynamic[];
    bf16* const tiles = (bf16*)aligned_dynamic_shared(qtile_dynamic, QTILE_WGMMA_SHARED, QTILE_THREADS);
#if QTILE_ON_SPECIALIZED
    // Stage b: its weight tile at tiles + 2b T, its x tile at tiles + (2b + 1) T (T = 128 x 64
    // values); after the stages, the full mbarriers of each stage, then the empty ones.
    auto ws_buf = [&](int b) { return tiles + 2 * b * (QTILE_ROWS * QTILE_K); };
    auto xs_buf = [&](int b) { return tiles + (2 * b + 1) * (QTILE_ROWS * QTILE_K); };
    const unsigned full_bar = (unsigned)__cvta_generic_to_shared(tiles + 2 * QTILE_STAGES * QTILE_ROWS * QTILE_K);
    const unsigned empty_bar = full_bar + 8 * QTILE_STAGES;
#else
    // Weight tile b at tiles + b T, x tile b at tiles + (2 + b) T (T = 128 x 64 values).
    auto ws_buf = [&](int b) { return tiles + b * (QTILE_ROWS * QTILE_K); };
    auto xs_buf = [&](int b) { return tiles + (2 + b) * (QTILE_ROWS * QTILE_K); };
#endif
#else
    __shared__ __align__(1024) bf16 ws[QTILE_ROWS * QTILE_K];
    __shared__ __align__(1024) bf16 xs[2][QTILE_TOKENS * QTILE_K];
    auto xs_buf = [&](int b) { return &xs[b][0]; };
#endif
    const int warp = threadIdx.x >> 5;
    const int row0 = blockIdx.x * QTILE_ROWS, tok0 = blockIdx.y * QTILE_TOKENS;
    const int steps = k / QTILE_K, first = blockIdx.z * steps_per_split;
    const int last = min(steps, first + steps_per_split);
    const int live = min(QTILE_TOKENS, t - tok0);
    const int kb = k / F::BLOCK;
    // The decode: thread i (of the first QTILE_DECODERS) takes tile row i / 2, columns
    // 32 (i % 2)..+31 of each step; a row past n decodes row 0 and is never stored.
    const int trow = threadIdx.x >> 1, dcol = 32 * (threadIdx.x & 1);
    const int drow = row0 + trow < n ? row0 + trow : 0;
#if QTILE_UNIT32
    typename F::Slice32 cur;
    if (first < last && threadIdx.x < QTILE_DECODERS) cur = F::slice32(w, n, kb, drow, first * QTILE_K + dcol);
#else
    typename F::Slice cur[4];
    if (first < last) {
#pragma unroll
        for (int u = 0; u < 4; u++) cur[u] = F::slice(w, n, kb, drow, first * QTILE_K + dcol + 8 * u);
    }
#endif
    // Decodes step s's slices (in `cur`) into `tile` while the next step's slices load (the last
    // step reloads its own: no read past k).
    auto decode = [&](bf16* tile, int s) {
        const int next = (s + 1 < last ? s + 1 : s) * QTILE_K + dcol;
#if QTILE_UNIT32
        const typename F::Slice32 ahead = F::slice32(w, n, kb, drow, next);
        // The slice's scales once for its four units (bench/NOTES.md v33).
        const Scales32 scales = F::scales32(cur, s * QTILE_K + dcol);
#endif
#pragma unroll
        for (int u = 0; u < 4; u++) {
            float v[8];
#if QTILE_UNIT32
            F::eight_of(cur, scales, s * QTILE_K + dcol, u, v);
#else
            const typename F::Slice ahead = F::slice(w, n, kb, drow, next + 8 * u);
            F::eight(cur[u], s * QTILE_K + dcol + 8 * u, v);
            cur[u] = ahead;
#endif
            const uint4 packed = make_uint4(pack_pair<false>(v[0], v[1]), pack_pair<false>(v[2], v[3]),
                                            pack_pair<false>(v[4], v[5]), pack_pair<false>(v[6], v[7]));
            *(uint4*)&tile[qtile_at(trow, dcol + 8 * u)] = packed;
        }
#if QTILE_UNIT32
        cur = ahead;
#endif
    };
    // x tile of step s into buffer b: QTILE_TOKENS x QTILE_K bf16 in 16-byte pieces, zeros past t.
    // Thread i copies column piece i % 8 of tokens i / 8 + 32 p (p < 4), every step.
    const int x_col = 8 * (threadIdx.x & 7);
    auto load_x = [&](int s, int b) {
#pragma unroll
        for (int p = 0; p < QTILE_TOKENS * QTILE_K / 8 / QTILE_DECODERS; p++) {
            const int tok = (threadIdx.x >> 3) + (QTILE_DECODERS / 8) * p;
            const bool in = tok < live;
            const bf16* src = x + (size_t)(in ? tok0 + tok : 0) * k + s * QTILE_K + x_col;
            cp_async16(&xs_buf(b)[qtile_at(tok, x_col)], src, in ? 16 : 0);
        }
        cp_async_commit();
    };
#if QTILE_ON_WGMMA
    // Issues one step's products of multiplying warp w's warpgroup (w / 4: tile rows 64 (w / 4)..,
    // all 128 tokens) from weight tile wt and x tile xt; k16 steps are 32 bytes into each
    // 128-byte row (2 in the descriptors' address field). The caller waits for them.
    auto issue_products = [&](float(&acc)[64], const bf16* wt, const bf16* xt, int w) {
        const unsigned long long a = wgmma_desc_sw128(&wt[64 * (w >> 2) * QTILE_K]);
        const unsigned long long bx = wgmma_desc_sw128(xt);
        wgmma_hold(acc);
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < QTILE_K / 16; kk++) wgmma_m64n128k16_bf16(acc, a + 2 * kk, bx + 2 * kk);
        wgmma_commit();
    };
#endif
#if QTILE_ON_SPECIALIZED
    // Stage (s - first) % QTILE_STAGES holds step s. Its full barrier completes a phase when the
    // 256 decoders have stored its weights (one arrival each) and their x copies have landed (one
    // each); its empty barrier when the 256 multiplying threads are done reading it.
    if (threadIdx.x == 0) {
        for (int b = 0; b < QTILE_STAGES; b++) {
            mbarrier_init(full_bar + 8 * b, 2 * QTILE_DECODERS);
            mbarrier_init(empty_bar + 8 * b, QTILE_THREADS - QTILE_DECODERS);
        }
    }
    __syncthreads();
    if (threadIdx.x < QTILE_DECODERS) {
        for (int s = first; s < last; s++) {
            const int i = s - first, b = i % QTILE_STAGES, round = i / QTILE_STAGES;
            if (round > 0) mbarrier_wait(empty_bar + 8 * b, (round - 1) & 1);
            // The first weights decode before the previous kernel is waited for.
            decode(ws_buf(b), s);
            if (i == 0) wait_for_previous_kernel();
            load_x(s, b);
            mbarrier_arrive_after_copies(full_bar + 8 * b);
            fence_proxy_async();
            mbarrier_arrive(full_bar + 8 * b);
        }
        return;
    }
    wait_for_previous_kernel();
    // Multiplying warp mwarp (0..7): warpgroup mwarp / 4 takes tile rows 64 (mwarp / 4)..
    const int mwarp = warp - QTILE_DECODERS / 32;
    float acc[64] = {};
    for (int s = first; s < last; s++) {
        const int i = s - first, b = i % QTILE_STAGES;
        mbarrier_wait(full_bar + 8 * b, (i / QTILE_STAGES) & 1);
        // The x copies are the decoders' cp.async stores: ordered before wgmma's reads here.
        fence_proxy_async();
        issue_products(acc, ws_buf(b), xs_buf(b), mwarp);
        wgmma_wait_all();
        wgmma_hold(acc);
        mbarrier_arrive(empty_bar + 8 * b);
    }
    store_wgmma_sums(acc, mwarp, row0, tok0, live, y, parts, n, t, ld, out_f32, grid_split(), 0);
#elif QTILE_ON_WGMMA
    float acc[64] = {};
    // The first weights decode before the previous kernel is waited for: they are not its output.
    if (first < last) decode(ws_buf(0), first);
    wait_for_previous_kernel();
    if (first < last) load_x(first, 0);
    for (int s = first; s < last; s++) {
        const int b = (s - first) & 1;
        cp_async_wait(0);
        fence_proxy_async();
        // Step s's tiles are whole, and every warpgroup's wgmma of step s - 1 is done with the
        // other buffers.
        __syncthreads();
        if (s + 1 < last) load_x(s + 1, b ^ 1);
#if !QTILE_OVERLAP
        if (s + 1 < last) decode(ws_buf(b ^ 1), s + 1);
#endif
        issue_products(acc, ws_buf(b), xs_buf(b), warp);
#if QTILE_OVERLAP
        if (s + 1 < last) decode(ws_buf(b ^ 1), s + 1);
#endif
        wgmma_wait_all();
        wgmma_hold(acc);
    }
    store_wgmma_sums(acc, warp, row0, tok0, live, y, parts, n, t, ld, out_f32, grid_split(), 0);
#else
    float acc[4][4][4] = {};
    const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    wait_for_previous_kernel();
    if (first < last) load_x(first, 0);
    // Warps 2 (rows) x 4 (tokens): warp (wr, wt) takes rows 64 wr.. and tokens 32 wt.. of the tile.
    const int wr = warp >> 2, wt = warp & 3;
    // ldmatrix rows: A's lane l reads row l % 16 of an m16 tile at column + 8 (l / 16); B's reads
    // token l % 8 + 8 (l / 16) of an n8 pair at column + 8 (l / 8 % 2).
    const int a_row = 64 * wr + (lane & 15), a_col = 8 * (lane >> 4);
    const int b_tok = 32 * wt + (lane & 7) + 8 * (lane >> 4), b_col = 8 * ((lane >> 3) & 1);
    for (int s = first; s < last; s++) {
        const int b = (s - first) & 1;
        // Every warp is done with the weights of step s - 1 and with its x buffer (b ^ 1).
        __syncthreads();
        if (s + 1 < last) load_x(s + 1, b ^ 1);
        decode(ws, s);
        cp_async_wait(s + 1 < last ? 1 : 0);
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < QTILE_K / 16; kk++) {
            // B of n8 tiles (0, 1) and (2, 3): registers b0, b1 of the first, then of the second.
            const uint4 bp[2] = {ldmatrix_x4(&xs[b][qtile_at(b_tok, 16 * kk + b_col)]),
                                 ldmatrix_x4(&xs[b][qtile_at(b_tok + 16, 16 * kk + b_col)])};
#pragma unroll
            for (int m = 0; m < 4; m++) {
                const uint4 a = ldmatrix_x4(&ws[qtile_at(a_row + 16 * m, 16 * kk + a_col)]);
                // Tokens past t multiply zeros (their x rows are zero-filled) and are never stored:
                // no branch between the mma.
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const uint4& q = bp[j >> 1];
                    mma_16x8x16<false>(acc[m][j], a.x, a.y, a.z, a.w, j & 1 ? q.z : q.x, j & 1 ? q.w : q.y);
                }
            }
        }
    }
    // Lane (g, c) holds rows g (e 0, 1) and g + 8 (e 2, 3) of each m16 tile, tokens 2c, 2c + 1.
#pragma unroll
    for (int m = 0; m < 4; m++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int row = row0 + 64 * wr + 16 * m + g + 8 * (e >> 1);
                const int tok = 32 * wt + 8 * j + 2 * c + (e & 1);
                if (row < n && tok < live) qgemm_store(acc[m][j][e], y, parts, n, t, ld, out_f32, row, tok0 + tok);
            }
#endif
#endif
}

// ---- Wide tiles: the weights as wgmma's register operand (sm_90a; Q4_K and Q6_K) ----
// A block of two warpgroups multiplies 128 rows by NT tokens (256; 64, 128 or 192 for products of
// fewer tokens, bench/NOTES.md v49), k in steps of 64 columns, so a step of up to NT tokens
// decodes each weight once. No decoded weight passes through shared memory:
// each lane decodes its own A fragments (2 rows x 16 columns a step) from the raw block bytes into
// registers, and wgmma reads them there while x comes from shared memory (bench/NOTES.md v35).
// A ring of QWIDE_STAGES stages (the step's x tile, by TMA unless QWIDE_TMA=0, and its raw weight
// bytes by cp.async) fills two steps ahead; the decode of step s runs while the tensor cores
// multiply step s - 1. K split into parts as qgemm's; the grid is qgemm_wide's.
#define QWIDE_ROWS 128
#define QWIDE_THREADS 256
#ifndef QWIDE_STAGES
#define QWIDE_STAGES 4
#endif
#define QWIDE_X_BYTES(NT) ((NT) * QTILE_K * 2)
// A stage's raw weight bytes, the most any format takes (Q6_K: 128 x 112 + 128 x 4).
#define QWIDE_W_BYTES 16384
// kernels.rs: wide_shared_bytes (every launch gets it): the stages, an mbarrier a stage for the
// TMA path's x tiles, and 1,024 bytes of slack to align the base.
#define QWIDE_SHARED(NT) (QWIDE_STAGES * (QWIDE_X_BYTES(NT) + QWIDE_W_BYTES + 8) + 1024)
// 1: one thread copies each step's x tile by TMA (the kernel's x_map, 64 columns x NT tokens,
// zeros past t) into the stage, completing on the stage's mbarrier, instead of every lane issuing
// eight 16-byte cp.async, which ncu found the wide tiles waiting on (bench/NOTES.md v35, v36:
// 3.4 % off the 256-user step). 0 (STRATA_KERNEL_DEFINES="QWIDE_TMA=0"): the lanes' copies.
#ifndef QWIDE_TMA
#define QWIDE_TMA 1
#endif
// Measurement only, wrong sums (bench/NOTES.md v54): 1 skips the fragments' decode (each lane
// loads one word of its row's stage bytes, masked to a small bf16 pair, for all 16 registers), 2
// skips the products (the decode folded into one sum so it stays), 3 skips the decode and takes
// A from shared memory (the x tile's rows: wgmma's SS form; 256-token tiles, the others as 1).
// 0, the default: none of them.
#ifndef QWIDE_PROBE
#define QWIDE_PROBE 0
#endif
// v54 (opt-in, STRATA_KERNEL_DEFINES=QWIDE_SS=1): the 256-token wide tiles warp-specialized.
// The same block (128 rows x 256 tokens, 64-column steps, x and the weight planes by TMA into a
// ring of QWIDE_STAGES stages), but three warpgroups: the first two only multiply, each 64 rows
// by wgmma's SS form (A and x from shared memory), and the third only decodes, a thread a row,
// its 64 values into a bf16 A tile (the 128-byte swizzle wgmma reads) in a ring of two. Stages pass
// between them by mbarriers, never a block barrier, so the decode of later steps runs while the
// tensor cores multiply (bench/NOTES.md v54). The decoders' first thread issues the TMA copies;
// each decoder copies its row's Q6_K d word itself (wide_copy_word), counted on the stage's
// mbarrier. The pairs (a QKV of Q4_K and Q6_K rows) and the narrower tiles stay as they are.
#ifndef QWIDE_SS
#define QWIDE_SS 0
#endif
#if QWIDE_SS && !(QWIDE_TMA && QWIDE_W_TMA)
#error "QWIDE_SS needs x and the weights by TMA"
#endif
#define QWIDE_SS_THREADS 384
#define QWIDE_SS_A_BYTES (QWIDE_ROWS * QTILE_K * 2)
// kernels.rs: wide_ss_shared_bytes. The stages, the two A tiles, twelve mbarriers (full and empty
// a stage, full and empty an A tile) and the slack.
#define QWIDE_SS_SHARED (QWIDE_STAGES * (QWIDE_X_BYTES(256) + QWIDE_W_BYTES) + 2 * QWIDE_SS_A_BYTES + 96 + 1024)
template <class F>
struct WideSs {
    static constexpr bool value = false;
};
template <>
struct WideSs<FmtQ4_K> {
    static constexpr bool value = true;
};
template <>
struct WideSs<FmtQ6_K> {
    static constexpr bool value = true;
};
// Whether qgemm_wide<F, NT> runs warp-specialized: Q4_K's and Q6_K's 256-token tiles, on wgmma,
// under QWIDE_SS.
template <class F, int NT>
__host__ __device__ constexpr bool wide_ss() {
    return QWIDE_SS && QTILE_ON_WGMMA && NT == 256 && WideSs<F>::value;
}
#if QTILE_ON_WGMMA
// kernels.rs reads these names in the PTX: the wide tiles then need their x map, their weight
// maps (QWIDE_W_TMA: see wide_at). The PTX's TMA instructions alone cannot tell the two apart.
#if QWIDE_TMA
extern "C" __constant__ int qwide_x_by_tma = 1;
#endif
#if QWIDE_W_TMA
extern "C" __constant__ int qwide_weights_by_tma = 1;
#endif

// The bytes of a step's weight planes by TMA (QWIDE_W_TMA): 128 rows of each field.
template <class F>
__host__ __device__ constexpr unsigned wide_plane_bytes() {
    return QWIDE_ROWS * (F::WIDE_WIDTH[0] + F::WIDE_WIDTH[1] + F::WIDE_WIDTH[2]);
}
// Step s's weight planes of tile rows row0.. by TMA into `stage`, completing on mbarrier `bar`.
template <class F>
__device__ __forceinline__ void wide_planes_by_tma(u8* stage, const TmaMap* const (&w_maps)[3], int s, int row0,
                                                   unsigned bar) {
#pragma unroll
    for (int p = 0; p < F::WIDE_FIELDS; p++)
        tma_load_2d(stage + F::WIDE_PLANE_AT[p], w_maps[p], F::wide_col(p, s), row0, bar);
}

// One block's product: tile rows row0.. of the n-row segment w by NT tokens from tok0,
// k steps [first, last) (none: zeros), stored as rows out0 + row0.. of an n_out-row output, as
// qgemm_store_to's z and prow0 say (out0 0 and n_out n, but in a pair: out0 the segment's first
// row of the product, n_out both segments' rows).
template <class F, int NT>
__device__ __forceinline__ void qgemm_wide_block(const u8* __restrict__ w, const bf16* __restrict__ x,
                                                 void* __restrict__ y, float* __restrict__ parts, int n, int k, int t,
                                                 int ld, int out_f32, int first, int last, int row0, int tok0,
                                                 const TmaMap& x_map, const TmaMap* const (&w_maps)[3], u8* const base,
                                                 int z, int prow0, int out0, int n_out) {
    static_assert(QWIDE_ROWS == QSTAGED_ROWS &&
                      NT * QSTAGED_STRIDE * 4 <= QWIDE_STAGES * (QWIDE_X_BYTES(NT) + QWIDE_W_BYTES),
                  "the staged sums fit the stages");
    constexpr unsigned X_BYTES = QWIDE_X_BYTES(NT);
    constexpr bool tma = QWIDE_TMA, w_tma = QWIDE_W_TMA;
    // The bytes a stage's mbarrier waits for: the x tile's and the weight planes' by TMA.
    constexpr unsigned STAGE_TX = (tma ? X_BYTES : 0) + (w_tma ? wide_plane_bytes<F>() : 0);
    auto x_stage = [&](int b) { return (bf16*)(base + b * X_BYTES); };
    auto w_stage = [&](int b) { return base + QWIDE_STAGES * X_BYTES + b * QWIDE_W_BYTES; };
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, c = lane & 3;
    const int live = min(NT, t - tok0);
    const int kb = k / F::BLOCK;
    // The raw bytes of step s: thread i copies half i / 128 of tile row i % 128's (a row past n
    // copies row 0, never stored); Q6_K's words of d go after the planes.
    const int crow = threadIdx.x & (QWIDE_ROWS - 1), chalf = threadIdx.x / QWIDE_ROWS;
    const size_t cblk = (size_t)(row0 + crow < n ? row0 + crow : 0) * kb;
    const u8* const crow_bytes = w + cblk * F::WIDE_BLOCK_BYTES;
    // x tile of step s by TMA into stage b, completing on x_full + 8 b (the map's 128-byte
    // swizzle is qtile_at's; rows past t arrive as zeros and count in the bytes), and under
    // QWIDE_W_TMA the weight planes on the same mbarrier.
    const unsigned x_full = (unsigned)__cvta_generic_to_shared(base + QWIDE_STAGES * (X_BYTES + QWIDE_W_BYTES));
    auto load_weights = [&](int s, int b) {
        u8* const stage = w_stage(b);
        if constexpr (w_tma) {
            if (threadIdx.x == 0) {
                mbarrier_expect_tx(x_full + 8 * b, STAGE_TX);
                wide_planes_by_tma<F>(stage, w_maps, s, row0, x_full + 8 * b);
            }
            if constexpr (F::WIDE_WORD) {
                if (chalf == 1) F::wide_copy_word(stage + F::WIDE_WORDS_AT + 4 * crow, w, n, kb, cblk, s);
            }
        } else {
            F::wide_copy(stage + crow * F::WIDE_ROW, stage + F::WIDE_WORDS_AT + 4 * crow, w, n, kb, cblk, crow_bytes,
                         s, chalf);
        }
    };
    if constexpr (tma || w_tma) {
        if (threadIdx.x == 0) {
            for (int b = 0; b < QWIDE_STAGES; b++) mbarrier_init(x_full + 8 * b, 1);
            fence_mbarrier_init();
        }
        __syncthreads();
    }
    // Without TMA, the x tile of step s: NT x 64 bf16 in 16-byte pieces (qtile_at's swizzle), zeros
    // past t (a zero-byte copy reads nothing; copying the last token's row instead made gate/up
    // at 160-224 tokens 1.4-2.1x slower, bench/NOTES.md v35). Thread i copies piece i % 8 of
    // tokens i / 8 + 32 p, a warp four whole 128-byte rows an instruction; 32 tokens on, the
    // swizzle repeats.
    constexpr int X_ROWS = NT * QTILE_K / 8 / QWIDE_THREADS;
    const int x_col = 8 * (threadIdx.x & 7), x_tok = threadIdx.x >> 3;
    const bf16* const x_row = x + (size_t)(tok0 + x_tok) * k + x_col;
    const size_t x_stride = (size_t)(QWIDE_THREADS / 8) * k;
    // This thread's tokens within t: p < x_live.
    const int x_live = (live - x_tok + QWIDE_THREADS / 8 - 1) / (QWIDE_THREADS / 8);
    const int x_dst = qtile_at(x_tok, x_col);
    auto load_x = [&](int s, int b) {
        if constexpr (tma) {
            if (threadIdx.x == 0) {
                // Under QWIDE_W_TMA the stage's weights, loaded first, set the whole count.
                if constexpr (!w_tma) mbarrier_expect_tx(x_full + 8 * b, STAGE_TX);
                tma_load_2d(x_stage(b), &x_map, s * QTILE_K, tok0, x_full + 8 * b);
            }
        } else {
            bf16* const dst = x_stage(b) + x_dst;
            const bf16* src = x_row + s * QTILE_K;
#pragma unroll
            for (int p = 0; p < X_ROWS; p++) {
                const bool in = p < x_live;
                cp_async16(dst + (QWIDE_THREADS / 8) * p * QTILE_K, in ? src : x, in ? 16 : 0);
                src += x_stride;
            }
        }
    };
    // This lane's fragment rows: tile rows 16 warp + g and + 8 (warpgroup warp / 4 takes 64 rows).
    const int ra = 16 * warp + g, rb = ra + 8;
    // Which half of its word holds a row's d: the parity of its block's index (Q6_K).
    const int half_a = ((row0 + ra < n ? row0 + ra : 0) * kb) & 1, half_b = ((row0 + rb < n ? row0 + rb : 0) * kb) & 1;
    float acc[NT / 2] = {};
    u32 a0[4][4], a1[4][4];
    // Step s: its stage is whole once this thread's copies have landed and every thread has
    // passed the barrier, which also says each warpgroup has waited for step s - 2's products:
    // their stage takes step s + 2's copies. Then decode step s's fragments (the tensor cores are
    // still on step s - 1) and issue its products; wait until only those are in flight, so the
    // other fragment registers are free for step s + 1.
    auto step = [&](int s, u32(&a)[4][4]) {
        const int i = s - first, b = i % QWIDE_STAGES;
        cp_async_wait(QWIDE_STAGES - 3);
        fence_proxy_async();
        __syncthreads();
        if constexpr (tma || w_tma) mbarrier_wait(x_full + 8 * b, (i / QWIDE_STAGES) & 1);
        if (s + QWIDE_STAGES - 2 < last) {
            load_weights(s + QWIDE_STAGES - 2, (i + QWIDE_STAGES - 2) % QWIDE_STAGES);
            load_x(s + QWIDE_STAGES - 2, (i + QWIDE_STAGES - 2) % QWIDE_STAGES);
        }
        cp_async_commit();
        const u8* stage = w_stage(b);
        const u32* words = (const u32*)(stage + F::WIDE_WORDS_AT);
        const int sb = (s >> 2) & 1;
#if QWIDE_PROBE == 1 || QWIDE_PROBE == 3
        const u32 raw = *(const u32*)(stage + 16 * ra + 4 * c) & 0x3E7F3E7Fu;
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
#pragma unroll
            for (int j = 0; j < 4; j++) a[kk][j] = raw + kk + j;
#else
        F::wide_fragment(stage, ra, F::WIDE_WORD ? words[ra] : 0u, s, c, 0, a, half_a ^ sb);
        F::wide_fragment(stage, rb, F::WIDE_WORD ? words[rb] : 0u, s, c, 1, a, half_b ^ sb);
#endif
        const unsigned long long bx = wgmma_desc_sw128(x_stage(b));
        wgmma_fence();
#if QWIDE_PROBE == 2
        u32 folded = 0;
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
#pragma unroll
            for (int j = 0; j < 4; j++) folded ^= a[kk][j];
        acc[0] += __uint_as_float(folded & 0x3E7F3E7Fu) + (float)bx;
#elif QWIDE_PROBE == 3
        if constexpr (NT == 256) {
#pragma unroll
            for (int kk = 0; kk < QTILE_K / 16; kk++)
                wgmma_m64n256k16_bf16(acc, bx + (warp >> 2) * 512 + 2 * kk, bx + 2 * kk);
        } else {
#pragma unroll
            for (int kk = 0; kk < QTILE_K / 16; kk++) wgmma_bf16_rs<NT>(acc, a[kk], bx + 2 * kk);
        }
#else
#pragma unroll
        for (int kk = 0; kk < QTILE_K / 16; kk++) wgmma_bf16_rs<NT>(acc, a[kk], bx + 2 * kk);
#endif
        wgmma_commit();
        wgmma_wait_one();
    };
    // The first stages' weights load before the wait for the previous kernel (they are not its
    // output); each stage's copies are one commit group, the first holding the early weights.
    for (int j = 0; j < QWIDE_STAGES - 2; j++)
        if (first + j < last) load_weights(first + j, j);
    wait_for_previous_kernel();
    for (int j = 0; j < QWIDE_STAGES - 2; j++) {
        if (first + j < last) load_x(first + j, j);
        cp_async_commit();
    }
    int s = first;
    for (; s + 1 < last; s += 2) {
        step(s, a0);
        step(s + 1, a1);
    }
    if (s < last) step(s, a0);
    wgmma_wait_all();
    wgmma_hold(acc);
    // Every warp is done with the stages (its products waited for) before its sums are staged
    // there: acc[4 j + e] is the fragment's [j][e] (store_wgmma_sums' layout), from row 16 warp.
    __syncthreads();
    float* const tile = (float*)base;
    stage_fragment_sums(reinterpret_cast<const float(&)[NT / 8][4]>(acc), tile, 16 * warp);
    __syncthreads();
    store_staged_sums<QWIDE_THREADS / 32>(tile, out0 + row0, tok0, live, y, parts, n_out, t, ld, out_f32, z, prow0);
}


// Row r's 64 values of step s from stage `stage` as bf16, stored in the A tile `a` (row r of half
// r / 64, 16-byte chunk c at c ^ (r % 8)), by the same arithmetic as F::wide_fragment, so the
// products see the same values. Q4_K: the low nibbles of the step's 32 bytes are columns 0-31,
// the high ones 32-63.
template <class F>
__device__ __forceinline__ void wide_ss_decode(const u8* stage, int r, int s, u8* a, u32, int);
// Row r's 64 bf16 values into the A tile `a`: pair(m, h, lo, hi) gives columns 8m + 2h, + 1 (lo)
// and 32 + 8m + 2h, + 1 (hi) as bf16 pairs.
template <class Pair>
__device__ __forceinline__ void wide_ss_store(u8* a, int r, Pair pair) {
    u8* const row = a + (r >> 6) * (QWIDE_SS_A_BYTES / 2) + (r & 63) * 128;
#pragma unroll
    for (int m = 0; m < 4; m++) {
        u32 lo[4], hi[4];
#pragma unroll
        for (int h = 0; h < 4; h++) pair(m, h, lo[h], hi[h]);
        *(uint4*)(row + ((m ^ (r & 7)) << 4)) = make_uint4(lo[0], lo[1], lo[2], lo[3]);
        *(uint4*)(row + (((4 + m) ^ (r & 7)) << 4)) = make_uint4(hi[0], hi[1], hi[2], hi[3]);
    }
}
template <>
__device__ __forceinline__ void wide_ss_decode<FmtQ4_K>(const u8* stage, int r, int s, u8* a, u32, int) {
    const uint4 head = *(const uint4*)(stage + wide_at<FmtQ4_K, 0>(r, 0));
    const uint4 q0 = *(const uint4*)(stage + wide_at<FmtQ4_K, 1>(r, 0));
    const uint4 q1 = *(const uint4*)(stage + wide_at<FmtQ4_K, 1>(r, 16));
    const PairScales k = k4_pair_scales(head, s & 3);
    const u32 q[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
    wide_ss_store(a, r, [&](int m, int h, u32& lo, u32& hi) {
        // Bytes 2 (h & 1), + 1 of word 2m + h / 2 into the pair's halves.
        const u32 p = __byte_perm(q[2 * m + (h >> 1)], 0u, h & 1 ? 0x4342u : 0x4140u);
        lo = bf16x2_fma(bf16x2_fma(and_or<0x000F000Fu>(p, 0x43004300u), BF16X2_ONE, 0xC300C300u), k.s_lo, k.b_lo);
        hi = bf16x2_fma(bf16x2_fma(and_or<0x000F000Fu>(p >> 4, 0x43004300u), BF16X2_ONE, 0xC300C300u), k.s_hi, k.b_hi);
    });
}
// Q6_K: column j < 32 from low-bit byte j (bits 4 (s % 2)..) and high-bit byte j (bits 4 (s % 2),
// + 1), column 32 + j from low-bit byte 32 + j and the same high-bit byte (bits 4 (s % 2) + 2, + 3);
// 16-column piece kk takes scale 4 (s % 4) + kk; `word` holds d in its half `dhalf`.
template <>
__device__ __forceinline__ void wide_ss_decode<FmtQ6_K>(const u8* stage, int r, int s, u8* a, u32 word, int dhalf) {
    const float d = half_to_f32(word >> (16 * dhalf));
    const u32 scales = *(const u32*)(stage + wide_at<FmtQ6_K, 2>(r, 4 * (s & 3)));
    u32 sl[4];
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        const float dl = d * (float)(signed char)(scales >> (8 * kk));
        sl[kk] = pack_pair<false>(dl, dl);
    }
    u32 ql[16], qh[8];
#pragma unroll
    for (int p = 0; p < 4; p++) {
        const uint4 v = *(const uint4*)(stage + wide_at<FmtQ6_K, 0>(r, 16 * p));
        ql[4 * p] = v.x, ql[4 * p + 1] = v.y, ql[4 * p + 2] = v.z, ql[4 * p + 3] = v.w;
    }
#pragma unroll
    for (int p = 0; p < 2; p++) {
        const uint4 v = *(const uint4*)(stage + wide_at<FmtQ6_K, 1>(r, 16 * p));
        qh[4 * p] = v.x, qh[4 * p + 1] = v.y, qh[4 * p + 2] = v.z, qh[4 * p + 3] = v.w;
    }
    const int odd = 4 * (s & 1);
    wide_ss_store(a, r, [&](int m, int h, u32& lo, u32& hi) {
        const u32 sel = h & 1 ? 0x4342u : 0x4140u;
        const int at = 2 * m + (h >> 1);
        const u32 lo0 = __byte_perm(ql[at], 0u, sel) >> odd;
        const u32 lo1 = __byte_perm(ql[8 + at], 0u, sel) >> odd;
        const u32 hb = __byte_perm(qh[at], 0u, sel);
        const u32 v0 = and_or<0x000F000Fu>(lo0, and_or<0x00300030u>(hb << 4 >> odd, 0x43004300u));
        const u32 v1 = and_or<0x000F000Fu>(lo1, and_or<0x00300030u>(hb << 2 >> odd, 0x43004300u));
        // (128 + q) - 160 = q - 32, exact; times the scale, rounded once.
        lo = bf16x2_fma(bf16x2_fma(v0, BF16X2_ONE, 0xC320C320u), sl[m >> 1], 0u);
        hi = bf16x2_fma(bf16x2_fma(v1, BF16X2_ONE, 0xC320C320u), sl[2 + (m >> 1)], 0u);
    });
}

// qgemm_wide_block's product (same arguments) on the warp-specialized tiles, for 256 tokens.
template <class F>
__device__ __forceinline__ void qgemm_wide_ss_block(const u8* __restrict__ w, const bf16* __restrict__ x,
                                                    void* __restrict__ y, float* __restrict__ parts, int n, int k,
                                                    int t, int ld, int out_f32, int first, int last, int row0,
                                                    int tok0, const TmaMap& x_map, const TmaMap* const (&w_maps)[3],
                                                    u8* const base, int z, int prow0, int out0, int n_out) {
    constexpr unsigned X_BYTES = QWIDE_X_BYTES(256);
    constexpr unsigned STAGE_TX = X_BYTES + wide_plane_bytes<F>();
    auto x_stage = [&](int b) { return base + b * X_BYTES; };
    auto w_stage = [&](int b) { return base + QWIDE_STAGES * X_BYTES + b * QWIDE_W_BYTES; };
    u8* const a_tiles = base + QWIDE_STAGES * (X_BYTES + QWIDE_W_BYTES);
    // mbarriers: full[b] (the TMA copies' bytes, and for Q6_K the 128 decoders' word copies),
    // empty[b] (the decoders' 4 warps and the 8 multiplying warps are done with stage b), a_full[j]
    // (4 decoding warps stored A tile j), a_empty[j] (the 8 multiplying warps' products of it are
    // done).
    const unsigned bars = (unsigned)__cvta_generic_to_shared(a_tiles + 2 * QWIDE_SS_A_BYTES);
    auto full = [&](int b) { return bars + 8 * b; };
    auto empty = [&](int b) { return bars + 8 * (QWIDE_STAGES + b); };
    auto a_full = [&](int j) { return bars + 8 * (2 * QWIDE_STAGES + j); };
    auto a_empty = [&](int j) { return bars + 8 * (2 * QWIDE_STAGES + 2 + j); };
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int live = min(256, t - tok0);
    const bool decoder = warp >= 8, issuer = threadIdx.x == 256;
    if (threadIdx.x == 0) {
        for (int b = 0; b < QWIDE_STAGES; b++) {
            mbarrier_init(full(b), F::WIDE_WORD ? 1 + 128 : 1);
            mbarrier_init(empty(b), 12);
        }
        for (int j = 0; j < 2; j++) {
            mbarrier_init(a_full(j), 4);
            mbarrier_init(a_empty(j), 8);
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    auto load_weights = [&](int s, int b) {
        mbarrier_expect_tx(full(b), STAGE_TX);
        wide_planes_by_tma<F>(w_stage(b), w_maps, s, row0, full(b));
    };
    auto load_x = [&](int s, int b) { tma_load_2d(x_stage(b), &x_map, s * QTILE_K, tok0, full(b)); };
    // A decoder's row and the first block of its bytes (a row past n copies row 0, never stored),
    // for Q6_K's words of d: each decoder copies its row's, counted on the stage's mbarrier.
    const int r = threadIdx.x - 256, kb = k / F::BLOCK;
    const size_t rblk = (size_t)(row0 + r < n ? row0 + r : 0) * kb;
    auto load_word = [&](int s, int b) {
        if constexpr (F::WIDE_WORD) {
            F::wide_copy_word(w_stage(b) + F::WIDE_WORDS_AT + 4 * r, w, n, kb, rblk, s);
            mbarrier_arrive_after_copies(full(b));
        }
    };
    // The first steps' weights before the wait for the previous kernel (they are not its output).
    if (issuer)
        for (int j = 0; j < QWIDE_STAGES - 1; j++)
            if (first + j < last) load_weights(first + j, j);
    if (decoder)
        for (int j = 0; j < QWIDE_STAGES - 1; j++)
            if (first + j < last) load_word(first + j, j);
    wait_for_previous_kernel();
    if (issuer)
        for (int j = 0; j < QWIDE_STAGES - 1; j++)
            if (first + j < last) load_x(first + j, j);
    float* const tile = (float*)base;
    if (decoder) {
        // Which half of its word holds the row's d: the parity of its block's index (Q6_K).
        const int dhalf = rblk & 1;
        for (int s = first; s < last; s++) {
            const int i = s - first, b = i % QWIDE_STAGES, j = i & 1;
            mbarrier_wait(full(b), (i / QWIDE_STAGES) & 1);
            if (i >= 2) mbarrier_wait(a_empty(j), ((i - 2) >> 1) & 1);
            const u32 word = F::WIDE_WORD ? *(const u32*)(w_stage(b) + F::WIDE_WORDS_AT + 4 * r) : 0u;
            wide_ss_decode<F>(w_stage(b), r, s, a_tiles + j * QWIDE_SS_A_BYTES, word, dhalf ^ ((s >> 2) & 1));
            fence_proxy_async();
            __syncwarp();
            if (lane == 0) {
                mbarrier_arrive(a_full(j));
                mbarrier_arrive(empty(b));
            }
            // Stage i + STAGES - 1's copies go where step i - 1's were, once all are done with it
            // (a decoder's word copy only waits for its own reads of step i - 1's).
            const int next = i + QWIDE_STAGES - 1;
            if (first + next < last) load_word(first + next, next % QWIDE_STAGES);
            if (issuer && first + next < last) {
                const int nb = next % QWIDE_STAGES;
                if (i >= 1) mbarrier_wait(empty(nb), ((i - 1) / QWIDE_STAGES) & 1);
                load_weights(first + next, nb);
                load_x(first + next, nb);
            }
        }
    } else {
        const int half = warp >> 2;
        // No zeros written before the products (ptxas then serializes them): the first step's
        // products overwrite acc, and a block of no steps zeroes it after.
        float acc[128];
        for (int s = first; s < last; s++) {
            const int i = s - first, b = i % QWIDE_STAGES, j = i & 1;
            mbarrier_wait(full(b), (i / QWIDE_STAGES) & 1);
            mbarrier_wait(a_full(j), (i >> 1) & 1);
            const unsigned long long ax = wgmma_desc_sw128(a_tiles + j * QWIDE_SS_A_BYTES) + half * 512;
            const unsigned long long bx = wgmma_desc_sw128(x_stage(b));
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < QTILE_K / 16; kk++)
                wgmma_m64n256k16_bf16(acc, ax + 2 * kk, bx + 2 * kk, i > 0 || kk > 0);
            wgmma_commit();
            wgmma_wait_one();
            // Step i - 1's products are done: its A tile and stage are free.
            if (i >= 1 && lane == 0) {
                mbarrier_arrive(a_empty((i - 1) & 1));
                mbarrier_arrive(empty((i - 1) % QWIDE_STAGES));
            }
        }
        wgmma_wait_all();
        wgmma_hold(acc);
        if (first >= last)
#pragma unroll
            for (int e = 0; e < 128; e++) acc[e] = 0.0f;
        // Both warpgroups' products are done (the decoders' last reads and every copy came before
        // them): the stages take the sums, acc[4 j + e] the fragment's [j][e], from row 16 warp.
        asm volatile("bar.sync 1, 256;" ::: "memory");
        stage_fragment_sums(reinterpret_cast<const float(&)[32][4]>(acc), tile, 16 * warp);
    }
    // All twelve warps store the sums.
    __syncthreads();
    store_staged_sums<QWIDE_SS_THREADS / 32>(tile, out0 + row0, tok0, live, y, parts, n_out, t, ld, out_f32, z, prow0);
}
#endif

// Grid (ceil(n / 128) - tail + tail x tail_splits, ceil(t / 256), splits): the first row tiles
// whole (k split as the grid's z says), the last `tail` (where k is not split) each in tail_splits
// blocks that split its steps evenly into the tail's parts ([tail_splits, t, rows of the tail]),
// so the last wave of a product of more tiles than SMs is not left mostly empty; qgemm_reduce adds
// them after (bench/NOTES.md v41).
template <class F, int NT>
__device__ void qgemm_wide(const u8* __restrict__ w, const bf16* __restrict__ x, void* __restrict__ y,
                           float* __restrict__ parts, int n, int k, int t, int ld, int out_f32, int steps_per_split,
                           int tail, int tail_splits, const TmaMap& x_map, const TmaMap* const (&w_maps)[3]) {
#if QTILE_ON_WGMMA
    extern __shared__ unsigned char qwide_dynamic[];
    constexpr bool ss = wide_ss<F, NT>();
    u8* const base = aligned_dynamic_shared(qwide_dynamic, ss ? QWIDE_SS_SHARED : QWIDE_SHARED(NT),
                                            ss ? QWIDE_SS_THREADS : QWIDE_THREADS);
    const int steps = k / QTILE_K;
    const int whole = (n + QWIDE_ROWS - 1) / QWIDE_ROWS - tail;
    const int tok0 = blockIdx.y * NT;
    // A block's rows, steps and where its sums go: a whole tile (k split as the grid's z says) or a
    // tail piece.
    int first, last, row0, z, prow0;
    if ((int)blockIdx.x < whole) {
        first = blockIdx.z * steps_per_split;
        last = min(steps, first + steps_per_split);
        row0 = blockIdx.x * QWIDE_ROWS;
        z = grid_split();
        prow0 = 0;
    } else {
        const int piece = blockIdx.x - whole, per = (steps + tail_splits - 1) / tail_splits;
        z = piece % tail_splits;
        first = min(steps, z * per);
        last = min(steps, first + per);
        row0 = (whole + piece / tail_splits) * QWIDE_ROWS;
        prow0 = whole * QWIDE_ROWS;
    }
    if constexpr (ss)
        qgemm_wide_ss_block<F>(w, x, y, parts, n, k, t, ld, out_f32, first, last, row0, tok0, x_map, w_maps, base, z, prow0,
                            0, n);
    else
        qgemm_wide_block<F, NT>(w, x, y, parts, n, k, t, ld, out_f32, first, last, row0, tok0, x_map, w_maps, base, z,
                                prow0, 0, n);
#else
    // Compiled without wgmma: the host never launches it (Kernels::wide_tiles).
    __trap();
#endif
}

// Blocks an SM holds of the NT-token wide tiles (quant_call.rs: QuantGemmTile::blocks_per_sm).
#define QWIDE_MIN_BLOCKS(NT) ((NT) == 64 ? 2 : 1)

// qgemm_wide{WIDTH}_{NAME} over NT tokens a tile (WIDTH empty for 256); warp-specialized (384
// threads, which Kernels::load reads from the PTX's .maxntid) where wide_ss says.
#define QUANT_WIDE_KERNEL(F, NAME, NT, WIDTH)                                                                   \
    extern "C" __global__ void __launch_bounds__(wide_ss<F, NT>() ? QWIDE_SS_THREADS : QWIDE_THREADS,          \
                                                 QWIDE_MIN_BLOCKS(NT))                                          \
        qgemm_wide##WIDTH##_##NAME(const u8* w, const bf16* x, void* y, float* parts, int n, int k, int t, int ld,      \
                          int out_f32, int steps, int tail, int tail_splits,                                    \
                          const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w_map0,          \
                          const __grid_constant__ TmaMap w_map1, const __grid_constant__ TmaMap w_map2) {       \
        const TmaMap* const w_maps[3] = {&w_map0, &w_map1, &w_map2};                                          \
        qgemm_wide<F, NT>(w, x, y, parts, n, k, t, ld, out_f32, steps, tail, tail_splits, x_map, w_maps);      \
    }

// Two segments of one product in one launch, as qgemm_wide's whole tiles: a layer's QKV whose v
// rows are Q6_K, which took two launches and two reduces, ~74 us at 224 tokens against ~34 for one
// segment (bench/NOTES.md v46). Grid (n0 / 128 + ceil(n1 / 128), ceil(t / NT), splits): segment
// 0's row tiles (n0 a multiple of 128), then segment 1's, whose rows are rows n0.. of y (and of
// parts, [splits, t, n0 + n1]); every block takes steps_per_split of k's steps.
template <class F0, class F1, int NT>
__device__ void qgemm_wide_pair(const u8* __restrict__ w0, const u8* __restrict__ w1, const bf16* __restrict__ x,
                                void* __restrict__ y, float* __restrict__ parts, int n0, int n1, int k, int t, int ld,
                                int out_f32, int steps_per_split, const TmaMap& x_map,
                                const TmaMap* const (&w0_maps)[3], const TmaMap* const (&w1_maps)[3]) {
#if QTILE_ON_WGMMA
    extern __shared__ unsigned char qwide_dynamic[];
    u8* const base = aligned_dynamic_shared(qwide_dynamic, QWIDE_SHARED(NT), QWIDE_THREADS);
    const int steps = k / QTILE_K, tiles0 = n0 / QWIDE_ROWS, tok0 = blockIdx.y * NT;
    const int first = blockIdx.z * steps_per_split, last = min(steps, first + steps_per_split);
    if ((int)blockIdx.x < tiles0)
        qgemm_wide_block<F0, NT>(w0, x, y, parts, n0, k, t, ld, out_f32, first, last, blockIdx.x * QWIDE_ROWS, tok0,
                             x_map, w0_maps, base, grid_split(), 0, 0, n0 + n1);
    else
        qgemm_wide_block<F1, NT>(w1, x, y, parts, n1, k, t, ld, out_f32, first, last,
                             ((int)blockIdx.x - tiles0) * QWIDE_ROWS, tok0, x_map, w1_maps, base, grid_split(), 0, n0,
                             n0 + n1);
#else
    // Compiled without wgmma: the host never launches it (Kernels::wide_tiles).
    __trap();
#endif
}

#define QUANT_WIDE_PAIR_KERNEL(F0, F1, NAME, NT, WIDTH)                                                         \
    extern "C" __global__ void __launch_bounds__(QWIDE_THREADS, QWIDE_MIN_BLOCKS(NT))                          \
        qgemm_wide##WIDTH##_pair_##NAME(                                                                        \
        const u8* w0, const u8* w1, const bf16* x, void* y, float* parts, int n0, int n1, int k, int t, int ld,    \
        int out_f32, int steps, const __grid_constant__ TmaMap x_map, const __grid_constant__ TmaMap w0_map0,  \
        const __grid_constant__ TmaMap w0_map1, const __grid_constant__ TmaMap w0_map2,                       \
        const __grid_constant__ TmaMap w1_map0, const __grid_constant__ TmaMap w1_map1,                       \
        const __grid_constant__ TmaMap w1_map2) {                                                              \
        const TmaMap* const w0_maps[3] = {&w0_map0, &w0_map1, &w0_map2};                                      \
        const TmaMap* const w1_maps[3] = {&w1_map0, &w1_map1, &w1_map2};                                      \
        qgemm_wide_pair<F0, F1, NT>(w0, w1, x, y, parts, n0, n1, k, t, ld, out_f32, steps, x_map, w0_maps,     \
                                    w1_maps);                                                                  \
    }

// y[j * ld + row] = the sum over splits of parts[split][j][row], for qgemm's split steps.
extern "C" __global__ void qgemm_reduce(const float* __restrict__ parts, void* __restrict__ y, int n, int t, int ld,
                                        int splits, int out_f32) {
    wait_for_previous_kernel();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x, count = (long long)t * n;
    if (i >= count) return;
    float sum = 0.0f;
    for (int z = 0; z < splits; z++) sum += parts[z * count + i];
    const long long at = (i / n) * ld + i % n;
    if (out_f32) {
        ((float*)y)[at] = sum;
    } else {
        ((bf16*)y)[at] = f2bf(sum);
    }
}

#define QUANT_GEMVS(F, NAME, T)                                                                                 \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) qgemv_##NAME##_t##T(                            \
        const u8* w, const int8_t* xq, const float2* xs, int two_pass, void* y, int n, int k, int t, int ld,   \
        int out_f32, const u64* norm_in, float eps) {                                                          \
        qgemv<F, T>(w, Q8Rows::of(xq, xs, k, t, two_pass), y, n, t, ld, out_f32, norm_in, eps);                \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) qgemv_silu_##NAME##_t##T(                       \
        const u8* w, const int8_t* xq, const float2* xs, int two_pass, bf16* out, int inter, int k, int t,     \
        const u64* norm_in, float eps) {                                                                       \
        qgemv_silu<F, T>(w, Q8Rows::of(xq, xs, k, t, two_pass), out, inter, t, norm_in, eps);                  \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) qgemv_residual_##NAME##_t##T(                   \
        const u8* w, const int8_t* xq, const float2* xs, int two_pass, float* res, bf16* res_bf16,             \
        u64* norm_out, const float* next_norm, int n, int k, int t) {                                          \
        qgemv_residual<F, T>(w, Q8Rows::of(xq, xs, k, t, two_pass), res, res_bf16, norm_out, next_norm, n, t); \
    }

#define QUANT_KERNELS(F, NAME)                                                                                 \
    QUANT_GEMVS(F, NAME, 1)                                                                                    \
    QUANT_GEMVS(F, NAME, 2)                                                                                    \
    QUANT_GEMVS(F, NAME, 4)                                                                                    \
    QUANT_GEMVS(F, NAME, 8)                                                                                    \
    extern "C" __global__ void __launch_bounds__(DEQUANT_THREADS) dequant_##NAME(const u8* w, bf16* out, int n, \
                                                                                 int k, int first, int rows) {    \
        dequant<F>(w, out, n, k, first, rows);                                                                 \
    }                                                                                                          \
    extern "C" __global__ void embedding_##NAME(const u8* table, const u32* tokens, float* out, int hidden,    \
                                                int vocab_start, int vocab_rows) {                             \
        embedding_quant<F>(table, tokens, out, hidden, vocab_start, vocab_rows);                               \
    } \
    extern "C" __global__ void __launch_bounds__(QGEMM_WARPS * 32) qgemm_##NAME(                               \
        const u8* w, const bf16* x, void* y, float* parts, int n, int k, int t, int ld, int out_f32, int steps) { \
        qgemm<F>(w, x, y, parts, n, k, t, ld, out_f32, steps);                                                 \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(QTILE_THREADS, QTILE_MIN_BLOCKS) qgemm_tile_##NAME(            \
        const u8* w, const bf16* x, void* y, float* parts, int n, int k, int t, int ld, int out_f32, int steps) { \
        qgemm_tile<F>(w, x, y, parts, n, k, t, ld, out_f32, steps);                                            \
    }

QUANT_KERNELS(FmtQ4_0, q4_0)
QUANT_KERNELS(FmtQ4_1, q4_1)
QUANT_KERNELS(FmtQ8_0, q8_0)
QUANT_KERNELS(FmtQ4_K, q4_k)
QUANT_KERNELS(FmtQ5_K, q5_k)
QUANT_KERNELS(FmtQ6_K, q6_k)
// The wide tiles of 256 tokens, then 64, 128 and 192 (quant_call.rs: QuantGemmTile::WIDE's order).
QUANT_WIDE_KERNEL(FmtQ4_K, q4_k, 256, )
QUANT_WIDE_KERNEL(FmtQ6_K, q6_k, 256, )
QUANT_WIDE_PAIR_KERNEL(FmtQ4_K, FmtQ6_K, q4_k_q6_k, 256, )
QUANT_WIDE_KERNEL(FmtQ4_K, q4_k, 64, 64)
QUANT_WIDE_KERNEL(FmtQ6_K, q6_k, 64, 64)
QUANT_WIDE_PAIR_KERNEL(FmtQ4_K, FmtQ6_K, q4_k_q6_k, 64, 64)
QUANT_WIDE_KERNEL(FmtQ4_K, q4_k, 128, 128)
QUANT_WIDE_KERNEL(FmtQ6_K, q6_k, 128, 128)
QUANT_WIDE_PAIR_KERNEL(FmtQ4_K, FmtQ6_K, q4_k_q6_k, 128, 128)
QUANT_WIDE_KERNEL(FmtQ4_K, q4_k, 192, 192)
QUANT_WIDE_KERNEL(FmtQ6_K, q6_k, 192, 192)
QUANT_WIDE_PAIR_KERNEL(FmtQ4_K, FmtQ6_K, q4_k_q6_k, 192, 192)
