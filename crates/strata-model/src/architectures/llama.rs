//! Llama (1, 2, 3.x) and its many fine-tunes, incl. SmolLM2 and DeepSeek-R1-Distill-Llama.
//! GGUF llama files store Q/K rows permuted for interleaved RoPE; Llama-3 scaling as `rope_freqs`.

use strata_formats::GgmlType;
use strata_runtime::cpu::ops::RopeLayout;

use super::Hparams;
use crate::config::{Arch, ModelConfig, RopeScaling};
use crate::error::ModelError;

pub(super) fn config(h: &Hparams) -> Result<ModelConfig, ModelError> {
    let mut c = h.base(Arch::Llama, RopeLayout::Interleaved)?;
    if let Some(factors) = rope_freq_factors(h, c.rope.dim)? {
        c.rope.scaling = RopeScaling::FreqFactors(factors);
    }
    Ok(c)
}

/// Llama-3.1 frequency factors from the `rope_freqs.weight` tensor, when present.
pub(super) fn rope_freq_factors(h: &Hparams, rope_dim: usize) -> Result<Option<Vec<f32>>, ModelError> {
    let Some(t) = h.file.tensor("rope_freqs.weight") else {
        return Ok(None);
    };
    if t.ty != GgmlType::F32 || t.n_elements != (rope_dim / 2) as u64 {
        return Err(ModelError::BadMetadata(format!(
            "rope_freqs.weight should be {} F32 values, found {} {}",
            rope_dim / 2,
            t.n_elements,
            t.ty
        )));
    }
    let bytes = h.file.tensor_data(t);
    Ok(Some(
        bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
    ))
}
