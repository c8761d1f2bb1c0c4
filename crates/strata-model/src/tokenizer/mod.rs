//! The `Tokenizer`: text to token ids and back for every model strata serves, built from GGUF
//! metadata (llama.cpp-compatible) or an HF `tokenizer.json`; owns BOS/EOS and the end-of-generation set.

mod detokenize;
mod gguf_vocab;

pub use detokenize::IncrementalDecoder;

use std::collections::BTreeSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use strata_formats::gguf::GgufFile;
use strata_formats::limits::{
    read_text_limited, MAX_JSON_FILE_BYTES, MAX_TOKENIZER_FILE_BYTES, MAX_TOKEN_ID_GAP, MAX_VOCAB,
};
use tokenizers::DecoderWrapper;

/// Texts of control tokens that end a generation even when the metadata does not say so
/// (the same rule llama.cpp applies).
pub const EOG_TOKEN_TEXTS: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<end_of_turn>",
    "</s>",
    "<|end|>",
    "<EOT>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
];

/// Errors from building or using a tokenizer.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("GGUF tokenizer metadata is missing the key `{0}`")]
    MissingKey(&'static str),
    #[error("GGUF tokenizer metadata key `{key}` is malformed: {reason}")]
    BadMetadata { key: String, reason: String },
    #[error("unsupported tokenizer model `{0}` (tokenizer.ggml.model); strata supports `gpt2` (byte-level BPE) and `llama` (SentencePiece)")]
    UnsupportedModel(String),
    #[error("unknown pre-tokenizer `{kind}` (tokenizer.ggml.pre); strata knows: {known}")]
    UnknownPreTokenizer { kind: String, known: String },
    #[error("cannot read {path}: {error}")]
    Io { path: PathBuf, error: std::io::Error },
    #[error("cannot load {path}: {message}")]
    BadFile { path: PathBuf, message: String },
    #[error("token id {id} is outside the vocabulary ({vocab_size} tokens)")]
    IdOutOfRange { id: u32, vocab_size: usize },
    #[error("tokenizer: {0}")]
    Backend(String),
}

/// Special token ids given by number (HF `config.json` / `generation_config.json`), not by text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    /// End-of-sequence ids; all of them end a generation, the first is the EOS.
    pub eos: Vec<u32>,
}

/// What kind of vocabulary entry a token is (GGUF `tokenizer.ggml.token_type` numbering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenKind {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenKind {
    /// The kind for a GGUF token type number (0, "undefined", counts as normal).
    pub fn from_gguf(v: i64) -> Option<Self> {
        Some(match v {
            0 | 1 => TokenKind::Normal,
            2 => TokenKind::Unknown,
            3 => TokenKind::Control,
            4 => TokenKind::UserDefined,
            5 => TokenKind::Unused,
            6 => TokenKind::Byte,
            _ => return None,
        })
    }

    /// Whether `decode(.., skip_special = true)` leaves this token out.
    pub fn is_special(self) -> bool {
        matches!(self, TokenKind::Control | TokenKind::Unknown | TokenKind::Unused)
    }
}

/// How the vocabulary spells text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VocabType {
    /// GPT-2 style byte-level BPE (`tokenizer.ggml.model = gpt2`).
    ByteLevelBpe,
    /// SentencePiece with `▁` for spaces and `<0xXX>` byte fallback (`tokenizer.ggml.model = llama`).
    SentencePiece,
    /// Whatever an HF `tokenizer.json` describes; decoding goes through its decoder.
    HfJson,
}

/// How `decode` turns ids into text.
enum DecodeMode {
    /// Concatenate per-token bytes; optionally drop one leading space (SentencePiece's prefix space).
    Table { strip_leading_space: bool },
    /// Run the `tokenizer.json` decoder.
    Hf,
}

struct Inner {
    /// Encoder that turns special-token text into the special token.
    with_special: tokenizers::Tokenizer,
    /// Encoder that treats special-token text as plain text.
    plain: tokenizers::Tokenizer,
    texts: Vec<String>,
    kinds: Vec<TokenKind>,
    piece_data: Vec<u8>,
    piece_offsets: Vec<usize>,
    vocab_type: VocabType,
    decode_mode: DecodeMode,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    /// Whether `encode` adds BOS/EOS itself (GGUF) or the `tokenizer.json` post-processor does (HF).
    manual_special: bool,
    /// Whether the text of normal tokens is the (lossy) UTF-8 of their pieces put end to end,
    /// whatever their neighbours (byte-level BPE): the incremental decoder's fast path.
    piece_by_piece: bool,
}

/// A model's tokenizer. Cheap to clone (shared inside).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_type", &self.inner.vocab_type)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.inner.bos)
            .field("eos", &self.inner.eos)
            .field("eog", &self.inner.eog)
            .finish()
    }
}

impl Tokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(gguf: &GgufFile) -> Result<Self, TokenizerError> {
        let v = gguf_vocab::build(gguf)?;
        let pieces: Vec<Vec<u8>> = v
            .texts
            .iter()
            .zip(&v.kinds)
            .map(|(text, &kind)| piece_bytes(text, kind, v.vocab_type))
            .collect();
        let eog = eog_set(&v.texts, &v.kinds, v.eos, &v.extra_eog);
        let strip = v.vocab_type == VocabType::SentencePiece && v.add_space_prefix;
        Ok(Self::assemble(Parts {
            hf: v.hf,
            texts: v.texts,
            kinds: v.kinds,
            pieces,
            vocab_type: v.vocab_type,
            decode_mode: DecodeMode::Table {
                strip_leading_space: strip,
            },
            bos: v.bos,
            eos: v.eos,
            eog,
            add_bos: v.add_bos,
            add_eos: v.add_eos,
            manual_special: true,
        }))
    }

    /// Loads an HF `tokenizer.json`, plus the `tokenizer_config.json` beside it when given
    /// (for the BOS/EOS token strings and `add_bos_token`/`add_eos_token`).
    pub fn from_hf_file(
        tokenizer_json: impl AsRef<Path>,
        tokenizer_config_json: Option<&Path>,
    ) -> Result<Self, TokenizerError> {
        Self::from_hf_files(tokenizer_json, tokenizer_config_json, &SpecialIds::default())
    }

    /// Like [`Self::from_hf_file`], with the ids a checkpoint's `config.json` and
    /// `generation_config.json` give: BOS and EOS when `tokenizer_config.json` names none, and
    /// every listed EOS id ends a generation.
    pub fn from_hf_files(
        tokenizer_json: impl AsRef<Path>,
        tokenizer_config_json: Option<&Path>,
        ids: &SpecialIds,
    ) -> Result<Self, TokenizerError> {
        let path = tokenizer_json.as_ref();
        let json = read_text(path, MAX_TOKENIZER_FILE_BYTES)?;
        let config = match tokenizer_config_json {
            Some(p) => Some(read_json(p)?),
            None => None,
        };
        Self::from_hf_json(&json, config.as_ref(), ids).map_err(|message| TokenizerError::BadFile {
            path: path.to_path_buf(),
            message,
        })
    }

    /// Like [`Self::from_hf_files`] for the text of a `tokenizer.json` and the parsed
    /// `tokenizer_config.json`; errors are the reason only (the caller names the file).
    pub fn from_hf_json(
        tokenizer_json: &str,
        config: Option<&serde_json::Value>,
        ids: &SpecialIds,
    ) -> Result<Self, String> {
        let hf = parse_hf_tokenizer(tokenizer_json)?;
        let token_string = |key: &str| config.and_then(|c| c.get(key)).and_then(config_token_text);
        let config_bool = |key: &str| config.and_then(|c| c.get(key)).and_then(|v| v.as_bool());

        let vocab = hf.get_vocab(true);
        let n = vocab.values().map(|&id| id as usize + 1).max().unwrap_or(0);
        // Tables below are indexed by id, so the largest id sizes them: it must be near the count.
        if n > vocab.len() + MAX_TOKEN_ID_GAP || n > MAX_VOCAB {
            return Err(format!(
                "token id {} is far past the {} tokens the file lists (strata allows ids up to {} and \
                 at most {MAX_VOCAB} tokens); the file is corrupt",
                n - 1,
                vocab.len(),
                vocab.len() + MAX_TOKEN_ID_GAP - 1
            ));
        }
        drop(vocab);
        let added = hf.get_added_tokens_decoder();
        let style = hf.get_decoder().map(piece_style).unwrap_or(PieceStyle::Other);
        let mut texts = Vec::with_capacity(n);
        let mut kinds = Vec::with_capacity(n);
        for id in 0..n as u32 {
            let text = hf.id_to_token(id).unwrap_or_default();
            let kind = match added.get(&id) {
                Some(t) if t.special => TokenKind::Control,
                Some(_) => TokenKind::UserDefined,
                None if style == PieceStyle::Spm && gguf_vocab::byte_token_value(&text).is_some() => TokenKind::Byte,
                None => TokenKind::Normal,
            };
            texts.push(text);
            kinds.push(kind);
        }
        let pieces = texts
            .iter()
            .zip(&kinds)
            .enumerate()
            .map(|(id, (text, &kind))| match style {
                PieceStyle::ByteLevel => piece_bytes(text, kind, VocabType::ByteLevelBpe),
                PieceStyle::Spm => piece_bytes(text, kind, VocabType::SentencePiece),
                PieceStyle::Other => hf
                    .decode(&[id as u32], false)
                    .map(String::into_bytes)
                    .unwrap_or_default(),
            })
            .collect();

        let in_vocab = |id: &u32| (*id as usize) < n;
        let bos = token_string("bos_token")
            .and_then(|t| hf.token_to_id(&t))
            .or(ids.bos.filter(in_vocab));
        let eos = token_string("eos_token")
            .and_then(|t| hf.token_to_id(&t))
            .or(ids.eos.iter().copied().find(in_vocab));
        let extra: Vec<u32> = ids.eos.iter().copied().filter(in_vocab).collect();
        let eog = eog_set(&texts, &kinds, eos, &extra);
        Ok(Self::assemble(Parts {
            hf,
            texts,
            kinds,
            pieces,
            vocab_type: VocabType::HfJson,
            decode_mode: DecodeMode::Hf,
            bos,
            eos,
            eog,
            add_bos: config_bool("add_bos_token").unwrap_or(false),
            add_eos: config_bool("add_eos_token").unwrap_or(false),
            manual_special: false,
        }))
    }

    fn assemble(p: Parts) -> Self {
        let piece_by_piece = match p.decode_mode {
            DecodeMode::Table { strip_leading_space } => !strip_leading_space,
            DecodeMode::Hf => matches!(p.hf.get_decoder(), Some(DecoderWrapper::ByteLevel(_))),
        };
        let mut plain = p.hf.clone();
        plain.set_encode_special_tokens(true);
        let mut piece_data = Vec::with_capacity(p.pieces.iter().map(Vec::len).sum());
        let mut piece_offsets = Vec::with_capacity(p.pieces.len() + 1);
        piece_offsets.push(0);
        for piece in &p.pieces {
            piece_data.extend_from_slice(piece);
            piece_offsets.push(piece_data.len());
        }
        Tokenizer {
            inner: Arc::new(Inner {
                with_special: p.hf,
                plain,
                texts: p.texts,
                kinds: p.kinds,
                piece_data,
                piece_offsets,
                vocab_type: p.vocab_type,
                decode_mode: p.decode_mode,
                bos: p.bos,
                eos: p.eos,
                eog: p.eog,
                add_bos: p.add_bos,
                add_eos: p.add_eos,
                manual_special: p.manual_special,
                piece_by_piece,
            }),
        }
    }

    /// Token ids for `text`. `add_special`: add BOS/EOS as the model's metadata says.
    /// `parse_special`: text such as `<|im_start|>` becomes that control token; otherwise it is
    /// tokenized as plain text. User-defined tokens are always recognised.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let inner = &*self.inner;
        let hf = if parse_special {
            &inner.with_special
        } else {
            &inner.plain
        };
        let hf_adds = add_special && !inner.manual_special;
        let encoding =
            guarded(|| hf.encode_fast(text, hf_adds)).map_err(|e| TokenizerError::Backend(format!("encoding: {e}")))?;
        let ids = encoding.get_ids();
        if !(add_special && inner.manual_special) {
            return Ok(ids.to_vec());
        }
        let mut out = Vec::with_capacity(ids.len() + 2);
        if let (true, Some(bos)) = (inner.add_bos, inner.bos) {
            out.push(bos);
        }
        out.extend_from_slice(ids);
        if let (true, Some(eos)) = (inner.add_eos, inner.eos) {
            out.push(eos);
        }
        Ok(out)
    }

    /// Text for `ids`. `skip_special` leaves out control, unknown and unused tokens.
    /// Bytes that are not valid UTF-8 become U+FFFD.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let inner = &*self.inner;
        match inner.decode_mode {
            DecodeMode::Table { strip_leading_space } => {
                let mut out = Vec::new();
                for &id in ids {
                    let i = self.check(id)?;
                    if skip_special && inner.kinds[i].is_special() {
                        continue;
                    }
                    out.extend_from_slice(self.piece(i));
                }
                let bytes = if strip_leading_space && out.first() == Some(&b' ') {
                    &out[1..]
                } else {
                    &out[..]
                };
                Ok(String::from_utf8_lossy(bytes).into_owned())
            }
            DecodeMode::Hf => {
                for &id in ids {
                    self.check(id)?;
                }
                guarded(|| inner.with_special.decode(ids, skip_special))
                    .map_err(|e| TokenizerError::Backend(format!("decoding: {e}")))
            }
        }
    }

    /// Whether decoding normal tokens only puts their pieces ([`Self::token_to_piece`]) end to end
    /// (byte-level BPE), so a stream of them can be decoded piece by piece.
    pub fn decodes_piece_by_piece(&self) -> bool {
        self.inner.piece_by_piece
    }

    /// The raw bytes one token stands for (possibly part of a UTF-8 character); special tokens
    /// give their text. `None` when `id` is outside the vocabulary.
    pub fn token_to_piece(&self, id: u32) -> Option<&[u8]> {
        self.check(id).ok().map(|i| self.piece(i))
    }

    /// The token's spelling in the vocabulary (`Ġthe`, `▁the`, `<0x0A>`, `<|im_end|>`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.inner.texts.get(id as usize).map(String::as_str)
    }

    /// The id whose vocabulary spelling is `text`.
    pub fn token_to_id(&self, text: &str) -> Option<u32> {
        self.inner.with_special.token_to_id(text)
    }

    /// What kind of entry `id` is.
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.inner.kinds.get(id as usize).copied()
    }

    /// Whether `decode(.., skip_special = true)` hides `id`.
    pub fn is_special(&self, id: u32) -> bool {
        self.token_kind(id).is_some_and(TokenKind::is_special)
    }

    /// Bytes of the longest token's piece (at least 1): a text of B bytes encodes to at least
    /// B / this many tokens, which bounds a prompt's length before tokenizing it.
    pub fn max_token_bytes(&self) -> usize {
        self.inner
            .piece_offsets
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or(0)
            .max(1)
    }

    /// Number of token ids (one more than the largest id).
    pub fn vocab_size(&self) -> usize {
        self.inner.texts.len()
    }

    /// How the vocabulary spells text.
    pub fn vocab_type(&self) -> VocabType {
        self.inner.vocab_type
    }

    /// Beginning-of-sequence token, if the model has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.inner.bos
    }

    /// End-of-sequence token, if the model has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.inner.eos
    }

    /// Whether `encode(.., add_special = true, ..)` starts with BOS (for GGUF, `tokenizer.ggml.add_bos_token`).
    pub fn add_bos(&self) -> bool {
        self.inner.add_bos && self.inner.bos.is_some()
    }

    /// Whether `encode(.., add_special = true, ..)` ends with EOS.
    pub fn add_eos(&self) -> bool {
        self.inner.add_eos && self.inner.eos.is_some()
    }

    /// Every token that ends a generation, sorted: EOS, EOT/EOM from the metadata, and control
    /// tokens spelled like one of [`EOG_TOKEN_TEXTS`].
    pub fn eog_ids(&self) -> &[u32] {
        &self.inner.eog
    }

    /// Whether `id` ends a generation.
    pub fn is_eog(&self, id: u32) -> bool {
        self.inner.eog.binary_search(&id).is_ok()
    }

    fn check(&self, id: u32) -> Result<usize, TokenizerError> {
        let i = id as usize;
        if i < self.inner.texts.len() {
            Ok(i)
        } else {
            Err(TokenizerError::IdOutOfRange {
                id,
                vocab_size: self.inner.texts.len(),
            })
        }
    }

    fn piece(&self, i: usize) -> &[u8] {
        let o = &self.inner.piece_offsets;
        &self.inner.piece_data[o[i]..o[i + 1]]
    }
}

struct Parts {
    hf: tokenizers::Tokenizer,
    texts: Vec<String>,
    kinds: Vec<TokenKind>,
    pieces: Vec<Vec<u8>>,
    vocab_type: VocabType,
    decode_mode: DecodeMode,
    bos: Option<u32>,
    eos: Option<u32>,
    eog: Vec<u32>,
    add_bos: bool,
    add_eos: bool,
    manual_special: bool,
}

/// The bytes one token decodes to, following llama.cpp's `token_to_piece`: normal tokens are
/// un-mapped from the vocabulary's spelling, every other kind is its text as written.
fn piece_bytes(text: &str, kind: TokenKind, vocab_type: VocabType) -> Vec<u8> {
    match (vocab_type, kind) {
        (VocabType::ByteLevelBpe, TokenKind::Normal) => {
            gguf_vocab::byte_level_decode(text).unwrap_or_else(|| text.as_bytes().to_vec())
        }
        (VocabType::SentencePiece, TokenKind::Normal) => text.replace('\u{2581}', " ").into_bytes(),
        (VocabType::SentencePiece, TokenKind::Byte) => match gguf_vocab::byte_token_value(text) {
            Some(b) => vec![b],
            None => text.as_bytes().to_vec(),
        },
        _ => text.as_bytes().to_vec(),
    }
}

fn eog_set(texts: &[String], kinds: &[TokenKind], eos: Option<u32>, extra: &[u32]) -> Vec<u32> {
    let mut set: BTreeSet<u32> = eos.into_iter().chain(extra.iter().copied()).collect();
    for (id, (text, kind)) in texts.iter().zip(kinds).enumerate() {
        if matches!(kind, TokenKind::Control | TokenKind::UserDefined) && EOG_TOKEN_TEXTS.contains(&text.as_str()) {
            set.insert(id as u32);
        }
    }
    set.into_iter().collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PieceStyle {
    ByteLevel,
    Spm,
    Other,
}

/// Guesses how single tokens spell bytes from a `tokenizer.json` decoder.
fn piece_style(decoder: &DecoderWrapper) -> PieceStyle {
    match decoder {
        DecoderWrapper::ByteLevel(_) => PieceStyle::ByteLevel,
        DecoderWrapper::Metaspace(_) | DecoderWrapper::ByteFallback(_) | DecoderWrapper::Replace(_) => PieceStyle::Spm,
        DecoderWrapper::Sequence(seq) => {
            let styles: Vec<PieceStyle> = seq.get_decoders().iter().map(piece_style).collect();
            if styles.contains(&PieceStyle::ByteLevel) {
                PieceStyle::ByteLevel
            } else if styles.contains(&PieceStyle::Spm) {
                PieceStyle::Spm
            } else {
                PieceStyle::Other
            }
        }
        _ => PieceStyle::Other,
    }
}

/// The `tokenizers` pipeline a `tokenizer.json` describes. The text is parsed as JSON first:
/// `tokenizers` panics (`expect("Helper")`) when a syntax error falls inside a decoder or
/// normalizer, which it cannot meet in an already parsed value. Any other panic of the library
/// on a hostile file also becomes an error rather than the end of the process.
fn parse_hf_tokenizer(text: &str) -> Result<tokenizers::Tokenizer, String> {
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("invalid JSON: {e}"))?;
    let mut hf = guarded(move || serde_json::from_value::<tokenizers::Tokenizer>(value))?;
    // strata counts and limits tokens itself; a file's padding or truncation would change
    // every encoding (and a padding length from the file would size every one).
    hf.with_padding(None);
    hf.with_truncation(None).map_err(|e| format!("{e}"))?;
    // A post-processor naming a special token it does not define panics on every encoding
    // (tokenizers indexes its map); one encoding now refuses such a file at load.
    guarded(|| hf.encode_fast("a", true)).map_err(|e| format!("it cannot encode text: {e}"))?;
    Ok(hf)
}

/// Runs a call into the `tokenizers` library, which panics instead of erroring on some malformed
/// files; the panic (already reported by the panic hook) becomes an error, not a dead thread.
fn guarded<T, E: fmt::Display>(call: impl FnOnce() -> Result<T, E>) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(call)) {
        Ok(result) => result.map_err(|e| e.to_string()),
        Err(_) => Err("the tokenizers library panicked on it; the tokenizer file is malformed".into()),
    }
}

/// The text of `path`, refused unread when longer than `limit` bytes.
fn read_text(path: &Path, limit: u64) -> Result<String, TokenizerError> {
    read_text_limited(path, limit).map_err(|error| TokenizerError::Io {
        path: path.to_path_buf(),
        error,
    })
}

fn read_json(path: &Path) -> Result<serde_json::Value, TokenizerError> {
    let text = read_text(path, MAX_JSON_FILE_BYTES)?;
    serde_json::from_str(&text).map_err(|e| TokenizerError::BadFile {
        path: path.to_path_buf(),
        message: format!("invalid JSON: {e}"),
    })
}

/// A token in `tokenizer_config.json`: a string or an added-token object with `content`.
pub(crate) fn config_token_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content").and_then(|c| c.as_str()).map(str::to_string),
        _ => None,
    }
}
