//! The `strata bench` command line: flags in the style of `vllm bench serve`, and what the command does with them.
//! Owns turning flags into a `BenchConfig`, printing tables and writing the JSON and SVG files.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::bail;
use clap::Args;

use crate::config::{Arrival, BenchConfig, Endpoint, InputSource, LoadShape, Sampling};
use crate::plot::{sweep_svg, SweepSeries};
use crate::report::{BenchReport, BenchResults};
use crate::table::{compare_table, run_details, summary_table};

/// Closed-loop users when --concurrency is not given.
pub const DEFAULT_USERS: usize = 8;
/// Measured requests when neither --num-requests nor --duration is given.
pub const DEFAULT_NUM_REQUESTS: u64 = 200;

/// Load-test an OpenAI-compatible server.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Server root URL, without /v1.
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    pub base_url: String,
    /// Model name to request (default: the first one GET /v1/models lists).
    #[arg(long)]
    pub model: Option<String>,
    /// Which endpoint to load.
    #[arg(long, value_enum, default_value_t = Endpoint::Chat)]
    pub endpoint: Endpoint,
    /// Closed loop: simulated users (default 8). Open loop: the most requests in flight (default: no cap).
    #[arg(long, short = 'c')]
    pub concurrency: Option<usize>,
    /// Requests per second for an open loop; inf means a closed loop of --concurrency users.
    #[arg(long, default_value = "inf", value_parser = parse_rate)]
    pub request_rate: f64,
    /// How open-loop arrivals are spaced.
    #[arg(long, value_enum, default_value_t = Arrival::Poisson)]
    pub arrival: Arrival,
    /// Measured requests to send (default 200 unless --duration is given; with both, whichever comes first).
    #[arg(long, short = 'n')]
    pub num_requests: Option<u64>,
    /// Stop sending after this many seconds; requests in flight still finish and count.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Requests sent before measuring, left out of every figure.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Tokens per random prompt (random input, the default).
    #[arg(long, default_value_t = 256)]
    pub input_len: u32,
    /// max_tokens per request (default 128, or each dataset reply's length).
    #[arg(long)]
    pub output_len: Option<u32>,
    /// Send this file as the prompt; a .jsonl file gives one {"prompt": ...} per line.
    #[arg(long, conflicts_with = "dataset")]
    pub prompt_file: Option<PathBuf>,
    /// ShareGPT dataset (JSON array or JSONL): first user turn is the prompt, its reply sets max_tokens.
    #[arg(long)]
    pub dataset: Option<PathBuf>,
    /// Ask for whole responses instead of streams (no TTFT or inter-token latency).
    #[arg(long)]
    pub no_stream: bool,
    /// Ask the server to ignore end-of-sequence so every answer has max_tokens tokens (vLLM, SGLang, llama.cpp, strata).
    #[arg(long)]
    pub ignore_eos: bool,
    /// Sampling temperature sent with every request (default: none sent, the server's own, 1.0 in
    /// the OpenAI API; 0 = greedy).
    #[arg(long)]
    pub temperature: Option<f32>,
    /// top_p sent with every request (default: none sent).
    #[arg(long)]
    pub top_p: Option<f32>,
    /// top_k sent with every request (default: none sent; vLLM, SGLang, llama.cpp, strata).
    #[arg(long)]
    pub top_k: Option<u32>,
    /// Bearer token (else $STRATA_API_KEY, else $OPENAI_API_KEY).
    #[arg(long, env = "STRATA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Whole-request timeout in seconds.
    #[arg(long, default_value_t = 600.0)]
    pub timeout: f64,
    /// Seed for prompts and arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Run once per concurrency level, e.g. 1,2,4,8,16,32,64, and plot throughput and TTFT P95 against it.
    #[arg(long, value_delimiter = ',')]
    pub sweep: Vec<usize>,
    /// Results JSON (default: strata-bench-UNIXSECONDS.json in the current folder).
    #[arg(long, short = 'o')]
    pub output: Option<PathBuf>,
    /// SVG chart of a sweep or of a compare of two sweeps (default for a sweep: the results path with .svg).
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Print two results files side by side with ratios (B/A), and run nothing.
    #[arg(long, num_args = 2, value_names = ["A_JSON", "B_JSON"])]
    pub compare: Option<Vec<PathBuf>>,
    /// Name of the server in tables and charts (default: host:port).
    #[arg(long)]
    pub label: Option<String>,
    /// tokenizer.json or GGUF file for counting tokens (default: the server's /tokenize, else words).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
}

fn parse_rate(text: &str) -> Result<f64, String> {
    let rate = if text.eq_ignore_ascii_case("inf") {
        f64::INFINITY
    } else {
        text.parse::<f64>()
            .map_err(|_| format!("{text:?} is not a rate; pass requests per second, e.g. 10, or inf"))?
    };
    if rate.is_nan() || rate <= 0.0 {
        return Err(format!("{text} is not a positive rate; pass e.g. 10, or inf"));
    }
    Ok(rate)
}

impl BenchArgs {
    /// The run these flags describe (the sweep levels are applied by [`run`]).
    pub fn to_config(&self) -> anyhow::Result<BenchConfig> {
        let load = if self.request_rate.is_infinite() {
            LoadShape::ClosedLoop {
                users: self.concurrency.unwrap_or(DEFAULT_USERS),
            }
        } else {
            LoadShape::OpenLoop {
                rate: self.request_rate,
                arrival: self.arrival,
                max_concurrency: self.concurrency,
            }
        };
        let input = match (&self.prompt_file, &self.dataset) {
            (Some(path), _) => InputSource::PromptFile { path: path.clone() },
            (None, Some(path)) => InputSource::Dataset { path: path.clone() },
            (None, None) => InputSource::Random {
                input_len: self.input_len,
            },
        };
        let num_requests = match (self.num_requests, self.duration) {
            (None, None) => Some(DEFAULT_NUM_REQUESTS),
            (n, _) => n,
        };
        let api_key = self
            .api_key
            .clone()
            .or_else(|| std::env::var("OPENAI_API_KEY").ok())
            .filter(|k| !k.is_empty());
        let cfg = BenchConfig {
            base_url: self.base_url.clone(),
            model: self.model.clone(),
            endpoint: self.endpoint,
            load,
            num_requests,
            duration_s: self.duration,
            warmup: self.warmup,
            input,
            output_len: self.output_len,
            stream: !self.no_stream,
            ignore_eos: self.ignore_eos,
            sampling: Sampling {
                temperature: self.temperature,
                top_p: self.top_p,
                top_k: self.top_k,
            },
            api_key,
            timeout_s: self.timeout,
            seed: self.seed,
            tokenizer: self.tokenizer.clone(),
            label: self.label.clone(),
            progress: false,
        };
        cfg.validate()?;
        if self.sweep.contains(&0) {
            bail!("--sweep has a level of 0; pass levels of at least 1, e.g. --sweep 1,2,4,8");
        }
        Ok(cfg)
    }
}

/// `strata bench`: runs (or compares), prints the table, writes the JSON and, for sweeps, the SVG.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if let Some(files) = &args.compare {
        let [a, b] = files.as_slice() else {
            bail!("--compare takes two files; pass --compare a.json b.json");
        };
        print!("{}", compare_files(a, b, args.plot.as_deref())?);
        return Ok(());
    }
    let mut cfg = args.to_config()?;
    cfg.progress = std::io::stderr().is_terminal();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| anyhow::anyhow!("cannot start the async runtime: {e}"))?;
    let runs: Vec<BenchReport> = runtime.block_on(async {
        if args.sweep.is_empty() {
            Ok(vec![crate::run_bench(&cfg).await?])
        } else {
            crate::run_sweep(&cfg, &args.sweep, |r| {
                eprintln!(
                    "concurrency {}: {:.1} output tok/s, TTFT p95 {} ms, error rate {:.2}%",
                    r.concurrency.map(|c| c.to_string()).unwrap_or_default(),
                    r.output_token_throughput,
                    r.ttft_ms
                        .as_ref()
                        .map(|s| format!("{:.1}", s.p95))
                        .unwrap_or("-".into()),
                    r.error_rate * 100.0
                )
            })
            .await
        }
    })?;
    if let [single] = runs.as_slice() {
        println!("{}", run_details(single));
    }
    print!("{}", summary_table(&runs));
    let output = args.output.clone().unwrap_or_else(default_output_path);
    BenchResults::new(runs).write(&output)?;
    println!("results: {}", output.display());
    let plot = args
        .plot
        .clone()
        .or_else(|| (!args.sweep.is_empty()).then(|| output.with_extension("svg")));
    if let Some(plot) = plot {
        let results = BenchResults::read(&output)?;
        let label = cfg.display_label();
        write_svg(
            &plot,
            &[SweepSeries {
                name: &label,
                runs: &results.runs,
            }],
        )?;
        println!("chart: {}", plot.display());
    }
    Ok(())
}

/// The compare table of two results files; with `plot`, also an SVG of both sweeps.
pub fn compare_files(a: &Path, b: &Path, plot: Option<&Path>) -> anyhow::Result<String> {
    let (results_a, results_b) = (BenchResults::read(a)?, BenchResults::read(b)?);
    let mut out = compare_table(
        &results_a,
        &results_b,
        &a.display().to_string(),
        &b.display().to_string(),
    );
    if let Some(plot) = plot {
        let name = |r: &BenchResults, fallback: &str| {
            r.runs
                .first()
                .map(|run| run.label.clone())
                .unwrap_or_else(|| fallback.to_string())
        };
        let (name_a, name_b) = (name(&results_a, "A"), name(&results_b, "B"));
        let (name_a, name_b) = if name_a == name_b {
            (format!("A: {name_a}"), format!("B: {name_b}"))
        } else {
            (name_a, name_b)
        };
        write_svg(
            plot,
            &[
                SweepSeries {
                    name: &name_a,
                    runs: &results_a.runs,
                },
                SweepSeries {
                    name: &name_b,
                    runs: &results_b.runs,
                },
            ],
        )?;
        out.push_str(&format!("chart: {}\n", plot.display()));
    }
    Ok(out)
}

fn write_svg(path: &Path, series: &[SweepSeries<'_>]) -> anyhow::Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .map_err(|e| anyhow::anyhow!("cannot create {}: {e}; pass another --plot", dir.display()))?;
    }
    std::fs::write(path, sweep_svg(series))
        .map_err(|e| anyhow::anyhow!("cannot write {}: {e}; pass another --plot", path.display()))
}

/// `strata-bench-UNIXSECONDS.json` in the current folder: later runs sort after earlier ones.
fn default_output_path() -> PathBuf {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    PathBuf::from(format!("strata-bench-{secs}.json"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).map(|c| c.bench)
    }

    #[test]
    fn defaults_are_a_closed_loop_of_eight_users() {
        let cfg = parse(&[]).unwrap().to_config().unwrap();
        assert_eq!(cfg.load, LoadShape::ClosedLoop { users: 8 });
        assert_eq!(cfg.num_requests, Some(200));
        assert!(cfg.stream);
    }

    #[test]
    fn a_rate_makes_an_open_loop() {
        let cfg = parse(&[
            "--request-rate",
            "5",
            "--arrival",
            "constant",
            "-c",
            "4",
            "--duration",
            "3",
        ])
        .unwrap()
        .to_config()
        .unwrap();
        assert_eq!(
            cfg.load,
            LoadShape::OpenLoop {
                rate: 5.0,
                arrival: Arrival::Constant,
                max_concurrency: Some(4)
            }
        );
        assert_eq!((cfg.num_requests, cfg.duration_s), (None, Some(3.0)));
    }

    #[test]
    fn bad_values_are_refused_with_a_fix() {
        assert!(parse(&["--request-rate", "fast"]).is_err());
        assert!(parse(&["--request-rate", "-1"]).is_err());
        let err = parse(&["--sweep", "1,0"]).unwrap().to_config().unwrap_err();
        assert!(err.to_string().contains("--sweep"));
        assert_eq!(parse(&["--sweep", "1,2,4"]).unwrap().sweep, vec![1, 2, 4]);
    }
}
