//! Fuzz targets of model loading, driven by `strata-fuzz`: a whole tiny GGUF model, `config.json`
//! and `tokenizer.json`, mutated, load or fail with an error, within memory and time bounds.
//!
//! `make test` runs each target's default cases from seed 0; `make fuzz` runs each for
//! `STRATA_FUZZ_SECONDS` from a fresh seed. Inputs that once failed live in
//! `tests/fuzz_regressions/<target>/` and are replayed first.

#[allow(dead_code)]
mod common;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::tiny_hf::{write_tokenizer, TinyCheckpoint, VOCAB};
use proptest::prelude::prop_oneof;
use serde_json::{json, Value};
use strata_formats::gguf::{GgufFile, MetaValue, MetaValueType};
use strata_formats::safetensors::Dtype;
use strata_fuzz::{
    fuzz, json_mutated, mutated, regressions_dir, replay_dir, Bounds, CountingAllocator, Outcome, Target,
};
use strata_model::chat_template::ChatTemplate;
use strata_model::hf_checkpoint::read_hf_config;
use strata_model::loader::{load_model, load_transformer};
use strata_model::tokenizer::{SpecialIds, Tokenizer};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

/// Loading copies the weights once and widens norms to f32; the tokenizer and template cost a
/// few MiB whatever the file (regexes, tables).
const GGUF_MODEL: Target = Target {
    name: "gguf_model",
    default_cases: 8000,
    bounds: Bounds {
        bytes_per_input_byte: 16,
        fixed_bytes: 32 << 20,
        time: Duration::from_secs(2),
    },
};

/// A `config.json` is tiny; what it may cost is the fixed tiny checkpoint it is loaded with.
const HF_CONFIG: Target = Target {
    name: "hf_config",
    default_cases: 2000,
    bounds: Bounds {
        bytes_per_input_byte: 64,
        fixed_bytes: 32 << 20,
        time: Duration::from_secs(2),
    },
};

/// `tokenizers` keeps a few copies of the vocabulary and merges (maps both ways, added tokens).
const TOKENIZER_JSON: Target = Target {
    name: "tokenizer_json",
    default_cases: 8000,
    bounds: Bounds {
        bytes_per_input_byte: 64,
        fixed_bytes: 32 << 20,
        time: Duration::from_secs(2),
    },
};

fn scratch_dir(target: &Target) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-fuzz-{}-{}", target.name, std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Loads a GGUF image as `strata run` does (tokenizer, template, weights), then tokenizes.
fn check_gguf_model(image: &[u8]) -> Outcome {
    let Ok(file) = GgufFile::from_bytes(image.to_vec()) else {
        return Outcome::Refused;
    };
    let file = Arc::new(file);
    let (Ok(tokenizer), Ok(template)) = (Tokenizer::from_gguf(&file), ChatTemplate::from_gguf(&file)) else {
        return Outcome::Refused;
    };
    let Ok(transformer) = load_transformer(file, &|_, _| {}) else {
        return Outcome::Refused;
    };
    let ids = tokenizer.encode("hi <|im_end|>", true, true).unwrap();
    let _ = tokenizer.decode(&ids, true);
    let _ = template;
    assert_eq!(transformer.weights.layers.len(), transformer.config.n_layers);
    Outcome::Accepted
}

#[test]
fn gguf_model_load() {
    replay_dir(
        GGUF_MODEL,
        &regressions_dir(env!("CARGO_MANIFEST_DIR"), &GGUF_MODEL),
        check_gguf_model,
    );
    // The tiny model with its byte-level BPE vocabulary, and with the same tokens read as a
    // SentencePiece vocabulary (whose merges strata derives from the tokens and scores).
    let byte_level = TinyCheckpoint::new("qwen2", Dtype::F16, false, 21).gguf_writer();
    let mut sentencepiece = byte_level.clone();
    sentencepiece
        .set_metadata("tokenizer.ggml.model", MetaValue::String("llama".into()))
        .unwrap();
    let scores = (0..VOCAB).map(|i| MetaValue::F32(-(i as f32))).collect();
    sentencepiece
        .set_metadata("tokenizer.ggml.scores", MetaValue::Array(MetaValueType::F32, scores))
        .unwrap();
    let seeds = [byte_level, sentencepiece].map(|w| {
        let layout = w.layout();
        let image = Arc::new(w.to_bytes());
        assert_eq!(check_gguf_model(&image), Outcome::Accepted);
        let (infos, data) = (layout.tensor_infos_start as usize, layout.data_start as usize);
        mutated(image, &[0..infos, infos..data])
    });
    let [byte_level, sentencepiece] = seeds;
    fuzz(GGUF_MODEL, prop_oneof![byte_level, sentencepiece], check_gguf_model);
}

/// `config.json` of four real shapes: the tiny checkpoint's (which loads) and SmolLM2, Mistral
/// and Qwen3 as released (whose shapes the tiny weights do not match).
fn config_seeds() -> Vec<Value> {
    let tiny = TinyCheckpoint::new("qwen2", Dtype::BF16, true, 22).config_json();
    // SmolLM2-135M-Instruct, the default model.
    let llama = json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
        "rms_norm_eps": 1e-05, "rope_theta": 100000, "rope_scaling": null,
        "max_position_embeddings": 8192, "tie_word_embeddings": true, "attention_bias": false,
        "mlp_bias": false, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
        "torch_dtype": "bfloat16", "initializer_range": 0.041666666666666664
    });
    let mistral = json!({
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 32768, "head_dim": null, "sliding_window": null,
        "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": false, "torch_dtype": "bfloat16"
    });
    let qwen3 = json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "head_dim": 128,
        "num_key_value_heads": 8, "vocab_size": 151936, "attention_bias": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "tie_word_embeddings": true,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"
    });
    vec![tiny, llama, mistral, qwen3]
}

#[test]
fn hf_config_json() {
    let dir = scratch_dir(&HF_CONFIG);
    TinyCheckpoint::new("qwen2", Dtype::BF16, true, 22).write_dir(&dir, 1);
    let config = dir.join("config.json");
    let check = |text: &[u8]| {
        std::fs::write(&config, text).unwrap();
        // The planner's read (shape only), then the whole load against the tiny weights.
        if read_hf_config(&dir).is_err() {
            return Outcome::Refused;
        }
        match load_model(&dir, &|_, _| {}) {
            Ok(model) => {
                let c = &model.transformer.config;
                assert_eq!(model.transformer.weights.layers.len(), c.n_layers);
                Outcome::Accepted
            }
            Err(_) => Outcome::Refused,
        }
    };
    replay_dir(
        HF_CONFIG,
        &regressions_dir(env!("CARGO_MANIFEST_DIR"), &HF_CONFIG),
        check,
    );
    let seeds = config_seeds();
    let inputs = prop_oneof![
        3 => json_mutated(Arc::new(seeds[0].clone())),
        1 => json_mutated(Arc::new(seeds[1].clone())),
        1 => json_mutated(Arc::new(seeds[2].clone())),
        1 => json_mutated(Arc::new(seeds[3].clone())),
    ];
    fuzz(HF_CONFIG, inputs, check);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A SentencePiece-style BPE `tokenizer.json` (Llama 2 / Mistral layout): byte fallback,
/// Metaspace-style normalizer and decoder, a BOS post-processor.
fn sentencepiece_seed() -> Value {
    let special = |id: u32, content: &str| {
        json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false,
               "normalized": false, "special": true})
    };
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), i.into());
    }
    for b in 0..=255u32 {
        vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
    }
    let pieces = [
        "\u{2581}",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "\u{2581}h",
        "ll",
        "\u{2581}he",
        "\u{2581}hell",
        "\u{2581}hello",
    ];
    for (i, p) in pieces.iter().enumerate() {
        vocab.insert(p.to_string(), (259 + i).into());
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u{2581}"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
                  "vocab": vocab,
                  "merges": ["\u{2581} h", "l l", "\u{2581}h e", "\u{2581}he ll", "\u{2581}hell o"]}
    })
}

/// A Unigram `tokenizer.json` with a Metaspace pre-tokenizer and decoder (T5 / Gemma style).
fn unigram_seed() -> Value {
    let pieces = [
        "<unk>",
        "\u{2581}",
        "\u{2581}hello",
        "h",
        "e",
        "l",
        "o",
        "\u{2581}w",
        "or",
        "ld",
        "!",
    ];
    let vocab: Vec<Value> = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| json!([p, -(i as f64)]))
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [{"id": 0, "content": "<unk>", "single_word": false, "lstrip": false,
                          "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always", "split": true},
        "post_processor": null,
        "decoder": {"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "always", "split": true},
        "model": {"type": "Unigram", "unk_id": 0, "vocab": vocab, "byte_fallback": false}
    })
}

/// A WordPiece `tokenizer.json` (BERT style), whose pieces only the library's decoder spells.
fn wordpiece_seed() -> Value {
    let pieces = [
        "[UNK]", "[CLS]", "[SEP]", "h", "##e", "##l", "##o", "hello", "world", "!",
    ];
    let vocab: serde_json::Map<String, Value> = pieces
        .iter()
        .enumerate()
        .map(|(i, p)| (p.to_string(), i.into()))
        .collect();
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                       "strip_accents": null, "lowercase": true},
        "pre_tokenizer": {"type": "BertPreTokenizer"},
        "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
                  "max_input_chars_per_word": 100, "vocab": vocab}
    })
}

/// The byte-level BPE `tokenizer.json` the tiny checkpoints use (GPT-2 / Qwen style).
fn byte_level_seed() -> Value {
    let dir = scratch_dir(&Target {
        name: "tokenizer_json_seed",
        ..TOKENIZER_JSON
    });
    write_tokenizer(&dir);
    let text = std::fs::read_to_string(dir.join("tokenizer.json")).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Builds the tokenizer, then encodes and decodes a little text with it.
fn check_tokenizer_json(text: &[u8]) -> Outcome {
    let Ok(text) = std::str::from_utf8(text) else {
        return Outcome::Refused;
    };
    let config = json!({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": false});
    let ids = SpecialIds {
        bos: Some(1),
        eos: vec![2, 7],
    };
    let Ok(tokenizer) = Tokenizer::from_hf_json(text, Some(&config), &ids) else {
        return Outcome::Refused;
    };
    for parse_special in [false, true] {
        // A post-processor may add ids the vocabulary lacks; decoding refuses those with an error.
        if let Ok(ids) = tokenizer.encode("Hello world! <s> \u{e9}t\u{e9} 123", true, parse_special) {
            let _ = tokenizer.decode(&ids, true);
        }
    }
    Outcome::Accepted
}

#[test]
fn tokenizer_json() {
    replay_dir(
        TOKENIZER_JSON,
        &regressions_dir(env!("CARGO_MANIFEST_DIR"), &TOKENIZER_JSON),
        check_tokenizer_json,
    );
    let seeds = [
        byte_level_seed(),
        sentencepiece_seed(),
        unigram_seed(),
        wordpiece_seed(),
    ];
    for seed in &seeds {
        assert_eq!(
            check_tokenizer_json(seed.to_string().as_bytes()),
            Outcome::Accepted,
            "{seed}"
        );
    }
    let inputs = prop_oneof![
        json_mutated(Arc::new(seeds[0].clone())),
        json_mutated(Arc::new(seeds[1].clone())),
        json_mutated(Arc::new(seeds[2].clone())),
        json_mutated(Arc::new(seeds[3].clone())),
    ];
    fuzz(TOKENIZER_JSON, inputs, check_tokenizer_json);
}
