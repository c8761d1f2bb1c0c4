//! Turning what a client sends into prompt token ids: chat messages through the model's chat
//! template, plain text with BOS as the model asks, texts too long to fit refused before
//! tokenizing. `strata run` / `strata tokenize` use these too.

use strata_engine::SubmitError;
use strata_model::chat_template::{ChatMessage, ChatTemplate, TemplateError};
use strata_model::tokenizer::{Tokenizer, TokenizerError};

use crate::error::ApiError;
use crate::protocol::{ChatMessageIn, MessageContent};
use crate::response_format::GrammarCheck;

/// Why a prompt could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("applying the chat template: {0}")]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(
        "this model's maximum context length is {} tokens, but the prompt is {bytes} bytes of text: \
         more than the {} bytes that many tokens can hold (no token is longer than {} bytes)",
        limit.max_model_len, limit.max_text_bytes(), limit.max_token_bytes
    )]
    TooLong { bytes: usize, limit: PromptLimit },
}

/// The longest prompt text worth tokenizing: no token stands for more than `max_token_bytes`
/// bytes, so a longer text than `max_model_len * max_token_bytes` bytes cannot fit, and is
/// refused before the tokenizer spends time and memory on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLimit {
    pub max_model_len: usize,
    pub max_token_bytes: usize,
}

impl PromptLimit {
    /// No limit (local tools such as `strata tokenize`).
    pub const NONE: PromptLimit = PromptLimit {
        max_model_len: usize::MAX,
        max_token_bytes: 1,
    };

    pub fn new(tokenizer: &Tokenizer, max_model_len: usize) -> Self {
        PromptLimit {
            max_model_len,
            max_token_bytes: tokenizer.max_token_bytes(),
        }
    }

    /// Texts longer than this many bytes have more than `max_model_len` tokens.
    pub fn max_text_bytes(&self) -> usize {
        self.max_model_len.saturating_mul(self.max_token_bytes)
    }

    /// Refuses a text that cannot fit, without tokenizing it.
    pub fn check_text(&self, text: &str) -> Result<(), PromptError> {
        if text.len() > self.max_text_bytes() {
            return Err(PromptError::TooLong {
                bytes: text.len(),
                limit: *self,
            });
        }
        Ok(())
    }

    /// Refuses a prompt of `tokens` ids that leaves no room to generate (the engine's own rule,
    /// applied before a request's other prompts are built).
    pub fn check_ids(&self, tokens: usize, field: &str) -> Result<(), ApiError> {
        if tokens >= self.max_model_len {
            return Err(self.too_long(tokens, field));
        }
        Ok(())
    }

    /// The 400 (`context_length_exceeded`) for a prompt of `tokens` ids, named by `field`.
    pub fn too_long(&self, tokens: usize, field: &str) -> ApiError {
        let refusal = SubmitError::PromptTooLong {
            prompt: tokens,
            max_model_len: self.max_model_len,
        };
        ApiError::from_submit(refusal, field)
    }

    /// Ids of a conversation rendered by the chat template (special tokens in the rendered text
    /// are parsed as such; the template adds BOS itself when the model wants one).
    pub fn chat_ids(
        &self,
        tokenizer: &Tokenizer,
        template: &ChatTemplate,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, PromptError> {
        self.chat_ids_with(
            tokenizer,
            template,
            messages,
            add_generation_prompt,
            &serde_json::Map::new(),
        )
    }

    /// [`Self::chat_ids`] for any serializable messages (e.g. with `tool_calls`), with `extra`
    /// template variables such as `tools`.
    pub fn chat_ids_with<M: serde::Serialize + ?Sized>(
        &self,
        tokenizer: &Tokenizer,
        template: &ChatTemplate,
        messages: &M,
        add_generation_prompt: bool,
        extra: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<Vec<u32>, PromptError> {
        let rendered = template.render_with(messages, add_generation_prompt, extra)?;
        self.check_text(&rendered)?;
        Ok(tokenizer.encode(&rendered, false, true)?)
    }

    /// Ids of a plain text prompt, special-token text kept as text; `add_special`: BOS/EOS as the
    /// model's metadata says.
    pub fn text_ids(&self, tokenizer: &Tokenizer, text: &str, add_special: bool) -> Result<Vec<u32>, PromptError> {
        self.check_text(text)?;
        Ok(tokenizer.encode(text, add_special, false)?)
    }
}

/// What turning a request into prompt ids needs from the served model and the server's limits.
#[derive(Clone, Copy)]
pub struct PromptContext<'a> {
    pub tokenizer: &'a Tokenizer,
    pub template: &'a ChatTemplate,
    pub limit: PromptLimit,
    /// Most generations (prompts x n) one request may queue (--max-queue).
    pub max_queue: usize,
    /// Checks `response_format` schemas against the vocabulary.
    pub grammar: &'a GrammarCheck,
}

/// [`PromptLimit::chat_ids`] without a length limit.
pub fn chat_prompt_ids(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> Result<Vec<u32>, PromptError> {
    PromptLimit::NONE.chat_ids(tokenizer, template, messages, add_generation_prompt)
}

/// Ids of a plain text prompt with BOS as the model asks ([`PromptLimit::text_ids`] without a
/// length limit).
pub fn text_prompt_ids(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, PromptError> {
    PromptLimit::NONE.text_ids(tokenizer, text, true)
}

/// Checks a request's messages and turns them into template messages. `field` is the name of the
/// list in the request (for error params).
pub fn chat_messages(messages: &[ChatMessageIn], field: &str) -> Result<Vec<ChatMessage>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_field(
            field,
            format!("`{field}` must contain at least one message"),
        ));
    }
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = match m.role.as_str() {
                "system" | "developer" => "system",
                "user" => "user",
                "assistant" => "assistant",
                "tool" => "tool",
                other => {
                    return Err(ApiError::invalid_field(
                        format!("{field}[{i}].role"),
                        format!(
                        "`{field}[{i}].role` is `{other}`; supported roles are system, developer, user, assistant and tool"
                    ),
                    ))
                }
            };
            let content = match &m.content {
                Some(MessageContent::Text(t)) => t.clone(),
                Some(MessageContent::Parts(parts)) => {
                    let mut text = String::new();
                    for (j, part) in parts.iter().enumerate() {
                        let param = format!("{field}[{i}].content[{j}]");
                        if part.kind != "text" {
                            return Err(ApiError::invalid_field(
                                format!("{param}.type"),
                                format!("`{param}.type` is `{}`; only `text` parts are supported", part.kind),
                            ));
                        }
                        match &part.text {
                            Some(t) => text.push_str(t),
                            None => {
                                return Err(ApiError::invalid_field(
                                    format!("{param}.text"),
                                    format!("`{param}.text` is required for a text part"),
                                ))
                            }
                        }
                    }
                    text
                }
                None if role == "assistant" => String::new(),
                None => {
                    return Err(ApiError::invalid_field(
                        format!("{field}[{i}].content"),
                        format!("`{field}[{i}].content` is required for a {role} message"),
                    ))
                }
            };
            Ok(ChatMessage::new(role, content))
        })
        .collect()
}

/// A template that refuses a conversation (e.g. roles that do not alternate) is the client's
/// error; a tokenizer failure is ours.
pub fn prompt_error(err: PromptError, field: &str) -> ApiError {
    match err {
        PromptError::Template(e) => ApiError::invalid_field(field, e.to_string()),
        PromptError::Tokenizer(e) => ApiError::invalid_field(field, format!("could not tokenize the prompt: {e}")),
        e @ PromptError::TooLong { .. } => ApiError::context_length_exceeded(field, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::ContentPart;

    fn msg(role: &str, content: Option<MessageContent>) -> ChatMessageIn {
        ChatMessageIn {
            role: role.into(),
            content,
            ..Default::default()
        }
    }

    #[test]
    fn parts_are_joined_and_roles_mapped() {
        let parts = MessageContent::Parts(vec![
            ContentPart {
                kind: "text".into(),
                text: Some("a".into()),
            },
            ContentPart {
                kind: "text".into(),
                text: Some("b".into()),
            },
        ]);
        let out = chat_messages(
            &[
                msg("developer", Some(MessageContent::Text("s".into()))),
                msg("user", Some(parts)),
                msg("assistant", None),
            ],
            "messages",
        )
        .unwrap();
        assert_eq!(
            out,
            vec![
                ChatMessage::system("s"),
                ChatMessage::user("ab"),
                ChatMessage::assistant("")
            ]
        );
    }

    #[test]
    fn texts_longer_than_the_context_can_hold_are_refused_by_length() {
        let limit = PromptLimit {
            max_model_len: 4,
            max_token_bytes: 3,
        };
        assert_eq!(limit.max_text_bytes(), 12);
        assert!(limit.check_text(&"a".repeat(12)).is_ok());
        let e = prompt_error(limit.check_text(&"é".repeat(7)).unwrap_err(), "prompt");
        assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(
            e.message.contains("is 4 tokens") && e.message.contains("14 bytes") && e.message.contains("12 bytes"),
            "{}",
            e.message
        );
        assert!(PromptLimit::NONE.check_text(&"a".repeat(1 << 20)).is_ok());
    }

    #[test]
    fn bad_messages_name_the_field() {
        let e = chat_messages(&[msg("function", Some(MessageContent::Text("x".into())))], "messages").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].role"));
        let image = MessageContent::Parts(vec![ContentPart {
            kind: "image_url".into(),
            text: None,
        }]);
        let e = chat_messages(&[msg("user", Some(image))], "messages").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[0].type"));
        let e = chat_messages(&[msg("user", None)], "messages").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content"));
        let e = chat_messages(&[], "messages").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }
}
