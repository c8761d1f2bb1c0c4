//! The full description of one bench run, as the library takes it and the JSON report records it.
//! Owns the load shape, the inputs, the request options and their validation.

use std::path::PathBuf;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Which OpenAI endpoint the requests go to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    /// POST /v1/chat/completions with one user message.
    Chat,
    /// POST /v1/completions with a plain prompt.
    Completions,
}

impl Endpoint {
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completions => "/v1/completions",
        }
    }
}

/// How the times between request arrivals are drawn in an open loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Arrival {
    /// Exponential gaps: a Poisson process, like independent users.
    Poisson,
    /// Equal gaps of 1/rate.
    Constant,
}

/// How requests are issued.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum LoadShape {
    /// `users` simulated users, each sending its next request when the previous one ends.
    ClosedLoop { users: usize },
    /// Requests arrive at `rate` per second whatever the server does, at most `max_concurrency` in flight.
    OpenLoop {
        rate: f64,
        arrival: Arrival,
        max_concurrency: Option<usize>,
    },
}

impl LoadShape {
    /// The users of a closed loop, or the cap of an open loop (None: no cap).
    pub fn concurrency(&self) -> Option<usize> {
        match self {
            LoadShape::ClosedLoop { users } => Some(*users),
            LoadShape::OpenLoop { max_concurrency, .. } => *max_concurrency,
        }
    }

    /// The same shape with its concurrency set to `level` (a sweep step).
    pub fn with_concurrency(&self, level: usize) -> LoadShape {
        match self {
            LoadShape::ClosedLoop { .. } => LoadShape::ClosedLoop { users: level },
            LoadShape::OpenLoop { rate, arrival, .. } => LoadShape::OpenLoop {
                rate: *rate,
                arrival: *arrival,
                max_concurrency: Some(level),
            },
        }
    }

    /// The request rate of an open loop; None for a closed loop.
    pub fn request_rate(&self) -> Option<f64> {
        match self {
            LoadShape::ClosedLoop { .. } => None,
            LoadShape::OpenLoop { rate, .. } => Some(*rate),
        }
    }
}

/// Where prompts come from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum InputSource {
    /// Random English words, adjusted to `input_len` tokens.
    Random { input_len: u32 },
    /// A text file sent as one prompt, or a `.jsonl` file of `{"prompt": ...}` lines.
    PromptFile { path: PathBuf },
    /// A ShareGPT-shaped dataset (JSON array or JSONL): first user turn as prompt, first reply sets the length.
    Dataset { path: PathBuf },
}

/// Everything one bench run needs. Build it with [`crate::BenchArgs::to_config`] or by hand.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BenchConfig {
    /// Server root, e.g. `http://127.0.0.1:8000` (no trailing `/v1`).
    pub base_url: String,
    /// Model name to request; None asks GET /v1/models and takes the first.
    pub model: Option<String>,
    pub endpoint: Endpoint,
    pub load: LoadShape,
    /// Stop after this many measured requests have been sent.
    pub num_requests: Option<u64>,
    /// Stop sending after this many seconds of the measured phase (in-flight requests still finish).
    pub duration_s: Option<f64>,
    /// Requests sent before the measured phase and left out of every figure.
    pub warmup: u64,
    pub input: InputSource,
    /// max_tokens of every request; None with a dataset means each reply's own length, else 128.
    pub output_len: Option<u32>,
    pub stream: bool,
    pub ignore_eos: bool,
    /// Sampling parameters sent with every request (those left None are not sent).
    #[serde(default)]
    pub sampling: Sampling,
    /// Sent as `Authorization: Bearer`; never written to the report.
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Whole-request timeout in seconds.
    pub timeout_s: f64,
    pub seed: u64,
    /// tokenizer.json or GGUF file for counting tokens on this side.
    pub tokenizer: Option<PathBuf>,
    /// Name of the server in tables and plots; None: host:port of `base_url`.
    pub label: Option<String>,
    /// Draw a progress bar on stderr (the CLI turns it on for terminals).
    #[serde(skip)]
    pub progress: bool,
}

/// Sampling parameters of the requests; None leaves the server's default.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
}

/// Output length used when neither `--output-len` nor a dataset reply says otherwise.
pub const DEFAULT_OUTPUT_LEN: u32 = 128;

impl BenchConfig {
    /// A closed-loop config with small defaults, for tests and library callers.
    pub fn new(base_url: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into(),
            model: None,
            endpoint: Endpoint::Chat,
            load: LoadShape::ClosedLoop { users: 8 },
            num_requests: Some(200),
            duration_s: None,
            warmup: 0,
            input: InputSource::Random { input_len: 256 },
            output_len: None,
            stream: true,
            ignore_eos: false,
            sampling: Sampling::default(),
            api_key: None,
            timeout_s: 600.0,
            seed: 0,
            tokenizer: None,
            label: None,
            progress: false,
        }
    }

    /// Checks what the types cannot; each error is one line with the fix.
    pub fn validate(&self) -> anyhow::Result<()> {
        use anyhow::bail;
        if self.base_url.starts_with("https://") {
            bail!(
                "base URL {:?} needs TLS, which strata bench is built without; bench the server's plain http port, \
                 e.g. --base-url http://127.0.0.1:8000",
                self.base_url
            );
        }
        if !self.base_url.starts_with("http://") {
            bail!(
                "base URL {:?} has no http:// scheme; pass e.g. --base-url http://127.0.0.1:8000",
                self.base_url
            );
        }
        if self.num_requests.is_none() && self.duration_s.is_none() {
            bail!("no stop condition; pass --num-requests N or --duration SECONDS");
        }
        if self.num_requests == Some(0) {
            bail!("--num-requests is 0; pass at least 1");
        }
        if let Some(t) = self.sampling.temperature {
            if !(t.is_finite() && t >= 0.0) {
                bail!("--temperature {t} is not a temperature; pass a number >= 0, e.g. --temperature 0.7");
            }
        }
        if let Some(p) = self.sampling.top_p {
            if !(p > 0.0 && p <= 1.0) {
                bail!("--top-p {p} is not in (0, 1]; pass e.g. --top-p 0.9");
            }
        }
        if let Some(d) = self.duration_s {
            if !(d.is_finite() && d > 0.0) {
                bail!("--duration {d} is not a positive number of seconds; pass e.g. --duration 60");
            }
        }
        match &self.load {
            LoadShape::ClosedLoop { users } if *users == 0 => bail!("--concurrency is 0; pass at least 1"),
            LoadShape::OpenLoop { rate, .. } if !(rate.is_finite() && *rate > 0.0) => {
                bail!("--request-rate {rate} is not a positive rate; pass e.g. --request-rate 10, or inf for a closed loop")
            }
            LoadShape::OpenLoop {
                max_concurrency: Some(0),
                ..
            } => bail!("--concurrency is 0; pass at least 1, or leave it out for no cap"),
            _ => {}
        }
        if let InputSource::Random { input_len: 0 } = self.input {
            bail!("--input-len is 0; pass at least 1");
        }
        if self.output_len == Some(0) {
            bail!("--output-len is 0; pass at least 1");
        }
        if !(self.timeout_s.is_finite() && self.timeout_s > 0.0) {
            bail!(
                "--timeout {} is not a positive number of seconds; pass e.g. --timeout 600",
                self.timeout_s
            );
        }
        Ok(())
    }

    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout_s)
    }

    /// The label for tables: the given one, else host:port of the base URL.
    pub fn display_label(&self) -> String {
        if let Some(label) = &self.label {
            return label.clone();
        }
        let without_scheme = self.base_url.split("://").nth(1).unwrap_or(&self.base_url);
        without_scheme.split('/').next().unwrap_or(without_scheme).to_string()
    }

    /// The URL of a path on the server, e.g. `/v1/models`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base_url.trim_end_matches('/'), path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_defaults_to_host_and_port() {
        let cfg = BenchConfig::new("http://127.0.0.1:8000/");
        assert_eq!(cfg.display_label(), "127.0.0.1:8000");
        assert_eq!(cfg.url("/v1/models"), "http://127.0.0.1:8000/v1/models");
    }

    #[test]
    fn validation_names_the_flag() {
        let mut cfg = BenchConfig::new("http://x:1");
        cfg.load = LoadShape::ClosedLoop { users: 0 };
        assert!(cfg.validate().unwrap_err().to_string().contains("--concurrency"));
        cfg.load = LoadShape::ClosedLoop { users: 1 };
        cfg.num_requests = None;
        assert!(cfg.validate().unwrap_err().to_string().contains("--duration"));
        assert!(BenchConfig::new("https://x:1")
            .validate()
            .unwrap_err()
            .to_string()
            .contains("TLS"));
    }

    #[test]
    fn api_key_is_never_serialized() {
        let mut cfg = BenchConfig::new("http://x:1");
        cfg.api_key = Some("sk-secret".into());
        assert!(!serde_json::to_string(&cfg).unwrap().contains("sk-secret"));
    }
}
