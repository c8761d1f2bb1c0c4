//! How the forward pass launches its typed kernel calls: `bench-gpu --ablate` entries left out,
//! and each launch timed under `STRATA_GPU_PROFILE`.

use strata_runtime::cuda::kernels::FAMILIES;
use strata_runtime::cuda::{CudaError, Event};

use super::forward::GpuTransformer;
use super::weights::ComputeDtype;

/// Decode steps of at least this bucket are profiled apart from smaller ones.
const PROFILE_BUCKET_APART: usize = 128;
impl GpuTransformer {
    /// The launcher typed calls take (`launch_with`): [`Self::launch`].
    #[allow(clippy::type_complexity)] // the signature of every call's `launch_with`
    pub(super) fn launcher(
        &self,
    ) -> impl FnMut(&str, (u32, u32, u32), u32, u32, &mut [*mut std::ffi::c_void]) -> Result<(), CudaError> + '_ {
        |name, grid, threads, shared, args| self.launch(name, None, grid, threads, shared, args)
    }

    /// [`Self::launcher`] whose profile entries also name the product's shape, `n`x`k` (the
    /// quantized GEMMs, whose kernel names do not).
    #[allow(clippy::type_complexity)] // the signature of every call's `launch_with`
    pub(super) fn shaped_launcher(
        &self,
        shape: (usize, usize),
    ) -> impl FnMut(&str, (u32, u32, u32), u32, u32, &mut [*mut std::ffi::c_void]) -> Result<(), CudaError> + '_ {
        move |name, grid, threads, shared, args| self.launch(name, Some(shape), grid, threads, shared, args)
    }

    /// Whether activations are f32 (`--dtype float32`): the calls take the kernels' f32 twins.
    pub(super) fn float32(&self) -> bool {
        self.weights.dtype == ComputeDtype::F32
    }

    /// Launches kernel `name` on this GPU's stream, unless ablated, timed when profiled (under
    /// its name and `shape`, if given).
    fn launch(
        &self,
        name: &str,
        shape: Option<(usize, usize)>,
        grid: (u32, u32, u32),
        block: u32,
        shared: u32,
        args: &mut [*mut std::ffi::c_void],
    ) -> Result<(), CudaError> {
        if self.ablated(name) {
            return Ok(());
        }
        let t = self.profile_start()?;
        // SAFETY: every launch comes from a typed call, which passes the arguments of the kernel's
        // signature in its .cu file, with device pointers into buffers sized for the step limits
        // that `StepLimits::check` enforces.
        unsafe { self.kernels.launch(&self.gpu, name, grid, block, shared, args) }?;
        self.profile_end(t, || match shape {
            Some((n, k)) => format!("{name} {n}x{k}"),
            None => name.to_string(),
        })
    }

    /// Whether `bench-gpu --ablate` leaves the kernel or product `name` out.
    pub(super) fn ablated(&self, name: &str) -> bool {
        self.ablate.iter().any(|a| name.contains(a.as_str()))
    }

    pub(super) fn profile_phase(&self, name: &'static str) {
        if let Some(p) = &self.profile {
            p.phase_ends(name);
        }
    }

    pub(super) fn profile_start(&self) -> Result<Option<Event>, CudaError> {
        match &self.profile {
            Some(p) if !self.capturing => p.start(&self.gpu).map(Some),
            _ => Ok(None),
        }
    }

    pub(super) fn profile_end(&self, start: Option<Event>, name: impl FnOnce() -> String) -> Result<(), CudaError> {
        match (start, &self.profile) {
            (Some(start), Some(p)) => {
                let kind = match self.decode_bucket {
                    // Large decode steps apart: their per-call times are the steady state of
                    // many users.
                    Some(b) if b >= PROFILE_BUCKET_APART => format!("decode x{b}"),
                    Some(_) => "decode".to_string(),
                    None => "prefill".to_string(),
                };
                p.end(&self.gpu, start, format!("{} ({kind})", name()))
            }
            _ => Ok(()),
        }
    }
}

/// Checks `bench-gpu --ablate`'s entries: each must name (a part of) a kernel of the .cu files or
/// a cuBLASLt product as the GPU profile prints it (`gemm NxK`, n outputs of k inputs).
pub fn check_ablation(entries: &[String]) -> Result<(), String> {
    for e in entries {
        let product = e
            .strip_prefix("gemm ")
            .and_then(|shape| shape.split_once('x'))
            .is_some_and(|(n, k)| {
                !n.is_empty() && !k.is_empty() && n.bytes().chain(k.bytes()).all(|b| b.is_ascii_digit())
            });
        let kernel = !e.is_empty()
            && FAMILIES
                .iter()
                .flat_map(|(_, _, names)| names.iter())
                .any(|name| name.contains(e.as_str()));
        if !product && !kernel {
            return Err(format!(
                "--ablate {e:?} names no kernel or product; use a kernel name or part of one (paged_attention, \
                 qkv_rope, add_rms_norm, silu_mul, ...) or a cuBLASLt product as the GPU profile prints it \
                 (\"gemm 4096x4096\")"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ablation_names_kernels_or_cublaslt_products() {
        let ok = |e: &[&str]| check_ablation(&e.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        for good in [
            &["paged_attention"][..],
            &["qkv_rope", "add_rms_norm", "silu_mul"],
            &["gemm 4096x4096", "gemm 28672x4096"],
            &["paged_attention_staged_bf16"],
        ] {
            assert!(ok(good).is_ok(), "{good:?}");
        }
        for bad in [
            &[""][..],
            &["nonsense"],
            &["gemm 4096"],
            &["gemm x4096"],
            &["gemm 4096x"],
            &["silu_mul", "gemm ax4"],
        ] {
            let err = ok(bad).unwrap_err();
            assert!(err.contains("names no kernel") && !err.contains('\n'), "{bad:?}: {err}");
        }
    }
}
