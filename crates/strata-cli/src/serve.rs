//! `strata serve`: loads a model, starts the engine and serves the OpenAI-compatible API until
//! SIGTERM/SIGINT. Flags follow vLLM's spelling; sizes accept units (2GiB, 512MiB, bytes).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use strata_engine::speculation::{DEFAULT_DISABLE_BY_BATCH_SIZE, DEFAULT_DRAFT_MODEL_TOKENS};
use strata_engine::{DraftModelSpeculation, EngineConfig, KvCacheDtype, NgramSpeculation};
use strata_model::kv_cache::DEFAULT_BLOCK_SIZE;
use strata_model::loader::default_model_path;
use strata_server::connections::{
    max_connections_for, raise_descriptor_limit, ConnectionLimits, DEFAULT_MAX_CONNECTIONS,
};
use strata_server::{AllowedOrigins, ServerConfig};

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Path of a GGUF model or an HF checkpoint directory (default: the SmolLM2-135M-Instruct file `make fetch` installs).
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Address to listen on (0.0.0.0 for every interface).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the log says which).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Require `Authorization: Bearer <key>` on the API (not on /health, /metrics, /openapi.json).
    #[arg(long, env = "STRATA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Origins whose web pages may call the API from a browser (CORS), e.g. http://localhost:5173:
    /// comma-separated or repeated, `*` for any. Their preflights get 204 before the API key is
    /// checked and every answer to them carries Access-Control-Allow-Origin; other origins'
    /// preflights get 403. Default: none (no CORS headers).
    #[arg(long, value_name = "ORIGINS")]
    pub allowed_origins: Vec<String>,
    /// Model name clients use (default: the model file's name without .gguf).
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Longest prompt + output in tokens (default: the model's context).
    #[arg(long)]
    pub max_model_len: Option<usize>,
    /// Sequences running at once (default: 64 on the CPU, 256 on a GPU).
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Tokens per engine step, prefill and decode together (default: 512 on the CPU, 2048 on a GPU).
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Requests allowed to wait for admission; more get 429.
    #[arg(long, default_value_t = 1024)]
    pub max_queue: usize,
    #[command(flatten)]
    pub device: crate::device::DeviceArgs,
    /// Memory for the KV cache on the CPU: bytes or a size like 512MiB, 2GiB, 1G (on a GPU,
    /// --gpu-memory-utilization sizes it).
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub kv_cache_memory: usize,
    /// KV cache element type: auto (full precision) or fp8 (E4M3 with scales, ~3.8x more tokens).
    #[arg(long, default_value = "auto", value_parser = KvCacheDtype::parse)]
    pub kv_cache_dtype: KvCacheDtype,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = DEFAULT_BLOCK_SIZE)]
    pub block_size: usize,
    /// Do not share the KV of common prompt prefixes between requests.
    #[arg(long)]
    pub no_enable_prefix_caching: bool,
    /// CPU compute threads (default: all cores).
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    #[command(flatten)]
    pub speculation: SpeculationArgs,
    /// Seconds in-flight requests get to finish after SIGTERM/SIGINT before they are aborted.
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_timeout: f64,
    /// Largest request body: bytes or a size like 32MiB; larger ones get 413.
    #[arg(long, default_value = "32MiB", value_parser = parse_size)]
    pub max_request_body_bytes: usize,
    /// Seconds between `: keep-alive` comments on a stream with nothing to send (e.g. queued).
    #[arg(long, default_value_t = 10.0)]
    pub sse_keep_alive: f64,
    /// Seconds a client has to send a request's headers (from connecting, or from the request's
    /// first byte); then the connection is closed.
    #[arg(long, default_value_t = 10.0)]
    pub header_read_timeout: f64,
    /// Seconds a client has to send a request's whole body once its headers are in; then it gets
    /// 408 and the connection is closed.
    #[arg(long, default_value_t = 30.0)]
    pub body_read_timeout: f64,
    /// Seconds an idle connection is kept open between requests.
    #[arg(long, default_value_t = 75.0)]
    pub keep_alive_timeout: f64,
    /// Connections open at once; more are answered 503 and closed (default: the open-descriptor
    /// limit, raised to its hard maximum at start, less 128; at most 4096).
    #[arg(long)]
    pub max_connections: Option<usize>,
}

/// Speculative decoding flags (`strata serve`).
#[derive(Args, Debug, Clone)]
pub struct SpeculationArgs {
    /// Prompt-lookup (n-gram) speculative decoding, off by default: `TOKENS` draft tokens a step
    /// from n-grams of 1 to 3 tokens, or `MAX:MIN:TOKENS` (vLLM's prompt_lookup_max,
    /// prompt_lookup_min, num_speculative_tokens), e.g. 3:1:4. Output is the same as without it.
    #[arg(long, value_name = "[MAX:MIN:]TOKENS", value_parser = NgramSpeculation::parse)]
    pub speculative_ngram: Option<NgramSpeculation>,
    /// Draft-model speculative decoding, off by default: a GGUF file or HF checkpoint of a smaller
    /// model with the target's tokenizer (e.g. Qwen2.5-0.5B-Instruct for Qwen2.5-7B-Instruct)
    /// proposes --num-speculative-tokens tokens a step, which the target verifies in one pass.
    /// Output is the same as without it. On a GPU the draft keeps its file's weight format
    /// (--quantization is the target's). Not with --speculative-ngram.
    #[arg(long, value_name = "PATH")]
    pub speculative_model: Option<PathBuf>,
    /// With --speculative-model: draft tokens a step, 1 to 16 (vLLM's num_speculative_tokens;
    /// default 4). --speculative-ngram takes its count in its own value.
    #[arg(long, visible_alias = "speculative-tokens", value_name = "N")]
    pub num_speculative_tokens: Option<usize>,
    /// With either method: no drafts in steps where more sequences than this run or wait
    /// (there verifying costs more than it saves; the default is measured, bench/NOTES.md).
    #[arg(long, default_value_t = DEFAULT_DISABLE_BY_BATCH_SIZE)]
    pub speculative_disable_by_batch_size: usize,
}

impl SpeculationArgs {
    /// The engine's setting: `None` when off.
    pub fn ngram(&self) -> Option<NgramSpeculation> {
        self.speculative_ngram.map(|s| NgramSpeculation {
            disable_by_batch_size: self.speculative_disable_by_batch_size,
            ..s
        })
    }

    /// The draft-model setting: `None` when off; an error, before anything loads, when the flags
    /// do not go together.
    pub fn draft_model(&self) -> anyhow::Result<Option<DraftModelSpeculation>> {
        match (&self.speculative_model, self.num_speculative_tokens) {
            (Some(_), _) if self.speculative_ngram.is_some() => {
                anyhow::bail!("--speculative-ngram and --speculative-model are two ways to draft; pass one of them")
            }
            (None, Some(_)) => anyhow::bail!(
                "--num-speculative-tokens is the draft model's count: pass --speculative-model PATH with it \
                 (--speculative-ngram takes its count as TOKENS)"
            ),
            (None, None) => Ok(None),
            (Some(_), tokens) => {
                let settings = DraftModelSpeculation {
                    num_tokens: tokens.unwrap_or(DEFAULT_DRAFT_MODEL_TOKENS),
                    disable_by_batch_size: self.speculative_disable_by_batch_size,
                };
                settings.validate().map_err(anyhow::Error::msg)?;
                Ok(Some(settings))
            }
        }
    }
}

/// Parses `512MiB`, `2GiB`, `1G`, `64k`, `1.5GiB` or a plain number of bytes.
pub fn parse_size(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size; write bytes or a number with a unit like 512MiB or 2GiB"))?;
    let multiplier: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" => 1e3,
        "kib" => 1024.0,
        "m" | "mb" => 1e6,
        "mib" => 1024.0 * 1024.0,
        "g" | "gb" => 1e9,
        "gib" => 1024.0 * 1024.0 * 1024.0,
        "t" | "tb" => 1e12,
        "tib" => 1024f64.powi(4),
        other => {
            return Err(format!(
                "unknown size unit {other:?} in {s:?}; use B, KiB, MiB, GiB, TiB (or K, M, G, T)"
            ))
        }
    };
    let bytes = value * multiplier;
    if !bytes.is_finite() || bytes < 1.0 || bytes > usize::MAX as f64 {
        return Err(format!("{s:?} is not a usable size"));
    }
    Ok(bytes as usize)
}

fn seconds(value: f64, flag: &str) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| anyhow::anyhow!("{flag} must be a number of seconds >= 0, got {value}"))
}

fn timeout(value: f64, flag: &str) -> anyhow::Result<Duration> {
    match seconds(value, flag)? {
        d if d.is_zero() => anyhow::bail!("{flag} must be more than 0 seconds"),
        d => Ok(d),
    }
}

/// Raises the open-descriptor limit and checks --max-connections against it (default: what fits).
fn connection_limits(args: &ServeArgs) -> anyhow::Result<ConnectionLimits> {
    let fitting = match raise_descriptor_limit() {
        Ok(limit) => {
            let fitting = max_connections_for(limit);
            tracing::debug!("open-descriptor limit: {limit}; room for {fitting} connections");
            Some(fitting)
        }
        Err(e) => {
            tracing::warn!("could not read the open-descriptor limit: {e}");
            None
        }
    };
    let max_connections = match (args.max_connections, fitting) {
        (Some(0), _) => anyhow::bail!("--max-connections must be at least 1"),
        (Some(asked), Some(fitting)) if asked > fitting => {
            tracing::warn!(
                "--max-connections {asked} is more than the open-descriptor limit leaves room for \
                 ({fitting}); past that, connections fail instead of getting 503 (raise `ulimit -n`)"
            );
            asked
        }
        (Some(asked), _) => asked,
        (None, fitting) => fitting.unwrap_or(DEFAULT_MAX_CONNECTIONS),
    };
    Ok(ConnectionLimits {
        header_read_timeout: timeout(args.header_read_timeout, "--header-read-timeout")?,
        body_read_timeout: timeout(args.body_read_timeout, "--body-read-timeout")?,
        keep_alive_timeout: timeout(args.keep_alive_timeout, "--keep-alive-timeout")?,
        max_connections,
    })
}

pub fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let path = args.model.clone().unwrap_or_else(default_model_path);
    let served_model_name = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| strata_model::loader::model_name(&path));
    let threads = match args.threads {
        Some(0) => anyhow::bail!("--threads must be at least 1"),
        Some(n) => n,
        None => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
    };
    let server_config = ServerConfig {
        served_model_name: served_model_name.clone(),
        api_key: args.api_key.clone().filter(|k| !k.is_empty()),
        max_request_body_bytes: args.max_request_body_bytes,
        sse_keep_alive: seconds(args.sse_keep_alive, "--sse-keep-alive")?.max(Duration::from_millis(10)),
        shutdown_timeout: seconds(args.shutdown_timeout, "--shutdown-timeout")?,
        connections: connection_limits(&args)?,
        allowed_origins: AllowedOrigins::parse(&args.allowed_origins)
            .map_err(|e| anyhow::anyhow!("--allowed-origins: {e}"))?,
    };
    let engine_config = EngineConfig {
        max_model_len: args.max_model_len,
        kv_cache_memory: args.kv_cache_memory,
        kv_cache_dtype: args.kv_cache_dtype,
        block_size: args.block_size,
        enable_prefix_caching: !args.no_enable_prefix_caching,
        max_queue: args.max_queue,
        threads,
        speculative_ngram: args.speculation.ngram(),
        speculative_model: args.speculation.draft_model()?,
        ..EngineConfig::default()
    };
    let model = crate::progress::load_with_progress(&path)?;
    let draft = match &args.speculation.speculative_model {
        Some(draft_path) if !draft_path.exists() => anyhow::bail!(
            "--speculative-model {}: no such file or directory; pass a .gguf file or an HF checkpoint \
             directory of a model with the target's tokenizer",
            draft_path.display()
        ),
        Some(draft_path) => Some(
            crate::progress::load_with_progress(draft_path)
                .with_context(|| format!("--speculative-model {}", draft_path.display()))?,
        ),
        None => None,
    };
    let steps = crate::device::StepFlags {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
    };
    let engine = crate::device::start_engine(model, draft, engine_config, &args.device, steps)?;
    let cap = engine.capacity();
    tracing::info!(
        "KV cache: {} blocks x {} tokens = {} tokens ({:.1} MiB, {}); {:.1} sequences of --max-model-len {} fit at once",
        cap.blocks,
        cap.block_size,
        cap.tokens(),
        cap.bytes as f64 / (1024.0 * 1024.0),
        cap.value_type,
        cap.max_len_sequences(),
        cap.max_model_len
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("strata-http")
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let address = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&address)
            .await
            .with_context(|| format!("cannot listen on {address}; pass another --port or --host"))?;
        let bound = listener.local_addr()?;
        let origins = &server_config.allowed_origins;
        tracing::info!(
            "serving `{served_model_name}` on http://{bound} (OpenAI API under /v1; /health, /metrics, /openapi.json){}{}",
            if server_config.api_key.is_some() { "; API key required" } else { "" },
            if origins.is_empty() { String::new() } else { format!("; browsers may call it from {origins}") }
        );
        strata_server::serve(listener, engine, server_config, strata_server::shutdown_signal()).await?;
        tracing::info!("stopped");
        anyhow::Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::{parse_size, SpeculationArgs};
    use clap::Parser;
    use strata_engine::{DraftModelSpeculation, NgramSpeculation};

    #[derive(Parser)]
    struct Flags {
        #[command(flatten)]
        speculation: SpeculationArgs,
    }

    #[test]
    fn speculation_flags_give_the_engine_setting() {
        let parse = |args: &[&str]| Flags::try_parse_from(std::iter::once("strata").chain(args.iter().copied()));
        let flags = parse(&[
            "--speculative-ngram",
            "3:1:4",
            "--speculative-disable-by-batch-size",
            "8",
        ])
        .unwrap();
        assert_eq!(
            flags.speculation.ngram(),
            Some(NgramSpeculation {
                lookup_max: 3,
                lookup_min: 1,
                num_tokens: 4,
                disable_by_batch_size: 8,
            })
        );
        assert_eq!(parse(&[]).unwrap().speculation.ngram(), None, "off by default");
        let err = parse(&["--speculative-ngram", "1:3:4"])
            .err()
            .expect("MIN above MAX is refused");
        assert!(err.to_string().contains("MIN <= MAX"), "{err}");
    }

    #[test]
    fn draft_model_flags_give_the_engine_setting_or_say_what_goes_together() {
        let parse = |args: &[&str]| {
            Flags::try_parse_from(std::iter::once("strata").chain(args.iter().copied()))
                .unwrap()
                .speculation
        };
        let flags = parse(&["--speculative-model", "draft.gguf"]);
        assert_eq!(flags.draft_model().unwrap(), Some(DraftModelSpeculation::new(4)));
        let flags = parse(&[
            "--speculative-model",
            "draft.gguf",
            "--speculative-tokens",
            "6",
            "--speculative-disable-by-batch-size",
            "3",
        ]);
        assert_eq!(
            flags.draft_model().unwrap(),
            Some(DraftModelSpeculation {
                num_tokens: 6,
                disable_by_batch_size: 3
            })
        );
        assert_eq!(parse(&[]).draft_model().unwrap(), None, "off by default");
        let refused = |args: &[&str]| parse(args).draft_model().unwrap_err().to_string();
        let both = refused(&["--speculative-model", "d.gguf", "--speculative-ngram", "4"]);
        assert!(both.contains("pass one of them"), "{both}");
        let alone = refused(&["--num-speculative-tokens", "4"]);
        assert!(alone.contains("pass --speculative-model PATH"), "{alone}");
        let many = refused(&["--speculative-model", "d.gguf", "--num-speculative-tokens", "17"]);
        assert!(many.contains("1..=16"), "{many}");
    }

    #[test]
    fn sizes_with_units() {
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1G"), Ok(1_000_000_000));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("1.5 KiB"), Ok(1536));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("3 parsecs").is_err());
        assert!(parse_size("0").is_err());
    }
}
