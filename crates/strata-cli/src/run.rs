//! `strata run`: one prompt in, its continuation streamed to stdout, speed to stderr.
//! With `--chat` the prompt becomes a user message rendered by the model's chat template.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use strata_engine::{generate, GenerateOptions, SamplingParams};
use strata_model::loader::default_model_path;
use strata_model::tokenizer::IncrementalDecoder;
use strata_runtime::cpu::ThreadPool;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Path of a GGUF model (default: the SmolLM2-135M-Instruct file `make fetch` installs).
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// The prompt text.
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Treat the prompt as a user message and apply the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// System message (with --chat).
    #[arg(long)]
    pub system: Option<String>,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the k most likely tokens (0 = all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalize tokens already in the prompt or output (1 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Penalize tokens already generated, once (OpenAI's presence_penalty).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Penalize tokens already generated, per occurrence (OpenAI's frequency_penalty).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Random seed for sampling.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// CPU threads (default: all cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let path = args.model.clone().unwrap_or_else(default_model_path);
    let model = crate::progress::load_with_progress(&path)?;
    let tok = &model.tokenizer;
    let prompt_ids = crate::tokenize::prompt_ids(
        tok,
        &model.chat_template,
        &args.prompt,
        args.chat,
        args.system.as_deref(),
    )?;
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            min_p: args.min_p,
            repetition_penalty: args.repetition_penalty,
            presence_penalty: args.presence_penalty,
            frequency_penalty: args.frequency_penalty,
            seed: args.seed,
        },
        stop_ids: if args.ignore_eos {
            vec![]
        } else {
            tok.eog_ids().to_vec()
        },
        prefill_chunk: 0,
    };
    let pool = match args.threads {
        Some(n) if n > 0 => ThreadPool::new(n),
        Some(_) => anyhow::bail!("--threads must be at least 1"),
        None => ThreadPool::with_all_cores(),
    };
    let mut decoder = IncrementalDecoder::new(tok, &prompt_ids);
    let mut stdout = std::io::stdout().lock();
    if !args.chat {
        write!(stdout, "{}", args.prompt)?;
    }
    let stats = generate(&model.transformer, &pool, &prompt_ids, &opts, &mut |id| {
        if let Some(text) = decoder.push(id) {
            let _ = write!(stdout, "{text}");
            let _ = stdout.flush();
        }
        true
    })?;
    if let Some(rest) = decoder.finish() {
        write!(stdout, "{rest}")?;
    }
    writeln!(stdout)?;
    stdout.flush()?;
    eprintln!(
        "prompt: {} tokens at {:.1} tok/s | generated: {} tokens at {:.1} tok/s ({:?}, {} threads)",
        stats.prompt_tokens,
        stats.prefill_tps(),
        stats.generated.len(),
        stats.decode_tps(),
        stats.stop,
        pool.n_threads()
    );
    Ok(())
}
