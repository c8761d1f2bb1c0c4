//! `strata run`: one prompt in, its continuation streamed to stdout, speed to stderr.
//! With `--chat` the prompt becomes a user message rendered by the model's chat template.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use strata_engine::{complete, EngineConfig, EngineHandle, GenerationRequest, KvCacheDtype, SamplingParams};
use strata_model::loader::{default_model_path, LoadedModel};
use strata_model::PagedKvCache;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Path of a GGUF model or an HF checkpoint directory (default: the SmolLM2-135M-Instruct file `make fetch` installs).
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
    #[command(flatten)]
    pub device: crate::device::DeviceArgs,
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
    let threads = match args.threads {
        Some(0) => anyhow::bail!("--threads must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    };
    let request = GenerationRequest {
        prompt: prompt_ids.clone(),
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
            ..SamplingParams::default()
        },
        ignore_eos: args.ignore_eos,
        ..GenerationRequest::greedy(vec![], 0)
    };
    let engine = start_single_stream(model, threads, prompt_ids.len() + args.max_tokens, &args.device)?;
    let stream = engine.submit(request)?;
    let mut stdout = std::io::stdout().lock();
    if !args.chat {
        write!(stdout, "{}", args.prompt)?;
    }
    let done = complete(stream, &mut |text| {
        let _ = write!(stdout, "{text}");
        let _ = stdout.flush();
    })
    .map_err(|e| anyhow::anyhow!(e))?;
    writeln!(stdout)?;
    stdout.flush()?;
    eprintln!(
        "prompt: {} tokens at {:.1} tok/s | generated: {} tokens at {:.1} tok/s ({}, {threads} threads)",
        done.usage.prompt_tokens,
        done.prompt_tps(),
        done.tokens.len(),
        done.decode_tps(),
        done.finish.as_str(),
    );
    Ok(())
}

/// An engine sized for one sequence of up to `tokens` tokens (prompt + output), as `run` and
/// `bench-local` use it.
pub fn start_single_stream(
    model: LoadedModel,
    threads: usize,
    tokens: usize,
    device: &crate::device::DeviceArgs,
) -> anyhow::Result<EngineHandle> {
    let context = model.transformer.config.max_position;
    anyhow::ensure!(
        tokens <= context,
        "prompt + --max-tokens = {tokens} tokens exceeds the model's context of {context}; ask for fewer tokens"
    );
    let block = strata_model::kv_cache::DEFAULT_BLOCK_SIZE;
    let per_token = PagedKvCache::bytes_per_token(&model.transformer.config, KvCacheDtype::Auto);
    let config = EngineConfig {
        threads,
        max_model_len: Some(tokens.max(2)),
        kv_cache_memory: per_token * (tokens.div_ceil(block) + 1) * block,
        enable_prefix_caching: false,
        ..Default::default()
    };
    // The whole prompt in one forward pass.
    let steps = crate::device::StepFlags {
        max_num_seqs: Some(1),
        max_num_batched_tokens: Some(tokens),
    };
    crate::device::start_engine(model, None, config, device, steps)
}
