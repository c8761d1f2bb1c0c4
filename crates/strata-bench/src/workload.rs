//! What the bench sends: prompts (random of a token length, a prompt file, or ShareGPT conversations) as request bodies.
//! Owns the model name and counting tokens on this side: a local tokenizer, the server's /tokenize, or a word estimate.

use std::path::Path;

use anyhow::{bail, Context};
use bytes::Bytes;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use strata_model::tokenizer::Tokenizer;

use crate::client::error_chain;
use crate::config::{BenchConfig, Endpoint, InputSource, LoadShape, DEFAULT_OUTPUT_LEN};
use crate::rng::SeededRng;

/// Where a token count came from; the report says which one each figure used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CountSource {
    /// `usage` in the server's response.
    ServerUsage,
    /// The local tokenizer given with `--tokenizer`.
    Tokenizer,
    /// The server's POST /tokenize.
    ServerTokenize,
    /// One token per streamed content chunk (approximate).
    StreamChunks,
    /// One token per whitespace-separated word (approximate).
    Words,
}

impl CountSource {
    pub fn describe(self) -> &'static str {
        match self {
            CountSource::ServerUsage => "server usage",
            CountSource::Tokenizer => "local tokenizer",
            CountSource::ServerTokenize => "server /tokenize",
            CountSource::StreamChunks => "stream chunks (approximate)",
            CountSource::Words => "words (approximate)",
        }
    }
}

/// Counts tokens of text on the client side.
#[derive(Clone, Debug)]
pub enum TokenCounter {
    Local(Tokenizer),
    Server {
        client: reqwest::Client,
        url: String,
        api_key: Option<String>,
        body: TokenizeBody,
    },
    Words,
}

/// The two request shapes of POST /tokenize in the wild.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizeBody {
    /// `{"model", "prompt", "add_special_tokens": false}` (strata, vLLM, SGLang).
    Prompt,
    /// `{"content"}` (llama.cpp).
    Content,
}

impl TokenCounter {
    /// The best counter available: `--tokenizer`, else the server's /tokenize, else words.
    pub async fn detect(cfg: &BenchConfig, client: &reqwest::Client, model: &str) -> anyhow::Result<Self> {
        if let Some(path) = &cfg.tokenizer {
            return Ok(TokenCounter::Local(load_tokenizer(path)?));
        }
        for body in [TokenizeBody::Prompt, TokenizeBody::Content] {
            let counter = TokenCounter::Server {
                client: client.clone(),
                url: cfg.url("/tokenize"),
                api_key: cfg.api_key.clone(),
                body,
            };
            if matches!(counter.count_with_model("hello world", model).await, Ok(n) if n > 0) {
                return Ok(counter);
            }
        }
        Ok(TokenCounter::Words)
    }

    pub fn source(&self) -> CountSource {
        match self {
            TokenCounter::Local(_) => CountSource::Tokenizer,
            TokenCounter::Server { .. } => CountSource::ServerTokenize,
            TokenCounter::Words => CountSource::Words,
        }
    }

    /// Tokens in `text`, without special tokens. `model` is sent to servers that want one.
    pub async fn count_with_model(&self, text: &str, model: &str) -> anyhow::Result<u64> {
        match self {
            TokenCounter::Local(tokenizer) => Ok(tokenizer
                .encode(text, false, false)
                .map_err(|e| anyhow::anyhow!("tokenizer failed: {e}"))?
                .len() as u64),
            TokenCounter::Words => Ok(text.split_whitespace().count() as u64),
            TokenCounter::Server {
                client,
                url,
                api_key,
                body,
            } => {
                let payload = match body {
                    TokenizeBody::Prompt => {
                        json!({"model": model, "prompt": text, "add_special_tokens": false})
                    }
                    TokenizeBody::Content => json!({"content": text, "add_special": false}),
                };
                let mut request = client.post(url).json(&payload);
                if let Some(key) = api_key {
                    request = request.bearer_auth(key);
                }
                let response = request
                    .send()
                    .await
                    .map_err(|e| anyhow::anyhow!("POST {url}: {}", error_chain(&e)))?;
                if !response.status().is_success() {
                    let status = response.status();
                    let body: Value = response.json().await.unwrap_or(Value::Null);
                    if body.pointer("/error/code").and_then(Value::as_str) == Some("context_length_exceeded") {
                        // The server counts nothing longer than its context; the request itself
                        // will be refused and counted as an error, so a word count stands in.
                        return Ok(text.split_whitespace().count() as u64);
                    }
                    bail!("POST {url} answered {status}");
                }
                let value: Value = response
                    .json()
                    .await
                    .map_err(|e| anyhow::anyhow!("POST {url}: {}", error_chain(&e)))?;
                value
                    .get("count")
                    .and_then(Value::as_u64)
                    .or_else(|| value.get("tokens").and_then(Value::as_array).map(|t| t.len() as u64))
                    .with_context(|| format!("POST {url} gave neither count nor tokens"))
            }
        }
    }
}

/// Loads a tokenizer from a `tokenizer.json` or a GGUF model file.
pub fn load_tokenizer(path: &Path) -> anyhow::Result<Tokenizer> {
    let fix = "pass a tokenizer.json or a .gguf model file with --tokenizer";
    let is_gguf = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        || std::fs::File::open(path)
            .and_then(|mut f| {
                let mut magic = [0u8; 4];
                std::io::Read::read_exact(&mut f, &mut magic).map(|_| magic == *b"GGUF")
            })
            .unwrap_or(false);
    if is_gguf {
        let gguf = strata_model::loader::open_gguf(path)
            .map_err(|e| anyhow::anyhow!("cannot open {}: {e}; {fix}", path.display()))?;
        return Tokenizer::from_gguf(&gguf)
            .map_err(|e| anyhow::anyhow!("no tokenizer in {}: {e}; {fix}", path.display()));
    }
    let config = path.with_file_name("tokenizer_config.json");
    let config = config.exists().then_some(config.as_path());
    Tokenizer::from_hf_file(path, config).map_err(|e| anyhow::anyhow!("cannot read {}: {e}; {fix}", path.display()))
}

/// Asks GET /v1/models: checks the server is there and finds the model name when none is given.
pub async fn resolve_model(cfg: &BenchConfig, client: &reqwest::Client) -> anyhow::Result<String> {
    let url = cfg.url("/v1/models");
    let mut request = client.get(&url);
    if let Some(key) = &cfg.api_key {
        request = request.bearer_auth(key);
    }
    let response = match request.send().await {
        Ok(r) => r,
        Err(e) => bail!(
            "cannot reach the server at {}: {}; start it, or pass --base-url",
            cfg.base_url,
            error_chain(&e)
        ),
    };
    if let Some(model) = &cfg.model {
        return Ok(model.clone());
    }
    let status = response.status();
    if !status.is_success() {
        bail!("GET {url} answered {status}; pass --model NAME (and --api-key if the server wants one)");
    }
    let value: Value = response
        .json()
        .await
        .map_err(|e| anyhow::anyhow!("GET {url} did not return JSON ({}); pass --model NAME", error_chain(&e)))?;
    match value.pointer("/data/0/id").and_then(Value::as_str) {
        Some(id) => Ok(id.to_string()),
        None => bail!("GET {url} lists no models; pass --model NAME"),
    }
}

/// One request ready to send: its serialized body and what is known of its size.
#[derive(Clone, Debug)]
pub struct PreparedRequest {
    pub body: Bytes,
    /// Prompt tokens as counted on this side (see [`Workload::prompt_counting`]).
    pub input_tokens: u64,
    pub max_tokens: u32,
}

/// Every request of a run, prepared before the clock starts.
#[derive(Debug)]
pub struct Workload {
    pub model: String,
    pub warmup: Vec<PreparedRequest>,
    /// Measured requests; a duration-bound run cycles through them.
    pub measured: Vec<PreparedRequest>,
    pub counter: TokenCounter,
    /// How prompt lengths were counted.
    pub prompt_counting: CountSource,
    /// Caveats the report repeats (approximations, repeated prompts).
    pub notes: Vec<String>,
}

impl Workload {
    /// The `i`-th measured request (cycling).
    pub fn measured_request(&self, i: u64) -> &PreparedRequest {
        &self.measured[(i % self.measured.len() as u64) as usize]
    }
}

/// Distinct prompts prepared for a run bound only by duration.
pub const DURATION_PROMPT_POOL: u64 = 2000;

/// Builds all prompts and request bodies of a run.
pub async fn prepare_workload(cfg: &BenchConfig, client: &reqwest::Client, model: String) -> anyhow::Result<Workload> {
    let counter = TokenCounter::detect(cfg, client, &model).await?;
    let mut notes = Vec::new();
    if counter.source() == CountSource::Words {
        notes.push(
            "no tokenizer (no --tokenizer, no server /tokenize): prompt lengths are approximate, one word per token; \
             pass --tokenizer tokenizer.json|model.gguf for exact lengths"
                .to_string(),
        );
    }
    let measured_count = match (cfg.num_requests, &cfg.load) {
        (Some(n), _) => n,
        (None, LoadShape::OpenLoop { rate, .. }) => {
            ((rate * cfg.duration_s.unwrap_or(0.0)).ceil() as u64 + 1).clamp(1, DURATION_PROMPT_POOL)
        }
        (None, LoadShape::ClosedLoop { .. }) => DURATION_PROMPT_POOL,
    };
    if cfg.num_requests.is_none() {
        notes.push(format!(
            "a duration-bound run cycles through {measured_count} distinct prompts"
        ));
    }
    let total = cfg.warmup + measured_count;
    if cfg.progress && counter.source() == CountSource::ServerTokenize {
        eprintln!("preparing {total} prompts with the server's /tokenize ...");
    }
    let mut rng = SeededRng::new(cfg.seed);
    let mut requests = Vec::with_capacity(total as usize);
    match &cfg.input {
        InputSource::Random { input_len } => {
            let max_tokens = cfg.output_len.unwrap_or(DEFAULT_OUTPUT_LEN);
            for _ in 0..total {
                let (prompt, tokens) = random_prompt(&mut rng, &counter, &model, *input_len).await?;
                requests.push(prepared(cfg, &model, &prompt, tokens, max_tokens));
            }
        }
        InputSource::PromptFile { path } => {
            let prompts = read_prompt_file(path)?;
            let max_tokens = cfg.output_len.unwrap_or(DEFAULT_OUTPUT_LEN);
            let mut counts = Vec::with_capacity(prompts.len());
            for p in &prompts {
                counts.push(counter.count_with_model(p, &model).await?);
            }
            for i in 0..total as usize {
                let k = i % prompts.len();
                requests.push(prepared(cfg, &model, &prompts[k], counts[k], max_tokens));
            }
        }
        InputSource::Dataset { path } => {
            let mut conversations = read_dataset(path)?;
            rng.shuffle(&mut conversations);
            conversations.truncate(total as usize);
            let mut prepared_once = Vec::with_capacity(conversations.len());
            for c in &conversations {
                let tokens = counter.count_with_model(&c.prompt, &model).await?;
                let max_tokens = match (cfg.output_len, &c.reply) {
                    (Some(n), _) => n,
                    (None, Some(reply)) => (counter.count_with_model(reply, &model).await? as u32).max(1),
                    (None, None) => DEFAULT_OUTPUT_LEN,
                };
                prepared_once.push(prepared(cfg, &model, &c.prompt, tokens, max_tokens));
            }
            for i in 0..total as usize {
                requests.push(prepared_once[i % prepared_once.len()].clone());
            }
        }
    }
    let measured = requests.split_off(cfg.warmup as usize);
    Ok(Workload {
        model,
        warmup: requests,
        measured,
        prompt_counting: counter.source(),
        counter,
        notes,
    })
}

fn prepared(cfg: &BenchConfig, model: &str, prompt: &str, input_tokens: u64, max_tokens: u32) -> PreparedRequest {
    PreparedRequest {
        body: request_body(cfg, model, prompt, max_tokens),
        input_tokens,
        max_tokens,
    }
}

/// The JSON body of one chat or completions request.
pub fn request_body(cfg: &BenchConfig, model: &str, prompt: &str, max_tokens: u32) -> Bytes {
    let mut body = json!({"model": model, "max_tokens": max_tokens, "stream": cfg.stream});
    match cfg.endpoint {
        Endpoint::Chat => body["messages"] = json!([{"role": "user", "content": prompt}]),
        Endpoint::Completions => body["prompt"] = json!(prompt),
    }
    if cfg.stream {
        body["stream_options"] = json!({"include_usage": true});
    }
    if cfg.ignore_eos {
        body["ignore_eos"] = json!(true);
    }
    let s = &cfg.sampling;
    if let Some(t) = s.temperature {
        body["temperature"] = json!(t);
    }
    if let Some(p) = s.top_p {
        body["top_p"] = json!(p);
    }
    if let Some(k) = s.top_k {
        body["top_k"] = json!(k);
    }
    Bytes::from(body.to_string())
}

/// Common English words that most tokenizers keep as one token (with their leading space).
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were", "their",
    "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "she", "other", "its", "may", "these", "what", "them", "than", "some", "him", "time", "into", "only", "do",
    "could", "new", "about", "two", "first", "then", "also", "any", "like", "our", "over", "such", "my", "out", "man",
    "even", "most", "made", "after", "many", "must", "before", "years", "way", "where", "should", "each", "well",
    "people", "much", "your", "through", "long", "down", "three", "work", "just", "state", "water", "own", "life",
    "good", "world", "day", "us", "same", "might", "back", "because", "under", "last", "great", "never", "house",
    "while", "place", "high", "old", "small", "part", "found", "think", "still", "between", "school", "take", "make",
    "know", "right", "year", "city", "since", "little", "light", "home", "country", "hand", "end", "game", "line",
    "name", "word", "open", "money", "night", "road", "power", "body", "river", "music", "paper", "story", "table",
    "market", "field", "voice", "heart", "model", "paint", "plant", "green", "black", "white",
];

/// A prompt of random words whose token count is `target` (or as close as a few adjustments get).
async fn random_prompt(
    rng: &mut SeededRng,
    counter: &TokenCounter,
    model: &str,
    target: u32,
) -> anyhow::Result<(String, u64)> {
    let target = u64::from(target);
    let first_guess = match counter {
        TokenCounter::Words => target,
        _ => (target * 3 / 4).max(1),
    };
    let mut words: Vec<&str> = (0..first_guess).map(|_| WORDS[rng.below(WORDS.len())]).collect();
    let mut closest: Option<(u64, String, u64)> = None;
    for _ in 0..24 {
        let text = words.join(" ");
        let n = counter.count_with_model(&text, model).await?;
        let distance = n.abs_diff(target);
        if n == target {
            return Ok((text, n));
        }
        if closest.as_ref().is_none_or(|(d, _, _)| distance < *d) {
            closest = Some((distance, text, n));
        }
        if n > target {
            let remove = ((n - target) * words.len() as u64 / n).max(1) as usize;
            if words.len() <= 1 {
                break;
            }
            words.truncate((words.len() - remove).max(1));
        } else {
            let deficit = target - n;
            if deficit >= 4 {
                words.extend((0..deficit * 3 / 4).map(|_| WORDS[rng.below(WORDS.len())]));
            } else {
                words.extend((0..deficit).map(|_| "a"));
            }
        }
    }
    let (_, text, n) = closest.context("no prompt was built")?;
    Ok((text, n))
}

/// Prompts from `--prompt-file`: a `.jsonl` file of `{"prompt": ...}` lines, else the whole file as one prompt.
pub fn read_prompt_file(path: &Path) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!(
            "cannot read prompt file {}: {e}; check the --prompt-file path",
            path.display()
        )
    })?;
    if !path.extension().is_some_and(|e| e.eq_ignore_ascii_case("jsonl")) {
        if text.trim().is_empty() {
            bail!("prompt file {} is empty; put the prompt text in it", path.display());
        }
        return Ok(vec![text]);
    }
    let mut prompts = Vec::new();
    for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let value: Value = serde_json::from_str(line).map_err(|e| {
            anyhow::anyhow!(
                "{} line {}: not JSON ({e}); write one {{\"prompt\": ...}} per line",
                path.display(),
                n + 1
            )
        })?;
        match value.get("prompt").and_then(Value::as_str).or(value.as_str()) {
            Some(p) => prompts.push(p.to_string()),
            None => bail!(
                "{} line {}: no \"prompt\" string; write one {{\"prompt\": ...}} per line",
                path.display(),
                n + 1
            ),
        }
    }
    if prompts.is_empty() {
        bail!(
            "prompt file {} has no prompts; write one {{\"prompt\": ...}} per line",
            path.display()
        );
    }
    Ok(prompts)
}

/// One conversation of a dataset: the first user turn and the reply to it.
#[derive(Clone, Debug, PartialEq)]
pub struct Conversation {
    pub prompt: String,
    pub reply: Option<String>,
}

#[derive(Deserialize)]
struct DatasetItem {
    #[serde(default)]
    conversations: Vec<ShareGptTurn>,
    #[serde(default)]
    messages: Vec<ChatTurn>,
}

#[derive(Deserialize)]
struct ShareGptTurn {
    from: String,
    value: Value,
}

#[derive(Deserialize)]
struct ChatTurn {
    role: String,
    content: Value,
}

impl DatasetItem {
    fn into_conversation(self) -> Option<Conversation> {
        let turns: Vec<(bool, String)> = self
            .conversations
            .into_iter()
            .map(|t| (t.from, t.value))
            .chain(self.messages.into_iter().map(|t| (t.role, t.content)))
            .filter_map(|(role, text)| {
                let is_user = matches!(role.as_str(), "human" | "user");
                let is_reply = matches!(role.as_str(), "gpt" | "assistant" | "chatgpt" | "bard" | "model");
                let text = text.as_str()?.to_string();
                (is_user || is_reply).then_some((is_user, text))
            })
            .collect();
        let first_user = turns
            .iter()
            .position(|(is_user, text)| *is_user && !text.trim().is_empty())?;
        let reply = turns[first_user + 1..]
            .iter()
            .find(|(is_user, _)| !is_user)
            .map(|(_, text)| text.clone());
        Some(Conversation {
            prompt: turns[first_user].1.clone(),
            reply,
        })
    }
}

/// Conversations of a ShareGPT-shaped dataset: a JSON array, or JSONL with one conversation per line.
/// Each item has `conversations: [{from, value}]` (ShareGPT) or `messages: [{role, content}]` (OpenAI).
pub fn read_dataset(path: &Path) -> anyhow::Result<Vec<Conversation>> {
    let fix = "give a ShareGPT JSON/JSONL file with --dataset";
    let text = std::fs::read_to_string(path)
        .map_err(|e| anyhow::anyhow!("cannot read dataset {}: {e}; {fix}", path.display()))?;
    let items: Vec<DatasetItem> = if text.trim_start().starts_with('[') {
        serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("dataset {}: {e}; {fix}", path.display()))?
    } else {
        let mut items = Vec::new();
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
            items.push(
                serde_json::from_str(line)
                    .map_err(|e| anyhow::anyhow!("dataset {} line {}: {e}; {fix}", path.display(), n + 1))?,
            );
        }
        items
    };
    let conversations: Vec<Conversation> = items.into_iter().filter_map(DatasetItem::into_conversation).collect();
    if conversations.is_empty() {
        bail!("dataset {} has no conversation with a user turn; {fix}", path.display());
    }
    Ok(conversations)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("strata-bench-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn sharegpt_and_openai_shapes_both_read() {
        let path = temp_file(
            "data.jsonl",
            concat!(
                r#"{"id":"a","conversations":[{"from":"system","value":"be nice"},{"from":"human","value":"hi there"},{"from":"gpt","value":"hello you"}]}"#,
                "\n\n",
                r#"{"messages":[{"role":"user","content":"q"}]}"#,
                "\n",
                r#"{"conversations":[{"from":"gpt","value":"only a reply"}]}"#,
                "\n",
            ),
        );
        let conversations = read_dataset(&path).unwrap();
        assert_eq!(
            conversations,
            vec![
                Conversation {
                    prompt: "hi there".into(),
                    reply: Some("hello you".into())
                },
                Conversation {
                    prompt: "q".into(),
                    reply: None
                },
            ]
        );
        let array = temp_file("data.json", r#"[{"conversations":[{"from":"human","value":"x"}]}]"#);
        assert_eq!(read_dataset(&array).unwrap().len(), 1);
    }

    #[test]
    fn prompt_file_is_one_prompt_or_jsonl_lines() {
        let plain = temp_file("p.txt", "line one\nline two\n");
        assert_eq!(read_prompt_file(&plain).unwrap(), vec!["line one\nline two\n"]);
        let lines = temp_file("p.jsonl", "{\"prompt\":\"a\"}\n\"b\"\n");
        assert_eq!(read_prompt_file(&lines).unwrap(), vec!["a", "b"]);
        let bad = temp_file("bad.jsonl", "{\"text\":1}\n");
        assert!(read_prompt_file(&bad).unwrap_err().to_string().contains("line 1"));
    }

    #[tokio::test]
    async fn random_prompts_hit_the_word_count() {
        let mut rng = SeededRng::new(3);
        for target in [1, 7, 100] {
            let (text, n) = random_prompt(&mut rng, &TokenCounter::Words, "m", target)
                .await
                .unwrap();
            assert_eq!(n, u64::from(target));
            assert_eq!(text.split_whitespace().count(), target as usize);
        }
    }

    #[test]
    fn bodies_carry_stream_options_and_ignore_eos() {
        let mut cfg = BenchConfig::new("http://x:1");
        cfg.ignore_eos = true;
        let chat: Value = serde_json::from_slice(&request_body(&cfg, "m", "hi", 5)).unwrap();
        assert_eq!(chat["messages"][0]["content"], "hi");
        assert_eq!(chat["stream_options"]["include_usage"], true);
        assert_eq!(chat["ignore_eos"], true);
        cfg.endpoint = Endpoint::Completions;
        cfg.stream = false;
        cfg.ignore_eos = false;
        let completion: Value = serde_json::from_slice(&request_body(&cfg, "m", "hi", 5)).unwrap();
        assert_eq!(completion["prompt"], "hi");
        assert!(completion.get("stream_options").is_none() && completion.get("ignore_eos").is_none());
        assert!(completion.get("temperature").is_none() && completion.get("top_p").is_none());
        cfg.sampling.temperature = Some(0.5);
        cfg.sampling.top_p = Some(0.9);
        cfg.sampling.top_k = Some(40);
        let sampled: Value = serde_json::from_slice(&request_body(&cfg, "m", "hi", 5)).unwrap();
        assert_eq!(
            (&sampled["temperature"], &sampled["top_p"], &sampled["top_k"]),
            (&json!(0.5), &json!(0.9f32), &json!(40))
        );
        cfg.sampling.top_p = Some(1.5);
        let err = cfg.validate().unwrap_err().to_string();
        assert!(err.contains("--top-p 1.5"), "{err}");
    }
}
