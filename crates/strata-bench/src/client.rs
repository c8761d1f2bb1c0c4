//! One timed HTTP request to an OpenAI-compatible server: TTFT, content-chunk arrival times, usage.
//! Owns sending, response parsing (SSE stream or one JSON body) and classifying what went wrong.

use std::fmt;
use std::time::{Duration, Instant};

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::config::BenchConfig;
use crate::sse::SseParser;

/// Why a request failed; the report counts each kind (and each HTTP status) separately.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The server answered with a non-2xx status.
    HttpStatus(u16),
    /// The whole request took longer than `--timeout`.
    Timeout,
    /// No connection could be made.
    Connect,
    /// The connection closed before the response was complete.
    Disconnect,
    /// The stream had bad JSON, or ended without `data: [DONE]`; or a JSON body could not be read.
    MalformedStream,
    /// The server sent `{"error": ...}` inside the stream.
    StreamErrorEvent,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ErrorKind::HttpStatus(code) => write!(f, "http_{code}"),
            ErrorKind::Timeout => f.write_str("timeout"),
            ErrorKind::Connect => f.write_str("connect"),
            ErrorKind::Disconnect => f.write_str("disconnect"),
            ErrorKind::MalformedStream => f.write_str("malformed_stream"),
            ErrorKind::StreamErrorEvent => f.write_str("stream_error_event"),
        }
    }
}

/// A failed request: its kind and the first words of what went wrong.
#[derive(Clone, Debug)]
pub struct RequestFailure {
    pub kind: ErrorKind,
    pub message: String,
}

impl RequestFailure {
    fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

/// Token counts the server reported in `usage`.
#[derive(Clone, Copy, Debug, Default, Deserialize)]
pub struct ReportedUsage {
    pub prompt_tokens: Option<u64>,
    pub completion_tokens: Option<u64>,
}

/// A request that finished well, with its timings measured from just before sending.
#[derive(Clone, Debug, Default)]
pub struct TimedCompletion {
    /// Time to the first chunk carrying non-empty content (None when not streamed).
    pub ttft: Option<Duration>,
    /// Time to the end of the response.
    pub e2e: Duration,
    /// Gaps between consecutive content chunks.
    pub inter_chunk_gaps: Vec<Duration>,
    /// Chunks that carried content.
    pub content_chunks: u32,
    /// The generated text (content and reasoning), kept only when the server gave no completion_tokens.
    pub text: String,
    pub usage: Option<ReportedUsage>,
}

/// Builds the HTTP client every part of the bench uses: no proxy, no Nagle, a pool as large as the load.
pub fn http_client(cfg: &BenchConfig, pool_size: usize) -> anyhow::Result<reqwest::Client> {
    build_client(cfg, pool_size.max(1))
}

/// A client with `idle_per_host` kept-alive connections (0: a new connection for every request).
fn build_client(cfg: &BenchConfig, idle_per_host: usize) -> anyhow::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(cfg.timeout())
        .pool_max_idle_per_host(idle_per_host)
        .tcp_nodelay(true)
        .no_proxy()
        .build()
        .map_err(|e| anyhow::anyhow!("cannot build the HTTP client: {}", error_chain(&e)))
}

/// One sent request: how it ended, and whether it was resent on a new connection.
#[derive(Debug)]
pub struct Sent {
    pub result: Result<TimedCompletion, RequestFailure>,
    /// The kept-alive connection it first went out on closed before any of the response arrived
    /// (the server had closed it while idle), so it was sent once more on a new connection.
    pub retried: bool,
}

/// Sends prepared request bodies to one endpoint and times them.
#[derive(Clone, Debug)]
pub struct RequestSender {
    client: reqwest::Client,
    /// Keeps no connection: the one resend of a request whose kept-alive connection was closed.
    fresh_client: reqwest::Client,
    url: String,
    stream: bool,
    api_key: Option<String>,
}

impl RequestSender {
    pub fn new(client: reqwest::Client, cfg: &BenchConfig) -> anyhow::Result<Self> {
        Ok(Self {
            client,
            fresh_client: build_client(cfg, 0)?,
            url: cfg.url(cfg.endpoint.path()),
            stream: cfg.stream,
            api_key: cfg.api_key.clone(),
        })
    }

    /// Sends one JSON body (already serialized) and times the answer. A request whose connection
    /// closed before any response byte is resent once on a new connection and timed from the
    /// resend: that is how a kept-alive connection the server closed while idle fails (llama.cpp's
    /// server does), and the server never saw the request. A server that drops requests this way
    /// every time still fails the resend; after any response byte a failure stands.
    pub async fn send(&self, body: Bytes) -> Sent {
        match self.send_with(&self.client, body.clone()).await {
            Err(Attempt::ClosedUnanswered(_)) => Sent {
                result: self
                    .send_with(&self.fresh_client, body)
                    .await
                    .map_err(Attempt::into_failure),
                retried: true,
            },
            result => Sent {
                result: result.map_err(Attempt::into_failure),
                retried: false,
            },
        }
    }

    async fn send_with(&self, client: &reqwest::Client, body: Bytes) -> Result<TimedCompletion, Attempt> {
        let mut request = client
            .post(&self.url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(key) = &self.api_key {
            request = request.bearer_auth(key);
        }
        let start = Instant::now();
        let response = request.send().await.map_err(|e| {
            let failure = classify(&e, false);
            if closed_before_response(&e) {
                Attempt::ClosedUnanswered(failure)
            } else {
                Attempt::Failed(failure)
            }
        })?;
        let status = response.status();
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            return Err(Attempt::Failed(RequestFailure::new(
                ErrorKind::HttpStatus(status.as_u16()),
                server_error_message(&text),
            )));
        }
        let completion = if self.stream {
            read_stream(response, start).await
        } else {
            read_full(response, start).await
        };
        completion.map_err(Attempt::Failed)
    }
}

/// How one attempt at a request failed.
enum Attempt {
    /// The connection closed (or was reset) before any of the response arrived.
    ClosedUnanswered(RequestFailure),
    Failed(RequestFailure),
}

impl Attempt {
    fn into_failure(self) -> RequestFailure {
        match self {
            Attempt::ClosedUnanswered(f) | Attempt::Failed(f) => f,
        }
    }
}

/// Whether a send failed because the connection closed or was reset before the response's status
/// line: hyper's "connection closed before message completed", or a reset. Not a timeout, and not
/// a failure to connect (nothing was sent then).
fn closed_before_response(e: &reqwest::Error) -> bool {
    if e.is_timeout() || e.is_connect() {
        return false;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.downcast_ref::<hyper::Error>()
            .is_some_and(hyper::Error::is_incomplete_message)
        {
            return true;
        }
        if let Some(io) = s.downcast_ref::<std::io::Error>() {
            use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
            if matches!(io.kind(), ConnectionReset | ConnectionAborted | BrokenPipe) {
                return true;
            }
        }
        source = s.source();
    }
    false
}

async fn read_stream(mut response: reqwest::Response, start: Instant) -> Result<TimedCompletion, RequestFailure> {
    let mut parser = SseParser::new();
    let mut state = StreamState::default();
    loop {
        match response.chunk().await {
            Ok(Some(bytes)) => {
                let at = start.elapsed();
                parser.feed(&bytes, |data| state.on_event(data, at));
            }
            Ok(None) => break,
            Err(e) => return Err(classify(&e, true)),
        }
    }
    let end = start.elapsed();
    parser.finish(|data| state.on_event(data, end));
    if let Some(failure) = state.failure {
        return Err(failure);
    }
    if !state.done {
        return Err(RequestFailure::new(
            ErrorKind::MalformedStream,
            "stream ended without data: [DONE]",
        ));
    }
    state.completion.e2e = end;
    Ok(state.completion.without_counted_text())
}

async fn read_full(response: reqwest::Response, start: Instant) -> Result<TimedCompletion, RequestFailure> {
    let bytes = response.bytes().await.map_err(|e| classify(&e, true))?;
    let e2e = start.elapsed();
    let parsed: FullResponse = serde_json::from_slice(&bytes).map_err(|e| {
        RequestFailure::new(
            ErrorKind::MalformedStream,
            format!("bad JSON response ({e}): {}", snippet(&bytes)),
        )
    })?;
    let mut text = String::new();
    for choice in &parsed.choices {
        if let Some(m) = &choice.message {
            text.push_str(m.reasoning_content.as_deref().unwrap_or(""));
            text.push_str(m.content.as_deref().unwrap_or(""));
        }
        text.push_str(choice.text.as_deref().unwrap_or(""));
    }
    Ok(TimedCompletion {
        ttft: None,
        e2e,
        inter_chunk_gaps: Vec::new(),
        content_chunks: 0,
        text,
        usage: parsed.usage,
    }
    .without_counted_text())
}

impl TimedCompletion {
    /// Drops the text when the server already counted its tokens, so long runs keep little memory.
    fn without_counted_text(mut self) -> Self {
        if self.usage.is_some_and(|u| u.completion_tokens.is_some()) {
            self.text = String::new();
        }
        self
    }
}

#[derive(Default)]
struct StreamState {
    completion: TimedCompletion,
    last_content_at: Option<Duration>,
    done: bool,
    failure: Option<RequestFailure>,
}

impl StreamState {
    fn on_event(&mut self, data: &[u8], at: Duration) {
        if self.failure.is_some() || self.done {
            return;
        }
        let data = data.trim_ascii();
        if data == b"[DONE]" {
            self.done = true;
            return;
        }
        let chunk: StreamChunk = match serde_json::from_slice(data) {
            Ok(c) => c,
            Err(e) => {
                self.failure = Some(RequestFailure::new(
                    ErrorKind::MalformedStream,
                    format!("bad JSON in stream ({e}): {}", snippet(data)),
                ));
                return;
            }
        };
        if let Some(error) = chunk.error {
            self.failure = Some(RequestFailure::new(
                ErrorKind::StreamErrorEvent,
                server_error_message(&error.to_string()),
            ));
            return;
        }
        let mut has_content = false;
        for choice in &chunk.choices {
            for piece in choice.pieces() {
                if !piece.is_empty() {
                    self.completion.text.push_str(piece);
                    has_content = true;
                }
            }
        }
        if has_content {
            let c = &mut self.completion;
            match self.last_content_at {
                None => c.ttft = Some(at),
                Some(last) => c.inter_chunk_gaps.push(at.saturating_sub(last)),
            }
            c.content_chunks += 1;
            self.last_content_at = Some(at);
        }
        if chunk.usage.is_some() {
            self.completion.usage = chunk.usage;
        }
    }
}

#[derive(Deserialize)]
struct StreamChunk {
    #[serde(default)]
    choices: Vec<StreamChoice>,
    usage: Option<ReportedUsage>,
    error: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct StreamChoice {
    delta: Option<Delta>,
    text: Option<String>,
}

impl StreamChoice {
    fn pieces(&self) -> [&str; 4] {
        let d = self.delta.as_ref();
        [
            d.and_then(|d| d.reasoning_content.as_deref()).unwrap_or(""),
            d.and_then(|d| d.reasoning.as_deref()).unwrap_or(""),
            d.and_then(|d| d.content.as_deref()).unwrap_or(""),
            self.text.as_deref().unwrap_or(""),
        ]
    }
}

#[derive(Deserialize)]
struct Delta {
    content: Option<String>,
    reasoning_content: Option<String>,
    reasoning: Option<String>,
}

#[derive(Deserialize)]
struct FullResponse {
    #[serde(default)]
    choices: Vec<FullChoice>,
    usage: Option<ReportedUsage>,
}

#[derive(Deserialize)]
struct FullChoice {
    message: Option<Message>,
    text: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    content: Option<String>,
    reasoning_content: Option<String>,
}

/// Sorts a reqwest error into a kind; `reading_body` marks errors after the headers arrived.
fn classify(e: &reqwest::Error, reading_body: bool) -> RequestFailure {
    let kind = if e.is_timeout() {
        ErrorKind::Timeout
    } else if e.is_connect() && !reading_body {
        ErrorKind::Connect
    } else {
        ErrorKind::Disconnect
    };
    RequestFailure::new(kind, error_chain(e))
}

/// An error and all its sources on one line.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

/// The `error.message` of an OpenAI-style error body, else the body's first characters.
fn server_error_message(body: &str) -> String {
    let parsed: Option<serde_json::Value> = serde_json::from_str(body).ok();
    let message = parsed.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("message"))
            .or_else(|| v.get("error"))
            .and_then(|m| m.as_str())
    });
    match message {
        Some(m) => snippet(m.as_bytes()),
        None => snippet(body.as_bytes()),
    }
}

fn snippet(bytes: &[u8]) -> String {
    const MAX: usize = 160;
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(MAX)]);
    let mut one_line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    if bytes.len() > MAX {
        one_line.push_str("...");
    }
    one_line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(state: &mut StreamState, data: &str, ms: u64) {
        state.on_event(data.as_bytes(), Duration::from_millis(ms));
    }

    #[test]
    fn ttft_skips_the_role_only_chunk_and_gaps_follow_content() {
        let mut s = StreamState::default();
        feed(
            &mut s,
            r#"{"choices":[{"delta":{"role":"assistant","content":""}}]}"#,
            1,
        );
        feed(&mut s, r#"{"choices":[{"delta":{"content":"Hi"}}]}"#, 5);
        feed(&mut s, r#"{"choices":[{"delta":{"content":" there"}}]}"#, 9);
        feed(
            &mut s,
            r#"{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}"#,
            10,
        );
        feed(&mut s, "[DONE]", 10);
        assert!(s.done && s.failure.is_none());
        let c = &s.completion;
        assert_eq!(c.ttft, Some(Duration::from_millis(5)));
        assert_eq!(c.inter_chunk_gaps, vec![Duration::from_millis(4)]);
        assert_eq!(c.text, "Hi there");
        assert_eq!(c.usage.and_then(|u| u.completion_tokens), Some(2));
    }

    #[test]
    fn completions_text_and_reasoning_count_as_content() {
        let mut s = StreamState::default();
        feed(&mut s, r#"{"choices":[{"text":"a"}]}"#, 2);
        feed(&mut s, r#"{"choices":[{"delta":{"reasoning_content":"hmm"}}]}"#, 3);
        assert_eq!(s.completion.content_chunks, 2);
        assert_eq!(s.completion.ttft, Some(Duration::from_millis(2)));
    }

    #[test]
    fn bad_json_and_error_events_are_classified() {
        let mut s = StreamState::default();
        feed(&mut s, r#"{"choices": ["#, 1);
        assert_eq!(s.failure.map(|f| f.kind), Some(ErrorKind::MalformedStream));
        let mut s = StreamState::default();
        feed(&mut s, r#"{"error":{"message":"out of memory"}}"#, 1);
        let failure = s.failure.expect("error event");
        assert_eq!(failure.kind, ErrorKind::StreamErrorEvent);
        assert_eq!(failure.message, "out of memory");
    }

    #[test]
    fn error_kinds_have_stable_names() {
        assert_eq!(ErrorKind::HttpStatus(503).to_string(), "http_503");
        assert_eq!(ErrorKind::MalformedStream.to_string(), "malformed_stream");
    }
}
