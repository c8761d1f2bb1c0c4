//! Qwen2 / Qwen2.5 (and DeepSeek-R1-Distill-Qwen): llama layout plus biases on Q, K and V.
//! RoPE pairs dimensions by halves (NeoX layout); GGUF keeps HF's Q/K row order.

use strata_runtime::cpu::ops::RopeLayout;

use super::Architecture;

pub const QWEN2: Architecture = Architecture {
    name: "qwen2",
    hf_class: "Qwen2ForCausalLM",
    qkv_bias: true,
    qk_norm: false,
    gguf_rope: RopeLayout::Neox,
};
