//! HF checkpoints against their GGUF twins: tiny random llama (Llama-3 RoPE scaling), mistral,
//! qwen2 (biases, sharded) and qwen3 (Q/K norm, tied) in F32, BF16 and F16, and every malformed case.

#[allow(dead_code)]
mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::tiny_hf::{TinyCheckpoint, END_OF_TEXT, IM_END, VOCAB};
use strata_formats::safetensors::Dtype;
use strata_model::chat_template::ChatMessage;
use strata_model::kv_cache::KvCacheDtype;
use strata_model::loader::{load_model, load_transformer, open_gguf};
use strata_model::{LogitsWanted, PagedKvCache, SeqChunk, Transformer};
use strata_runtime::cpu::ThreadPool;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-hf-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Logits of a 7-token prefill (every position) then one decode step (the decode path).
fn logits(t: &Transformer) -> Vec<Vec<f32>> {
    let pool = ThreadPool::new(2);
    let mut kv = PagedKvCache::new(&t.config, KvCacheDtype::Auto, 4, 4);
    let mut scratch = Default::default();
    let prompt: Vec<u32> = vec![3, 200, 42, 8, 8, 1, 255];
    let table = vec![2u32, 0, 3];
    let prefill = SeqChunk {
        tokens: prompt.clone(),
        first_pos: 0,
        block_table: table.clone(),
        logits: LogitsWanted::All,
        prompt_len: usize::MAX,
        adjust: None,
    };
    let l1 = t.forward(&[prefill], &mut kv, &pool, &mut scratch).unwrap();
    let decode = SeqChunk {
        tokens: vec![IM_END],
        first_pos: prompt.len(),
        block_table: table,
        logits: LogitsWanted::Last,
        prompt_len: prompt.len(),
        adjust: None,
    };
    let l2 = t.forward(&[decode], &mut kv, &pool, &mut scratch).unwrap();
    let mut rows: Vec<Vec<f32>> = (0..prompt.len()).map(|i| l1.row(i).to_vec()).collect();
    rows.push(l2.last_of(0).unwrap().to_vec());
    rows
}

/// Largest difference over the largest magnitude, over all rows.
fn relative_error(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut err, mut scale) = (0.0f64, 0.0f64);
    for (ra, rb) in a.iter().zip(b) {
        assert_eq!(ra.len(), rb.len());
        for (&x, &y) in ra.iter().zip(rb) {
            err = err.max((x as f64 - y as f64).abs());
            scale = scale.max(y.abs() as f64);
        }
    }
    err / scale
}

/// Writes `ck` as a checkpoint directory and as a GGUF twin and returns both transformers.
fn load_both(ck: &TinyCheckpoint, name: &str, shards: usize) -> (Transformer, Transformer, PathBuf) {
    let dir = temp_dir(name);
    ck.write_dir(&dir, shards);
    let gguf = dir.with_extension("gguf");
    ck.write_gguf(&gguf);
    let from_gguf = load_transformer(Arc::clone(&open_gguf(&gguf).unwrap()), &|_, _| {}).unwrap();
    std::fs::remove_file(&gguf).unwrap();
    let loaded = load_model(&dir, &|_, _| {}).unwrap();
    (loaded.transformer, from_gguf, dir)
}

#[test]
fn llama_f32_with_llama3_rope_matches_the_permuted_gguf_twin() {
    let ck = TinyCheckpoint::new("llama", Dtype::F32, false, 1);
    let (hf, gguf, dir) = load_both(&ck, "llama-f32", 1);
    assert_eq!(hf.config.rope.layout, strata_runtime::cpu::ops::RopeLayout::Neox);
    assert_eq!(
        gguf.config.rope.layout,
        strata_runtime::cpu::ops::RopeLayout::Interleaved
    );
    assert_eq!(hf.config.rope.inv_freq(), gguf.config.rope.inv_freq());
    let err = relative_error(&logits(&hf), &logits(&gguf));
    assert!(err < 1e-4, "relative error {err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn llama_bf16_keeps_bf16_matrices_and_matches_the_bf16_gguf_twin() {
    let ck = TinyCheckpoint::new("llama", Dtype::BF16, true, 2);
    let (hf, gguf, dir) = load_both(&ck, "llama-bf16", 1);
    let w = &hf.weights;
    assert_eq!(w.layers[0].wq.info.ty, strata_formats::GgmlType::BF16);
    assert_eq!(w.arena.bytes(&w.layers[0].wq).len(), 64 * 64 * 2);
    // Same bf16 values; only the order of the sums inside attention differs (interleaved pairs
    // in the twin), so the results agree to f32 rounding.
    let err = relative_error(&logits(&hf), &logits(&gguf));
    assert!(err < 1e-5, "relative error {err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sharded_qwen2_bf16_with_biases_equals_its_gguf_twin_exactly() {
    let ck = TinyCheckpoint::new("qwen2", Dtype::BF16, false, 3);
    let (hf, gguf, dir) = load_both(&ck, "qwen2-sharded", 3);
    assert!(hf.config.arch.qkv_bias && hf.weights.layers[1].bq.is_some());
    assert_eq!(logits(&hf), logits(&gguf));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tied_qwen3_f16_with_qk_norm_equals_its_gguf_twin_exactly() {
    let ck = TinyCheckpoint::new("qwen3", Dtype::F16, true, 4);
    let (hf, gguf, dir) = load_both(&ck, "qwen3-f16", 1);
    assert!(hf.config.arch.qk_norm && hf.config.tied_embeddings);
    assert_eq!((hf.config.head_dim, hf.config.q_dim()), (32, 128));
    assert_eq!(logits(&hf), logits(&gguf));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn mistral_loads_from_its_config_json_path_with_tokenizer_eos_and_template() {
    let ck = TinyCheckpoint::new("mistral", Dtype::F32, false, 5);
    let dir = temp_dir("mistral");
    ck.write_dir(&dir, 1);
    let model = load_model(&dir.join("config.json"), &|_, _| {}).unwrap();
    let tok = &model.tokenizer;
    assert_eq!(tok.vocab_size(), VOCAB);
    assert_eq!(tok.eos_id(), Some(IM_END));
    assert!(tok.is_eog(IM_END) && tok.is_eog(END_OF_TEXT), "{:?}", tok.eog_ids());
    let ids = tok.encode("hi <|im_end|>", false, true).unwrap();
    assert_eq!(ids, vec![u32::from(b'h'), u32::from(b'i'), u32::from(b' '), IM_END]);
    assert_eq!(tok.decode(&ids, true).unwrap(), "hi ");
    let prompt = model.chat_template.render(&[ChatMessage::user("hi")], true).unwrap();
    assert_eq!(prompt, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The error `load_model` gives for the checkpoint in `dir`.
fn load_error(dir: &Path) -> String {
    match load_model(dir, &|_, _| {}) {
        Ok(_) => panic!("{} should not load", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn malformed_checkpoints_give_errors_that_name_the_problem() {
    let dir = temp_dir("malformed");
    let e = load_error(&dir);
    assert!(e.contains("has no config.json"), "{e}");

    let ck = TinyCheckpoint::new("llama", Dtype::BF16, false, 6);
    ck.write_dir(&dir, 1);
    let mut config = ck.config_json();
    config["model_type"] = "gemma".into();
    config["architectures"] = serde_json::json!(["GemmaForCausalLM"]);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let e = load_error(&dir);
    assert!(e.contains("'gemma'") && e.contains("Qwen2ForCausalLM"), "{e}");
    std::fs::write(dir.join("config.json"), ck.config_json().to_string()).unwrap();

    let mut missing = TinyCheckpoint::new("llama", Dtype::BF16, false, 6);
    missing
        .tensors
        .retain(|t| t.name != "model.layers.1.mlp.up_proj.weight");
    missing.write_weights(&dir, 1);
    let e = load_error(&dir);
    assert!(
        e.contains("model.layers.1.mlp.up_proj.weight") && e.contains("missing"),
        "{e}"
    );

    let mut wrong = TinyCheckpoint::new("llama", Dtype::BF16, false, 6);
    let k = wrong.tensor_mut("model.layers.0.self_attn.k_proj.weight");
    k.shape = vec![64, 32];
    wrong.write_weights(&dir, 1);
    let e = load_error(&dir);
    assert!(
        e.contains("model.layers.0.self_attn.k_proj.weight")
            && e.contains("[64, 32]")
            && e.contains("expected [32, 64]"),
        "{e}"
    );

    let mut untied = TinyCheckpoint::new("llama", Dtype::BF16, true, 6);
    untied.tied = false;
    untied.write_dir(&dir, 1);
    let e = load_error(&dir);
    assert!(e.contains("lm_head.weight") && e.contains("missing"), "{e}");

    // A needed tensor in a dtype strata does not compute with (in a file of its own beside the rest).
    let mut rest = TinyCheckpoint::new("llama", Dtype::BF16, true, 6);
    rest.tensors.retain(|t| t.name != "model.embed_tokens.weight");
    rest.write_weights(&dir, 1);
    let bytes = vec![0u8; VOCAB * 64];
    let img = strata_formats::safetensors::serialize(
        &[("model.embed_tokens.weight", Dtype::I8, &[VOCAB as u64, 64], &bytes)],
        &Default::default(),
    )
    .unwrap();
    std::fs::write(dir.join("embed.safetensors"), img).unwrap();
    let e = load_error(&dir);
    assert_eq!(
        e,
        "unsupported dtype I8 for tensor model.embed_tokens.weight (strata reads BF16, F16 and F32)"
    );
    std::fs::remove_file(dir.join("embed.safetensors")).unwrap();

    std::fs::write(dir.join("model.safetensors"), b"\xff\xff\xff\xff\xff\xff\xff\x7f{}").unwrap();
    let e = load_error(&dir);
    assert!(
        e.contains("model.safetensors") && e.contains("exceeds the limit"),
        "{e}"
    );

    ck.write_dir(&dir, 1);
    std::fs::remove_file(dir.join("tokenizer.json")).unwrap();
    let e = load_error(&dir);
    assert!(e.contains("has no tokenizer.json"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
