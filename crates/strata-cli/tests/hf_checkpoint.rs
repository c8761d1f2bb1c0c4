//! `strata run` and `strata tokenize` on a tiny random HF checkpoint directory written here
//! (config.json, bf16 safetensors, tokenizer.json), and the one-line error for a bare directory.

#[allow(dead_code)]
#[path = "../../strata-model/tests/common/tiny_hf.rs"]
mod tiny_hf;

use std::process::Command;

use strata_formats::safetensors::Dtype;

fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

#[test]
fn run_generates_from_a_checkpoint_directory() {
    let dir = std::env::temp_dir().join(format!("strata-cli-hf-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    tiny_hf::TinyCheckpoint::new("qwen2", Dtype::BF16, true, 7).write_dir(&dir, 1);
    let out = strata()
        .args([
            "run",
            "--prompt",
            "hello",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--threads",
            "2",
        ])
        .arg("--model")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("hello"));
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(stderr.contains("generated: 4 tokens at"), "got {stderr:?}");

    let out = strata()
        .args(["tokenize", "--chat", "hi"])
        .arg("--model")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<u64> = json[0]["ids"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v.as_u64())
        .collect();
    // <|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n, one token per byte.
    assert_eq!(&ids[..4], &[256, u64::from(b'u'), u64::from(b's'), u64::from(b'e')]);
    assert_eq!(ids.iter().filter(|&&id| id == 256).count(), 2);

    std::fs::remove_file(dir.join("config.json")).unwrap();
    let out = strata()
        .args(["run", "--prompt", "hi"])
        .arg("--model")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.lines().count() == 1 && stderr.contains("has no config.json"),
        "got {stderr:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
