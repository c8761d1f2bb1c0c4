//! Mistral 7B and relatives: the llama layout under its own GGUF architecture name.
//! (Most Mistral GGUF files say `llama`; newer converters write `mistral`.)

use strata_runtime::cpu::ops::RopeLayout;

use super::Hparams;
use crate::config::{Arch, ModelConfig, RopeScaling};
use crate::error::ModelError;

pub(super) fn config(h: &Hparams) -> Result<ModelConfig, ModelError> {
    let mut c = h.base(Arch::Mistral, RopeLayout::Interleaved)?;
    if let Some(factors) = super::llama::rope_freq_factors(h, c.rope.dim)? {
        c.rope.scaling = RopeScaling::FreqFactors(factors);
    }
    Ok(c)
}
