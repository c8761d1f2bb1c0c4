//! `strata tokenize`: the token ids strata feeds the model for a text, as JSON.
//! Same rules as `strata run`: BOS as the model says for plain text, the chat template with --chat.

use std::path::PathBuf;

use clap::Args;
use strata_model::chat_template::ChatMessage;
use strata_model::chat_template::ChatTemplate;
use strata_model::loader::{default_model_path, load_text};
use strata_model::tokenizer::Tokenizer;
use strata_server::prompt::{chat_prompt_ids, text_prompt_ids};

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// Path of a GGUF model or an HF checkpoint directory (default: the SmolLM2 file `make fetch` installs).
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Treat the text as a user message and apply the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// The texts to tokenize.
    #[arg(required = true)]
    pub texts: Vec<String>,
}

/// The ids for `text`, exactly as `strata run` builds its prompt (with `chat`, `text` is the
/// user message, after an optional system message).
pub fn prompt_ids(
    tok: &Tokenizer,
    template: &ChatTemplate,
    text: &str,
    chat: bool,
    system: Option<&str>,
) -> anyhow::Result<Vec<u32>> {
    Ok(if chat {
        let messages: Vec<ChatMessage> = system
            .map(ChatMessage::system)
            .into_iter()
            .chain([ChatMessage::user(text)])
            .collect();
        chat_prompt_ids(tok, template, &messages, true)?
    } else {
        text_prompt_ids(tok, text)?
    })
}

pub fn tokenize(args: TokenizeArgs) -> anyhow::Result<()> {
    let path = args.model.clone().unwrap_or_else(default_model_path);
    let (tok, template) = load_text(&path)?;
    let mut out = Vec::new();
    for text in &args.texts {
        let ids = prompt_ids(&tok, &template, text, args.chat, None)?;
        out.push(serde_json::json!({ "text": text, "chat": args.chat, "ids": ids }));
    }
    println!("{}", serde_json::to_string(&out)?);
    Ok(())
}
