//! End-to-end tests of the `strata` command: generation on the default model and the
//! one-line errors for bad model files and arguments.

mod common;
#[allow(dead_code)]
#[path = "../../strata-model/tests/common/tiny_hf.rs"]
mod tiny_hf;

use common::{default_model, exits_with_one_line, scratch_dir, strata};

use std::ffi::OsString;

use strata_formats::gguf::MetaValue;
use strata_formats::safetensors::Dtype;

/// `strata ARGS --model <the default model>`, which must succeed: its stdout and stderr.
fn on_the_default_model(args: &[&str]) -> (String, String) {
    let model = default_model();
    let out = strata().args(args).arg("--model").arg(&model).output().unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn run_prints_the_greedy_continuation_and_speed() {
    let (stdout, stderr) = on_the_default_model(&[
        "run",
        "--prompt",
        "The capital of France is",
        "--max-tokens",
        "8",
        "--threads",
        "2",
    ]);
    assert!(stdout.starts_with("The capital of France is Paris"), "got {stdout:?}");
    assert!(
        stderr.contains("generated: 8 tokens at") && stderr.contains("tok/s"),
        "got {stderr:?}"
    );
}

#[test]
fn gpu_only_flags_on_the_cpu_are_named_not_silently_dropped() {
    let (_, stderr) = on_the_default_model(&[
        "run",
        "--prompt",
        "Hi",
        "--max-tokens",
        "2",
        "--device",
        "cpu",
        "--quantization",
        "fp8",
        "--enforce-eager",
    ]);
    assert!(
        stderr.contains("--quantization, --enforce-eager applies to GPUs only") && stderr.contains("--device cuda"),
        "got {stderr:?}"
    );
}

#[test]
fn chat_applies_the_template_and_stops_at_end_of_turn() {
    let (stdout, stderr) = on_the_default_model(&[
        "run",
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-tokens",
        "48",
        // The exact answer is the float path's; `standard` answers otherwise.
        "--activation-precision",
        "high",
    ]);
    assert!(stdout.contains("Paris"), "got {stdout:?}");
    assert!(
        !stdout.contains("<|im_end|>") && !stdout.contains("<|im_start|>"),
        "special tokens leaked: {stdout:?}"
    );
    assert!(
        stderr.contains("(stop,"),
        "the answer should end at <|im_end|>: {stderr:?}"
    );
}

#[test]
fn tokenize_matches_the_fidelity_prompts() {
    let (stdout, _) = on_the_default_model(&["tokenize", "The capital of France is"]);
    let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(v[0]["ids"], serde_json::json!([504, 3575, 282, 4649, 314]));
}

fn one_line_error(args: &[&str]) -> String {
    let out = strata().args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} should fail");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one line, got {stderr:?}");
    lines[0].to_string()
}

#[test]
fn missing_model_file_says_how_to_fix_it() {
    let msg = one_line_error(&["run", "--model", "/nonexistent/model.gguf", "--prompt", "hi"]);
    assert!(
        msg.starts_with("error:") && msg.contains("not found") && msg.contains("--model"),
        "{msg}"
    );
}

#[test]
fn a_file_that_is_not_gguf_is_refused_clearly() {
    let dir = std::env::temp_dir().join(format!("strata-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("weights.safetensors");
    std::fs::write(&bad, b"{\"not\": \"gguf\"}").unwrap();
    let msg = one_line_error(&["run", "--model", bad.to_str().unwrap(), "--prompt", "hi"]);
    assert!(
        msg.contains("unsupported model format") && msg.contains("GGUF"),
        "{msg}"
    );
    let truncated = dir.join("truncated.gguf");
    let head = std::fs::read(default_model()).unwrap()[..4096].to_vec();
    std::fs::write(&truncated, head).unwrap();
    let msg = one_line_error(&["run", "--model", truncated.to_str().unwrap(), "--prompt", "hi"]);
    assert!(msg.contains("truncated"), "{msg}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_arguments_get_an_error_not_a_panic() {
    let model = default_model();
    let m = model.to_str().unwrap();
    let msg = one_line_error(&["run", "--model", m, "--prompt", "hi", "--top-p", "0"]);
    assert!(msg.contains("top_p"), "{msg}");
    let msg = one_line_error(&["run", "--model", m, "--prompt", "hi", "--repetition-penalty", "0"]);
    assert!(msg.contains("repetition_penalty"), "{msg}");
    let msg = one_line_error(&["run", "--model", m, "--prompt", "hi", "--max-tokens", "100000"]);
    assert!(msg.contains("exceeds the model's context"), "{msg}");
}

#[test]
fn multi_gpu_flags_are_checked_with_a_way_out() {
    let model = default_model();
    let m = model.to_str().unwrap();
    let msg = one_line_error(&[
        "run",
        "--model",
        m,
        "--prompt",
        "hi",
        "--device",
        "cuda:0",
        "--tensor-parallel-size",
        "2",
    ]);
    assert!(
        msg.contains("runs on that one GPU") && msg.contains("--device cuda with --tensor-parallel-size"),
        "{msg}"
    );
    let msg = one_line_error(&[
        "run", "--model", m, "--prompt", "hi", "--device", "cpu", "--dtype", "bf16",
    ]);
    assert!(
        msg.contains("computes in float32") && msg.contains("drop --dtype bfloat16"),
        "{msg}"
    );
    let out = strata()
        .args(["run", "--model", m, "--prompt", "hi", "--collective-timeout", "0"])
        .output()
        .unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        !out.status.success() && stderr.contains("positive number of seconds"),
        "{stderr}"
    );
    let out = strata()
        .args(["run", "--model", m, "--prompt", "hi", "--device", "gpu7"])
        .output()
        .unwrap();
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        !out.status.success() && stderr.contains("use auto, cpu, cuda or cuda:N"),
        "{stderr}"
    );
}

#[test]
fn the_attention_benchmark_checks_its_context_range() {
    // Checked before any GPU is opened, so the same line with or without one.
    let msg = one_line_error(&["bench-gpu", "--attention", "--output-tokens", "0"]);
    assert!(
        msg.contains("--attention needs") && msg.contains("output tokens > 0"),
        "{msg}"
    );
}

#[test]
fn bench_gpu_refuses_an_ablation_that_names_no_kernel() {
    // Checked before any GPU is opened, so the same line with or without one.
    for bad in ["nonsense", "gemm 4096", "gemm x4096", "silu_mul,"] {
        let msg = one_line_error(&["bench-gpu", "--ablate", bad]);
        assert!(
            msg.contains("--ablate") && msg.contains("names no kernel") && msg.contains("gemm 4096x4096"),
            "{bad}: {msg}"
        );
    }
}

#[test]
fn serve_refuses_unusable_connection_limits() {
    for (flag, value) in [
        ("--header-read-timeout", "0"),
        ("--body-read-timeout", "0"),
        ("--keep-alive-timeout", "inf"),
        ("--max-connections", "0"),
    ] {
        let msg = one_line_error(&["serve", "--port", "0", flag, value]);
        assert!(msg.starts_with("error:") && msg.contains(flag), "{msg}");
    }
}

#[test]
fn a_tiny_gguf_with_a_lying_block_count_gets_one_line_not_an_abort() {
    let dir = scratch_dir("block-count");
    let ck = tiny_hf::TinyCheckpoint::new("qwen2", Dtype::F32, false, 11);
    let good = dir.join("tiny.gguf");
    ck.write_gguf(&good);
    // The unaltered file runs, so the errors below come from the block count alone.
    let out = strata()
        .args([
            "run",
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
            "--ignore-eos",
            "--threads",
            "1",
        ])
        .arg("--model")
        .arg(&good)
        .output()
        .unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));

    for (block_count, want) in [
        (1u64 << 31, "block count 2147483648 is over strata's limit of 4096"),
        (
            3,
            "qwen2.block_count = 3, but the model's tensors cover 2 of those layers (there is no blk.2.*)",
        ),
    ] {
        let bad = dir.join(format!("blocks-{block_count}.gguf"));
        let mut w = ck.gguf_writer();
        w.set_metadata("qwen2.block_count", MetaValue::U64(block_count))
            .unwrap();
        std::fs::write(&bad, w.to_bytes()).unwrap();
        for command in ["run", "serve"] {
            let mut args: Vec<OsString> = vec![command.into(), "--model".into(), bad.clone().into()];
            let rest = if command == "run" {
                ["--prompt", "hi"]
            } else {
                ["--port", "0"]
            };
            args.extend(rest.map(OsString::from));
            let line = exits_with_one_line(&args);
            assert!(line.starts_with("error: ") && line.contains(want), "{command}: {line}");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_load_error_says_its_reason_once() {
    let dir = scratch_dir("once");
    for (name, bytes, reason) in [
        (
            "empty.gguf",
            &b""[..],
            "file is truncated: magic needs 4 bytes at offset 0, file has 0",
        ),
        (
            "four.gguf",
            &b"GGUF"[..],
            "file is truncated: version needs 4 bytes at offset 4, file has 4",
        ),
    ] {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        let args: Vec<OsString> = vec![
            "run".into(),
            "--model".into(),
            path.into(),
            "--prompt".into(),
            "hi".into(),
        ];
        let line = exits_with_one_line(&args);
        assert_eq!(line.matches("file is truncated").count(), 1, "{line}");
        assert!(line.ends_with(reason), "{line}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn plan_refuses_a_config_json_whose_layer_count_is_absurd() {
    let dir = scratch_dir("plan-layers");
    let mut config = tiny_hf::TinyCheckpoint::new("llama", Dtype::BF16, false, 12).config_json();
    // Used to size a per-layer table of 2^32 - 1 entries (34 GB) and abort.
    config["num_hidden_layers"] = 4_294_967_295u64.into();
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let topology =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../strata-parallel/fixtures/h200x2_nv18.json");
    let args: Vec<OsString> = vec![
        "plan".into(),
        "--model".into(),
        path.into(),
        "--topology".into(),
        topology.into(),
    ];
    let line = exits_with_one_line(&args);
    assert!(
        line.contains("config.json: block count 4294967295 is over strata's limit of 4096"),
        "{line}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_unknown_cpu_isa_cap_is_refused_in_one_line() {
    let out = strata()
        .env("STRATA_CPU_ISA", "sse9")
        .args(["run", "--prompt", "hi"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("error: STRATA_CPU_ISA=\"sse9\"") && stderr.contains("avx2"),
        "{stderr}"
    );
}
