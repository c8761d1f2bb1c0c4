//! The `STRATA_*` measurement knobs of the CUDA forward pass, read from the environment once,
//! when a model is placed on its GPU; the rest of the CUDA layer reads this struct.

use strata_runtime::cuda::Fp8Gemv;

/// Shared-memory stages a warp of the staged attention kernel uses by default.
const DEFAULT_ATTENTION_STAGES: usize = 3;
/// Steps of at most this many tokens use the GEMVs instead of cuBLASLt by default.
const DEFAULT_GEMV_MAX_TOKENS: usize = 8;
/// Quantized products of up to this many tokens use quant.cu's tensor-core GEMMs by default: at
/// 256 users of a 7B Q4_K_M on an H100 the tiles beat dequantizing for cuBLASLt 1.08x (mma.sync)
/// and 1.15x (wgmma) in output tok/s; 512-token prompts stay faster dequantized (NOTES v27-v29).
const DEFAULT_QUANT_GEMM_MAX_TOKENS: usize = 256;
/// Of those, products of at least this many tokens take the shared-memory tiles of 128 tokens.
const DEFAULT_QUANT_GEMM_TILE_MIN_TOKENS: usize = 128;
/// Products whose every segment has wide tiles take them up to this many tokens by default: a
/// 512-token prompt of a 7B Q4_K_M gets its first token 8-10 % sooner than dequantized for
/// cuBLASLt on an H100, the 256-user mix even (bench/NOTES.md v44).
const DEFAULT_QUANT_WIDE_MAX_TOKENS: usize = 1024;
const DEFAULT_QUANT_WIDE_NARROW: usize = 192;

/// What the environment turns on or off; the defaults are what strata runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuKnobs {
    /// `STRATA_OVERLAP=0`: decode steps wait to be read before the next one starts.
    pub overlap: bool,
    /// `STRATA_GEMV_MAX_TOKENS=N`: products of at most N tokens run as GEMVs (0: none).
    pub gemv_max_tokens: usize,
    /// `STRATA_QUANT_GEMV_MAX_TOKENS=N`: products of quantized matrices of up to N tokens run as
    /// GEMVs 8 tokens a pass instead of dequantizing the matrix for cuBLASLt (0: off, the
    /// default until measured; bench/NOTES.md, v24).
    pub quant_gemv_max_tokens: usize,
    /// `STRATA_QUANT_GEMM_MAX_TOKENS=N`: products of quantized matrices of up to N tokens (past
    /// the GEMVs) run on quant.cu's tensor-core GEMM, which decodes the blocks in registers,
    /// instead of dequantizing the matrix for cuBLASLt (0: off; bench/NOTES.md, v25).
    pub quant_gemm_max_tokens: usize,
    /// `STRATA_QUANT_GEMM_TILE_MIN_TOKENS=N`: of those products, the ones of at least N tokens
    /// take the GEMM in shared-memory tiles of 128 tokens instead of the 64-token one (0: never;
    /// bench/NOTES.md, v27-v29).
    pub quant_gemm_tile_min_tokens: usize,
    /// `STRATA_FUSE_ROPE=0`: RoPE and the cache write in rope.cu's kernel, not the QKV GEMV.
    pub fuse_rope: bool,
    /// `STRATA_FUSE_NORM=0`: the norms as kernels between the GEMVs, not carried by them.
    pub fuse_norm: bool,
    /// `STRATA_FUSE_FP8=0`: the FP8 GEMMs' inputs quantized and their outputs scaled by fp8.cu's
    /// own kernels, not by the norms before them and the SiLU kernel (bench/NOTES.md, FP8 v5).
    pub fuse_fp8: bool,
    /// `STRATA_ATTENTION=simt`: the CUDA-core attention kernels instead of tensor cores.
    pub simt_attention: bool,
    /// `STRATA_ATTN_STAGES=N`: shared-memory stages of the staged attention kernel (0: off,
    /// otherwise clamped to 2..=max).
    pub attention_stages: usize,
    /// `STRATA_GEMM_TUNE=0`: cuBLASLt's first choices, untimed.
    pub tune_gemms: bool,
    /// `STRATA_GPU_PROFILE` (any value): the GPU time of every kernel, printed at the end.
    pub profile: bool,
    /// `STRATA_FP8_FAST_ACCUM=0`: FP8 GEMMs with cuBLASLt's periodic promotion to f32 sums.
    pub fp8_fast_accum: bool,
    /// `STRATA_FP8_OUTER_SCALES=1`: FP8 GEMMs scaled by cuBLASLt itself (outer-vector scales),
    /// not by fp8.cu's kernel after it. Opt-in: cuBLASLt 13.0 refused them on an H200
    /// (bench/NOTES.md, FP8 v2); a refusal falls back to the kernel.
    pub fp8_outer_scales: bool,
    /// `STRATA_FP8_GEMV=mma`: FP8 decode products on tensor cores (fp8.cu's `fp8_mma_gemv_*`).
    pub fp8_gemv: Fp8Gemv,
    /// An FP8 QKV GEMV applies RoPE and writes the cache itself (`fp8_gemv_qkv_rope_t*`), as
    /// the bf16 one does (bench/NOTES.md, FP8 v6); `STRATA_FP8_QKV_ROPE=0` runs rope.cu after it.
    pub fp8_qkv_rope: bool,
    /// Quantized products on quant.cu's wide tiles where they run (`qgemm_wide*`, Q4_K and Q6_K,
    /// wgmma with the weights decoded in registers; 12 % off the 256-user Q4_K_M step,
    /// bench/NOTES.md v36; of 9-192 tokens too since v49); `STRATA_QUANT_WIDE=0` keeps every
    /// product on qgemm's tiles (mma.sync to 128 tokens, the 128-token tiles past them).
    pub quant_wide: bool,
    /// `STRATA_QUANT_WIDE_MAX_TOKENS=N`: products whose segments all have wide tiles stay on them
    /// up to N tokens, past `quant_gemm_max_tokens` (where that is not 0), instead of being
    /// dequantized for cuBLASLt (bench/NOTES.md v44).
    pub quant_wide_max_tokens: usize,
    /// The wide tiles' partial last wave with k split to fill the SMs, and its sums added by
    /// `qgemm_reduce` (gate/up at up to 256 tokens; 0.35 ms off a 256-user Q4_K_M step,
    /// bench/NOTES.md v41); `STRATA_QUANT_WIDE_TAIL=0` runs those tiles whole.
    pub quant_wide_tail: bool,
    /// A product of two wide-tile segments with a pair kernel (a QKV of Q4_K q/k rows and Q6_K
    /// v rows) in one launch and one k split (`qgemm_wide_pair_*`; ~0.2 ms off the 256-user
    /// Q4_K_M step, bench/NOTES.md v46); `STRATA_QUANT_WIDE_PAIRS=0` launches each segment alone.
    pub quant_wide_pairs: bool,
    /// `STRATA_QUANT_WIDE_NARROW=N`: quantized products of up to N tokens (192 by default) on
    /// the narrowest wide tile that holds them, of 64, 128 or 192 tokens, where those run
    /// (`qgemm_wide64_*` ...), instead of qgemm's mma.sync tiles (up to 128 tokens), which
    /// decoded each weight once per 64 tokens at a fraction of the tensor cores' rate, or the
    /// 256-token wide tiles (bench/NOTES.md v49); 0 keeps those.
    pub quant_wide_narrow: usize,
    /// The k splits of a quantized GEMM into `proj` (o and down, without TP) summed by the norm
    /// after it, and a one-segment QKV's by rope.cu, instead of a `qgemm_reduce` launch
    /// (bench/NOTES.md v40, v43); `STRATA_FOLD_SPLIT_SUMS=0` launches the reduce.
    pub fold_split_sums: bool,
    /// Prompt steps' attention by tiles of 16 query tokens a block
    /// (`paged_attention_prefill_*`: each context slice read once a tile, not once a token;
    /// bench/NOTES.md, prompt attention); `STRATA_PREFILL_ATTENTION=0` keeps a block a token.
    pub prefill_attention: bool,
}

impl GpuKnobs {
    /// The knobs of this process's environment.
    pub fn from_env() -> GpuKnobs {
        GpuKnobs::from_vars(|name| std::env::var(name).ok())
    }

    /// The knobs `var` gives (a variable's value, `None` when unset).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> GpuKnobs {
        let off = |name: &str| var(name).is_some_and(|v| v == "0");
        let number = |name: &str| var(name).and_then(|v| v.parse::<usize>().ok());
        GpuKnobs {
            overlap: !off("STRATA_OVERLAP"),
            gemv_max_tokens: number("STRATA_GEMV_MAX_TOKENS").unwrap_or(DEFAULT_GEMV_MAX_TOKENS),
            quant_gemv_max_tokens: number("STRATA_QUANT_GEMV_MAX_TOKENS").unwrap_or(0),
            quant_gemm_max_tokens: number("STRATA_QUANT_GEMM_MAX_TOKENS").unwrap_or(DEFAULT_QUANT_GEMM_MAX_TOKENS),
            quant_gemm_tile_min_tokens: number("STRATA_QUANT_GEMM_TILE_MIN_TOKENS")
                .unwrap_or(DEFAULT_QUANT_GEMM_TILE_MIN_TOKENS),
            fuse_rope: !off("STRATA_FUSE_ROPE"),
            fuse_norm: !off("STRATA_FUSE_NORM"),
            fuse_fp8: !off("STRATA_FUSE_FP8"),
            simt_attention: var("STRATA_ATTENTION").is_some_and(|v| v == "simt"),
            attention_stages: match number("STRATA_ATTN_STAGES") {
                None => DEFAULT_ATTENTION_STAGES,
                Some(0) => 0,
                Some(n) => n.clamp(2, strata_runtime::cuda::STAGED_ATTENTION_MAX_STAGES),
            },
            tune_gemms: !off("STRATA_GEMM_TUNE"),
            profile: var("STRATA_GPU_PROFILE").is_some(),
            fp8_fast_accum: !off("STRATA_FP8_FAST_ACCUM"),
            fp8_outer_scales: var("STRATA_FP8_OUTER_SCALES").is_some_and(|v| v == "1"),
            fp8_gemv: match var("STRATA_FP8_GEMV").as_deref() {
                Some("mma") => Fp8Gemv::Mma,
                _ => Fp8Gemv::Lanes,
            },
            fp8_qkv_rope: !off("STRATA_FP8_QKV_ROPE"),
            quant_wide: !off("STRATA_QUANT_WIDE"),
            quant_wide_max_tokens: number("STRATA_QUANT_WIDE_MAX_TOKENS").unwrap_or(DEFAULT_QUANT_WIDE_MAX_TOKENS),
            quant_wide_tail: !off("STRATA_QUANT_WIDE_TAIL"),
            quant_wide_pairs: !off("STRATA_QUANT_WIDE_PAIRS"),
            quant_wide_narrow: number("STRATA_QUANT_WIDE_NARROW").unwrap_or(DEFAULT_QUANT_WIDE_NARROW),
            fold_split_sums: !off("STRATA_FOLD_SPLIT_SUMS"),
            prefill_attention: !off("STRATA_PREFILL_ATTENTION"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn knobs(vars: &[(&str, &str)]) -> GpuKnobs {
        GpuKnobs::from_vars(|name| vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string()))
    }

    #[test]
    fn defaults_are_what_strata_runs_with_and_each_knob_turns_one_thing() {
        let defaults = knobs(&[]);
        assert_eq!(
            defaults,
            GpuKnobs {
                overlap: true,
                gemv_max_tokens: 8,
                quant_gemv_max_tokens: 0,
                quant_gemm_max_tokens: 256,
                quant_gemm_tile_min_tokens: 128,
                fuse_rope: true,
                fuse_norm: true,
                fuse_fp8: true,
                simt_attention: false,
                attention_stages: 3,
                tune_gemms: true,
                profile: false,
                fp8_fast_accum: true,
                fp8_outer_scales: false,
                fp8_gemv: Fp8Gemv::Lanes,
                fp8_qkv_rope: true,
                quant_wide: true,
                quant_wide_max_tokens: 1024,
                quant_wide_tail: true,
                quant_wide_pairs: true,
                quant_wide_narrow: 192,
                fold_split_sums: true,
                prefill_attention: true,
            }
        );
        let all = knobs(&[
            ("STRATA_OVERLAP", "0"),
            ("STRATA_GEMV_MAX_TOKENS", "0"),
            ("STRATA_QUANT_GEMV_MAX_TOKENS", "64"),
            ("STRATA_QUANT_GEMM_MAX_TOKENS", "512"),
            ("STRATA_QUANT_GEMM_TILE_MIN_TOKENS", "0"),
            ("STRATA_FUSE_ROPE", "0"),
            ("STRATA_FUSE_NORM", "0"),
            ("STRATA_FUSE_FP8", "0"),
            ("STRATA_ATTENTION", "simt"),
            ("STRATA_ATTN_STAGES", "0"),
            ("STRATA_GEMM_TUNE", "0"),
            ("STRATA_GPU_PROFILE", "1"),
            ("STRATA_FP8_FAST_ACCUM", "0"),
            ("STRATA_FP8_OUTER_SCALES", "1"),
            ("STRATA_FP8_GEMV", "mma"),
            ("STRATA_FP8_QKV_ROPE", "0"),
            ("STRATA_QUANT_WIDE", "0"),
            ("STRATA_QUANT_WIDE_MAX_TOKENS", "2048"),
            ("STRATA_QUANT_WIDE_TAIL", "0"),
            ("STRATA_QUANT_WIDE_PAIRS", "0"),
            ("STRATA_QUANT_WIDE_NARROW", "0"),
            ("STRATA_FOLD_SPLIT_SUMS", "0"),
            ("STRATA_PREFILL_ATTENTION", "0"),
        ]);
        assert_eq!(
            all,
            GpuKnobs {
                overlap: false,
                gemv_max_tokens: 0,
                quant_gemv_max_tokens: 64,
                quant_gemm_max_tokens: 512,
                quant_gemm_tile_min_tokens: 0,
                fuse_rope: false,
                fuse_norm: false,
                fuse_fp8: false,
                simt_attention: true,
                attention_stages: 0,
                tune_gemms: false,
                profile: true,
                fp8_fast_accum: false,
                fp8_outer_scales: true,
                fp8_gemv: Fp8Gemv::Mma,
                fp8_qkv_rope: false,
                quant_wide: false,
                quant_wide_max_tokens: 2048,
                quant_wide_tail: false,
                quant_wide_pairs: false,
                quant_wide_narrow: 0,
                fold_split_sums: false,
                prefill_attention: false,
            }
        );
        // Stages are clamped; values that are not numbers keep the default.
        assert_eq!(knobs(&[("STRATA_ATTN_STAGES", "9")]).attention_stages, 4);
        assert_eq!(knobs(&[("STRATA_ATTN_STAGES", "1")]).attention_stages, 2);
        assert_eq!(knobs(&[("STRATA_GEMV_MAX_TOKENS", "x")]).gemv_max_tokens, 8);
        assert!(knobs(&[("STRATA_OVERLAP", "1")]).overlap);
    }
}
