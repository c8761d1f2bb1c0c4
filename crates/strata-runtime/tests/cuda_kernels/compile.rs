//! Every kernel family compiles with NVRTC for sm_90, sm_86 and sm_80 (and the arch-specific
//! sm_90a, wgmma in the tile GEMM, also warp-specialized, and the wide tiles' f32 decode and the
//! lanes' x copies) and, where ptxas is given, assembles (no GPU needed); the model shapes the kernels are
//! not written for are refused before compiling.

use std::collections::HashSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use strata_runtime::cuda::kernels::{
    arch_to_compile, compile_all, compile_variant, entry_max_threads, has_specialized_tiles, nvrtc_available,
    KernelSpec, FAMILIES, WIDE_SS_THREADS,
};

/// ptxas from `STRATA_PTXAS` (`make test` passes the fetched one), if it is there.
fn ptxas() -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os("STRATA_PTXAS")?);
    path.is_file().then_some(path)
}

/// Starts ptxas on `ptx` for the real architecture of `arch` (compute_90 -> sm_90).
fn assemble(ptxas: &PathBuf, ptx: &str, arch: &str, file: PathBuf) -> (String, Child) {
    std::fs::write(&file, ptx).unwrap();
    let sm = arch.replace("compute_", "sm_");
    let child = Command::new(ptxas)
        .arg(format!("-arch={sm}"))
        .arg(&file)
        .args(["-o", "/dev/null"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", ptxas.display()));
    (format!("{} for {sm}", file.display()), child)
}

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
    let arch_specific = [(128, 7, "compute_90a")];
    let ptxas = ptxas();
    match &ptxas {
        Some(p) => eprintln!("assembling every PTX with {}", p.display()),
        None => {
            let why = "STRATA_PTXAS names no ptxas (run `make test`, which fetches it)";
            assert!(std::env::var_os("STRATA_REQUIRE_NVRTC").is_none(), "{why}");
            eprintln!("not assembled: {why}");
        }
    }
    let variants = std::thread::spawn(compile_quant_variants);
    let dir = std::env::temp_dir().join(format!("strata-ptxas-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut running = Vec::new();
    // Only attention.cu takes the shape, so the other families' PTX for an arch is the same for
    // every shape: each distinct (arch, PTX) is assembled once.
    let mut assembled = HashSet::new();
    for (head_dim, group, arch) in shapes.into_iter().chain(ampere).chain(arch_specific) {
        let spec = KernelSpec { head_dim, group };
        let ptx = compile_all(spec, arch).unwrap_or_else(|e| panic!("{spec:?} {arch}: {e}"));
        if let Some(p) = &ptxas {
            // One shape's families at a time (ten ptxas at once at most).
            finish(&mut running);
            for (family, text) in &ptx {
                if !assembled.insert((arch, text.clone())) {
                    continue;
                }
                let file = dir.join(format!("{family}_{head_dim}_{group}_{arch}.ptx"));
                running.push(assemble(p, text, arch, file));
            }
        }
        for ((family, text), (_, _, names)) in ptx.iter().zip(FAMILIES) {
            // Only the sm_90a build multiplies the quantized tiles with wgmma, and its wide
            // tiles copy x by TMA.
            let wgmma = text.contains("wgmma.mma_async");
            let tma = text.contains("cp.async.bulk.tensor.2d");
            assert_eq!(
                (wgmma, tma),
                (
                    *family == "quant" && arch == "compute_90a",
                    *family == "quant" && arch == "compute_90a"
                ),
                "{family}.cu for {arch}: wgmma {wgmma}, TMA {tma}"
            );
            // The wide tiles copy x and their weight planes by TMA by default (Kernels::load
            // finds the markers); nowhere else are the markers.
            for marker in ["qwide_x_by_tma", "qwide_weights_by_tma"] {
                assert_eq!(
                    text.contains(marker),
                    *family == "quant" && arch == "compute_90a",
                    "{family}.cu for {arch}: the marker {marker}"
                );
            }
            // The wide tiles are warp-specialized (384 threads) only where they are opted into.
            if *family == "quant" && arch == "compute_90a" {
                assert_eq!(
                    entry_max_threads(text, "qgemm_wide_q4_k"),
                    Some(256),
                    "quant.cu's wide tiles"
                );
            }
            // Kernels::load takes the tiles as warp-specialized only where they are opted into.
            assert!(
                *family != "quant" || !has_specialized_tiles(text),
                "quant.cu for {arch}: taken for the warp-specialized tiles"
            );
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
    // The variants' PTX, compiled on their own thread meanwhile (NVRTC takes one core).
    for (defines, file, shows, missing, ptx) in variants.join().unwrap() {
        assert!(shows(&ptx), "quant.cu with {defines:?}: {missing}");
        if let Some(p) = &ptxas {
            running.push(assemble(p, &ptx, "compute_90a", dir.join(file)));
        }
    }
    finish(&mut running);
    let _ = std::fs::remove_dir_all(&dir);
}

/// What a variant's PTX must show.
type Shows = fn(&str) -> bool;
/// A variant of quant.cu: its defines, the file ptxas assembles, what its PTX must show, what is
/// missing otherwise, and its PTX.
type Variant = (&'static [&'static str], &'static str, Shows, &'static str, String);

/// The variants of quant.cu the GPU scripts time, compiled for compute_90a.
fn compile_quant_variants() -> Vec<Variant> {
    let (_, quant, _) = FAMILIES.iter().find(|(family, _, _)| *family == "quant").unwrap();
    let spec = KernelSpec {
        head_dim: 128,
        group: 7,
    };
    // Each variant's defines, the file ptxas assembles, what its PTX must show and what is
    // missing otherwise.
    let variants: [(&[&str], &str, Shows, &str); 6] = [
        // The 256-token wide tiles warp-specialized (v54): 384 threads, SS products; the
        // narrower tiles and the pairs keep 256.
        (
            &["QWIDE_SS=1"],
            "quant_wide_ss.ptx",
            |ptx| {
                entry_max_threads(ptx, "qgemm_wide_q4_k") == Some(WIDE_SS_THREADS)
                    && entry_max_threads(ptx, "qgemm_wide_q6_k") == Some(WIDE_SS_THREADS)
                    && entry_max_threads(ptx, "qgemm_wide_pair_q4_k_q6_k") == Some(256)
                    && entry_max_threads(ptx, "qgemm_wide128_q4_k") == Some(256)
            },
            "the 256-token wide tiles are not bounded to 384 threads",
        ),
        // The warp-specialized wgmma tiles (512 threads a block, stages handed over by mbarriers).
        (
            &["QTILE_SPECIALIZED=1"],
            "quant_specialized.ptx",
            |ptx| ptx.contains("mbarrier.try_wait") && has_specialized_tiles(ptx),
            "no warp-specialized tiles in the PTX",
        ),
        // The wide tiles' x and weights copied by the lanes (the default copies both by TMA,
        // which Kernels::load recognizes).
        (
            &["QWIDE_TMA=0", "QWIDE_W_TMA=0"],
            "quant_wide_lanes.ptx",
            |ptx| {
                ptx.contains("m64n256k16")
                    && !ptx.contains("cp.async.bulk.tensor.2d")
                    && !ptx.contains("qwide_x_by_tma")
            },
            "the wide tiles still copy x by TMA",
        ),
        // The wide tiles' weights copied by the lanes into interleaved rows (the default copies
        // their planes by TMA, which Kernels::load recognizes by a marker).
        (
            &["QWIDE_W_TMA=0"],
            "quant_wide_w_lanes.ptx",
            |ptx| ptx.contains("m64n256k16") && !ptx.contains("qwide_weights_by_tma"),
            "the wide tiles still copy their weights by TMA",
        ),
        // The wide tiles' f32 decode (the default decodes in bf16 pairs).
        (
            &["QWIDE_BF16X2=0"],
            "quant_wide_f32.ptx",
            |ptx| ptx.contains("m64n256k16") && !ptx.contains("fma.rn.bf16x2"),
            "not the wide tiles' f32 decode",
        ),
        // The SiLU GEMVs' gate and up rows in one pass (quantized.sh single times it).
        (
            &["QGEMV_SILU_PAIRS=1"],
            "quant_silu_pairs.ptx",
            |ptx| ptx.contains(".entry qgemv_silu_q4_k_t1("),
            "no qgemv_silu_q4_k_t1",
        ),
    ];
    variants
        .into_iter()
        .map(|(defines, file, shows, missing)| {
            let ptx = compile_variant("quant", quant, spec, "compute_90a", defines).unwrap();
            (defines, file, shows, missing, ptx)
        })
        .collect()
}

/// Waits for the started ptxas runs; each must have assembled its PTX.
fn finish(running: &mut Vec<(String, Child)>) {
    for (what, child) in running.drain(..) {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "ptxas refused {what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn the_arch_specific_target_is_taken_only_where_it_runs() {
    // By default only quant.cu takes compute_90a on a 9.0 GPU (its wgmma tiles).
    assert_eq!(arch_to_compile((9, 0), None, "quant").unwrap(), "compute_90a");
    assert_eq!(arch_to_compile((9, 0), None, "attention").unwrap(), "compute_90");
    assert_eq!(arch_to_compile((8, 6), None, "quant").unwrap(), "compute_86");
    assert_eq!(arch_to_compile((8, 9), None, "quant").unwrap(), "compute_89");
    // compute_90a for every family; the GPU's portable target forces the fallbacks.
    assert_eq!(
        arch_to_compile((9, 0), Some("compute_90a"), "norm").unwrap(),
        "compute_90a"
    );
    assert_eq!(
        arch_to_compile((9, 0), Some("compute_90"), "quant").unwrap(),
        "compute_90"
    );
    assert_eq!(
        arch_to_compile((8, 0), Some("compute_80"), "quant").unwrap(),
        "compute_80"
    );
    for (cc, v) in [
        ((8, 0), "compute_90a"),
        ((9, 0), "compute_86"),
        ((12, 0), "compute_90a"),
    ] {
        let e = arch_to_compile(cc, Some(v), "quant").unwrap_err().to_string();
        assert!(e.contains("STRATA_KERNEL_ARCH") && e.contains("unset it"), "{e}");
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
