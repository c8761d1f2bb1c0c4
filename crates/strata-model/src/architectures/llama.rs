//! Llama (1, 2, 3.x) and its many fine-tunes, incl. SmolLM2 and DeepSeek-R1-Distill-Llama.
//! GGUF llama files store Q/K rows permuted for interleaved RoPE; Llama-3 scaling as `rope_freqs`.

use strata_runtime::cpu::ops::RopeLayout;

use super::Architecture;

pub const LLAMA: Architecture = Architecture {
    name: "llama",
    hf_class: "LlamaForCausalLM",
    qkv_bias: false,
    qk_norm: false,
    gguf_rope: RopeLayout::Interleaved,
};
