//! Qwen3 dense models: no QKV bias, but an RMSNorm on each query and key head before RoPE.
//! Head dimension is explicit (`attention.key_length`), not hidden / heads.

use strata_runtime::cpu::ops::RopeLayout;

use super::Hparams;
use crate::config::{Arch, ModelConfig};
use crate::error::ModelError;

pub(super) fn config(h: &Hparams) -> Result<ModelConfig, ModelError> {
    let mut c = h.base(Arch::Qwen3, RopeLayout::Neox)?;
    c.qk_norm = true;
    Ok(c)
}
