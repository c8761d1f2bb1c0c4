//! Qwen3 dense models: no QKV bias, but an RMSNorm on each query and key head before RoPE.
//! Head dimension is explicit (`attention.key_length`), not hidden / heads.

use strata_runtime::cpu::ops::RopeLayout;

use super::Architecture;

pub const QWEN3: Architecture = Architecture {
    name: "qwen3",
    hf_class: "Qwen3ForCausalLM",
    qkv_bias: false,
    qk_norm: true,
    gguf_rope: RopeLayout::Neox,
};
