//! Constrained decoding: the grammar a request's output must match (any JSON object, a JSON schema,
//! or a Lark grammar), compiled by llguidance against the model's vocabulary into per-step token masks.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use strata_model::tokenizer::Tokenizer;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputConstraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON schema (`response_format: {"type": "json_schema", ...}`).
    JsonSchema(serde_json::Value),
    /// A grammar in llguidance's Lark dialect, which may embed JSON schemas as `%json { ... }`
    /// (tool calls forced by `tool_choice`).
    Lark(String),
}

impl OutputConstraint {
    fn grammar(&self) -> TopLevelGrammar {
        match self {
            OutputConstraint::JsonObject => TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"})),
            OutputConstraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            OutputConstraint::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        }
    }
}

/// The model's vocabulary as llguidance sees it: each token's bytes (special tokens marked with
/// 0xFF so grammars can name them), and our tokenizer for the text a grammar forces.
struct VocabEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for VocabEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.tokenizer
            .encode(&String::from_utf8_lossy(s), false, false)
            .unwrap_or_default()
    }
}

/// Compiles requests' constraints against one model's vocabulary; built once per engine.
#[derive(Clone)]
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrammarCompiler")
    }
}

impl GrammarCompiler {
    /// The compiler for `tokenizer`'s vocabulary; `None` for a vocabulary without an
    /// end-of-sequence token (a constrained output could never end).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<GrammarCompiler, String> {
        let eos = tokenizer
            .eos_id()
            .or_else(|| tokenizer.eog_ids().first().copied())
            .ok_or("the model's vocabulary has no end-of-sequence token")?;
        let words: Vec<Vec<u8>> = (0..tokenizer.vocab_size() as u32)
            .map(|id| {
                let piece = tokenizer.token_to_piece(id).unwrap_or_default();
                if tokenizer.is_special(id) {
                    let mut marked = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    marked.extend_from_slice(piece);
                    marked
                } else {
                    piece.to_vec()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(words.len() as u32, eos);
        info.tok_bos = tokenizer.bos_id();
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(VocabEnv { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory: Arc::new(factory),
        })
    }

    /// A fresh matcher for `constraint`, or why the grammar or schema is unusable.
    pub fn matcher(&self, constraint: &OutputConstraint) -> Result<Matcher, String> {
        let parser = self
            .factory
            .create_parser(constraint.grammar())
            .map_err(|e| e.to_string())?;
        Ok(Matcher::new(Ok(parser)))
    }
}
