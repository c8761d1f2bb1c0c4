//! Model files whose numbers lie (layer counts, widths, token ids, padding, file sizes): each gets
//! a clear error, or is made harmless, before anything is sized by the lie.

#[allow(dead_code)]
mod common;

use std::path::{Path, PathBuf};

use common::tiny_hf::{write_tokenizer, TinyCheckpoint};
use strata_formats::gguf::{GgufFile, GgufWriter, MetaValue};
use strata_formats::limits::MAX_JSON_FILE_BYTES;
use strata_formats::safetensors::Dtype;
use strata_model::architectures::config_from_gguf;
use strata_model::hf_checkpoint::config_from_json_value;
use strata_model::loader::load_model;
use strata_model::tokenizer::{SpecialIds, Tokenizer};

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-lying-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn load_error(path: &Path) -> String {
    match load_model(path, &|_, _| {}) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn a_gguf_block_count_past_the_limit_or_the_tensors_is_refused_before_allocating() {
    let dir = temp_dir("gguf-blocks");
    let ck = TinyCheckpoint::new("llama", Dtype::F32, true, 5);
    for (block_count, want) in [
        // Used to reserve 2^31 layers (1.9 TB) and abort.
        (
            1u64 << 31,
            "bad model metadata: block count 2147483648 is over strata's limit of 4096",
        ),
        (
            4096,
            "bad model metadata: llama.block_count = 4096, but the model's tensors cover 2 of those \
             layers (there is no blk.2.*)",
        ),
    ] {
        let mut w = ck.gguf_writer();
        w.set_metadata("llama.block_count", MetaValue::U64(block_count))
            .unwrap();
        let bytes = w.to_bytes();
        // The planner reads the shape alone: it gets the same error.
        let err = config_from_gguf(&GgufFile::from_bytes(bytes.clone()).unwrap()).unwrap_err();
        assert!(err.to_string().starts_with(want), "{err}");
        let path = dir.join("model.gguf");
        std::fs::write(&path, bytes).unwrap();
        let err = load_error(&path);
        assert!(err.starts_with(want), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_hf_layer_count_past_the_limit_or_the_tensors_is_refused_before_allocating() {
    let dir = temp_dir("hf-layers");
    let ck = TinyCheckpoint::new("qwen2", Dtype::BF16, false, 6);
    ck.write_dir(&dir, 1);
    for (layers, want) in [
        (1u64 << 31, "block count 2147483648 is over strata's limit of 4096"),
        (
            7,
            "config.json: num_hidden_layers = 7, but the model's tensors cover 2 of those layers \
             (there is no model.layers.2.*)",
        ),
    ] {
        let mut config = ck.config_json();
        config["num_hidden_layers"] = layers.into();
        std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
        let err = load_error(&dir);
        assert!(err.contains(want), "{err}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn widths_vocabularies_and_contexts_past_the_limits_are_refused() {
    let ck = TinyCheckpoint::new("mistral", Dtype::F32, false, 7);
    for (key, value, want) in [
        (
            "hidden_size",
            1u64 << 40,
            "embedding length 1099511627776 is over strata's limit of 1048576",
        ),
        (
            "intermediate_size",
            1 << 30,
            "feed-forward length 1073741824 is over strata's limit of 4194304",
        ),
        (
            "num_attention_heads",
            1 << 20,
            "head count 1048576 is over strata's limit of 16384",
        ),
        (
            "vocab_size",
            1 << 32,
            "vocabulary size 4294967296 is over strata's limit of 16777216",
        ),
        (
            "max_position_embeddings",
            1 << 40,
            "context length 1099511627776 is over strata's limit of 67108864",
        ),
        ("max_position_embeddings", 0, "context length is 0"),
        // A zero base made every rotary frequency infinite and every logit NaN.
        ("rope_theta", 0, "RoPE base 0 is invalid"),
    ] {
        let mut config = ck.config_json();
        config[key] = value.into();
        if key == "num_attention_heads" {
            config["num_key_value_heads"] = value.into();
            config["head_dim"] = 16.into();
        }
        let err = config_from_json_value(&config).unwrap_err();
        assert!(err.starts_with(want), "{key} = {value}: {err}");
    }
}

/// The test checkpoint's `tokenizer.json`, parsed (`test` names the scratch folder).
fn tokenizer_json(test: &str) -> serde_json::Value {
    let dir = temp_dir(test);
    write_tokenizer(&dir);
    let text = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn a_tokenizer_json_token_id_far_past_the_vocabulary_is_refused() {
    let mut json = tokenizer_json("huge-id");
    // Used to reserve a table of 4 billion token texts and abort.
    json["model"]["vocab"]["a"] = 4_000_000_000u64.into();
    let err = Tokenizer::from_hf_json(&json.to_string(), None, &SpecialIds::default()).unwrap_err();
    assert!(
        err.starts_with("token id 4000000000 is far past the 259 tokens the file lists"),
        "{err}"
    );
    // A small gap is fine: ids may skip a few (as padded vocabularies do).
    json["model"]["vocab"]["a"] = 1000.into();
    let tok = Tokenizer::from_hf_json(&json.to_string(), None, &SpecialIds::default()).unwrap();
    assert_eq!(tok.vocab_size(), 1001);
}

#[test]
fn a_tokenizer_json_padding_or_truncation_is_ignored() {
    let mut json = tokenizer_json("padding");
    // A fixed padding length would have sized every encoding (here 10^9 ids per prompt).
    json["padding"] = serde_json::json!({"strategy": {"Fixed": 1_000_000_000u64}, "direction": "Right",
        "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "!"});
    json["truncation"] =
        serde_json::json!({"direction": "Right", "max_length": 1, "strategy": "LongestFirst", "stride": 0});
    let tok = Tokenizer::from_hf_json(&json.to_string(), None, &SpecialIds::default()).unwrap();
    assert_eq!(
        tok.encode("hi!", false, false).unwrap(),
        [u32::from(b'h'), u32::from(b'i'), u32::from(b'!')]
    );
}

#[test]
fn json_files_past_their_size_limit_are_refused_unread() {
    let dir = temp_dir("big-json");
    TinyCheckpoint::new("llama", Dtype::F32, true, 8).write_dir(&dir, 1);
    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    let padded = format!(
        "{config}{}",
        " ".repeat(MAX_JSON_FILE_BYTES as usize + 1 - config.len())
    );
    std::fs::write(dir.join("config.json"), padded).unwrap();
    let err = load_error(&dir);
    assert!(
        err.contains("config.json: cannot read: the file is 16777217 bytes, over strata's limit of 16777216"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_sentencepiece_vocabulary_of_huge_tokens_is_refused_rather_than_hung_on() {
    // 100 tokens of 10 kB: deriving merges tries every split of every token, 10^10 byte
    // comparisons (minutes), for a 1 MB file.
    let mut w = GgufWriter::new();
    w.add_metadata("tokenizer.ggml.model", MetaValue::String("llama".into()))
        .unwrap();
    let tokens = (0..100).map(|i| format!("{i:03}{}", "a".repeat(10_000)));
    w.add_string_array("tokenizer.ggml.tokens", tokens).unwrap();
    let file = GgufFile::from_bytes(w.to_bytes()).unwrap();
    let err = Tokenizer::from_gguf(&file).unwrap_err().to_string();
    assert!(
        err.contains("the tokens are too long to derive SentencePiece merges from"),
        "{err}"
    );
}

#[test]
fn a_tokenizer_json_post_processor_naming_an_undefined_token_is_refused_at_load() {
    let mut json = tokenizer_json("post-processor");
    // tokenizers panicked on every encoding of such a file (found by the tokenizer_json fuzz target).
    json["post_processor"] = serde_json::json!({"type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {}});
    let err = Tokenizer::from_hf_json(&json.to_string(), None, &SpecialIds::default()).unwrap_err();
    assert_eq!(
        err,
        "it cannot encode text: the tokenizers library panicked on it; the tokenizer file is malformed"
    );
}

#[test]
fn an_end_of_sequence_list_past_the_limit_is_refused() {
    let dir = temp_dir("eos-list");
    let ck = TinyCheckpoint::new("llama", Dtype::F32, true, 9);
    ck.write_dir(&dir, 1);
    // Each id was compared with all before it: 10^6 ids made 5 * 10^11 comparisons.
    let ids: Vec<u32> = (0..1_000_000).collect();
    std::fs::write(
        dir.join("generation_config.json"),
        serde_json::json!({ "eos_token_id": ids }).to_string(),
    )
    .unwrap();
    let err = load_error(&dir);
    assert!(
        err.contains("generation_config.json: eos_token_id lists 1000000 token ids; strata reads at most 1024"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
