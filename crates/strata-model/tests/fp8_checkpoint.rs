//! FP8 E4M3 checkpoints on the CPU: `fp8` (per-tensor, block) and `compressed-tensors`
//! (per-channel) layouts load to bf16 equal to their dequantized twins; bad layouts say why.

#[allow(dead_code)]
mod common;

use std::path::{Path, PathBuf};

use common::fp8_hf::{write_fp8, Scheme};
use common::tiny_hf::TinyCheckpoint;
use strata_formats::safetensors::Dtype;
use strata_model::kv_cache::KvCacheDtype;
use strata_model::loader::load_model;
use strata_model::{LogitsWanted, PagedKvCache, SeqChunk, Transformer};
use strata_runtime::cpu::ThreadPool;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-fp8-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Logits of a 6-token prefill (every position) and one decode step.
fn logits(t: &Transformer) -> Vec<f32> {
    let pool = ThreadPool::new(2);
    let mut kv = PagedKvCache::new(&t.config, KvCacheDtype::Auto, 4, 4);
    let mut scratch = Default::default();
    let prompt = vec![3u32, 200, 42, 8, 1, 255];
    let chunk = |tokens: Vec<u32>, first_pos, logits| SeqChunk {
        tokens,
        first_pos,
        block_table: vec![2, 0],
        logits,
        prompt_len: 6,
        adjust: None,
    };
    let a = t
        .forward(&[chunk(prompt, 0, LogitsWanted::All)], &mut kv, &pool, &mut scratch)
        .unwrap();
    let b = t
        .forward(&[chunk(vec![7], 6, LogitsWanted::Last)], &mut kv, &pool, &mut scratch)
        .unwrap();
    a.data.iter().chain(&b.data).copied().collect()
}

/// Largest difference over the largest magnitude.
fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    let err = a.iter().zip(b).fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    err / b.iter().fold(0.0f32, |m, y| m.max(y.abs()))
}

#[test]
fn fp8_checkpoints_load_to_their_dequantized_values_in_every_layout() {
    for (i, (scheme, name)) in [
        (Scheme::PerTensor, "per-tensor"),
        (Scheme::PerChannel, "per-channel"),
        (Scheme::Blocks, "blocks"),
    ]
    .into_iter()
    .enumerate()
    {
        let ck = TinyCheckpoint::new(["llama", "qwen2", "qwen3"][i], Dtype::BF16, false, 40 + i as u64);
        let dir = temp_dir(name);
        let twin = write_fp8(&ck, &dir.join("fp8"), scheme);
        twin.write_dir(&dir.join("twin"), 1);
        ck.write_dir(&dir.join("bf16"), 1);
        let load = |d: &str| load_model(&dir.join(d), &|_, _| {}).unwrap().transformer;
        let (fp8, twin, bf16) = (load("fp8"), load("twin"), load("bf16"));
        let wq = &fp8.weights.layers[0].wq;
        assert_eq!(wq.info.ty, strata_formats::GgmlType::BF16, "{name}");
        let per_row = if matches!(scheme, Scheme::Blocks) { 0 } else { wq.rows };
        assert_eq!(wq.fp8_scales.as_ref().map(Vec::len), Some(per_row), "{name}");
        assert!(bf16.weights.layers[0].wq.fp8_scales.is_none());
        let twin_wq = &twin.weights.layers[0].wq;
        assert_eq!(
            (wq.file_bytes(), twin_wq.file_bytes()),
            (twin_wq.file_bytes() / 2, 2 * (wq.rows * wq.cols) as u64)
        );
        assert_eq!(
            fp8.weights.arena.bytes(wq),
            twin.weights.arena.bytes(&twin.weights.layers[0].wq)
        );
        let got = logits(&fp8);
        assert_eq!(got, logits(&twin), "{name}: the FP8 checkpoint is its dequantized twin");
        // Against the unquantized model: each weight within half an E4M3 step (1/16 relative);
        // the tiny random model's logits move by up to ~12% of their largest magnitude.
        let err = relative_error(&got, &logits(&bf16));
        eprintln!("{name}: FP8 logits vs bf16: max relative error {err:.4}");
        assert!(err > 0.0 && err < 0.2, "{name}: relative error {err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn fp8_checkpoints_that_cannot_be_read_say_why_in_one_line() {
    let ck = TinyCheckpoint::new("llama", Dtype::BF16, false, 50);
    let dir = temp_dir("errors");
    write_fp8(&ck, &dir, Scheme::PerChannel);
    let error = |dir: &Path| match load_model(dir, &|_, _| {}) {
        Ok(_) => panic!("should not load"),
        Err(e) => e.to_string(),
    };
    let mut config = ck.config_json();
    // FP8 tensors without a quantization_config.
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let e = error(&dir);
    assert!(
        e.contains("q_proj.weight") && e.contains("no quantization_config"),
        "{e}"
    );
    // A block layout over per-channel scales: no `weight_scale_inv` tensors.
    config["quantization_config"] = serde_json::json!({"quant_method": "fp8", "weight_block_size": [32, 32]});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let e = error(&dir);
    assert!(
        e.contains("without its scale tensor") && e.contains("weight_scale_inv"),
        "{e}"
    );
    // Other methods.
    config["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 4});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let e = error(&dir);
    assert!(
        e.contains("config.json") && e.contains("quant_method 'gptq'") && !e.contains('\n'),
        "{e}"
    );
    // Block scales whose grid does not fit the block size config.json gives.
    write_fp8(&ck, &dir, Scheme::Blocks);
    config["quantization_config"] = serde_json::json!({"quant_method": "fp8", "weight_block_size": [16, 16]});
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let e = error(&dir);
    assert!(e.contains("weight_scale_inv") && e.contains("16x16 blocks"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
