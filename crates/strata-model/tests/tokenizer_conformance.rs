//! Conformance of GGUF tokenizers against llama.cpp's vocab test vectors (`ggml-vocab-*.gguf.inp/.out`)
//! and checks on the default model (SmolLM2): ids, round trips, special tokens and the EOG set.

use std::path::PathBuf;

use strata_formats::gguf::{GgufFile, GgufWriter, MetaValue, MetaValueType};
use strata_model::tokenizer::{TokenKind, Tokenizer, TokenizerError, VocabType};

fn cache_dir() -> PathBuf {
    match std::env::var_os("STRATA_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/strata"),
    }
}

fn must_exist(path: PathBuf) -> PathBuf {
    assert!(path.exists(), "{} is missing: run `make fetch` first", path.display());
    path
}

fn load_gguf_tokenizer(path: &PathBuf) -> Tokenizer {
    let gguf = GgufFile::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// One llama.cpp test vector: input text and the expected ids.
struct Case {
    text: String,
    expected: Vec<u32>,
}

/// Reads `<vocab>.gguf.inp` (each string followed by `\n__ggml_vocab_test__\n`) and
/// `<vocab>.gguf.out` (one line of space-separated ids per string).
fn load_cases(name: &str) -> (Tokenizer, Vec<Case>) {
    let dir = cache_dir().join("vocab");
    let gguf = must_exist(dir.join(format!("ggml-vocab-{name}.gguf")));
    let inp = must_exist(dir.join(format!("ggml-vocab-{name}.gguf.inp")));
    let out = must_exist(dir.join(format!("ggml-vocab-{name}.gguf.out")));
    let inp = std::fs::read_to_string(&inp).unwrap_or_else(|e| panic!("{}: {e}", inp.display()));
    let out = std::fs::read_to_string(&out).unwrap_or_else(|e| panic!("{}: {e}", out.display()));

    let mut texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    assert_eq!(texts.pop(), Some(""), "{name}.inp must end with the separator");
    let mut lines: Vec<&str> = out.split('\n').collect();
    assert_eq!(lines.pop(), Some(""), "{name}.out must end with a newline");
    assert_eq!(
        texts.len(),
        lines.len(),
        "{name}: .inp has {} strings, .out has {} lines",
        texts.len(),
        lines.len()
    );
    assert!(texts.len() > 30, "{name}: only {} test strings", texts.len());

    let cases = texts
        .iter()
        .zip(&lines)
        .map(|(text, line)| Case {
            text: text.to_string(),
            expected: line
                .split_whitespace()
                .map(|t| t.parse().expect("id in .out file"))
                .collect(),
        })
        .collect();
    (load_gguf_tokenizer(&gguf), cases)
}

/// Encodes every vector (add_special = false, parse_special = false, as llama.cpp's test does) and
/// checks decode(encode(s)) == s. Returns (passed, total, failure descriptions).
fn run_vocab(name: &str) -> (usize, usize, Vec<String>) {
    let (tok, cases) = load_cases(name);
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let got = tok
            .encode(&case.text, false, false)
            .unwrap_or_else(|e| panic!("{name} #{i}: {e}"));
        if got != case.expected {
            failures.push(format!(
                "{name} #{i} {:?}: expected {:?}, got {:?}",
                case.text, case.expected, got
            ));
            continue;
        }
        let back = tok.decode(&got, false).unwrap_or_else(|e| panic!("{name} #{i}: {e}"));
        if back != case.text {
            failures.push(format!(
                "{name} #{i} {:?}: ids match but decode gives {back:?}",
                case.text
            ));
        }
    }
    let total = cases.len();
    let passed = total - failures.len();
    eprintln!("{name}: {passed}/{total} vectors pass (ids and round trip)");
    for f in &failures {
        eprintln!("  {f}");
    }
    (passed, total, failures)
}

fn assert_all_pass(name: &str) {
    let (passed, total, failures) = run_vocab(name);
    assert!(
        failures.is_empty(),
        "{name}: {passed}/{total} pass; failures:\n{}",
        failures.join("\n")
    );
}

#[test]
fn llama_bpe_vectors() {
    assert_all_pass("llama-bpe");
}

#[test]
fn qwen2_vectors() {
    assert_all_pass("qwen2");
}

#[test]
fn gpt2_vectors() {
    assert_all_pass("gpt-2");
}

#[test]
fn starcoder_vectors() {
    assert_all_pass("starcoder");
}

#[test]
fn llama_spm_vectors() {
    assert_all_pass("llama-spm");
}

fn smollm2() -> Tokenizer {
    load_gguf_tokenizer(&must_exist(cache_dir().join("models/SmolLM2-135M-Instruct.Q4_1.gguf")))
}

#[test]
fn smollm2_plain_text_ids_and_round_trip() {
    let tok = smollm2();
    assert_eq!(tok.vocab_type(), VocabType::ByteLevelBpe);
    assert_eq!(tok.vocab_size(), 49152);
    // Each word is a single vocabulary entry: The, Ġcapital, Ġof, ĠFrance, Ġis.
    let ids = tok.encode("The capital of France is", false, false).expect("encode");
    assert_eq!(ids, vec![504, 3575, 282, 4649, 314]);
    assert_eq!(tok.decode(&ids, false).expect("decode"), "The capital of France is");
    // SmolLM pre-tokenizer splits digits one by one.
    assert_eq!(tok.encode("123", false, false).expect("encode"), vec![33, 34, 35]);
    for text in [
        "",
        " ",
        "Hello, world!\n\n",
        "naïve café 日本語 😀",
        "  leading and trailing  ",
        "x = f(1234567);",
    ] {
        let ids = tok.encode(text, false, false).expect("encode");
        assert_eq!(tok.decode(&ids, false).expect("decode"), text, "round trip of {text:?}");
    }
}

#[test]
fn smollm2_special_tokens() {
    let tok = smollm2();
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    assert_eq!(tok.token_text(0), Some("<|endoftext|>"));
    assert_eq!(tok.token_kind(2), Some(TokenKind::Control));
    assert_eq!(tok.token_to_piece(1), Some(&b"<|im_start|>"[..]));
    assert_eq!(tok.token_to_piece(216), Some(&b" "[..]), "Ġ is a space");
    assert_eq!(tok.token_to_piece(49152), None);

    let chat = "<|im_start|>user\nHi<|im_end|>\n";
    let parsed = tok.encode(chat, false, true).expect("encode");
    assert_eq!(parsed, vec![1, 4093, 198, 26843, 2, 198]);
    let literal = tok.encode(chat, false, false).expect("encode");
    assert!(
        !literal.contains(&1) && !literal.contains(&2),
        "parse_special=false must not produce control tokens: {literal:?}"
    );
    assert_eq!(tok.decode(&literal, false).expect("decode"), chat);
    assert_eq!(tok.decode(&parsed, false).expect("decode"), chat);
    assert_eq!(tok.decode(&parsed, true).expect("decode"), "user\nHi\n");

    // GGUF says add_bos_token = false for SmolLM2.
    assert!(!tok.add_bos());
    assert_eq!(
        tok.encode("Hi", true, false).expect("encode"),
        tok.encode("Hi", false, false).expect("encode")
    );

    let eog = tok.eog_ids();
    assert!(eog.contains(&2), "<|im_end|> ends generation: {eog:?}");
    assert!(eog.contains(&0), "<|endoftext|> ends generation: {eog:?}");
    assert!(!eog.contains(&3), "{eog:?}");
    assert!(tok.is_eog(2) && !tok.is_eog(504));
    assert!(matches!(
        tok.decode(&[49152], false),
        Err(TokenizerError::IdOutOfRange { id: 49152, .. })
    ));
}

#[test]
fn add_special_follows_metadata() {
    let dir = cache_dir().join("vocab");
    let spm = load_gguf_tokenizer(&must_exist(dir.join("ggml-vocab-llama-spm.gguf")));
    assert_eq!(spm.vocab_type(), VocabType::SentencePiece);
    let with = spm.encode("Hello world", true, false).expect("encode");
    let without = spm.encode("Hello world", false, false).expect("encode");
    assert_eq!(with[0], 1, "llama-spm GGUF says add_bos_token = true");
    assert_eq!(&with[1..], &without[..]);
    assert_eq!(spm.decode(&with, true).expect("decode"), "Hello world");
    assert!(spm.is_eog(2));

    let llama3 = load_gguf_tokenizer(&must_exist(dir.join("ggml-vocab-llama-bpe.gguf")));
    let ids = llama3.encode("Hello", true, false).expect("encode");
    assert_eq!(
        ids[0], 128000,
        "llama-bpe adds <|begin_of_text|> by default, as llama.cpp does"
    );
    assert!(llama3.is_eog(128001) && llama3.is_eog(128009), "{:?}", llama3.eog_ids());
    let parsed = llama3
        .encode("<|start_header_id|>user<|end_header_id|>", false, true)
        .expect("encode");
    assert_eq!(parsed.first(), Some(&128006));
    assert_eq!(parsed.last(), Some(&128007));

    let qwen2 = load_gguf_tokenizer(&must_exist(dir.join("ggml-vocab-qwen2.gguf")));
    assert!(qwen2.is_eog(151643) && qwen2.is_eog(151645), "{:?}", qwen2.eog_ids());
    // User-defined tokens are recognised even without parse_special, as in llama.cpp.
    assert_eq!(qwen2.encode("a[PAD151646]b", false, false).expect("encode").len(), 3);
}

fn tiny_gguf(pre: Option<&str>, extra: &[(&str, MetaValue)]) -> GgufFile {
    let mut w = GgufWriter::new();
    w.add_metadata("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
        .expect("meta");
    if let Some(pre) = pre {
        w.add_metadata("tokenizer.ggml.pre", MetaValue::String(pre.into()))
            .expect("meta");
    }
    w.add_string_array("tokenizer.ggml.tokens", ["a", "b", "ab", "<|im_end|>", "<|eot|>"])
        .expect("meta");
    let types = [1, 1, 1, 3, 3].into_iter().map(MetaValue::I32).collect();
    w.add_metadata("tokenizer.ggml.token_type", MetaValue::Array(MetaValueType::I32, types))
        .expect("meta");
    w.add_string_array("tokenizer.ggml.merges", ["a b"]).expect("meta");
    for (k, v) in extra {
        w.add_metadata(*k, v.clone()).expect("meta");
    }
    GgufFile::from_bytes(w.to_bytes()).expect("tiny GGUF parses")
}

#[test]
fn unknown_pre_tokenizer_is_a_clear_error() {
    let err = Tokenizer::from_gguf(&tiny_gguf(Some("mystery-pre"), &[])).expect_err("unknown pre must fail");
    let msg = err.to_string();
    assert!(msg.contains("mystery-pre"), "{msg}");
    for known in ["llama-bpe", "qwen2", "smollm", "gpt-2"] {
        assert!(msg.contains(known), "message should list {known}: {msg}");
    }
}

#[test]
fn tiny_vocab_merges_and_eog_metadata() {
    let eot = [
        ("tokenizer.ggml.eot_token_id", MetaValue::U32(4)),
        ("tokenizer.ggml.eos_token_id", MetaValue::U32(3)),
    ];
    let tok = Tokenizer::from_gguf(&tiny_gguf(Some("gpt-2"), &eot)).expect("tiny tokenizer");
    assert_eq!(tok.encode("abab", false, false).expect("encode"), vec![2, 2]);
    assert_eq!(tok.encode("ab", false, false).expect("encode"), vec![2]);
    assert_eq!(tok.encode("ba", false, false).expect("encode"), vec![1, 0]);
    assert_eq!(tok.eog_ids(), &[3, 4]);
    let err = Tokenizer::from_gguf(&GgufFile::from_bytes(GgufWriter::new().to_bytes()).expect("empty GGUF"))
        .expect_err("no tokenizer metadata");
    assert!(err.to_string().contains("tokenizer.ggml.model"), "{err}");
}

/// A tiny byte-level `tokenizer.json` with a BOS-adding post-processor, plus its config.
const TINY_TOKENIZER_JSON: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [
    {"id": 7, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
    {"id": 8, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
  ],
  "normalizer": null,
  "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
  "post_processor": {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<s>": {"id": "<s>", "ids": [7], "tokens": ["<s>"]}}
  },
  "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
  "model": {
    "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
    "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
    "vocab": {"h": 0, "i": 1, "\u0120": 2, "hi": 3, "\u0120h": 4, "\u0120hi": 5, "!": 6, "<s>": 7, "</s>": 8},
    "merges": ["h i", "\u0120 hi"]
  }
}"#;

#[test]
fn hf_tokenizer_json() {
    let dir = std::env::temp_dir().join(format!("strata-hf-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let json = dir.join("tokenizer.json");
    let config = dir.join("tokenizer_config.json");
    std::fs::write(&json, TINY_TOKENIZER_JSON).expect("write");
    std::fs::write(&config, r#"{"bos_token": "<s>", "eos_token": {"content": "</s>"}}"#).expect("write");

    let tok = Tokenizer::from_hf_file(&json, Some(&config)).expect("load tokenizer.json");
    assert_eq!(tok.vocab_type(), VocabType::HfJson);
    assert_eq!(tok.vocab_size(), 9);
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(7), Some(8)));
    assert_eq!(tok.eog_ids(), &[8]);
    assert_eq!(tok.encode("hi hi!", false, false).expect("encode"), vec![3, 5, 6]);
    assert_eq!(tok.encode("hi hi!", true, false).expect("encode"), vec![7, 3, 5, 6]);
    assert_eq!(tok.encode("hi</s>", false, true).expect("encode"), vec![3, 8]);
    assert_ne!(tok.encode("hi</s>", false, false).expect("encode"), vec![3, 8]);
    assert_eq!(tok.decode(&[7, 3, 5, 6, 8], true).expect("decode"), "hi hi!");
    assert_eq!(tok.decode(&[7, 3, 8], false).expect("decode"), "<s>hi</s>");
    assert_eq!(tok.token_to_piece(5), Some(&b" hi"[..]));
    assert_eq!(tok.token_kind(8), Some(TokenKind::Control));

    let err = Tokenizer::from_hf_file(dir.join("missing.json"), None).expect_err("missing file");
    assert!(err.to_string().contains("missing.json"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn shared_types_are_thread_safe() {
    fn assert_send_sync<T: Send + Sync + Clone>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<strata_model::tokenizer::IncrementalDecoder>();
    assert_send_sync::<strata_model::chat_template::ChatTemplate>();
    // A clone shares the vocabulary and behaves identically.
    let tok = smollm2();
    let copy = tok.clone();
    assert_eq!(
        copy.encode("Hi!", false, false).expect("encode"),
        tok.encode("Hi!", false, false).expect("encode")
    );
}
