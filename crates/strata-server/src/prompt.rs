//! Turning what a client sends into prompt token ids: chat messages through the model's chat
//! template, plain text with BOS as the model asks. `strata run` / `strata tokenize` use these too.

use strata_model::chat_template::{ChatMessage, ChatTemplate, TemplateError};
use strata_model::tokenizer::{Tokenizer, TokenizerError};

use crate::error::ApiError;
use crate::protocol::{ChatMessageIn, MessageContent};

/// Why a prompt could not be built.
#[derive(Debug, thiserror::Error)]
pub enum PromptError {
    #[error("applying the chat template: {0}")]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Ids of a conversation rendered by the chat template (special tokens in the rendered text are
/// parsed as such; the template adds BOS itself when the model wants one).
pub fn chat_prompt_ids(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> Result<Vec<u32>, PromptError> {
    let rendered = template.render(messages, add_generation_prompt)?;
    Ok(tokenizer.encode(&rendered, false, true)?)
}

/// Ids of a plain text prompt: BOS as the model's metadata says, special-token text kept as text.
pub fn text_prompt_ids(tokenizer: &Tokenizer, text: &str) -> Result<Vec<u32>, PromptError> {
    Ok(tokenizer.encode(text, true, false)?)
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
                other => {
                    return Err(ApiError::invalid_field(
                        format!("{field}[{i}].role"),
                        format!(
                        "`{field}[{i}].role` is `{other}`; supported roles are system, developer, user and assistant"
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
            name: None,
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
    fn bad_messages_name_the_field() {
        let e = chat_messages(&[msg("tool", Some(MessageContent::Text("x".into())))], "messages").unwrap_err();
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
