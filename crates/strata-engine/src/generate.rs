//! Generating one sequence on its own: prefill the prompt, then decode token by token.
//! Used by `strata run` and the local benchmark; the batched scheduler builds on the same calls.

use std::time::{Duration, Instant};

use strata_model::{ForwardScratch, LogitsWanted, ModelError, PagedKvCache, SeqChunk, Transformer};
use strata_runtime::cpu::ThreadPool;

use crate::sampler::{Sampler, SamplingParams};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Tokens that end generation (not emitted).
    pub stop_ids: Vec<u32>,
    /// Prompt tokens per forward pass (chunked prefill); 0 = whole prompt at once.
    pub prefill_chunk: usize,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token was produced.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// Timings of a generation.
#[derive(Debug, Clone)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub generated: Vec<u32>,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    pub stop: StopReason,
}

impl GenerateStats {
    /// Prompt tokens per second.
    pub fn prefill_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Generated tokens per second after the first (each needs one decode step).
    pub fn decode_tps(&self) -> f64 {
        self.generated.len().saturating_sub(1) as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Generates from `prompt`, calling `on_token` for each new token (return false to stop).
pub fn generate(
    model: &Transformer,
    pool: &ThreadPool,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<GenerateStats, ModelError> {
    if prompt.is_empty() {
        return Err(ModelError::BadBatch("the prompt is empty".into()));
    }
    opts.sampling.validate().map_err(ModelError::BadBatch)?;
    let block_size = strata_model::kv_cache::DEFAULT_BLOCK_SIZE;
    let total = prompt.len() + opts.max_tokens;
    let max_pos = model.config.max_position;
    if total > max_pos {
        return Err(ModelError::BadBatch(format!(
            "prompt ({} tokens) + max tokens ({}) = {total} exceeds the model's context of {max_pos}",
            prompt.len(),
            opts.max_tokens
        )));
    }
    let n_blocks = total.div_ceil(block_size);
    let mut kv = PagedKvCache::new(
        &model.config,
        strata_model::kv_cache::KvCacheDtype::F32,
        block_size,
        n_blocks,
    );
    let table: Vec<u32> = (0..n_blocks as u32).collect();
    let mut scratch = ForwardScratch::default();
    let mut sampler = Sampler::new(opts.sampling.clone());

    let t0 = Instant::now();
    let chunk = if opts.prefill_chunk == 0 {
        prompt.len()
    } else {
        opts.prefill_chunk
    };
    let mut logits = None;
    for (i, part) in prompt.chunks(chunk).enumerate() {
        let last = (i + 1) * chunk >= prompt.len();
        let seq = SeqChunk {
            tokens: part.to_vec(),
            first_pos: i * chunk,
            block_table: table.clone(),
            logits: if last { LogitsWanted::Last } else { LogitsWanted::None },
            prompt_len: prompt.len(),
        };
        logits = Some(model.forward(&[seq], &mut kv, pool, &mut scratch)?);
    }
    let prefill_time = t0.elapsed();
    let mut generated = Vec::new();
    let mut stop = StopReason::Length;
    let t1 = Instant::now();
    let mut next = logits
        .as_ref()
        .and_then(|l| l.last_of(0))
        .map(|row| sampler.sample(row, prompt, &[]));
    while let Some(tok) = next.take() {
        if opts.stop_ids.contains(&tok) {
            stop = StopReason::Stop;
            break;
        }
        generated.push(tok);
        if !on_token(tok) {
            stop = StopReason::Stop;
            break;
        }
        if generated.len() >= opts.max_tokens {
            break;
        }
        let seq = SeqChunk {
            tokens: vec![tok],
            first_pos: prompt.len() + generated.len() - 1,
            block_table: table.clone(),
            logits: LogitsWanted::Last,
            prompt_len: prompt.len(),
        };
        let l = model.forward(&[seq], &mut kv, pool, &mut scratch)?;
        next = l.last_of(0).map(|row| sampler.sample(row, prompt, &generated));
        scratch.recycle(l);
    }
    Ok(GenerateStats {
        prompt_tokens: prompt.len(),
        generated,
        prefill_time,
        decode_time: t1.elapsed(),
        stop,
    })
}
