//! Incremental detokenizer: turns a stream of generated token ids into text chunks that are
//! always whole UTF-8 characters and add up exactly to decoding all ids at once.
//!
//! It decodes a small window the way vLLM and TGI do: the text of `prefix + new tokens` minus the
//! text of `prefix`, so tokenizer rules that depend on neighbours (SentencePiece drops the space
//! of the first token of a text) come out right. A chunk is held back while the decoded window ends
//! in U+FFFD, which is how an incomplete multi-byte character (split over byte-level or
//! `<0xXX>` byte-fallback tokens) shows up; `finish` flushes whatever is left.
//!
//! Byte-level BPE vocabularies (Llama-3, Qwen2, GPT-2 style) decode normal tokens piece by piece,
//! so while only normal tokens come the decoder just collects their bytes and emits them once
//! they end on a whole character: the same chunks, without decoding the window twice a token.

use super::{TokenKind, Tokenizer};

/// Prompt tokens kept as left context for the first generated tokens.
const PROMPT_CONTEXT: usize = 6;

/// Streams text for one sequence's generated tokens.
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    tokenizer: Tokenizer,
    skip_special: bool,
    /// Token window; `ids[..prefix]` is never looked at again and is dropped when text is emitted.
    ids: Vec<u32>,
    /// Start of the context window: text of `ids[prefix..read]` has been emitted already.
    prefix: usize,
    /// Tokens before `read` have had their text emitted.
    read: usize,
    /// Fast path on: the emitted text ends on a whole character and `pending` holds the bytes of
    /// `ids[read..]` (all normal tokens).
    piece_by_piece: bool,
    pending: Vec<u8>,
}

impl IncrementalDecoder {
    /// A decoder for a sequence whose prompt ended with `prompt_tail` (any length; only the last
    /// few ids are kept, for context). Special tokens are skipped; see [`Self::with_skip_special`].
    pub fn new(tokenizer: &Tokenizer, prompt_tail: &[u32]) -> Self {
        let tail = &prompt_tail[prompt_tail.len().saturating_sub(PROMPT_CONTEXT)..];
        let ids: Vec<u32> = tail
            .iter()
            .copied()
            .filter(|&id| tokenizer.token_to_piece(id).is_some())
            .collect();
        let read = ids.len();
        // The prompt's text must end on a whole character for new bytes to start a fresh one.
        let tail_bytes: Vec<u8> = ids
            .iter()
            .flat_map(|&id| tokenizer.token_to_piece(id).unwrap_or_default().iter().copied())
            .collect();
        let piece_by_piece = tokenizer.decodes_piece_by_piece()
            && ids
                .iter()
                .all(|&id| tokenizer.token_kind(id) == Some(TokenKind::Normal))
            && std::str::from_utf8(&tail_bytes).is_ok();
        IncrementalDecoder {
            tokenizer: tokenizer.clone(),
            skip_special: true,
            ids,
            prefix: 0,
            read,
            piece_by_piece,
            pending: Vec::new(),
        }
    }

    /// Whether control tokens (e.g. `<|im_end|>`) are left out of the text (default `true`).
    pub fn with_skip_special(mut self, skip_special: bool) -> Self {
        self.skip_special = skip_special;
        self
    }

    /// Adds one generated token; returns the new text it completes, if any. Ids outside the
    /// vocabulary are ignored (with a warning).
    pub fn push(&mut self, id: u32) -> Option<String> {
        if self.tokenizer.token_to_piece(id).is_none() {
            tracing::warn!("incremental decoder: token id {id} is outside the vocabulary; ignored");
            return None;
        }
        self.ids.push(id);
        if self.piece_by_piece && self.tokenizer.token_kind(id) == Some(TokenKind::Normal) {
            self.pending
                .extend_from_slice(self.tokenizer.token_to_piece(id).unwrap_or_default());
            let text = String::from_utf8_lossy(&self.pending);
            if text.is_empty() || text.ends_with('\u{FFFD}') {
                return None;
            }
            let text = text.into_owned();
            self.pending.clear();
            self.emitted();
            return Some(text);
        }
        // Any other token: decode the window (and go back to the fast path once text ends on a
        // whole character again).
        self.piece_by_piece = false;
        self.pending.clear();
        let (before, after) = self.window_texts();
        if after.len() <= before.len() || after.ends_with('\u{FFFD}') {
            return None;
        }
        let text = self.advance(&before, &after);
        self.piece_by_piece = self.tokenizer.decodes_piece_by_piece();
        Some(text)
    }

    /// Turns the fast path off (tests compare both paths).
    #[doc(hidden)]
    pub fn without_piece_by_piece(mut self) -> Self {
        self.piece_by_piece = false;
        self
    }

    /// Flushes text held back at the end of the stream; incomplete characters become U+FFFD.
    pub fn finish(&mut self) -> Option<String> {
        if self.read >= self.ids.len() {
            return None;
        }
        self.pending.clear();
        let (before, after) = self.window_texts();
        let text = self.advance(&before, &after);
        (!text.is_empty()).then_some(text)
    }

    /// Text of the already-emitted context window, and of the window plus the pending tokens.
    fn window_texts(&self) -> (String, String) {
        let decode = |ids: &[u32]| {
            self.tokenizer.decode(ids, self.skip_special).unwrap_or_else(|e| {
                tracing::warn!("incremental decoder: {e}");
                String::new()
            })
        };
        (
            decode(&self.ids[self.prefix..self.read]),
            decode(&self.ids[self.prefix..]),
        )
    }

    /// Emits `after` minus `before` and moves the window forward.
    fn advance(&mut self, before: &str, after: &str) -> String {
        let start = if after.starts_with(before) {
            before.len()
        } else {
            common_prefix_len(before, after)
        };
        let text = after[start..].to_string();
        self.emitted();
        text
    }

    /// All pushed tokens' text is out: they become the context window.
    fn emitted(&mut self) {
        self.prefix = self.read;
        self.read = self.ids.len();
        self.ids.drain(..self.prefix);
        self.read -= self.prefix;
        self.prefix = 0;
    }
}

/// Byte length of the longest common prefix of `a` and `b` that ends on a character boundary.
fn common_prefix_len(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, ca), cb)| ca != cb)
        .map(|((i, _), _)| i)
        .unwrap_or_else(|| a.len().min(b.len()))
}

#[cfg(test)]
mod tests {
    use super::common_prefix_len;

    #[test]
    fn common_prefix_stops_at_char_boundary() {
        assert_eq!(common_prefix_len("abc", "abd"), 2);
        assert_eq!(common_prefix_len("a\u{e9}", "a\u{e8}"), 1);
        assert_eq!(common_prefix_len("ab", "abc"), 2);
        assert_eq!(common_prefix_len("", "x"), 0);
    }
}
