//! The element type a GPU computes in (`--dtype`), known without the `cuda` feature so that the
//! planner can size a GPU's KV cache on any machine.

use serde::Serialize;

/// What a GPU computes in (`--dtype`): the element type of the weight matrices, of the
/// activations between kernels, and of the full-precision (`auto`) KV cache. Sums are f32 either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ComputeDtype {
    /// bf16: the serving default.
    Bf16,
    /// f32 throughout: twice the memory and none of the fast kernels (decode GEMVs, tensor-core
    /// attention, fp8 cache), a reference that rounds like a float32 framework.
    F32,
}

impl ComputeDtype {
    /// Bytes of one element.
    pub fn bytes(self) -> usize {
        match self {
            ComputeDtype::Bf16 => 2,
            ComputeDtype::F32 => 4,
        }
    }

    /// Its name in logs and KV layouts.
    pub fn as_str(self) -> &'static str {
        match self {
            ComputeDtype::Bf16 => "bf16",
            ComputeDtype::F32 => "f32",
        }
    }
}
