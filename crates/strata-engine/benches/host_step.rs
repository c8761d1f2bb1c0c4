//! The engine's host work between decode steps at many users, with no GPU: a mock executor spins
//! (or sleeps) `--step-ms` per step and returns argmax tokens; one consumer thread per request.
//!
//! `cargo bench -p strata-engine --bench host_step -- [--users 256] [--prompt-len 512]
//! [--min-output 64] [--max-output 256] [--step-ms 15] [--sleep] [--max-batched-tokens 2048] [--runs 3]
//! [--out bench/results/engine_host_step.json]`
//!
//! Prints, for the decode steps of big batches (3/4 of the users or more) and of all batches, the
//! host gap (from one step's collect to the next step's submit: everything the engine thread
//! does between two GPU steps), and the engine's decode step time minus the mock's step time.
//! `--max-batched-tokens` (2048, the GPU default) sets how fast the prompts are taken in.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use strata_engine::{EngineConfig, EngineHandle, GenerationRequest, RequestOutput};
use strata_model::chat_template::ChatTemplate;
use strata_model::config::{RopeConfig, RopeScaling};
use strata_model::kv_cache::KvCacheDtype;
use strata_model::loader::cache_dir;
use strata_model::tokenizer::Tokenizer;
use strata_model::{Executor, KvLayout, Logits, LogitsWanted, ModelConfig, ModelError, SeqChunk};
use strata_runtime::cpu::ops::RopeLayout;

mod common;

struct Options {
    users: usize,
    prompt_len: usize,
    min_output: usize,
    max_output: usize,
    step: Duration,
    sleep: bool,
    runs: usize,
    max_batched_tokens: usize,
    out: Option<std::path::PathBuf>,
}

fn options() -> Result<Options, String> {
    let mut o = Options {
        users: 256,
        prompt_len: 512,
        min_output: 64,
        max_output: 256,
        step: Duration::from_millis(15),
        sleep: false,
        runs: 3,
        max_batched_tokens: 2048,
        out: None,
    };
    let args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut num = || -> Result<usize, String> {
            it.next()
                .ok_or(format!("{flag} needs a value"))?
                .parse()
                .map_err(|e| format!("{flag}: {e}"))
        };
        match flag.as_str() {
            "--users" => o.users = num()?,
            "--prompt-len" => o.prompt_len = num()?,
            "--min-output" => o.min_output = num()?,
            "--max-output" => o.max_output = num()?,
            "--step-ms" => o.step = Duration::from_millis(num()? as u64),
            "--runs" => o.runs = num()?,
            "--max-batched-tokens" => o.max_batched_tokens = num()?,
            "--sleep" => o.sleep = true,
            // Relative to the workspace root (cargo runs benches from the crate's folder).
            "--out" => {
                let path = it.next().ok_or("--out needs a path")?;
                o.out = Some(
                    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                        .join("../..")
                        .join(path),
                );
            }
            other => return Err(format!("unknown flag {other}")),
        }
    }
    if o.users == 0 || o.min_output == 0 || o.max_output < o.min_output {
        return Err("need --users >= 1 and 1 <= --min-output <= --max-output".into());
    }
    Ok(o)
}

/// One decode step as the mock saw it.
struct Step {
    batch: usize,
    /// From the previous step's collect to this submit (the previous step decoded too).
    host_gap: Duration,
}

/// A Llama-3-8B-shaped model whose every step waits `step` and answers pseudo-random argmax
/// tokens; it records the host gap before every decode step that follows a decode step.
struct MockGpu {
    config: ModelConfig,
    blocks: usize,
    step: Duration,
    sleep: bool,
    last_return: Option<(Instant, bool)>,
    steps: Arc<Mutex<Vec<Step>>>,
    /// Logits of steps run and not yet collected, and whether each decoded.
    done: VecDeque<(Logits, bool)>,
}

impl Executor for MockGpu {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Runs the step now; `collect` hands its logits back.
    fn submit(&mut self, batch: Vec<SeqChunk>, _tokens_from: Option<Vec<usize>>) -> Result<(), ModelError> {
        let called = Instant::now();
        let decode = batch.iter().all(|c| c.tokens.len() == 1 && c.first_pos >= c.prompt_len);
        if let Some((at, true)) = self.last_return {
            if decode {
                self.steps.lock().unwrap().push(Step {
                    batch: batch.len(),
                    host_gap: called - at,
                });
            }
        }
        let end = called + self.step;
        if self.sleep {
            std::thread::sleep(self.step);
        } else {
            while Instant::now() < end {
                std::hint::spin_loop();
            }
        }
        let vocab = self.config.vocab_size;
        let mut logits = Logits {
            vocab,
            ..Default::default()
        };
        for (i, c) in batch.iter().enumerate() {
            let last = c.tokens.last().copied().unwrap_or(0) as u64;
            let mut x = (c.end_pos() as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ last.wrapping_mul(0xBF58_476D);
            x ^= x >> 29;
            // Ordinary word pieces of the Llama-3 vocabulary.
            let token = (1000 + x % 100_000) as u32;
            match c.logits {
                LogitsWanted::None => {}
                LogitsWanted::LastArgmax => logits.argmax.push((i, token)),
                LogitsWanted::Last | LogitsWanted::LastSampled(_) | LogitsWanted::All | LogitsWanted::AllArgmax => {
                    let row = logits.data.len();
                    logits.data.resize(row + vocab, 0.0);
                    logits.data[row + token as usize] = 10.0;
                    logits.rows.push((i, c.end_pos() - 1));
                }
            }
        }
        self.done.push_back((logits, decode));
        Ok(())
    }

    fn collect(&mut self) -> Result<Logits, ModelError> {
        let (logits, decode) = self
            .done
            .pop_front()
            .ok_or_else(|| ModelError::BadBatch("collect without a submitted batch".into()))?;
        self.last_return = Some((Instant::now(), decode));
        Ok(logits)
    }

    fn kv_layout(&self) -> KvLayout {
        KvLayout {
            blocks: self.blocks,
            block_size: 16,
            bytes: self.blocks * 16 * 128 * 1024,
            dtype: KvCacheDtype::Auto,
            value_type: "f32",
        }
    }

    fn device(&self) -> String {
        format!("mock GPU ({:?} a step)", self.step)
    }
}

fn llama3_shape() -> ModelConfig {
    ModelConfig {
        arch: &strata_model::architectures::LLAMA,
        n_layers: 32,
        hidden: 4096,
        intermediate: 14336,
        n_heads: 32,
        n_kv_heads: 8,
        head_dim: 128,
        vocab_size: 128_256,
        rms_eps: 1e-5,
        rope: RopeConfig {
            theta: 500_000.0,
            dim: 128,
            layout: RopeLayout::Neox,
            scaling: RopeScaling::None,
        },
        max_position: 8192,
        tied_embeddings: false,
    }
}

fn mean_ms(v: &[Duration]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.iter().map(Duration::as_secs_f64).sum::<f64>() * 1e3 / v.len() as f64
}

fn median_ms(v: &[Duration]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort();
    s[s.len() / 2].as_secs_f64() * 1e3
}

fn run(o: &Options, tokenizer: &Tokenizer) -> serde_json::Value {
    let steps = Arc::new(Mutex::new(Vec::new()));
    let max_model_len = o.prompt_len + o.max_output + 1;
    let blocks = o.users * max_model_len.div_ceil(16) + 64;
    let mock = MockGpu {
        config: llama3_shape(),
        blocks,
        step: o.step,
        sleep: o.sleep,
        last_return: None,
        steps: Arc::clone(&steps),
        done: VecDeque::new(),
    };
    let config = EngineConfig {
        max_num_seqs: o.users,
        max_num_batched_tokens: o.max_batched_tokens,
        max_model_len: Some(max_model_len),
        threads: 1,
        ..Default::default()
    };
    let template = ChatTemplate::chatml("<|begin_of_text|>", "<|eot_id|>");
    let e = EngineHandle::start_with(Box::new(mock), tokenizer.clone(), template, config).expect("engine starts");
    let t0 = Instant::now();
    let tokens: usize = std::thread::scope(|s| {
        let readers: Vec<_> = (0..o.users)
            .map(|i| {
                let mut x = 0x2545_F491_4F6C_DD1Du64 ^ (i as u64 + 1).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                let prompt: Vec<u32> = (0..o.prompt_len)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (1000 + x % 100_000) as u32
                    })
                    .collect();
                let span = o.max_output - o.min_output + 1;
                let output = o.min_output + (i * 97) % span;
                let req = GenerationRequest {
                    ignore_eos: true,
                    ..GenerationRequest::greedy(prompt, output)
                };
                let mut stream = e.submit(req).expect("the request is valid");
                s.spawn(move || {
                    let mut n = 0;
                    while let Some(out) = stream.blocking_next() {
                        match out {
                            RequestOutput::Delta { tokens, .. } => n += tokens.len(),
                            RequestOutput::Failed(e) | RequestOutput::Unavailable(e) => panic!("request failed: {e}"),
                            RequestOutput::Finished { .. } => {}
                        }
                    }
                    n
                })
            })
            .collect();
        readers.into_iter().map(|r| r.join().expect("reader")).sum()
    });
    let wall = t0.elapsed().as_secs_f64();
    let stats = e.stats();
    e.shutdown();
    let steps = std::mem::take(&mut *steps.lock().unwrap());
    let full: Vec<Duration> = steps
        .iter()
        .filter(|s| s.batch * 4 >= o.users * 3)
        .map(|s| s.host_gap)
        .collect();
    let all: Vec<Duration> = steps.iter().map(|s| s.host_gap).collect();
    let mean_batch = steps.iter().map(|s| s.batch).sum::<usize>() as f64 / steps.len().max(1) as f64;
    let engine_step = stats.decode_step_seconds_total * 1e3 / stats.decode_steps_total.max(1) as f64;
    println!(
        "| {} | {:.3} | {:.3} | {} | {:.3} | {:.1} | {} | {:.3} | {tokens} | {wall:.2} |",
        o.users,
        mean_ms(&full),
        median_ms(&full),
        full.len(),
        mean_ms(&all),
        mean_batch,
        all.len(),
        engine_step - o.step.as_secs_f64() * 1e3,
    );
    serde_json::json!({
        "users": o.users,
        "host_gap_big_batches_mean_ms": mean_ms(&full),
        "host_gap_big_batches_p50_ms": median_ms(&full),
        "big_batch_steps": full.len(),
        "host_gap_all_decode_steps_mean_ms": mean_ms(&all),
        "mean_batch": mean_batch,
        "decode_steps": all.len(),
        "engine_decode_step_minus_mock_ms": engine_step - o.step.as_secs_f64() * 1e3,
        "tokens": tokens,
        "wall_s": wall,
    })
}

fn main() {
    let o = common::options_or_exit(options());
    let dir = cache_dir().join("tokenizers").join("llama3");
    let tokenizer = match Tokenizer::from_hf_file(dir.join("tokenizer.json"), Some(&dir.join("tokenizer_config.json")))
    {
        Ok(t) => t,
        Err(e) => {
            eprintln!(
                "error: cannot load the Llama-3 tokenizer from {}: {e}; run `make fetch` first",
                dir.display()
            );
            std::process::exit(1);
        }
    };
    println!(
        "mock step {:?} ({}), prompts of {} tokens, {}-{} output tokens",
        o.step,
        if o.sleep { "sleep" } else { "spin" },
        o.prompt_len,
        o.min_output,
        o.max_output
    );
    println!(
        "| users | host gap, batch >= 3/4 users: mean ms | p50 ms | steps | host gap, all decode steps: mean ms | their batch | steps | engine decode step - mock ms | tokens | wall s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let runs: Vec<serde_json::Value> = (0..o.runs).map(|_| run(&o, &tokenizer)).collect();
    if let Some(path) = &o.out {
        let report = serde_json::json!({
            "mock_step_ms": o.step.as_secs_f64() * 1e3,
            "mock_sleeps": o.sleep,
            "prompt_tokens": o.prompt_len,
            "output_tokens": [o.min_output, o.max_output],
            "max_batched_tokens": o.max_batched_tokens,
            "runs": runs,
        });
        let text = serde_json::to_string_pretty(&report).expect("a JSON value prints");
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("error: cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
        println!("wrote {}", path.display());
    }
}
