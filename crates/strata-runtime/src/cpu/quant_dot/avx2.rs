//! AVX2 + FMA + F16C dot-product kernels (and their AVX-512 VNNI twins) and activation quantization for x86_64.
//! Handed out only by [`kernel`] / [`kernel_vnni`] / used only by [`quantize_act_row`] after run-time feature checks.

// Every kernel is a tile of weight rows by `R` activation rows: the tile walks the blocks
// once; each weight block is loaded and unpacked to bytes once and multiplied with the `R`
// activation rows (`_mm256_maddubs_epi16` + `_mm256_madd_epi16` give exact `i32` partial
// sums), which are scaled and accumulated in `f32` with FMA.
//
// Q4_0, Q4_1 and Q8_0 (the types of llama.cpp's common small files, SmolLM2's among them),
// Q4_K, Q5_K and Q6_K (the K-quant files' types) read
// their weights in row groups (`WeightLayout::RowGroups8`): eight rows share every vector, one
// lane each, so the activations are broadcast instead of the weights being reduced across
// lanes; a tile is one group by up to 4 (AVX2) or 8 (VNNI) activation rows, or with VNNI and
// a few activation rows two groups in one 512-bit register (`vnni_group_pair_tile`). The other types
// read the file's rows in tiles of `RW` weight rows by `R` activation rows, one accumulator
// per pair: single-stream decode (`m == 1`) uses 4 x 1 tiles, so four FMA chains hide latency
// and the per-row setup and horizontal sums are shared.
//
// Where the CPU has AVX-512 VNNI (with VL), the 32-block kernels come in a second build whose
// integer sums are `vpdpbusd` (one instruction for two `maddubs` + `add` + `madd`, on 256-bit
// registers, whose 32 registers also let a tile take 8 activation rows): the integer sums are
// the same exact numbers and the float code around them is shared, so both builds give
// bit-identical results (tested).

// The tiles index several parallel per-row arrays (weights, activations, accumulators) by
// the same row index; iterator chains over all of them would hide the tile shape.
#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::act::{bsum32, scales, write_bsums, write_q8_1_meta};
use super::{act_format_for, act_row_bytes, weight_row_bytes, ActFormat, MatrixFn, GROUP_ROWS, Q8_1_META_BYTES};
use strata_formats::quant::QK_K;
use strata_formats::GgmlType;

/// Whether this CPU has every feature the kernels here are compiled for.
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c")
}

/// Whether this CPU also has AVX-512 VNNI on 256-bit registers (the `vpdpbusd` builds).
pub(super) fn available_vnni() -> bool {
    available()
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// The AVX-512 VNNI kernel for weights of type `w`, or `None` when the CPU lacks the
/// features or the type has no such build (the float types keep AVX2).
/// As with [`kernel`], this check is what makes calling the returned functions sound.
pub(super) fn kernel_vnni(w: GgmlType) -> Option<MatrixFn> {
    if !available_vnni() {
        return None;
    }
    use GgmlType::*;
    Some(match w {
        Q8_0 => vnni_groups_q8_0,
        Q4_0 => vnni_groups_q4_0,
        Q5_0 => vnni_mat_q5_0,
        Q4_1 => vnni_groups_q4_1,
        Q5_1 => vnni_mat_q5_1,
        Q4K => vnni_groups_q4k,
        Q6K => vnni_groups_q6k,
        Q5K => vnni_groups_q5k,
        _ => return None,
    })
}

/// The row-group kernel for weights of type `w` that writes its output by activation row
/// (`out[j * rows + r]`), VNNI where `vnni` (the build [`kernel_vnni`] hands out) else AVX2,
/// or `None` when the CPU lacks the features or the type has no row-group kernel.
pub(super) fn columns_kernel(w: GgmlType, vnni: bool) -> Option<MatrixFn> {
    if !(if vnni { available_vnni() } else { available() }) {
        return None;
    }
    use GgmlType::*;
    Some(match (w, vnni) {
        (Q8_0, true) => vnni_groups_q8_0_columns,
        (Q4_0, true) => vnni_groups_q4_0_columns,
        (Q4_1, true) => vnni_groups_q4_1_columns,
        (Q4K, true) => vnni_groups_q4k_columns,
        (Q6K, true) => vnni_groups_q6k_columns,
        (Q5K, true) => vnni_groups_q5k_columns,
        (Q8_0, false) => groups_q8_0_columns,
        (Q4_0, false) => groups_q4_0_columns,
        (Q4_1, false) => groups_q4_1_columns,
        (Q4K, false) => groups_q4k_columns,
        (Q6K, false) => groups_q6k_columns,
        (Q5K, false) => groups_q5k_columns,
        _ => return None,
    })
}

/// The AVX2 kernel for weights of type `w`, or `None` when the CPU lacks the features or the
/// type has no AVX2 kernel. The functions returned here are the only way to reach the
/// `#[target_feature]` code, so the feature check below is what makes calling them sound.
pub(super) fn kernel(w: GgmlType) -> Option<MatrixFn> {
    if !available() {
        return None;
    }
    use GgmlType::*;
    Some(match w {
        F32 => mat_f32,
        F16 => mat_f16,
        BF16 => mat_bf16,
        Q8_0 => groups_q8_0,
        Q4_0 => groups_q4_0,
        Q5_0 => mat_q5_0,
        Q4_1 => groups_q4_1,
        Q5_1 => mat_q5_1,
        Q4K => groups_q4k,
        Q5K => groups_q5k,
        Q6K => groups_q6k,
        _ => return None,
    })
}

// ---------------------------------------------------------------------------------------
// Small helpers. Loads take fixed-size arrays and constant offsets, so their bounds
// assertions fold away after inlining.

/// 32 bytes at `off` of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld256<const N: usize>(b: &[u8; N], off: usize) -> __m256i {
    assert!(off + 32 <= N);
    // SAFETY: the assertion keeps the unaligned 32-byte read inside `b`.
    unsafe { _mm256_loadu_si256(b.as_ptr().add(off).cast()) }
}

/// 16 bytes at `off` of `b`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld128<const N: usize>(b: &[u8; N], off: usize) -> __m128i {
    assert!(off + 16 <= N);
    // SAFETY: the assertion keeps the unaligned 16-byte read inside `b`.
    unsafe { _mm_loadu_si128(b.as_ptr().add(off).cast()) }
}

/// 8 bytes at `off` of `b` in the low half of a vector (high half zero).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld64<const N: usize>(b: &[u8; N], off: usize) -> __m128i {
    assert!(off + 8 <= N);
    // SAFETY: the assertion keeps the unaligned 8-byte read inside `b`.
    unsafe { _mm_loadl_epi64(b.as_ptr().add(off).cast()) }
}

/// Little-endian `u32` at `off`.
#[inline]
fn u32_at<const N: usize>(b: &[u8; N], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// IEEE half to single with F16C.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn f16_to_f32(bits: u16) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// Sum of the 8 lanes, added in the same order as [`hsum4`] adds each of its vectors, so
/// a row's result does not depend on which tile computed it.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    _mm_cvtss_f32(hsum4(v, v, v, v))
}

/// Sum over pairs of `u[i] * s[i]` (unsigned bytes times signed bytes), as 8 `i32` lanes.
/// Exact as long as each adjacent pair of products fits in `i16` (each caller states why).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_us8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
}

/// `mul_sum_us8(u0, s0) + mul_sum_us8(u1, s1)`, adding the pairs in `i16` first (exact when
/// each sum of four products fits in `i16`; each caller states why).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn mul_sum_us8x2(u0: __m256i, s0: __m256i, u1: __m256i, s1: __m256i) -> __m256i {
    let p16 = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
    _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
}

/// The VNNI twin of [`mul_sum_us8`]: the same exact `i32` lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn vnni_mul_sum_us8(u: __m256i, s: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
}

/// The VNNI twin of [`mul_sum_us8x2`]: the same exact `i32` lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn vnni_mul_sum_us8x2(u0: __m256i, s0: __m256i, u1: __m256i, s1: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), u0, s0), u1, s1)
}

// ---------------------------------------------------------------------------------------
// Views of the operands.

/// The first `nb` blocks of `BB` bytes of each of `RW` weight rows.
#[inline]
fn weight_blocks<const RW: usize, const BB: usize>(w: [&[u8]; RW], nb: usize) -> [&[[u8; BB]]; RW] {
    let mut out: [&[[u8; BB]]; RW] = [&[]; RW];
    for x in 0..RW {
        out[x] = &w[x].as_chunks::<BB>().0[..nb];
    }
    out
}

/// Splits `R` activation rows (each at least `act_row_bytes(fmt, n)` bytes) into their
/// `Q`-byte quant chunks and `M`-byte metadata chunks, the first `nq` and `nm` of each.
#[inline]
#[allow(clippy::type_complexity)]
fn split_acts<const R: usize, const Q: usize, const M: usize>(
    n: usize,
    nq: usize,
    nm: usize,
    a: [&[u8]; R],
) -> ([&[[u8; Q]]; R], [&[[u8; M]]; R]) {
    let mut q: [&[[u8; Q]]; R] = [&[]; R];
    let mut meta: [&[[u8; M]]; R] = [&[]; R];
    for r in 0..R {
        let (qs, rest) = a[r].split_at(n);
        q[r] = &qs.as_chunks::<Q>().0[..nq];
        meta[r] = &rest.as_chunks::<M>().0[..nm];
    }
    (q, meta)
}

/// Sums of the lanes of four vectors, as one vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps::<1>(t))
}

/// Horizontal sums of every accumulator of a tile, four at a time where possible.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn finish<const RW: usize, const R: usize>(acc: [[__m256; R]; RW]) -> [[f32; R]; RW] {
    let mut out = [[0.0f32; R]; RW];
    let total = RW * R;
    let mut k = 0;
    while k + 4 <= total {
        let v = |j: usize| acc[(k + j) / R][(k + j) % R];
        let s = hsum4(v(0), v(1), v(2), v(3));
        let mut lanes = [0.0f32; 4];
        // SAFETY: `lanes` is exactly 4 floats, the size of the unaligned store.
        unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), s) };
        for (j, l) in lanes.into_iter().enumerate() {
            out[(k + j) / R][(k + j) % R] = l;
        }
        k += 4;
    }
    while k < total {
        out[k / R][k % R] = hsum(acc[k / R][k % R]);
        k += 1;
    }
    out
}

// ---------------------------------------------------------------------------------------
// 32-blocks of 5-bit quants against Q8_1 activations, two blocks at a time: Q5_0, Q5_1.
//
// Each block's dot is `d da sum(q qa) + m s` with `s = da sum(qa)` from the activation
// row: `m` is the block's min for Q5_1, and `-16 d` for Q5_0 (whose values are
// `(q - 16) d`), so both share one kernel.
//
// Blocks go in pairs: the quants of blocks i and i+1 sit in one register as
// [low halves of i | low halves of i+1] and [high of i | high of i+1], and so do the
// activations after a lane swap, so the two products can be added as i16 and reduced,
// converted and scaled once for both blocks.

/// The 16 nibble bytes at `off` of two blocks: `[lo0 | lo1]`, `[hi0 | hi1]` (values 0..16).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nibbles2<const N: usize>(b0: &[u8; N], b1: &[u8; N], off: usize) -> (__m256i, __m256i) {
    let x = _mm256_set_m128i(ld128(b1, off), ld128(b0, off));
    let m4 = _mm256_set1_epi8(0x0f);
    let lo = _mm256_and_si256(x, m4);
    let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(x), m4);
    (lo, hi)
}

/// Adds the fifth bits (`0x10`) from the 32-bit `qh` words of two blocks to their nibbles
/// as laid out by [`nibbles2`]: bits 0..16 of a block's `qh` belong to its low nibbles,
/// bits 16..32 to its high ones.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn add_fifth_bits2(lo: __m256i, hi: __m256i, qh0: u32, qh1: u32) -> (__m256i, __m256i) {
    let qh = _mm256_set_m128i(_mm_set1_epi32(qh1 as i32), _mm_set1_epi32(qh0 as i32));
    let bitm = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let b5 = _mm256_set1_epi8(0x10);
    // Byte k of the result holds bit k of the selected 8 bits, as 0x10 or 0.
    let spread = |sel: __m256i| {
        let v = _mm256_and_si256(_mm256_shuffle_epi8(qh, sel), bitm);
        _mm256_and_si256(_mm256_cmpeq_epi8(v, bitm), b5)
    };
    let sel_lo = _mm256_set_epi64x(0x0101_0101_0101_0101, 0, 0x0101_0101_0101_0101, 0);
    let sel_hi = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
    );
    (_mm256_or_si256(lo, spread(sel_lo)), _mm256_or_si256(hi, spread(sel_hi)))
}

/// `[d0, m0, d1, m1]` from the f16 pairs `(d, m)` leading two blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dm2<const N: usize>(b0: &[u8; N], b1: &[u8; N]) -> __m128 {
    let dm = _mm_unpacklo_epi32(
        _mm_cvtsi32_si128(u32_at(b0, 0) as i32),
        _mm_cvtsi32_si128(u32_at(b1, 0) as i32),
    );
    _mm_cvtph_ps(dm)
}

/// `[d0, d0, d1, d1]` from the f16 scales `d` leading two blocks.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dd2<const N: usize>(b0: &[u8; N], b1: &[u8; N]) -> __m128 {
    let x = _mm_unpacklo_epi32(
        _mm_cvtsi32_si128(u32_at(b0, 0) as i32),
        _mm_cvtsi32_si128(u32_at(b1, 0) as i32),
    );
    // Halves [d0, x0, d1, x1] -> [d0, d0, d1, d1].
    _mm_cvtph_ps(_mm_shufflelo_epi16::<0b10_10_00_00>(x))
}

/// Q5_0 pair: values `q - 16`, as `q` (0..32) with the min `-16 d` (`-16` is the tile's `k`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dec2_q5_0(b0: &[u8; 22], b1: &[u8; 22]) -> (__m256i, __m256i, __m128) {
    let (lo, hi) = nibbles2(b0, b1, 6);
    let (lo, hi) = add_fifth_bits2(lo, hi, u32_at(b0, 2), u32_at(b1, 2));
    (lo, hi, dd2(b0, b1))
}

/// Q5_1 pair: values `q d + m` with `q` in 0..32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dec2_q5_1(b0: &[u8; 24], b1: &[u8; 24]) -> (__m256i, __m256i, __m128) {
    let (lo, hi) = nibbles2(b0, b1, 8);
    let (lo, hi) = add_fifth_bits2(lo, hi, u32_at(b0, 4), u32_at(b1, 4));
    (lo, hi, dm2(b0, b1))
}

macro_rules! tile_min {
    ($name:ident, $feat:literal, $mul_sum:ident, $mul_sum2:ident, $bb:literal, $dec2:ident, $k:literal) => {
        /// A tile of `RW` weight rows by `R` Q8_1 activation rows. Per pair of blocks the
        /// decoder gives `dm = [d0, m0, d1, m1]` (the min lanes hold `d` for Q5_0) and the
        /// activation row `meta = [da0, s0, da1, s1]`. The integer sums are scaled by
        /// `[d0 x4, d1 x4] * [da0 x4, da1 x4]` into the FMA chain; the min terms `m s` gather
        /// in lanes 1 and 3 of a second chain `sum dm * meta`, added in (times `k`) once at
        /// the end. The byte sums are exact: the unsigned 5-bit pairs add in `i16`
        /// (`2 * (2 * 31 * 127) < 32768`).
        #[inline]
        #[target_feature(enable = $feat)]
        fn $name<const RW: usize, const R: usize>(n: usize, w: [&[u8]; RW], a: [&[u8]; R]) -> [[f32; R]; RW] {
            let nb = n / 32;
            let np = nb / 2;
            let wb = weight_blocks::<RW, $bb>(w, nb);
            let (aq, am) = split_acts::<R, 64, { 2 * Q8_1_META_BYTES }>(n, np, np, a);
            const HAS_MIN: bool = $k != 0.0;
            let spread = _mm256_setr_epi32(0, 0, 0, 0, 2, 2, 2, 2);
            let mut acc = [[_mm256_setzero_ps(); R]; RW];
            let mut accm = [[_mm_setzero_ps(); R]; RW];
            for p in 0..np {
                let mut meta = [_mm_setzero_ps(); R];
                let mut dav = [_mm256_setzero_ps(); R];
                let mut qlo = [_mm256_setzero_si256(); R];
                let mut qhi = [_mm256_setzero_si256(); R];
                for r in 0..R {
                    let mp = &am[r][p];
                    meta[r] = _mm_castsi128_ps(_mm_unpacklo_epi64(ld64(mp, 0), ld64(mp, Q8_1_META_BYTES)));
                    dav[r] = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(meta[r]), spread);
                    // Blocks in value order to [lo0 | lo1], [hi0 | hi1] halves.
                    let (b0, b1) = (ld256(&aq[r][p], 0), ld256(&aq[r][p], 32));
                    qlo[r] = _mm256_permute2x128_si256::<0x20>(b0, b1);
                    qhi[r] = _mm256_permute2x128_si256::<0x31>(b0, b1);
                }
                for x in 0..RW {
                    let (lo, hi, dm) = $dec2(&wb[x][2 * p], &wb[x][2 * p + 1]);
                    let dv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dm), spread);
                    for r in 0..R {
                        let pi = _mm256_cvtepi32_ps($mul_sum2(lo, qlo[r], hi, qhi[r]));
                        acc[x][r] = _mm256_fmadd_ps(pi, _mm256_mul_ps(dv, dav[r]), acc[x][r]);
                        if HAS_MIN {
                            accm[x][r] = _mm_fmadd_ps(dm, meta[r], accm[x][r]);
                        }
                    }
                }
            }
            if nb % 2 == 1 {
                // The last odd block: decode it as a pair with itself and put its low and
                // high halves side by side; its metadata starts `[da, s]`.
                let i = nb - 1;
                for x in 0..RW {
                    let (lo, hi, dm) = $dec2(&wb[x][i], &wb[x][i]);
                    let q = _mm256_permute2x128_si256::<0x20>(lo, hi);
                    for r in 0..R {
                        let (qs, meta) = a[r].split_at(n);
                        let qa: &[u8; 32] = &qs.as_chunks::<32>().0[i];
                        let md: &[u8; Q8_1_META_BYTES] = &meta.as_chunks::<Q8_1_META_BYTES>().0[i];
                        let meta = _mm_castsi128_ps(ld64(md, 0));
                        let pi = _mm256_cvtepi32_ps($mul_sum(q, ld256(qa, 0)));
                        let sv = _mm256_broadcastss_ps(_mm_mul_ps(dm, meta));
                        acc[x][r] = _mm256_fmadd_ps(pi, sv, acc[x][r]);
                        if HAS_MIN {
                            accm[x][r] = _mm_fmadd_ps(dm, meta, accm[x][r]);
                        }
                    }
                }
            }
            if HAS_MIN {
                let kmin = _mm_setr_ps(0.0, $k, 0.0, $k);
                for x in 0..RW {
                    for r in 0..R {
                        let mins = _mm256_zextps128_ps256(_mm_mul_ps(accm[x][r], kmin));
                        acc[x][r] = _mm256_add_ps(acc[x][r], mins);
                    }
                }
            }
            finish(acc)
        }
    };
}

/// The Q4_0..Q5_1 tiles in both builds: (name, features, decoder, block bytes, min factor).
macro_rules! tiles_min {
    ($avx2:ident, $vnni:ident, $bb:literal, $dec2:ident, $k:literal) => {
        tile_min!($avx2, "avx2,fma,f16c", mul_sum_us8, mul_sum_us8x2, $bb, $dec2, $k);
        tile_min!(
            $vnni,
            "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
            vnni_mul_sum_us8,
            vnni_mul_sum_us8x2,
            $bb,
            $dec2,
            $k
        );
    };
}

tiles_min!(tile_q5_0, vnni_tile_q5_0, 22, dec2_q5_0, -16.0);
tiles_min!(tile_q5_1, vnni_tile_q5_1, 24, dec2_q5_1, 1.0);

// ---------------------------------------------------------------------------------------
// Q4_0, Q4_1 and Q8_0 in row groups (`WeightLayout::RowGroups8`) against Q8_1 activations.
//
// Lane i of every vector belongs to weight row i of the group: a 32-byte load of quants holds
// the same four quant bytes of the eight rows, and one broadcast of the four matching
// activation bytes multiplies all eight rows at once, so a block costs no horizontal sums
// and its scaling is shared by eight rows. A block's integer sum is exact, hence the same in
// every build; it is scaled in f32 as `acc = fma(isum, dw * da, acc)` (then Q4_1's
// `acc = fma(m, s, acc)`) in block order, so a row's result does not depend on the tile
// height, the build or the batch. Q4_0's `-8` and (with VNNI) Q8_0's `+128` come off the
// activation block sums in i32.

/// `KIND` of the row-group kernels.
const GK_Q4_0: u8 = 0;
const GK_Q4_1: u8 = 1;
const GK_Q8_0: u8 = 2;

/// Little-endian `i32` at `off`.
#[inline]
fn i32_at<const N: usize>(b: &[u8; N], off: usize) -> i32 {
    u32_at(b, off) as i32
}

/// Little-endian `f32` at `off`.
#[inline]
fn f32_at<const N: usize>(b: &[u8; N], off: usize) -> f32 {
    f32::from_bits(u32_at(b, off))
}

/// Adds the products of unsigned nibbles `lo`, `hi` with signed bytes `alo`, `ahi` to `acc`,
/// a sum kept in `i16` lanes until [`q4_finish`] (at most eight products of pairs per block:
/// `8 * 2 * 15 * 127 < 32768`, exact).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_step(acc: __m256i, lo: __m256i, alo: __m256i, hi: __m256i, ahi: __m256i) -> __m256i {
    let p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, alo), _mm256_maddubs_epi16(hi, ahi));
    _mm256_add_epi16(acc, p)
}

/// The `i32` lanes of a block's sum from [`q4_step`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q4_finish(acc: __m256i) -> __m256i {
    _mm256_madd_epi16(acc, _mm256_set1_epi16(1))
}

/// The VNNI twin of [`q4_step`], accumulating in `i32` lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn vnni_q4_step(acc: __m256i, lo: __m256i, alo: __m256i, hi: __m256i, ahi: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(acc, lo, alo), hi, ahi)
}

/// The VNNI twin of [`q4_finish`]: the lanes are already `i32`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn vnni_q4_finish(acc: __m256i) -> __m256i {
    acc
}

/// Adds the products of signed bytes `v` and `a` to the `i32` lanes of `acc` (`v`'s sign moves
/// onto `a`; a pair is exact in `i16`: `2 * 128 * 127 < 32768`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_step(acc: __m256i, v: __m256i, a: __m256i) -> __m256i {
    let p = _mm256_maddubs_epi16(_mm256_sign_epi8(v, v), _mm256_sign_epi8(a, v));
    _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
}

/// A block's sum from [`q8_step`] (`sum`, the activation block's sum, is not needed).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q8_finish(acc: __m256i, _sum: i32) -> __m256i {
    acc
}

/// The VNNI twin of [`q8_step`]: `v + 128` as unsigned bytes, the `128 * sum` taken off in
/// [`vnni_q8_finish`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn vnni_q8_step(acc: __m256i, v: __m256i, a: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, _mm256_xor_si256(v, _mm256_set1_epi8(-128)), a)
}

/// The VNNI twin of [`q8_finish`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn vnni_q8_finish(acc: __m256i, sum: i32) -> __m256i {
    _mm256_sub_epi32(acc, _mm256_set1_epi32(sum << 7))
}

macro_rules! group_tile {
    ($name:ident, $feat:literal, $q4_step:ident, $q4_finish:ident, $q8_step:ident, $q8_finish:ident) => {
        /// One row group (`n / 32` blocks of `GB` bytes of weights of kind `KIND`) against
        /// `R` Q8_1 activation rows: lane i of result r is the dot of weight row i with
        /// activation row r.
        #[inline]
        #[target_feature(enable = $feat)]
        fn $name<const KIND: u8, const GB: usize, const R: usize>(
            n: usize,
            group: &[u8],
            a: [&[u8]; R],
        ) -> [__m256; R] {
            let nb = n / 32;
            let blocks = &group.as_chunks::<GB>().0[..nb];
            let (aq, am) = split_acts::<R, 32, Q8_1_META_BYTES>(n, nb, nb, a);
            let m4 = _mm256_set1_epi8(0x0f);
            let mut acc = [_mm256_setzero_ps(); R];
            for (b, blk) in blocks.iter().enumerate() {
                prefetch_block_ahead(blocks, b);
                let dw = _mm256_cvtph_ps(ld128(blk, 0));
                let mut isum = [_mm256_setzero_si256(); R];
                if KIND == GK_Q8_0 {
                    for j in 0..8 {
                        let v = ld256(blk, 16 + 32 * j);
                        for r in 0..R {
                            isum[r] = $q8_step(isum[r], v, _mm256_set1_epi32(i32_at(&aq[r][b], 4 * j)));
                        }
                    }
                    for r in 0..R {
                        isum[r] = $q8_finish(isum[r], i32_at(&am[r][b], 8));
                    }
                } else {
                    let qo = if KIND == GK_Q4_1 { 32 } else { 16 };
                    for j in 0..4 {
                        let v = ld256(blk, qo + 32 * j);
                        let lo = _mm256_and_si256(v, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4);
                        for r in 0..R {
                            let alo = _mm256_set1_epi32(i32_at(&aq[r][b], 4 * j));
                            let ahi = _mm256_set1_epi32(i32_at(&aq[r][b], 16 + 4 * j));
                            isum[r] = $q4_step(isum[r], lo, alo, hi, ahi);
                        }
                    }
                    for r in 0..R {
                        isum[r] = $q4_finish(isum[r]);
                        if KIND == GK_Q4_0 {
                            isum[r] = _mm256_sub_epi32(isum[r], _mm256_set1_epi32(i32_at(&am[r][b], 8) << 3));
                        }
                    }
                }
                let mw = if KIND == GK_Q4_1 {
                    _mm256_cvtph_ps(ld128(blk, 16))
                } else {
                    _mm256_setzero_ps()
                };
                for r in 0..R {
                    let da = _mm256_set1_ps(f32_at(&am[r][b], 0));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(dw, da), acc[r]);
                    if KIND == GK_Q4_1 {
                        acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(f32_at(&am[r][b], 4)), acc[r]);
                    }
                }
            }
            acc
        }
    };
}

group_tile!(group_tile, "avx2,fma,f16c", q4_step, q4_finish, q8_step, q8_finish);
group_tile!(
    vnni_group_tile,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    vnni_q4_step,
    vnni_q4_finish,
    vnni_q8_step,
    vnni_q8_finish
);

// Q4_K in row groups against Q8K activations. Per super-block the eight rows' sub-block scales
// and mins are decoded from their packed bytes once (`k4_group_scales`); each sub-block's
// integer sum (i16 lanes on AVX2: eight pairs, `8 * 2 * 15 * 127 < 32768`; i32 with VNNI) is
// exact, times its 6-bit scale in i32 (`8 * 63 * 32 * 15 * 127 < 2^31`), and the super-block's
// totals go to f32 as `acc = fma(sumi, d * da, acc)` then `acc = fnmadd(summ, dmin * da, acc)`:
// the same integers as the scalar kernel, in an order no tile height, build or batch changes.

/// Prefetches (into L1) the block about 16 KiB after block `i` of `blocks`, one call a block,
/// in every row-group tile: a group of a long row spans 40-100 KiB, and prefetching a whole
/// group at its start issued hundreds of prefetches at once, which halved what a one-row
/// product drew from DRAM (quant_dot 1536x8960, bench/NOTES.md). Past the matrix's end the
/// addresses are only hints.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_block_ahead<const N: usize>(blocks: &[[u8; N]], i: usize) {
    let ahead = 16384usize.div_ceil(N);
    let base = blocks.as_ptr().wrapping_add(i + ahead).cast::<u8>();
    for off in (0..N).step_by(64) {
        // SAFETY: a prefetch never faults and changes no memory; `wrapping_add` keeps the
        // pointer arithmetic defined even past the end of `blocks`.
        _mm_prefetch::<_MM_HINT_T0>(base.wrapping_add(off).cast());
    }
}

/// `KIND` of the K-quant row-group kernels (Q4_K and Q5_K share a tile, Q6_K has its own).
const GK_Q4K: u8 = 3;
const GK_Q6K: u8 = 4;
const GK_Q5K: u8 = 5;

/// Where a Q4_K / Q5_K group block's quant nibbles start (Q5_K: after its fifth bits at 128).
const fn k4_quants_at(kind: u8) -> usize {
    if kind == GK_Q5K {
        384
    } else {
        128
    }
}

/// Q5_K's fifth bits of sub-block `j`, at bit 4 of each byte, from the group's qh chunk `qh`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_fifth_bits(qh: __m256i, j: usize) -> __m256i {
    let bit = _mm256_and_si256(_mm256_srl_epi32(qh, _mm_cvtsi32_si128(j as i32)), _mm256_set1_epi8(1));
    _mm256_slli_epi32::<4>(bit)
}

/// The 512-bit twin of [`q5_fifth_bits`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn q5_fifth_bits_x2(qh: __m512i, j: usize) -> __m512i {
    let bit = _mm512_and_si512(_mm512_srl_epi32(qh, _mm_cvtsi32_si128(j as i32)), _mm512_set1_epi8(1));
    _mm512_slli_epi32::<4>(bit)
}

/// The i32 lanes (one per row of the group) of the eight sub-block scales and mins of a Q4_K
/// group block, unpacked from the twelve scale bytes each row stores one after another.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_group_scales<const N: usize>(blk: &[u8; N]) -> ([__m256i; 8], [__m256i; 8]) {
    let mut t = [_mm256_setzero_si256(); 12];
    for (s, v) in t.iter_mut().enumerate() {
        *v = _mm256_cvtepu8_epi32(ld64(blk, 32 + 8 * s));
    }
    let (low6, low4) = (_mm256_set1_epi32(63), _mm256_set1_epi32(15));
    let mut sc = [_mm256_setzero_si256(); 8];
    let mut mn = [_mm256_setzero_si256(); 8];
    for j in 0..4 {
        sc[j] = _mm256_and_si256(t[j], low6);
        mn[j] = _mm256_and_si256(t[j + 4], low6);
        // Sub-blocks 4..8: four bits from byte j + 8, the top two from the bytes of j and j + 4.
        let sc_top = _mm256_slli_epi32::<4>(_mm256_srli_epi32::<6>(t[j]));
        let mn_top = _mm256_slli_epi32::<4>(_mm256_srli_epi32::<6>(t[j + 4]));
        sc[j + 4] = _mm256_or_si256(_mm256_and_si256(t[j + 8], low4), sc_top);
        mn[j + 4] = _mm256_or_si256(_mm256_srli_epi32::<4>(t[j + 8]), mn_top);
    }
    (sc, mn)
}

/// Adds the products of unsigned nibbles `q` with signed bytes `a` to the `i16` lanes of `acc`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn nib_step(acc: __m256i, q: __m256i, a: __m256i) -> __m256i {
    _mm256_add_epi16(acc, _mm256_maddubs_epi16(q, a))
}

/// The VNNI twin of [`nib_step`] and [`byte_step`]: unsigned bytes `q` times signed bytes `a`
/// added to the `i32` lanes of `acc`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn vnni_byte_step(acc: __m256i, q: __m256i, a: __m256i) -> __m256i {
    _mm256_dpbusd_epi32(acc, q, a)
}

macro_rules! group_tile_q4k {
    ($name:ident, $feat:literal, $step:ident, $finish:ident) => {
        /// One Q4_K or (`KIND` = `GK_Q5K`) Q5_K row group (`n / 256` blocks of `GB` bytes)
        /// against `R` Q8K activation rows: lane i of result r is the dot of weight row i with
        /// activation row r. Quants sum in `$step`'s lanes four bytes at a time, then in i32
        /// (Q5_K's pairs reach `2 * 31 * 127`, so four of them in i16 at most).
        #[inline]
        #[target_feature(enable = $feat)]
        fn $name<const KIND: u8, const GB: usize, const R: usize>(
            n: usize,
            group: &[u8],
            a: [&[u8]; R],
        ) -> [__m256; R] {
            let nb = n / QK_K;
            let blocks = &group.as_chunks::<GB>().0[..nb];
            let av = split_q8k::<R>(n, nb, a);
            let m4 = _mm256_set1_epi8(0x0f);
            let mut acc = [_mm256_setzero_ps(); R];
            for (i, blk) in blocks.iter().enumerate() {
                prefetch_block_ahead(blocks, i);
                let (sc, mn) = k4_group_scales(blk);
                let mut sumi = [_mm256_setzero_si256(); R];
                // Sub-block j: the low nibbles (even j) or high nibbles (odd j) of quant bytes
                // 32 (j / 2)..+32 (Q5_K: and bit j of qh bytes 0..32), against activation
                // quants 32 j..+32.
                for j in 0..8 {
                    let mut isum = [_mm256_setzero_si256(); R];
                    let mut part = [_mm256_setzero_si256(); R];
                    for c in 0..8 {
                        let v = ld256(blk, k4_quants_at(KIND) + 32 * (8 * (j / 2) + c));
                        let mut q = if j % 2 == 0 {
                            _mm256_and_si256(v, m4)
                        } else {
                            _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4)
                        };
                        if KIND == GK_Q5K {
                            q = _mm256_or_si256(q, q5_fifth_bits(ld256(blk, 128 + 32 * c), j));
                        }
                        for r in 0..R {
                            let a4 = _mm256_set1_epi32(i32_at(&av.q[r][i], 32 * j + 4 * c));
                            part[r] = $step(part[r], q, a4);
                        }
                        if c % 4 == 3 {
                            for r in 0..R {
                                isum[r] = _mm256_add_epi32(isum[r], $finish(part[r]));
                                part[r] = _mm256_setzero_si256();
                            }
                        }
                    }
                    for r in 0..R {
                        sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(isum[r], sc[j]));
                    }
                }
                let d = _mm256_cvtph_ps(ld128(blk, 0));
                let dmin = _mm256_cvtph_ps(ld128(blk, 16));
                for r in 0..R {
                    let bs = &av.bsums[r][i];
                    let mut summ = _mm256_setzero_si256();
                    for j in 0..8 {
                        let xs = _mm256_set1_epi32(bsum32(bs, j));
                        summ = _mm256_add_epi32(summ, _mm256_mullo_epi32(mn[j], xs));
                    }
                    let da = _mm256_set1_ps(f32::from_le_bytes(av.d[r][i]));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[r]), _mm256_mul_ps(d, da), acc[r]);
                    acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(dmin, da), acc[r]);
                }
            }
            acc
        }
    };
}

group_tile_q4k!(group_tile_q4k, "avx2,fma,f16c", nib_step, q4_finish);
group_tile_q4k!(
    vnni_group_tile_q4k,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    vnni_byte_step,
    vnni_q4_finish
);

/// `x` in the low eight lanes, `y` in the high eight.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn lanes_pair(x: __m256i, y: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(x), y)
}

/// [`vnni_group_tile_q4k`] (Q4_K or Q5_K) on 512-bit registers over two consecutive row groups (`g0`, `g1`):
/// lanes 0-7 of result r are group `g0`'s rows, lanes 8-15 group `g1`'s, each lane with the
/// same integer sums and float operations in the same order, so the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn vnni_group_pair_tile_q4k<const KIND: u8, const GB: usize, const R: usize>(
    n: usize,
    g0: &[u8],
    g1: &[u8],
    a: [&[u8]; R],
) -> [__m512; R] {
    let nb = n / QK_K;
    let (b0, b1) = (&g0.as_chunks::<GB>().0[..nb], &g1.as_chunks::<GB>().0[..nb]);
    let av = split_q8k::<R>(n, nb, a);
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); R];
    for i in 0..nb {
        prefetch_block_ahead(b0, i);
        prefetch_block_ahead(b1, i);
        let ((sc0, mn0), (sc1, mn1)) = (k4_group_scales(&b0[i]), k4_group_scales(&b1[i]));
        let mut sumi = [_mm512_setzero_si512(); R];
        for j in 0..8 {
            let sc = lanes_pair(sc0[j], sc1[j]);
            let mut isum = [_mm512_setzero_si512(); R];
            for c in 0..8 {
                let v = ld_pair(&b0[i], &b1[i], k4_quants_at(KIND) + 32 * (8 * (j / 2) + c));
                let mut q = if j % 2 == 0 {
                    _mm512_and_si512(v, m4)
                } else {
                    _mm512_and_si512(_mm512_srli_epi32::<4>(v), m4)
                };
                if KIND == GK_Q5K {
                    q = _mm512_or_si512(q, q5_fifth_bits_x2(ld_pair(&b0[i], &b1[i], 128 + 32 * c), j));
                }
                for r in 0..R {
                    let a4 = _mm512_set1_epi32(i32_at(&av.q[r][i], 32 * j + 4 * c));
                    isum[r] = _mm512_dpbusd_epi32(isum[r], q, a4);
                }
            }
            for r in 0..R {
                sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(isum[r], sc));
            }
        }
        let d = ph_pair(&b0[i], &b1[i], 0);
        let dmin = ph_pair(&b0[i], &b1[i], 16);
        for r in 0..R {
            let bs = &av.bsums[r][i];
            let mut summ = _mm512_setzero_si512();
            for j in 0..8 {
                let xs = _mm512_set1_epi32(bsum32(bs, j));
                summ = _mm512_add_epi32(summ, _mm512_mullo_epi32(lanes_pair(mn0[j], mn1[j]), xs));
            }
            let da = _mm512_set1_ps(f32::from_le_bytes(av.d[r][i]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]), _mm512_mul_ps(d, da), acc[r]);
            acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(dmin, da), acc[r]);
        }
    }
    acc
}

// Q6_K in row groups against Q8K activations. Each 16-value sub-block's integer sum of the
// unsigned 6-bit quants (`[0, 63]`; i32 lanes: on AVX2 each four-byte product is widened at
// once, `2 * 63 * 127` fits i16 but four of them do not) is times its i8 scale in i32; the
// `-32` offset comes off as `32 * sum_k sc_k * bsum_k`, two sub-blocks a `madd`; the
// super-block's total goes to f32 as `acc = fma(sumi, d * da, acc)`. Exact integers as in the
// scalar kernel (`16 * 16 * 63 * 127 * 128 < 2^31`), one float order for every tile.

/// Bytes of a Q6_K group block: eight rows' 210-byte super-blocks.
const Q6K_GROUP_BYTES: usize = 1680;

/// Where a Q6_K group block's parts start: quant bytes (128 of low nibbles, then 64 of high bit
/// pairs, four bytes a row at a time), the sixteen scales byte by byte, `d`.
const Q6K_QH: usize = 1024;
const Q6K_SCALES: usize = 1536;
const Q6K_D: usize = 1664;

/// Bits `2g, 2g + 1` of each byte of `qh` moved to bits 4, 5 (the quant's high bits for group g).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q6_high_bits(qh: __m256i, g: usize) -> __m256i {
    let v = match g {
        0 => _mm256_slli_epi16::<4>(qh),
        1 => _mm256_slli_epi16::<2>(qh),
        2 => qh,
        _ => _mm256_srli_epi16::<2>(qh),
    };
    _mm256_and_si256(v, _mm256_set1_epi8(0x30))
}

/// Scales `2 kp` and `2 kp + 1` of each row of a Q6_K group block as an i16 pair in the row's
/// lane (the operand of a `madd` against two sub-blocks' activation sums).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn q6_scale_pairs(blk: &[u8; Q6K_GROUP_BYTES], kp: usize) -> __m256i {
    let s0 = _mm_cvtepi8_epi16(ld64(blk, Q6K_SCALES + 16 * kp));
    let s1 = _mm_cvtepi8_epi16(ld64(blk, Q6K_SCALES + 16 * kp + 8));
    _mm256_set_m128i(_mm_unpackhi_epi16(s0, s1), _mm_unpacklo_epi16(s0, s1))
}

/// Adds the products of unsigned bytes `q` with signed bytes `a` to the `i32` lanes of `acc`
/// (each lane's four products summed in i32 at once).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn byte_step(acc: __m256i, q: __m256i, a: __m256i) -> __m256i {
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), _mm256_set1_epi16(1)))
}

macro_rules! group_tile_q6k {
    ($name:ident, $feat:literal, $step:ident) => {
        /// One Q6_K row group (`n / 256` blocks of `GB` bytes) against `R` Q8K activation rows:
        /// lane i of result r is the dot of weight row i with activation row r.
        #[inline]
        #[target_feature(enable = $feat)]
        fn $name<const KIND: u8, const GB: usize, const R: usize>(
            n: usize,
            group: &[u8],
            a: [&[u8]; R],
        ) -> [__m256; R] {
            let nb = n / QK_K;
            let blocks = &group.as_chunks::<Q6K_GROUP_BYTES>().0[..nb];
            let av = split_q8k::<R>(n, nb, a);
            let m4 = _mm256_set1_epi8(0x0f);
            let mut acc = [_mm256_setzero_ps(); R];
            for (i, blk) in blocks.iter().enumerate() {
                prefetch_block_ahead(blocks, i);
                let mut sumi = [_mm256_setzero_si256(); R];
                // Value 128 h + 32 g + l: low bits from the low (g < 2) or high nibble of quant
                // byte 64 h + 32 (g % 2) + l, high bits from bits 2g of byte 32 h + l of qh. One
                // load of each of the three bytes serves the four groups; sub-block 8 h + 2 g +
                // half holds positions l of 16 half..16 half + 16.
                for h in 0..2 {
                    for half in 0..2 {
                        let mut isum = [[_mm256_setzero_si256(); R]; 4];
                        for t in 0..4 {
                            let l = 16 * half + 4 * t;
                            let ql0 = ld256(blk, 8 * (64 * h + l));
                            let ql1 = ld256(blk, 8 * (64 * h + 32 + l));
                            let qh = ld256(blk, Q6K_QH + 8 * (32 * h + l));
                            let low = [
                                _mm256_and_si256(ql0, m4),
                                _mm256_and_si256(ql1, m4),
                                _mm256_and_si256(_mm256_srli_epi16::<4>(ql0), m4),
                                _mm256_and_si256(_mm256_srli_epi16::<4>(ql1), m4),
                            ];
                            for g in 0..4 {
                                let q = _mm256_or_si256(low[g], q6_high_bits(qh, g));
                                for r in 0..R {
                                    let a4 = _mm256_set1_epi32(i32_at(&av.q[r][i], 128 * h + 32 * g + l));
                                    isum[g][r] = $step(isum[g][r], q, a4);
                                }
                            }
                        }
                        for g in 0..4 {
                            let k = 8 * h + 2 * g + half;
                            let sc = _mm256_cvtepi8_epi32(ld64(blk, Q6K_SCALES + 8 * k));
                            for r in 0..R {
                                sumi[r] = _mm256_add_epi32(sumi[r], _mm256_mullo_epi32(isum[g][r], sc));
                            }
                        }
                    }
                }
                let mut off = [_mm256_setzero_si256(); R];
                for kp in 0..8 {
                    // Each row's scale pair against the pair of activation sums of those sub-blocks.
                    let pairs = q6_scale_pairs(blk, kp);
                    for r in 0..R {
                        let b2 = _mm256_set1_epi32(i32_at(&av.bsums[r][i], 4 * kp));
                        off[r] = _mm256_add_epi32(off[r], _mm256_madd_epi16(pairs, b2));
                    }
                }
                let d = _mm256_cvtph_ps(ld128(blk, Q6K_D));
                for r in 0..R {
                    let total = _mm256_sub_epi32(sumi[r], _mm256_slli_epi32::<5>(off[r]));
                    let da = _mm256_set1_ps(f32::from_le_bytes(av.d[r][i]));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, da), acc[r]);
                }
            }
            acc
        }
    };
}

group_tile_q6k!(group_tile_q6k, "avx2,fma,f16c", byte_step);
group_tile_q6k!(
    vnni_group_tile_q6k,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    vnni_byte_step
);

/// [`vnni_group_tile_q6k`] on 512-bit registers over two consecutive row groups (`g0`, `g1`):
/// lanes 0-7 of result r are group `g0`'s rows, lanes 8-15 group `g1`'s, each lane with the
/// same integer sums and float operations in the same order, so the same bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn vnni_group_pair_tile_q6k<const KIND: u8, const GB: usize, const R: usize>(
    n: usize,
    g0: &[u8],
    g1: &[u8],
    a: [&[u8]; R],
) -> [__m512; R] {
    let nb = n / QK_K;
    let (b0, b1) = (
        &g0.as_chunks::<Q6K_GROUP_BYTES>().0[..nb],
        &g1.as_chunks::<Q6K_GROUP_BYTES>().0[..nb],
    );
    let av = split_q8k::<R>(n, nb, a);
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); R];
    for i in 0..nb {
        prefetch_block_ahead(b0, i);
        prefetch_block_ahead(b1, i);
        let (x, y) = (&b0[i], &b1[i]);
        let mut sumi = [_mm512_setzero_si512(); R];
        for h in 0..2 {
            for half in 0..2 {
                let mut isum = [[_mm512_setzero_si512(); R]; 4];
                for t in 0..4 {
                    let l = 16 * half + 4 * t;
                    let ql0 = ld_pair(x, y, 8 * (64 * h + l));
                    let ql1 = ld_pair(x, y, 8 * (64 * h + 32 + l));
                    let qh = ld_pair(x, y, Q6K_QH + 8 * (32 * h + l));
                    let low = [
                        _mm512_and_si512(ql0, m4),
                        _mm512_and_si512(ql1, m4),
                        _mm512_and_si512(_mm512_srli_epi32::<4>(ql0), m4),
                        _mm512_and_si512(_mm512_srli_epi32::<4>(ql1), m4),
                    ];
                    for g in 0..4 {
                        let high = match g {
                            0 => _mm512_slli_epi32::<4>(qh),
                            1 => _mm512_slli_epi32::<2>(qh),
                            2 => qh,
                            _ => _mm512_srli_epi32::<2>(qh),
                        };
                        let q = _mm512_or_si512(low[g], _mm512_and_si512(high, _mm512_set1_epi8(0x30)));
                        for r in 0..R {
                            let a4 = _mm512_set1_epi32(i32_at(&av.q[r][i], 128 * h + 32 * g + l));
                            isum[g][r] = _mm512_dpbusd_epi32(isum[g][r], q, a4);
                        }
                    }
                }
                for g in 0..4 {
                    let k = 8 * h + 2 * g + half;
                    let sc = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(
                        ld64(x, Q6K_SCALES + 8 * k),
                        ld64(y, Q6K_SCALES + 8 * k),
                    ));
                    for r in 0..R {
                        sumi[r] = _mm512_add_epi32(sumi[r], _mm512_mullo_epi32(isum[g][r], sc));
                    }
                }
            }
        }
        let mut off = [_mm512_setzero_si512(); R];
        for kp in 0..8 {
            // On 256-bit halves: a 512-bit `madd` would need AVX-512 BW.
            let (px, py) = (q6_scale_pairs(x, kp), q6_scale_pairs(y, kp));
            for r in 0..R {
                let b2 = _mm256_set1_epi32(i32_at(&av.bsums[r][i], 4 * kp));
                let m = lanes_pair(_mm256_madd_epi16(px, b2), _mm256_madd_epi16(py, b2));
                off[r] = _mm512_add_epi32(off[r], m);
            }
        }
        let d = ph_pair(x, y, Q6K_D);
        for r in 0..R {
            let total = _mm512_sub_epi32(sumi[r], _mm512_slli_epi32::<5>(off[r]));
            let da = _mm512_set1_ps(f32::from_le_bytes(av.d[r][i]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total), _mm512_mul_ps(d, da), acc[r]);
        }
    }
    acc
}

/// The VNNI group tile on 512-bit registers over two consecutive row groups (`g0`, `g1`):
/// lanes 0-7 of result r are group `g0`'s rows, lanes 8-15 group `g1`'s. Each activation
/// broadcast and `vpdpbusd` serves sixteen rows instead of eight; every lane runs the same
/// integer sums and the same float operations in the same order as [`vnni_group_tile`], so
/// the results are bit for bit its results.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn vnni_group_pair_tile<const KIND: u8, const GB: usize, const R: usize>(
    n: usize,
    g0: &[u8],
    g1: &[u8],
    a: [&[u8]; R],
) -> [__m512; R] {
    let nb = n / 32;
    let (b0, b1) = (&g0.as_chunks::<GB>().0[..nb], &g1.as_chunks::<GB>().0[..nb]);
    let (aq, am) = split_acts::<R, 32, Q8_1_META_BYTES>(n, nb, nb, a);
    let m4 = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); R];
    for b in 0..nb {
        prefetch_block_ahead(b0, b);
        prefetch_block_ahead(b1, b);
        let dw = ph_pair(&b0[b], &b1[b], 0);
        let mut isum = [_mm512_setzero_si512(); R];
        if KIND == GK_Q8_0 {
            for j in 0..8 {
                let v = _mm512_xor_si512(ld_pair(&b0[b], &b1[b], 16 + 32 * j), _mm512_set1_epi8(-128));
                for r in 0..R {
                    isum[r] = _mm512_dpbusd_epi32(isum[r], v, _mm512_set1_epi32(i32_at(&aq[r][b], 4 * j)));
                }
            }
            for r in 0..R {
                isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(i32_at(&am[r][b], 8) << 7));
            }
        } else {
            let qo = if KIND == GK_Q4_1 { 32 } else { 16 };
            for j in 0..4 {
                let v = ld_pair(&b0[b], &b1[b], qo + 32 * j);
                let lo = _mm512_and_si512(v, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi32::<4>(v), m4);
                for r in 0..R {
                    let alo = _mm512_set1_epi32(i32_at(&aq[r][b], 4 * j));
                    let ahi = _mm512_set1_epi32(i32_at(&aq[r][b], 16 + 4 * j));
                    isum[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[r], lo, alo), hi, ahi);
                }
            }
            if KIND == GK_Q4_0 {
                for r in 0..R {
                    isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(i32_at(&am[r][b], 8) << 3));
                }
            }
        }
        let mw = if KIND == GK_Q4_1 {
            ph_pair(&b0[b], &b1[b], 16)
        } else {
            _mm512_setzero_ps()
        };
        for r in 0..R {
            let da = _mm512_set1_ps(f32_at(&am[r][b], 0));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, da), acc[r]);
            if KIND == GK_Q4_1 {
                acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(f32_at(&am[r][b], 4)), acc[r]);
            }
        }
    }
    acc
}

/// Two groups' 32 bytes at `off` of their blocks `x` and `y`, `x`'s in the low half.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn ld_pair<const N: usize>(x: &[u8; N], y: &[u8; N], off: usize) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld256(x, off)), ld256(y, off))
}

/// Two groups' eight f16 at `off` of their blocks `x` and `y`, as sixteen f32 (`x`'s first).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn ph_pair<const N: usize>(x: &[u8; N], y: &[u8; N], off: usize) -> __m512 {
    _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(
        _mm256_castsi128_si256(ld128(x, off)),
        ld128(y, off),
    ))
}

/// Writes a pair tile's results: the low eight lanes as group rows `r0..`, the high eight as the
/// next group's ([`put_group`] for each; `valid` rows of the second).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
fn put_group_pair<const R: usize, const COLUMNS: bool>(
    out: &mut [f32],
    shape: (usize, usize),
    r0: usize,
    valid: usize,
    j: usize,
    t: [__m512; R],
) {
    let mut low = [_mm256_setzero_ps(); R];
    let mut high = [_mm256_setzero_ps(); R];
    for r in 0..R {
        low[r] = _mm512_castps512_ps256(t[r]);
        high[r] = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(t[r])));
    }
    put_group::<R, COLUMNS>(out, shape, r0, GROUP_ROWS, j, low);
    put_group::<R, COLUMNS>(out, shape, r0 + GROUP_ROWS, valid, j, high);
}

/// Writes a group tile's results for the first `valid` rows of the group: lane i of `t[r]` to
/// `out[(r0 + i) * m + j + r]`, or with `COLUMNS` (the output of `rows` weight rows by
/// activation row) to `out[(j + r) * rows + r0 + i]`, eight lanes in one store.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn put_group<const R: usize, const COLUMNS: bool>(
    out: &mut [f32],
    (m, rows): (usize, usize),
    r0: usize,
    valid: usize,
    j: usize,
    t: [__m256; R],
) {
    for (r, v) in t.into_iter().enumerate() {
        if COLUMNS && valid == GROUP_ROWS {
            let at = (j + r) * rows + r0;
            let dst: &mut [f32; GROUP_ROWS] = (&mut out[at..at + GROUP_ROWS]).try_into().expect("eight lanes");
            // SAFETY: `dst` is exactly 8 floats, the size of the unaligned store.
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr(), v) };
            continue;
        }
        let mut lanes = [0.0f32; GROUP_ROWS];
        // SAFETY: `lanes` is exactly 8 floats, the size of the unaligned store.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
        for (i, l) in lanes[..valid].iter().enumerate() {
            let at = if COLUMNS {
                (j + r) * rows + r0 + i
            } else {
                (r0 + i) * m + j + r
            };
            out[at] = *l;
        }
    }
}

// ---------------------------------------------------------------------------------------
// K-quants against Q8K activations.

/// Q8K activation rows split into 256-quant chunks, scales and per-16 sums.
struct Q8KRows<'a, const R: usize> {
    q: [&'a [[u8; QK_K]]; R],
    d: [&'a [[u8; 4]]; R],
    bsums: [&'a [[u8; 32]]; R],
}

#[inline]
fn split_q8k<const R: usize>(n: usize, nb: usize, a: [&[u8]; R]) -> Q8KRows<'_, R> {
    let mut q: [&[[u8; QK_K]]; R] = [&[]; R];
    let mut d: [&[[u8; 4]]; R] = [&[]; R];
    let mut bsums: [&[[u8; 32]]; R] = [&[]; R];
    for r in 0..R {
        let (qs, rest) = a[r].split_at(n);
        let (ds, bs) = rest.split_at(4 * nb);
        q[r] = &qs.as_chunks::<QK_K>().0[..nb];
        d[r] = &ds.as_chunks::<4>().0[..nb];
        bsums[r] = &bs.as_chunks::<32>().0[..nb];
    }
    Q8KRows { q, d, bsums }
}

// ---------------------------------------------------------------------------------------
// Float weights against F32 activations.

/// 8 F32 weights.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dec8_f32(b: &[u8; 32]) -> __m256 {
    _mm256_castsi256_ps(ld256(b, 0))
}

/// 8 F16 weights.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dec8_f16(b: &[u8; 16]) -> __m256 {
    _mm256_cvtph_ps(ld128(b, 0))
}

/// 8 BF16 weights.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dec8_bf16(b: &[u8; 16]) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(ld128(b, 0))))
}

/// One weight value, for the tails of rows whose length is not a multiple of 8.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dec1(ty: GgmlType, w: &[u8], i: usize) -> f32 {
    match ty {
        GgmlType::F32 => f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]),
        GgmlType::F16 => f16_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])),
        _ => f32::from_bits(u32::from(u16::from_le_bytes([w[2 * i], w[2 * i + 1]])) << 16),
    }
}

macro_rules! tile_float {
    ($name:ident, $ty:expr, $bb:literal, $dec:ident) => {
        /// A tile of `RW` float weight rows by `R` F32 activation rows. With a single
        /// accumulator pair the loop runs two chains (even and odd groups of 8).
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        fn $name<const RW: usize, const R: usize>(n: usize, w: [&[u8]; RW], a: [&[u8]; R]) -> [[f32; R]; RW] {
            let n8 = n / 8;
            let wb = weight_blocks::<RW, $bb>(w, n8);
            let mut av: [&[[u8; 32]]; R] = [&[]; R];
            for r in 0..R {
                av[r] = &a[r].as_chunks::<32>().0[..n8];
            }
            let mut acc = [[[_mm256_setzero_ps(); R]; RW]; 2];
            let mut i = 0;
            while i + 2 <= n8 {
                for (u, acc_u) in acc.iter_mut().enumerate() {
                    for x in 0..RW {
                        let wv = $dec(&wb[x][i + u]);
                        for r in 0..R {
                            let xv = _mm256_castsi256_ps(ld256(&av[r][i + u], 0));
                            acc_u[x][r] = _mm256_fmadd_ps(wv, xv, acc_u[x][r]);
                        }
                    }
                }
                i += 2;
            }
            if i < n8 {
                for x in 0..RW {
                    let wv = $dec(&wb[x][i]);
                    for r in 0..R {
                        let xv = _mm256_castsi256_ps(ld256(&av[r][i], 0));
                        acc[0][x][r] = _mm256_fmadd_ps(wv, xv, acc[0][x][r]);
                    }
                }
            }
            let [mut acc0, acc1] = acc;
            for x in 0..RW {
                for r in 0..R {
                    acc0[x][r] = _mm256_add_ps(acc0[x][r], acc1[x][r]);
                }
            }
            let mut out = finish(acc0);
            for e in 8 * n8..n {
                for x in 0..RW {
                    let wv = dec1($ty, w[x], e);
                    for r in 0..R {
                        let xs = &a[r][4 * e..4 * e + 4];
                        out[x][r] += wv * f32::from_le_bytes([xs[0], xs[1], xs[2], xs[3]]);
                    }
                }
            }
            out
        }
    };
}

tile_float!(tile_f32, GgmlType::F32, 32, dec8_f32);
tile_float!(tile_f16, GgmlType::F16, 16, dec8_f16);
tile_float!(tile_bf16, GgmlType::BF16, 16, dec8_bf16);

// ---------------------------------------------------------------------------------------
// Whole matrices: tiles over all weight rows and activation rows.
//
// The file's rows: m == 1: 4 x 1 tiles (then 1 x 1 for the last rows); m == 2: 2 x 2 tiles;
// otherwise 1 x 4 tiles along the activation rows, with a 1 x (m mod 4) tile at the end.
// Row groups: see `group_matrix_fn`.
// Before each tile the weight bytes some distance past it are prefetched: the hardware
// prefetcher stops at 4 KiB page boundaries. How far and into which cache depends on the CPU
// (see [`Prefetch`]).

/// How the matrix kernels prefetch the weights ahead of the tile they compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Prefetch {
    /// Bytes past the tile being computed.
    ahead: usize,
    /// `prefetchnta` (into L1, bypassing the outer caches where the CPU can) rather than
    /// `prefetcht0` (into every level).
    non_temporal: bool,
}

impl Prefetch {
    /// The plan for this CPU's vendor, chosen once. On AMD (Zen 3, the first target) weights
    /// stream from DRAM and `prefetchnta` 8 KiB ahead doubled the bandwidth the hardware
    /// prefetcher reached alone. On Intel (a 2-vCPU Xeon with 260 MiB of L3 that holds
    /// SmolLM2's weights) `prefetchnta` halved it instead: one thread's Q4_1 rows ran at 6.1 GB/s
    /// from L3 and 7.5 from DRAM with it, 15.6 and 11.8 with `prefetcht0` 4 KiB ahead.
    fn for_this_cpu() -> Prefetch {
        static PLAN: std::sync::OnceLock<Prefetch> = std::sync::OnceLock::new();
        *PLAN.get_or_init(|| Prefetch::for_vendor(&cpu_vendor()))
    }

    fn for_vendor(vendor: &[u8; 12]) -> Prefetch {
        match vendor {
            b"AuthenticAMD" | b"HygonGenuine" => Prefetch {
                ahead: 8192,
                non_temporal: true,
            },
            _ => Prefetch {
                ahead: 4096,
                non_temporal: false,
            },
        }
    }
}

/// The CPU's vendor string from CPUID leaf 0 (`GenuineIntel`, `AuthenticAMD`, ...).
fn cpu_vendor() -> [u8; 12] {
    let r = __cpuid(0);
    let mut v = [0u8; 12];
    v[..4].copy_from_slice(&r.ebx.to_le_bytes());
    v[4..8].copy_from_slice(&r.edx.to_le_bytes());
    v[8..].copy_from_slice(&r.ecx.to_le_bytes());
    v
}

/// Prefetches the cache lines of `w[from + pf.ahead..to + pf.ahead]` (clipped to `w`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_ahead(w: &[u8], from: usize, to: usize, pf: Prefetch) {
    let end = (to + pf.ahead).min(w.len());
    let from = from + pf.ahead;
    let base = w.as_ptr() as usize;
    // Walk whole lines: start at the line holding byte `from`.
    let mut off = from.saturating_sub((base + from) % 64);
    while off < end {
        // SAFETY: a prefetch is only a hint: it never faults and changes no memory; `off`
        // is inside `w`, so the pointer arithmetic stays inside the allocation.
        let p = unsafe { w.as_ptr().add(off) }.cast();
        if pf.non_temporal {
            _mm_prefetch::<_MM_HINT_NTA>(p);
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p);
        }
        off += 64;
    }
}

macro_rules! matrix_fn {
    ($safe:ident, $inner:ident, $tile:ident, $ty:expr) => {
        matrix_fn!($safe, $inner, $tile, $ty, "avx2,fma,f16c");
    };
    ($safe:ident, $inner:ident, $tile:ident, $ty:expr, $feat:literal) => {
        #[target_feature(enable = $feat)]
        fn $inner(n: usize, w: &[u8], rows: usize, acts: &[u8], m: usize, out: &mut [f32]) {
            let wb = weight_row_bytes($ty, n);
            let ab = act_row_bytes(act_format_for($ty), n);
            let w = &w[..wb * rows];
            let out = &mut out[..rows * m];
            let wrow = |r: usize| &w[r * wb..(r + 1) * wb];
            let arow = |j: usize| &acts[j * ab..(j + 1) * ab];
            let pf = Prefetch::for_this_cpu();
            let mut r = 0;
            match m {
                1 => {
                    while r + 4 <= rows {
                        prefetch_ahead(w, r * wb, (r + 4) * wb, pf);
                        let t = $tile::<4, 1>(n, [wrow(r), wrow(r + 1), wrow(r + 2), wrow(r + 3)], [arow(0)]);
                        out[r..r + 4].copy_from_slice(&[t[0][0], t[1][0], t[2][0], t[3][0]]);
                        r += 4;
                    }
                    while r < rows {
                        out[r] = $tile::<1, 1>(n, [wrow(r)], [arow(0)])[0][0];
                        r += 1;
                    }
                }
                2 => {
                    while r + 2 <= rows {
                        prefetch_ahead(w, r * wb, (r + 2) * wb, pf);
                        let t = $tile::<2, 2>(n, [wrow(r), wrow(r + 1)], [arow(0), arow(1)]);
                        out[2 * r..2 * r + 4].copy_from_slice(&[t[0][0], t[0][1], t[1][0], t[1][1]]);
                        r += 2;
                    }
                    if r < rows {
                        let t = $tile::<1, 2>(n, [wrow(r)], [arow(0), arow(1)]);
                        out[2 * r..2 * r + 2].copy_from_slice(&t[0]);
                    }
                }
                _ => {
                    for (r, o) in out.chunks_exact_mut(m).enumerate() {
                        prefetch_ahead(w, r * wb, (r + 1) * wb, pf);
                        let wr = [wrow(r)];
                        let mut j = 0;
                        while j + 4 <= m {
                            let t = $tile::<1, 4>(n, wr, [arow(j), arow(j + 1), arow(j + 2), arow(j + 3)]);
                            o[j..j + 4].copy_from_slice(&t[0]);
                            j += 4;
                        }
                        match m - j {
                            3 => {
                                let t = $tile::<1, 3>(n, wr, [arow(j), arow(j + 1), arow(j + 2)]);
                                o[j..j + 3].copy_from_slice(&t[0]);
                            }
                            2 => {
                                let t = $tile::<1, 2>(n, wr, [arow(j), arow(j + 1)]);
                                o[j..j + 2].copy_from_slice(&t[0]);
                            }
                            1 => o[j] = $tile::<1, 1>(n, wr, [arow(j)])[0][0],
                            _ => {}
                        }
                    }
                }
            }
        }

        fn $safe(n: usize, w: &[u8], rows: usize, acts: &[u8], m: usize, out: &mut [f32]) {
            // SAFETY: `kernel()` / `kernel_vnni()` hand this function out only after
            // `available()` / `available_vnni()` found the features `$inner` is compiled
            // for on this CPU; all memory access inside is through bounds-checked slices.
            unsafe { $inner(n, w, rows, acts, m, out) }
        }
    };
}

matrix_fn!(mat_f32, mat_f32_impl, tile_f32, GgmlType::F32);
matrix_fn!(mat_f16, mat_f16_impl, tile_f16, GgmlType::F16);
matrix_fn!(mat_bf16, mat_bf16_impl, tile_bf16, GgmlType::BF16);
matrix_fn!(mat_q5_0, mat_q5_0_impl, tile_q5_0, GgmlType::Q5_0);
matrix_fn!(mat_q5_1, mat_q5_1_impl, tile_q5_1, GgmlType::Q5_1);

/// The VNNI builds of the 8-bit kernels (see the module comment).
macro_rules! vnni_matrix_fn {
    ($safe:ident, $inner:ident, $tile:ident, $ty:expr) => {
        matrix_fn!(
            $safe,
            $inner,
            $tile,
            $ty,
            "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
        );
    };
}

vnni_matrix_fn!(vnni_mat_q5_0, vnni_mat_q5_0_impl, vnni_tile_q5_0, GgmlType::Q5_0);
vnni_matrix_fn!(vnni_mat_q5_1, vnni_mat_q5_1_impl, vnni_tile_q5_1, GgmlType::Q5_1);

/// Activation rows from which the VNNI group kernels of `KIND` take two groups at a time. A
/// pair reads two streams a tile: from DRAM it lost where a tile is bound by its bytes (Q4 at
/// one row 0.83-0.93x, Q8_0 at three 0.87x; from L2 1.13-1.27x faster) and won from two rows
/// (Q4) or four (Q8_0) on (bench/NOTES.md), and one-row decode of a model larger than the L3
/// streams from DRAM.
const fn pair_min_rows(kind: u8) -> usize {
    if kind == GK_Q8_0 {
        4
    } else {
        2
    }
}

macro_rules! group_matrix_fn {
    ($safe:ident, $columns:ident, $inner:ident, $tile:ident, $kind:ident, $gb:literal, $ty:expr, $feat:literal,
     $rmax:literal $(, $pair:ident)?) => {
        /// Row groups one after another (with `$pair` and at least `pair_min_rows` activation
        /// rows: two at a time on 512-bit registers, then the last one alone), each against the
        /// activation rows `$rmax` at a time (then the rest at once): the groups' weights stay
        /// in L1 while the rows pass.
        /// With `COLUMNS` the output is by activation row (`out[j * rows + r]`).
        #[target_feature(enable = $feat)]
        fn $inner<const COLUMNS: bool>(n: usize, w: &[u8], rows: usize, acts: &[u8], m: usize, out: &mut [f32]) {
            let gbytes = GROUP_ROWS * weight_row_bytes($ty, n);
            let ab = act_row_bytes(act_format_for($ty), n);
            let arow = |j: usize| &acts[j * ab..(j + 1) * ab];
            let group = |g: usize| &w[g * gbytes..(g + 1) * gbytes];
            let groups = rows.div_ceil(GROUP_ROWS);
            // Every activation row through `$tile_rows!(R, j)`: tiles of `$rmax` rows, then the
            // rest in one pass (a verification step of speculative decoding is 2-5 rows; AVX2's
            // 16 registers hold at most 4 rows' sums).
            macro_rules! each_row_tile {
                ($tile_rows:ident) => {{
                    let mut j = 0;
                    while j + $rmax <= m {
                        $tile_rows!($rmax, j);
                        j += $rmax;
                    }
                    match m - j {
                        0 => {}
                        1 => $tile_rows!(1, j),
                        2 => $tile_rows!(2, j),
                        3 => $tile_rows!(3, j),
                        4 if $rmax > 4 => $tile_rows!(4, j),
                        5 if $rmax > 5 => $tile_rows!(5, j),
                        6 if $rmax > 6 => $tile_rows!(6, j),
                        7 if $rmax > 7 => $tile_rows!(7, j),
                        _ => unreachable!("fewer than {} rows are left", $rmax),
                    }
                }};
            }
            let mut g = 0;
            $(
                while g + 1 < groups && m >= pair_min_rows($kind) {
                    let r0 = g * GROUP_ROWS;
                    let valid = GROUP_ROWS.min(rows - r0 - GROUP_ROWS);
                    let (g0, g1) = (group(g), group(g + 1));
                    macro_rules! pair_rows {
                        ($r:literal, $j:expr) => {{
                            let t = $pair::<$kind, $gb, $r>(n, g0, g1, std::array::from_fn(|r| arow($j + r)));
                            put_group_pair::<$r, COLUMNS>(out, (m, rows), r0, valid, $j, t);
                        }};
                    }
                    each_row_tile!(pair_rows);
                    g += 2;
                }
            )?
            while g < groups {
                let r0 = g * GROUP_ROWS;
                let valid = GROUP_ROWS.min(rows - r0);
                let gw = group(g);
                macro_rules! group_rows {
                    ($r:literal, $j:expr) => {{
                        let t = $tile::<$kind, $gb, $r>(n, gw, std::array::from_fn(|r| arow($j + r)));
                        put_group::<$r, COLUMNS>(out, (m, rows), r0, valid, $j, t);
                    }};
                }
                each_row_tile!(group_rows);
                g += 1;
            }
        }

        fn $safe(n: usize, w: &[u8], rows: usize, acts: &[u8], m: usize, out: &mut [f32]) {
            // SAFETY: `kernel()` / `kernel_vnni()` hand this function out only after
            // `available()` / `available_vnni()` found the features `$inner` is compiled
            // for on this CPU; all memory access inside is through bounds-checked slices.
            unsafe { $inner::<false>(n, w, rows, acts, m, out) }
        }

        fn $columns(n: usize, w: &[u8], rows: usize, acts: &[u8], m: usize, out: &mut [f32]) {
            // SAFETY: as for `$safe` (`columns_kernel()` checks the same features).
            unsafe { $inner::<true>(n, w, rows, acts, m, out) }
        }
    };
}

group_matrix_fn!(
    groups_q4_0,
    groups_q4_0_columns,
    groups_q4_0_impl,
    group_tile,
    GK_Q4_0,
    144,
    GgmlType::Q4_0,
    "avx2,fma,f16c",
    4
);
group_matrix_fn!(
    groups_q4_1,
    groups_q4_1_columns,
    groups_q4_1_impl,
    group_tile,
    GK_Q4_1,
    160,
    GgmlType::Q4_1,
    "avx2,fma,f16c",
    4
);
group_matrix_fn!(
    groups_q8_0,
    groups_q8_0_columns,
    groups_q8_0_impl,
    group_tile,
    GK_Q8_0,
    272,
    GgmlType::Q8_0,
    "avx2,fma,f16c",
    4
);
group_matrix_fn!(
    groups_q4k,
    groups_q4k_columns,
    groups_q4k_impl,
    group_tile_q4k,
    GK_Q4K,
    1152,
    GgmlType::Q4K,
    "avx2,fma,f16c",
    4
);
group_matrix_fn!(
    vnni_groups_q4k,
    vnni_groups_q4k_columns,
    vnni_groups_q4k_impl,
    vnni_group_tile_q4k,
    GK_Q4K,
    1152,
    GgmlType::Q4K,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    8,
    vnni_group_pair_tile_q4k
);
group_matrix_fn!(
    groups_q6k,
    groups_q6k_columns,
    groups_q6k_impl,
    group_tile_q6k,
    GK_Q6K,
    1680,
    GgmlType::Q6K,
    "avx2,fma,f16c",
    2
);
group_matrix_fn!(
    vnni_groups_q6k,
    vnni_groups_q6k_columns,
    vnni_groups_q6k_impl,
    vnni_group_tile_q6k,
    GK_Q6K,
    1680,
    GgmlType::Q6K,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    4,
    vnni_group_pair_tile_q6k
);
group_matrix_fn!(
    groups_q5k,
    groups_q5k_columns,
    groups_q5k_impl,
    group_tile_q4k,
    GK_Q5K,
    1408,
    GgmlType::Q5K,
    "avx2,fma,f16c",
    4
);
group_matrix_fn!(
    vnni_groups_q5k,
    vnni_groups_q5k_columns,
    vnni_groups_q5k_impl,
    vnni_group_tile_q4k,
    GK_Q5K,
    1408,
    GgmlType::Q5K,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    8,
    vnni_group_pair_tile_q4k
);
group_matrix_fn!(
    vnni_groups_q4_0,
    vnni_groups_q4_0_columns,
    vnni_groups_q4_0_impl,
    vnni_group_tile,
    GK_Q4_0,
    144,
    GgmlType::Q4_0,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    8,
    vnni_group_pair_tile
);
group_matrix_fn!(
    vnni_groups_q4_1,
    vnni_groups_q4_1_columns,
    vnni_groups_q4_1_impl,
    vnni_group_tile,
    GK_Q4_1,
    160,
    GgmlType::Q4_1,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    8,
    vnni_group_pair_tile
);
group_matrix_fn!(
    vnni_groups_q8_0,
    vnni_groups_q8_0_columns,
    vnni_groups_q8_0_impl,
    vnni_group_tile,
    GK_Q8_0,
    272,
    GgmlType::Q8_0,
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni",
    8,
    vnni_group_pair_tile
);

// ---------------------------------------------------------------------------------------
// Activation quantization.

/// Quantizes with AVX2 when the CPU has it (returns `false` otherwise, writing nothing).
/// Arguments were checked by the caller. The bytes are identical to the scalar quantizer's:
/// the same `max |x|`, the same `d` and `1/d` from [`scales`], the same products `x * (1/d)`,
/// rounded half to even, NaN to 0, clamped to `[-127, 127]`.
pub(super) fn quantize_act_row(fmt: ActFormat, x: &[f32], out: &mut [u8]) -> bool {
    if fmt == ActFormat::F32 || !available() {
        return false;
    }
    // SAFETY: `available()` just confirmed AVX2, FMA and F16C, the features
    // `quantize_impl` is compiled for; it touches memory only through slices.
    unsafe { quantize_impl(fmt, x, out) };
    true
}

#[target_feature(enable = "avx2,fma,f16c")]
fn quantize_impl(fmt: ActFormat, x: &[f32], out: &mut [u8]) {
    let n = x.len();
    let (qs, meta) = out.split_at_mut(n);
    match fmt {
        ActFormat::F32 => {}
        ActFormat::Q8_1 => {
            for ((xb, qb), m) in x
                .as_chunks::<32>()
                .0
                .iter()
                .zip(qs.as_chunks_mut::<32>().0)
                .zip(meta.chunks_exact_mut(Q8_1_META_BYTES))
            {
                let (d, sum) = quant32_blocks(xb, qb);
                write_q8_1_meta(d, sum, m);
            }
        }
        ActFormat::Q8K => {
            let nb = n / QK_K;
            let (ds, bsums) = meta.split_at_mut(4 * nb);
            for (((xb, qb), db), sb) in x
                .as_chunks::<QK_K>()
                .0
                .iter()
                .zip(qs.as_chunks_mut::<QK_K>().0)
                .zip(ds.chunks_exact_mut(4))
                .zip(bsums.chunks_exact_mut(32))
            {
                let (d, _) = quant32_blocks(xb, qb);
                db.copy_from_slice(&d.to_le_bytes());
                write_bsums(qb, sb);
            }
        }
    }
}

/// Loads 8 floats at `8 * k` of `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn ld8f<const N: usize>(x: &[f32; N], k: usize) -> __m256 {
    assert!(8 * k + 8 <= N);
    // SAFETY: the assertion keeps the unaligned 8-float read inside `x`.
    unsafe { _mm256_loadu_ps(x.as_ptr().add(8 * k)) }
}

/// Quantizes `N` values (a multiple of 32) with one scale; returns `(d, sum of quants)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn quant32_blocks<const N: usize>(x: &[f32; N], q: &mut [u8; N]) -> (f32, i32) {
    let sign = _mm256_set1_ps(-0.0);
    let mut mx = _mm256_setzero_ps();
    for k in 0..N / 8 {
        // max(|x|, mx) returns `mx` when `|x|` is NaN, as `f32::max` ignores NaN.
        mx = _mm256_max_ps(_mm256_andnot_ps(sign, ld8f(x, k)), mx);
    }
    let m = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    let (d, id) = scales(_mm_cvtss_f32(m));
    let idv = _mm256_set1_ps(id);
    let lo = _mm256_set1_ps(-127.0);
    let hi = _mm256_set1_ps(127.0);
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let mut sum = _mm256_setzero_si256();
    for (c, qc) in q.as_chunks_mut::<32>().0.iter_mut().enumerate() {
        let mut v = [_mm256_setzero_si256(); 4];
        for (t, vt) in v.iter_mut().enumerate() {
            let p = _mm256_mul_ps(ld8f(x, 4 * c + t), idv);
            let p = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(p);
            let p = _mm256_and_ps(p, _mm256_cmp_ps::<_CMP_ORD_Q>(p, p));
            let p = _mm256_min_ps(_mm256_max_ps(p, lo), hi);
            *vt = _mm256_cvtps_epi32(p);
            sum = _mm256_add_epi32(sum, *vt);
        }
        let p16a = _mm256_packs_epi32(v[0], v[1]);
        let p16b = _mm256_packs_epi32(v[2], v[3]);
        let p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), order);
        // SAFETY: `qc` is exactly 32 bytes, the size of the unaligned store.
        unsafe { _mm256_storeu_si256(qc.as_mut_ptr().cast(), p8) };
    }
    let s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256::<1>(sum));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    (d, _mm_cvtsi128_si32(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefetch_plan_follows_the_vendor() {
        let amd = Prefetch::for_vendor(b"AuthenticAMD");
        assert!(amd.non_temporal && amd.ahead == 8192);
        let intel = Prefetch::for_vendor(b"GenuineIntel");
        assert!(!intel.non_temporal && intel.ahead == 4096);
        assert_eq!(Prefetch::for_vendor(b"SomethingNew"), intel);
        // This CPU's vendor is one CPUID string of printable ASCII.
        assert!(cpu_vendor().iter().all(|b| b.is_ascii_graphic()));
    }
}
