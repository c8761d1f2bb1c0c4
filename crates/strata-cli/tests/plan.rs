//! `strata topo` and `strata plan` on the saved fixture machines: the matrix, the choice, refusals,
//! forced layouts and bad flags, through the real binary (no GPU, no model load).

use std::path::PathBuf;
use std::process::{Command, Output};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../strata-parallel/fixtures")
        .join(name)
}

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata")).args(args).output().unwrap()
}

/// `strata plan --model MODEL --topology fixtures/FIXTURE EXTRA...`.
fn plan_on(fixture_name: &str, model: &str, extra: &[&str]) -> Output {
    let topology = fixture(fixture_name);
    let mut args = vec!["plan", "--model", model, "--topology", topology.to_str().unwrap()];
    args.extend(extra);
    strata(&args)
}

fn stdout_of(out: &Output) -> String {
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn failure_of(out: &Output) -> String {
    assert!(
        !out.status.success(),
        "should fail; stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8(out.stderr.clone()).unwrap()
}

#[test]
fn topo_prints_the_matrix_and_round_trips_json() {
    let a30 = fixture("a30x4_seeds.json");
    let shown = stdout_of(&strata(&["topo", "--topology", a30.to_str().unwrap()]));
    assert!(
        shown.contains("GPU3") && shown.contains("SYS") && shown.contains("PXB"),
        "{shown}"
    );
    let saved = std::env::temp_dir().join(format!("strata-topo-{}.json", std::process::id()));
    let json = stdout_of(&strata(&[
        "topo",
        "--json",
        "--topology",
        a30.to_str().unwrap(),
        "--save",
        saved.to_str().unwrap(),
    ]));
    let printed: serde_json::Value = serde_json::from_str(&json).unwrap();
    let written: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&saved).unwrap()).unwrap();
    assert_eq!(printed, written);
    assert_eq!(printed["gpus"].as_array().unwrap().len(), 4);
    std::fs::remove_file(&saved).unwrap();
}

#[test]
fn topo_without_a_driver_says_so_in_one_line() {
    let out = strata(&["topo"]);
    if out.status.success() {
        println!("skipped: this machine has an NVIDIA driver");
        return;
    }
    let err = failure_of(&out);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("no NVIDIA driver found (looked for libnvidia-ml.so.1)"),
        "{err}"
    );
}

#[test]
fn plan_on_the_seeds_a30s_chooses_a_pipeline_and_explains_the_rest() {
    let text = stdout_of(&plan_on("a30x4_seeds.json", "qwen2.5-32b", &[]));
    assert!(
        text.contains("plan: TP 2 x PP 2") || text.contains("plan: PP"),
        "{text}"
    );
    assert!(text.contains("doesn't fit: GPU"), "{text}");
    assert!(text.contains("slower:"), "{text}");
    assert!(text.contains("NCCL_NVLS_ENABLE=0"), "{text}");
    let json = stdout_of(&plan_on("a30x4_seeds.json", "qwen2.5-32b", &["--json"]));
    let plan: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert!(plan["chosen"]["pp"].as_u64().unwrap() >= 2, "{json}");
    assert_eq!(plan["chosen"]["verdict"]["verdict"], "chosen");
}

#[test]
fn plan_refuses_what_cannot_fit_and_says_what_would() {
    let err = failure_of(&plan_on("rtx3090x2_sys.json", "qwen2.5-32b", &[]));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("does not fit") && err.contains("file ("), "{err}");
}

#[test]
fn a_forced_plan_is_honoured_with_a_warning_and_p2p_disabled() {
    let text = stdout_of(&plan_on(
        "a30x4_seeds.json",
        "qwen2.5-32b",
        &["--tensor-parallel-size", "4"],
    ));
    assert!(text.contains("plan: TP 4"), "{text}");
    assert!(text.contains("warning: this forced layout is"), "{text}");
    assert!(text.contains("NCCL_P2P_DISABLE=1"), "{text}");
    let split = stdout_of(&plan_on(
        "rtx3090x2_sys.json",
        "llama-3-8b",
        &["--split-mode", "layer", "--tensor-split", "3,1"],
    ));
    assert!(
        split.contains("plan: PP 2") && split.contains("0-23") && split.contains("24-31"),
        "{split}"
    );
}

#[test]
fn bad_flags_fail_in_one_line_with_the_fix() {
    let too_many = failure_of(&plan_on(
        "rtx3090x2_sys.json",
        "llama-3-8b",
        &["--tensor-parallel-size", "4"],
    ));
    assert_eq!(too_many.lines().count(), 1, "{too_many}");
    assert!(too_many.contains("needs 4 GPUs; this machine has 2"), "{too_many}");
    let unknown = failure_of(&plan_on("rtx3090x2_sys.json", "llama-9-9b", &[]));
    assert_eq!(unknown.lines().count(), 1, "{unknown}");
    assert!(unknown.contains("llama-3-8b"), "{unknown}");
    let missing = failure_of(&strata(&[
        "plan",
        "--model",
        "llama-3-8b",
        "--topology",
        "/no/such/file.json",
    ]));
    assert_eq!(missing.lines().count(), 1, "{missing}");
    assert!(missing.contains("/no/such/file.json"), "{missing}");
    let fraction = failure_of(&strata(&[
        "plan",
        "--model",
        "llama-3-8b",
        "--gpu-memory-utilization",
        "1.5",
    ]));
    assert!(fraction.contains("not a fraction in (0, 1]"), "{fraction}");
}
