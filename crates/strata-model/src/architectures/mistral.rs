//! Mistral 7B and relatives: the llama layout under its own GGUF architecture name.
//! (Most Mistral GGUF files say `llama`; newer converters write `mistral`.)

use strata_runtime::cpu::ops::RopeLayout;

use super::Architecture;

pub const MISTRAL: Architecture = Architecture {
    name: "mistral",
    hf_class: "MistralForCausalLM",
    qkv_bias: false,
    qk_norm: false,
    gguf_rope: RopeLayout::Interleaved,
};
