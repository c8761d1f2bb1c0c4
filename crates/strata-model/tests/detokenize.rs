//! Incremental detokenizer tests on real vocabularies: chunks are whole UTF-8 characters, add up to
//! `decode(all ids)`, keep SentencePiece's spaces right with a prompt prefix, and flush leftovers.

use std::path::PathBuf;

use strata_formats::gguf::GgufFile;
use strata_model::tokenizer::{IncrementalDecoder, Tokenizer};

fn cache_dir() -> PathBuf {
    match std::env::var_os("STRATA_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/strata"),
    }
}

fn load(rel: &str) -> Tokenizer {
    let path = cache_dir().join(rel);
    assert!(path.exists(), "{} is missing: run `make fetch` first", path.display());
    let gguf = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The vocabularies under test: SentencePiece with byte fallback, and byte-level BPEs.
fn tokenizers() -> Vec<(&'static str, Tokenizer)> {
    vec![
        ("llama-spm", load("vocab/ggml-vocab-llama-spm.gguf")),
        ("llama-bpe", load("vocab/ggml-vocab-llama-bpe.gguf")),
        ("qwen2", load("vocab/ggml-vocab-qwen2.gguf")),
        ("smollm2", load("models/SmolLM2-135M-Instruct.Q4_1.gguf")),
    ]
}

const TEXTS: &[&str] = &[
    "Hello world",
    " leading space and  double spaces ",
    "emoji 😀 and a family 👨‍👩‍👧 and flags 🇫🇷🇯🇵",
    "日本語のテキストと中文和한국어",
    "combining marks: e\u{301} n\u{303} a\u{308}\u{332} ก\u{e49}",
    "mixed\nlines\tand\u{a0}nbsp € ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "🦀🦀🦀",
    "Ａ　全角　ｓｐａｃｅ。",
];

/// Feeds `ids` one at a time; returns the chunks (pushes, then finish) and how many pushes held text back.
fn stream(dec: &mut IncrementalDecoder, ids: &[u32]) -> (Vec<String>, usize) {
    let mut chunks = Vec::new();
    let mut held = 0;
    for &id in ids {
        match dec.push(id) {
            Some(chunk) => chunks.push(chunk),
            None => held += 1,
        }
    }
    chunks.extend(dec.finish());
    (chunks, held)
}

#[test]
fn chunks_add_up_to_full_decode_and_are_clean() {
    for (name, tok) in tokenizers() {
        let mut total_held = 0;
        for text in TEXTS {
            let ids = tok.encode(text, false, false).expect("encode");
            let full = tok.decode(&ids, false).expect("decode");
            assert_eq!(&full, text, "{name}: round trip");
            let mut dec = IncrementalDecoder::new(&tok, &[]).with_skip_special(false);
            let (chunks, held) = stream(&mut dec, &ids);
            total_held += held;
            assert_eq!(chunks.concat(), full, "{name}: chunks of {text:?}: {chunks:?}");
            for chunk in &chunks {
                assert!(!chunk.is_empty(), "{name}: empty chunk for {text:?}");
                assert!(
                    !chunk.contains('\u{FFFD}'),
                    "{name}: U+FFFD in chunk {chunk:?} of valid text {text:?}"
                );
            }
            // Any token whose bytes are not valid UTF-8 on their own must have been held back.
            let partial = ids
                .iter()
                .any(|&id| std::str::from_utf8(tok.token_to_piece(id).unwrap_or_default()).is_err());
            if partial {
                assert!(
                    held > 0,
                    "{name}: {text:?} has partial-character tokens but nothing was held back"
                );
            }
        }
        assert!(
            total_held > 0,
            "{name}: the test texts never split a character across tokens"
        );
    }
}

#[test]
fn byte_fallback_emoji_is_held_until_complete() {
    let tok = load("vocab/ggml-vocab-llama-spm.gguf");
    let ids = tok.encode("🦀", false, false).expect("encode");
    let bytes: Vec<u32> = ["<0xF0>", "<0x9F>", "<0xA6>", "<0x80>"]
        .iter()
        .map(|t| tok.token_to_id(t).expect("byte token"))
        .collect();
    assert!(ids.ends_with(&bytes), "🦀 should fall back to bytes: {ids:?}");
    let mut dec = IncrementalDecoder::new(&tok, &[]);
    let out: Vec<Option<String>> = ids.iter().map(|&id| dec.push(id)).collect();
    let (last, rest) = out.split_last().expect("some ids");
    assert!(rest[rest.len() - 3..].iter().all(Option::is_none), "{out:?}");
    assert!(last.as_deref().is_some_and(|s| s.ends_with('🦀')), "{out:?}");
    assert_eq!(dec.finish(), None);
}

#[test]
fn prompt_tail_keeps_sentencepiece_leading_space() {
    let tok = load("vocab/ggml-vocab-llama-spm.gguf");
    let prompt = tok.encode("The capital of France is", true, false).expect("encode");
    let all = tok
        .encode("The capital of France is Paris, 巴黎 🗼.", true, false)
        .expect("encode");
    assert!(
        all.starts_with(&prompt),
        "prompt ids must be a prefix: {prompt:?} vs {all:?}"
    );
    let generated = &all[prompt.len()..];

    let mut with_context = IncrementalDecoder::new(&tok, &prompt);
    let (chunks, _) = stream(&mut with_context, generated);
    assert!(
        chunks[0].starts_with(" Paris"),
        "space before the first generated word is kept: {chunks:?}"
    );
    let prompt_text = tok.decode(&prompt, true).expect("decode");
    let all_text = tok.decode(&all, true).expect("decode");
    assert_eq!(format!("{prompt_text}{}", chunks.concat()), all_text);

    // Without context the first token's space is dropped, exactly as decode() of the ids alone does.
    let mut bare = IncrementalDecoder::new(&tok, &[]);
    let (chunks, _) = stream(&mut bare, generated);
    assert_eq!(chunks.concat(), tok.decode(generated, true).expect("decode"));
    assert!(chunks[0].starts_with("Paris"), "{chunks:?}");
}

#[test]
fn special_tokens_are_skipped_by_default() {
    let tok = load("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let ids = tok.encode("Hi there!<|im_end|>", false, true).expect("encode");
    assert_eq!(ids.last(), Some(&2));
    let mut dec = IncrementalDecoder::new(&tok, &[1, 520, 198]);
    let (chunks, _) = stream(&mut dec, &ids);
    assert_eq!(chunks.concat(), "Hi there!");
    let mut keep = IncrementalDecoder::new(&tok, &[]).with_skip_special(false);
    let (chunks, _) = stream(&mut keep, &ids);
    assert_eq!(chunks.concat(), "Hi there!<|im_end|>");
}

#[test]
fn finish_flushes_incomplete_bytes_as_replacement() {
    let tok = load("vocab/ggml-vocab-llama-spm.gguf");
    let a = tok.encode("a", false, false).expect("encode");
    let f0 = tok.token_to_id("<0xF0>").expect("byte token");
    let f9 = tok.token_to_id("<0x9F>").expect("byte token");
    let mut ids = a.clone();
    ids.extend([f0, f9]);
    let mut dec = IncrementalDecoder::new(&tok, &[]);
    let (chunks, held) = stream(&mut dec, &ids);
    assert_eq!(held, 2);
    assert_eq!(chunks.concat(), tok.decode(&ids, false).expect("decode"));
    assert!(chunks.last().is_some_and(|c| c.ends_with('\u{FFFD}')), "{chunks:?}");
    // Out-of-vocabulary ids are ignored rather than poisoning the stream.
    let mut dec = IncrementalDecoder::new(&tok, &[]);
    assert_eq!(dec.push(u32::MAX), None);
    assert_eq!(dec.push(a[0]).as_deref(), Some("a"));
}

/// A xorshift stream from `seed`: each call gives a number below its argument.
fn below(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut state = seed;
    move |n| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state % n
    }
}

/// Random id streams (many of them byte tokens, so invalid UTF-8 is common) still add up exactly.
#[test]
fn random_id_streams_add_up() {
    let mut next = below(0x9E37_79B9_7F4A_7C15);
    for (name, tok) in tokenizers() {
        let vocab = tok.vocab_size() as u64;
        for round in 0..150 {
            let len = 1 + next(24) as usize;
            let ids: Vec<u32> = (0..len)
                .map(|_| match next(3) {
                    // SentencePiece byte tokens live at 3..259; byte-level single bytes at low ids.
                    0 => 3 + next(256) as u32,
                    _ => next(vocab) as u32,
                })
                .collect();
            for skip in [false, true] {
                let mut dec = IncrementalDecoder::new(&tok, &[]).with_skip_special(skip);
                let (chunks, _) = stream(&mut dec, &ids);
                let full = tok.decode(&ids, skip).expect("decode");
                assert_eq!(chunks.concat(), full, "{name} round {round} skip={skip}: ids {ids:?}");
            }
        }
    }
}

/// Byte-level vocabularies (GGUF tables and `tokenizer.json` files) take the piece-by-piece fast
/// path; its chunks are the window decoder's, token for token, also around control tokens, with
/// a prompt tail, and with special tokens kept or skipped.
#[test]
fn piece_by_piece_chunks_equal_the_window_decoder() {
    let hf = |name: &str| {
        let dir = cache_dir().join("tokenizers").join(name);
        assert!(dir.exists(), "{} is missing: run `make fetch` first", dir.display());
        Tokenizer::from_hf_file(dir.join("tokenizer.json"), Some(&dir.join("tokenizer_config.json")))
            .unwrap_or_else(|e| panic!("{name}: {e}"))
    };
    let mut all = tokenizers();
    all.push(("llama3 tokenizer.json", hf("llama3")));
    all.push(("qwen2.5 tokenizer.json", hf("qwen2.5")));
    let mut next = below(0x2545_F491_4F6C_DD1D);
    for (name, tok) in all {
        assert_eq!(
            tok.decodes_piece_by_piece(),
            name != "llama-spm",
            "{name}: which vocabularies decode piece by piece"
        );
        let vocab = tok.vocab_size() as u64;
        // Whole texts (multi-byte characters split over tokens) and random ids (control tokens,
        // invalid UTF-8 and all), after a prompt tail.
        let mut streams: Vec<Vec<u32>> = TEXTS
            .iter()
            .map(|t| tok.encode(t, false, false).expect("encode"))
            .collect();
        for _ in 0..200 {
            let len = 1 + next(32) as usize;
            streams.push((0..len).map(|_| next(vocab) as u32).collect());
        }
        let prompt = tok.encode("The answer is", false, false).expect("encode");
        for (i, ids) in streams.iter().enumerate() {
            for skip in [false, true] {
                let mut fast = IncrementalDecoder::new(&tok, &prompt).with_skip_special(skip);
                let mut window = IncrementalDecoder::new(&tok, &prompt)
                    .with_skip_special(skip)
                    .without_piece_by_piece();
                let pushed = |dec: &mut IncrementalDecoder| -> Vec<Option<String>> {
                    let mut out: Vec<_> = ids.iter().map(|&id| dec.push(id)).collect();
                    out.push(dec.finish());
                    out
                };
                assert_eq!(
                    pushed(&mut fast),
                    pushed(&mut window),
                    "{name} stream {i} skip={skip}: ids {ids:?}"
                );
            }
        }
    }
}
