//! Qwen2 / Qwen2.5 (and DeepSeek-R1-Distill-Qwen): llama layout plus biases on Q, K and V.
//! RoPE pairs dimensions by halves (NeoX layout); GGUF keeps HF's Q/K row order.

use strata_runtime::cpu::ops::RopeLayout;

use super::Hparams;
use crate::config::{Arch, ModelConfig};
use crate::error::ModelError;

pub(super) fn config(h: &Hparams) -> Result<ModelConfig, ModelError> {
    let mut c = h.base(Arch::Qwen2, RopeLayout::Neox)?;
    c.qkv_bias = true;
    Ok(c)
}
