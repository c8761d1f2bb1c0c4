//! Every kernel family compiles with NVRTC for sm_90, sm_86 and sm_80 (no GPU needed), and the
//! model shapes the kernels are not written for are refused before compiling.

use strata_runtime::cuda::kernels::{compile_all, nvrtc_available, KernelSpec, FAMILIES};

#[test]
fn every_kernel_compiles_with_nvrtc_for_sm90_sm86_and_sm80() {
    // `make test` puts the fetched NVRTC wheel's folder on LD_LIBRARY_PATH.
    if !nvrtc_available() {
        let why = "libnvrtc.so.13 is not loadable (run `make test`, which fetches it and sets LD_LIBRARY_PATH)";
        assert!(std::env::var_os("STRATA_REQUIRE_NVRTC").is_none(), "{why}");
        eprintln!("skipped: {why}");
        return;
    }
    // The shapes of the models strata is tested on: SmolLM2, Llama-3-8B, Qwen2.5-7B, MHA, head 256.
    // Ampere (A30/A100 sm_80, RTX 3090 sm_86) for one shape: the shape only changes attention.
    let shapes = [(64, 3), (128, 4), (128, 7), (128, 1), (256, 8)].map(|(h, g)| (h, g, "compute_90"));
    let ampere = [(128, 4, "compute_86"), (128, 4, "compute_80")];
    for (head_dim, group, arch) in shapes.into_iter().chain(ampere) {
        let spec = KernelSpec { head_dim, group };
        let ptx = compile_all(spec, arch).unwrap_or_else(|e| panic!("{spec:?} {arch}: {e}"));
        for ((family, text), (_, _, names)) in ptx.iter().zip(FAMILIES) {
            for name in names {
                assert!(
                    text.contains(&format!(".entry {name}(")),
                    "{family}.cu: kernel {name} missing from the PTX"
                );
            }
            // And every kernel in the PTX is listed, so Kernels::get finds it.
            for entry in text.split(".entry ").skip(1) {
                let name = entry.split('(').next().unwrap_or_default().trim();
                assert!(names.contains(&name), "{family}.cu: kernel {name} is not in FAMILIES");
            }
        }
    }
}

#[test]
fn kernel_limits_are_checked_before_compiling() {
    assert!(KernelSpec { head_dim: 80, group: 1 }.validate().is_err());
    assert!(KernelSpec {
        head_dim: 512,
        group: 1
    }
    .validate()
    .is_err());
    assert!(KernelSpec {
        head_dim: 128,
        group: 9
    }
    .validate()
    .is_err());
    assert!(KernelSpec {
        head_dim: 128,
        group: 8
    }
    .validate()
    .is_ok());
}
