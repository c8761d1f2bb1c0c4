//! Builds a `tokenizers` pipeline from GGUF `tokenizer.ggml.*` metadata, reproducing llama.cpp's
//! tokenizers: byte-level BPE (`gpt2`, pre-tokenizer picked by `tokenizer.ggml.pre`) and SentencePiece (`llama`).

use std::collections::HashMap;

use strata_formats::gguf::{GgufFile, MetaValue};
use strata_formats::limits::MAX_SPM_SPLIT_WORK;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use super::{TokenKind, TokenizerError, VocabType};

/// Llama-3 split regex (llama.cpp's `llama-bpe`), case-insensitive contractions spelled out.
const LLAMA3_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2 split regex: as Llama-3 but every digit is its own piece.
const QWEN2_REGEX: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// The classic GPT-2 split regex (without the final `\s+`, which only matters for pieces llama.cpp keeps anyway).
const GPT2_REGEX: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";

/// Pre-tokenizer families strata knows, with the `tokenizer.ggml.pre` names that select them.
const KNOWN_PRE: &[(&str, PreKind)] = &[
    ("default", PreKind::LlamaCppDefault),
    ("gpt-2", PreKind::Gpt2),
    ("gpt2", PreKind::Gpt2),
    ("llama-bpe", PreKind::Llama3),
    ("llama3", PreKind::Llama3),
    ("llama-v3", PreKind::Llama3),
    ("qwen2", PreKind::Qwen2),
    ("deepseek-r1-qwen", PreKind::Qwen2),
    ("smollm", PreKind::DigitsThenGpt2),
    ("starcoder", PreKind::DigitsThenGpt2),
    ("refact", PreKind::DigitsThenGpt2),
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreKind {
    /// llama.cpp's fallback for BPE files whose converter did not name a pre-tokenizer.
    LlamaCppDefault,
    Gpt2,
    Llama3,
    Qwen2,
    DigitsThenGpt2,
}

/// Everything `Tokenizer` needs that was read from a GGUF file.
pub(crate) struct GgufVocab {
    pub hf: tokenizers::Tokenizer,
    pub texts: Vec<String>,
    pub kinds: Vec<TokenKind>,
    pub vocab_type: VocabType,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub extra_eog: Vec<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
}

/// Reads the vocabulary and builds the matching encoder.
pub(crate) fn build(gguf: &GgufFile) -> Result<GgufVocab, TokenizerError> {
    let model = gguf
        .get_str("tokenizer.ggml.model")
        .ok_or(TokenizerError::MissingKey("tokenizer.ggml.model"))?;
    let texts =
        string_array(gguf, "tokenizer.ggml.tokens")?.ok_or(TokenizerError::MissingKey("tokenizer.ggml.tokens"))?;
    if texts.is_empty() || texts.len() > u32::MAX as usize {
        return Err(bad("tokenizer.ggml.tokens", format!("has {} entries", texts.len())));
    }
    let n = texts.len();
    let kinds = match gguf.get_array("tokenizer.ggml.token_type") {
        None => vec![TokenKind::Normal; n],
        Some(items) => {
            if items.len() != n {
                return Err(bad(
                    "tokenizer.ggml.token_type",
                    format!("has {} entries but there are {n} tokens", items.len()),
                ));
            }
            let mut kinds = Vec::with_capacity(n);
            for (i, v) in items.iter().enumerate() {
                let kind = v
                    .as_i64()
                    .and_then(TokenKind::from_gguf)
                    .ok_or_else(|| bad("tokenizer.ggml.token_type", format!("entry {i} is {v}, expected 0..=6")))?;
                kinds.push(kind);
            }
            kinds
        }
    };

    let token_id = |key: &'static str| -> Option<u32> {
        let id = gguf.get_u64(key)?;
        if id < n as u64 {
            Some(id as u32)
        } else {
            tracing::warn!("GGUF {key} = {id} is outside the vocabulary ({n} tokens); ignoring it");
            None
        }
    };
    let bos = token_id("tokenizer.ggml.bos_token_id");
    let eos = token_id("tokenizer.ggml.eos_token_id");
    let unk = token_id("tokenizer.ggml.unknown_token_id");
    let extra_eog: Vec<u32> = ["tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"]
        .into_iter()
        .filter_map(token_id)
        .collect();

    // The string -> id map. A text listed twice keeps its first id (later copies can only be decoded).
    let mut vocab: HashMap<String, u32> = HashMap::with_capacity(n);
    let mut duplicates = 0usize;
    for (id, text) in texts.iter().enumerate() {
        if vocab.contains_key(text) {
            duplicates += 1;
        } else {
            vocab.insert(text.clone(), id as u32);
        }
    }
    if duplicates > 0 {
        tracing::warn!(
            "GGUF vocabulary lists {duplicates} token texts more than once; the first id of each is used for encoding"
        );
    }

    let (vocab_type, mut hf, add_bos_default, add_space_prefix) = match model {
        "gpt2" => {
            let pre_name = gguf.get_str("tokenizer.ggml.pre").unwrap_or_else(|| {
                tracing::warn!("GGUF has no tokenizer.ggml.pre; using llama.cpp's `default` pre-tokenizer, which may tokenize differently from the original model");
                "default"
            });
            let pre = KNOWN_PRE
                .iter()
                .find(|(name, _)| *name == pre_name)
                .map(|(_, k)| *k)
                .ok_or_else(|| TokenizerError::UnknownPreTokenizer {
                    kind: pre_name.to_string(),
                    known: KNOWN_PRE.iter().map(|(name, _)| *name).collect::<Vec<_>>().join(", "),
                })?;
            let merges = gpt2_merges(gguf, &vocab)?;
            let bpe = BPE::builder()
                .vocab_and_merges(vocab.into_iter().collect::<Vocab>(), merges)
                .ignore_merges(pre == PreKind::Llama3)
                .build()
                .map_err(|e| TokenizerError::Backend(format!("building the BPE model: {e}")))?;
            let mut hf = tokenizers::Tokenizer::new(bpe);
            hf.with_pre_tokenizer(Some(pre_tokenizer(pre)?));
            (VocabType::ByteLevelBpe, hf, pre == PreKind::Llama3, false)
        }
        "llama" => {
            let scores = match gguf.get_array("tokenizer.ggml.scores") {
                Some(items) if items.len() == n => {
                    let mut scores = Vec::with_capacity(n);
                    for (i, v) in items.iter().enumerate() {
                        let s = v.as_f64().ok_or_else(|| {
                            bad("tokenizer.ggml.scores", format!("entry {i} is {v}, expected a number"))
                        })?;
                        scores.push(s as f32);
                    }
                    scores
                }
                Some(items) => {
                    return Err(bad(
                        "tokenizer.ggml.scores",
                        format!("has {} entries but there are {n} tokens", items.len()),
                    ))
                }
                None => {
                    tracing::warn!(
                        "SentencePiece GGUF has no tokenizer.ggml.scores; merging pieces in vocabulary order"
                    );
                    (0..n).map(|i| -(i as f32)).collect()
                }
            };
            let merges = spm_merges(&texts, &scores, &vocab)?;
            let mut builder = BPE::builder()
                .vocab_and_merges(vocab.into_iter().collect::<Vocab>(), merges)
                .byte_fallback(true)
                .fuse_unk(true);
            if let Some(unk) = unk {
                builder = builder.unk_token(texts[unk as usize].clone());
            }
            let bpe = builder
                .build()
                .map_err(|e| TokenizerError::Backend(format!("building the SentencePiece model: {e}")))?;
            let add_space_prefix = gguf.get_bool("tokenizer.ggml.add_space_prefix").unwrap_or(true);
            let mut hf = tokenizers::Tokenizer::new(bpe);
            let replace = Replace::new(" ", "\u{2581}")
                .map_err(|e| TokenizerError::Backend(format!("building the space normalizer: {e}")))?;
            if add_space_prefix {
                let seq = NormalizerSequence::new(vec![Prepend::new("\u{2581}".into()).into(), replace.into()]);
                hf.with_normalizer(Some(seq))
                    .map_err(|e| TokenizerError::Backend(e.to_string()))?;
            } else {
                hf.with_normalizer(Some(replace))
                    .map_err(|e| TokenizerError::Backend(e.to_string()))?;
            }
            (VocabType::SentencePiece, hf, true, add_space_prefix)
        }
        other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
    };
    // Control and unknown tokens are "special": matched in text only when parse_special is on.
    // User-defined tokens are always matched, as llama.cpp does.
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (id, (text, kind)) in texts.iter().zip(&kinds).enumerate() {
        if text.is_empty() || hf.token_to_id(text) != Some(id as u32) {
            continue;
        }
        match kind {
            TokenKind::Control | TokenKind::Unknown => {
                special.push(AddedToken::from(text.clone(), true).normalized(false))
            }
            TokenKind::UserDefined => user.push(AddedToken::from(text.clone(), false).normalized(false)),
            _ => {}
        }
    }
    hf.add_special_tokens(special)
        .map_err(|e| TokenizerError::Backend(format!("adding special tokens: {e}")))?;
    hf.add_tokens(user)
        .map_err(|e| TokenizerError::Backend(format!("adding user-defined tokens: {e}")))?;
    Ok(GgufVocab {
        hf,
        texts,
        kinds,
        vocab_type,
        bos,
        eos,
        extra_eog,
        add_bos: gguf.get_bool("tokenizer.ggml.add_bos_token").unwrap_or(add_bos_default),
        add_eos: gguf.get_bool("tokenizer.ggml.add_eos_token").unwrap_or(false),
        add_space_prefix,
    })
}

fn bad(key: &str, reason: String) -> TokenizerError {
    TokenizerError::BadMetadata {
        key: key.to_string(),
        reason,
    }
}

/// A string array under `key`, or `None` when the key is absent.
fn string_array(gguf: &GgufFile, key: &str) -> Result<Option<Vec<String>>, TokenizerError> {
    let Some(value) = gguf.get(key) else {
        return Ok(None);
    };
    let items = value
        .as_array()
        .ok_or_else(|| bad(key, format!("is {value}, expected an array of strings")))?;
    items
        .iter()
        .enumerate()
        .map(|(i, v)| match v {
            MetaValue::String(s) => Ok(s.clone()),
            other => Err(bad(key, format!("entry {i} is {other}, expected a string"))),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Some)
}

/// `tokenizer.ggml.merges` as pairs, skipping (with a warning) any the vocabulary cannot express.
fn gpt2_merges(gguf: &GgufFile, vocab: &HashMap<String, u32>) -> Result<Vec<(String, String)>, TokenizerError> {
    const KEY: &str = "tokenizer.ggml.merges";
    let value = gguf.get(KEY).ok_or(TokenizerError::MissingKey(KEY))?;
    let lines = value
        .as_array()
        .ok_or_else(|| bad(KEY, format!("is {value}, expected an array of strings")))?;
    let mut merges = Vec::with_capacity(lines.len());
    let mut merged = String::new();
    let mut skipped = 0usize;
    for (i, line) in lines.iter().enumerate() {
        let line = line
            .as_str()
            .ok_or_else(|| bad(KEY, format!("entry {i} is {line}, expected a string")))?;
        let Some((a, b)) = line.split_once(' ') else {
            return Err(bad(
                KEY,
                format!("entry {i} {line:?} is not two tokens separated by a space"),
            ));
        };
        if a.is_empty() || b.is_empty() {
            return Err(bad(KEY, format!("entry {i} {line:?} has an empty side")));
        }
        merged.clear();
        merged.push_str(a);
        merged.push_str(b);
        if vocab.contains_key(a) && vocab.contains_key(b) && vocab.contains_key(&merged) {
            merges.push((a.to_string(), b.to_string()));
        } else {
            skipped += 1;
        }
    }
    if skipped > 0 {
        tracing::warn!("skipped {skipped} BPE merges whose tokens are not in the vocabulary");
    }
    Ok(merges)
}

/// SentencePiece merges derived from the vocabulary: every way of writing a token as two tokens,
/// ranked by the merged token's score (best first). With these, BPE reproduces llama.cpp's
/// greedy highest-score-bigram-first SPM tokenizer.
///
/// Trying every split costs the square of a token's length, so a vocabulary whose squared lengths
/// add up past [`MAX_SPM_SPLIT_WORK`] (far beyond any real one) is refused rather than hung on.
fn spm_merges(
    texts: &[String],
    scores: &[f32],
    vocab: &HashMap<String, u32>,
) -> Result<Vec<(String, String)>, TokenizerError> {
    let work = texts
        .iter()
        .fold(0u64, |sum, t| sum.saturating_add((t.len() as u64).saturating_pow(2)));
    if work > MAX_SPM_SPLIT_WORK {
        return Err(bad(
            "tokenizer.ggml.tokens",
            format!(
                "the tokens are too long to derive SentencePiece merges from (their squared lengths add up \
                 to {work}, strata's limit is {MAX_SPM_SPLIT_WORK}); the file is corrupt"
            ),
        ));
    }
    let mut candidates: Vec<(f32, u32, usize)> = Vec::new();
    for (id, text) in texts.iter().enumerate() {
        if vocab.get(text) != Some(&(id as u32)) {
            continue;
        }
        for (split, _) in text.char_indices().skip(1) {
            let (left, right) = text.split_at(split);
            if vocab.contains_key(left) && vocab.contains_key(right) {
                candidates.push((scores[id], id as u32, split));
            }
        }
    }
    candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    Ok(candidates
        .into_iter()
        .map(|(_, id, split)| {
            let (left, right) = texts[id as usize].split_at(split);
            (left.to_string(), right.to_string())
        })
        .collect())
}

fn split(regex: &str) -> Result<PreTokenizerWrapper, TokenizerError> {
    Split::new(
        SplitPattern::Regex(regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map(Into::into)
    .map_err(|e| TokenizerError::Backend(format!("compiling pre-tokenizer regex: {e}")))
}

/// The pre-tokenizer pipeline of one family; every family ends in the byte-level mapping.
fn pre_tokenizer(kind: PreKind) -> Result<PreTokenizerWrapper, TokenizerError> {
    let bytes_only = ByteLevel::new(false, false, false).into();
    let seq = match kind {
        PreKind::Gpt2 => return Ok(ByteLevel::new(false, false, true).into()),
        PreKind::DigitsThenGpt2 => vec![Digits::new(true).into(), ByteLevel::new(false, false, true).into()],
        PreKind::Llama3 => vec![split(LLAMA3_REGEX)?, bytes_only],
        PreKind::Qwen2 => vec![split(QWEN2_REGEX)?, bytes_only],
        PreKind::LlamaCppDefault => vec![
            split(r"[\p{P}\$\+<=>\^~\|]+")?,
            split(GPT2_REGEX)?,
            split(r"\p{N}+")?,
            split(r"[0-9][0-9][0-9]")?,
            bytes_only,
        ],
    };
    Ok(PreSequence::new(seq).into())
}

/// Bytes 0..=255 that GPT-2's byte-level alphabet keeps as the same code point.
const fn byte_is_printable(b: u8) -> bool {
    matches!(b, 33..=126 | 161..=172 | 174..=255)
}

/// The bytes GPT-2 moves to code points 256.. (in order).
const SHIFTED_BYTES: [u8; 68] = {
    let mut table = [0u8; 68];
    let mut n = 0;
    let mut b = 0usize;
    while b < 256 {
        if !byte_is_printable(b as u8) {
            table[n] = b as u8;
            n += 1;
        }
        b += 1;
    }
    table
};

/// The raw bytes behind a byte-level BPE token (`Ġ` -> space), or `None` when some character is
/// not in the byte-level alphabet (then the token is plain text, e.g. an added token).
pub(crate) fn byte_level_decode(token: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(token.len());
    for c in token.chars() {
        let u = c as u32;
        if u < 256 && byte_is_printable(u as u8) {
            out.push(u as u8);
        } else if (256..256 + SHIFTED_BYTES.len() as u32).contains(&u) {
            out.push(SHIFTED_BYTES[(u - 256) as usize]);
        } else {
            return None;
        }
    }
    Some(out)
}

/// The byte of a SentencePiece byte-fallback token such as `<0x0A>`.
pub(crate) fn byte_token_value(token: &str) -> Option<u8> {
    let hex = token.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_alphabet_round_trips() {
        assert_eq!(byte_level_decode("\u{120}the"), Some(b" the".to_vec()));
        assert_eq!(byte_level_decode("\u{10a}"), Some(b"\n".to_vec()));
        assert_eq!(byte_level_decode("\u{2581}x"), None);
        assert_eq!(SHIFTED_BYTES[0], 0);
        assert_eq!(SHIFTED_BYTES[32], b' ');
        assert_eq!(SHIFTED_BYTES[67], 173);
    }

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(byte_token_value("<0x0A>"), Some(10));
        assert_eq!(byte_token_value("<0xFF>"), Some(255));
        assert_eq!(byte_token_value("<0x1>"), None);
        assert_eq!(byte_token_value("0x0A"), None);
    }
}
