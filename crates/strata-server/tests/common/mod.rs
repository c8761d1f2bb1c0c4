//! Helpers of the server tests: an in-process `strata serve` on an ephemeral 127.0.0.1 port over
//! the real default model, JSON calls, and an SSE reader that keeps each event's arrival time.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use serde_json::Value;
use strata_engine::{cpu_executor, EngineConfig, EngineHandle};
use strata_model::loader::{default_model_path, load_model, LoadedModel};
use strata_model::{CpuExecutor, Executor, KvLayout, Logits, ModelConfig, ModelError, SeqChunk};
use strata_server::{ServerConfig, ServerError};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const MODEL: &str = "smol";

/// One compute thread and a small cache: the harness runs two tests at once on two cores.
pub fn engine_config() -> EngineConfig {
    EngineConfig {
        threads: 1,
        kv_cache_memory: 64 << 20,
        max_model_len: Some(1024),
        ..Default::default()
    }
}

pub fn server_config() -> ServerConfig {
    ServerConfig {
        served_model_name: MODEL.into(),
        shutdown_timeout: Duration::from_secs(10),
        ..Default::default()
    }
}

/// The default model, loaded off the async threads.
pub async fn default_model() -> LoadedModel {
    let path = default_model_path();
    assert!(path.exists(), "{} is missing: run `make fetch` first", path.display());
    tokio::task::spawn_blocking(move || load_model(&path, &|_, _| {}).expect("default model loads"))
        .await
        .expect("load task")
}

/// A running server.
pub struct TestServer {
    pub base: String,
    pub engine: EngineHandle,
    pub client: reqwest::Client,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), ServerError>>>,
}

impl TestServer {
    pub async fn start(engine_config: EngineConfig, config: ServerConfig) -> TestServer {
        let model = default_model().await;
        let engine = EngineHandle::start(model, engine_config).expect("engine starts");
        Self::serve(engine, config).await
    }

    /// Serves a running engine.
    pub async fn serve(engine: EngineHandle, config: ServerConfig) -> TestServer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("address"));
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(strata_server::serve(listener, engine.clone(), config, async move {
            let _ = stopped.await;
        }));
        TestServer {
            base,
            engine,
            client: reqwest::Client::new(),
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub async fn default() -> TestServer {
        Self::start(engine_config(), server_config()).await
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    /// A raw TCP connection to the server (for what an HTTP client will not do: stall, flood).
    pub async fn connect(&self) -> tokio::net::TcpStream {
        let address = self.base.trim_start_matches("http://");
        tokio::net::TcpStream::connect(address).await.expect("connects")
    }

    /// Sends the shutdown signal (as SIGTERM would) and waits for `serve` to return.
    pub async fn stop(&mut self) -> Result<(), ServerError> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.task.take() {
            Some(t) => t.await.expect("server task"),
            None => Ok(()),
        }
    }

    /// Signals shutdown without waiting.
    pub fn signal_stop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }

    pub async fn wait_stopped(&mut self) -> Result<(), ServerError> {
        match self.task.take() {
            Some(t) => t.await.expect("server task"),
            None => Ok(()),
        }
    }

    /// POSTs raw bytes and returns (status, JSON body).
    pub async fn post_raw(&self, path: &str, body: impl Into<reqwest::Body>) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .expect("request sent");
        let status = r.status().as_u16();
        let text = r.text().await.expect("body");
        (
            status,
            serde_json::from_str(&text).unwrap_or_else(|_| panic!("not JSON: {text}")),
        )
    }

    pub async fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, body.to_string()).await
    }

    pub async fn get(&self, path: &str) -> (u16, String) {
        let r = self.client.get(self.url(path)).send().await.expect("request sent");
        let status = r.status().as_u16();
        (status, r.text().await.expect("body"))
    }

    /// Waits until the engine holds no KV blocks and runs nothing; false on timeout.
    pub async fn wait_blocks_free(&self, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        loop {
            let s = self.engine.stats();
            if s.kv_blocks_used == 0 && s.running == 0 && s.waiting == 0 {
                return true;
            }
            if Instant::now() > end {
                eprintln!("still busy: {s:?}");
                return false;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// One SSE event: a `data:` payload (with its `event:` name, if any) or a `:` comment, with
/// when it arrived.
#[derive(Debug, Clone)]
pub struct SseEvent {
    pub at: Instant,
    pub event: Option<String>,
    pub data: Option<String>,
    pub comment: Option<String>,
}

impl SseEvent {
    pub fn json(&self) -> Option<Value> {
        self.data
            .as_deref()
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap_or_else(|_| panic!("bad chunk {d}")))
    }
}

/// Reads SSE events from a response as they arrive.
pub struct SseReader {
    pub response: reqwest::Response,
    buffer: String,
}

impl SseReader {
    pub fn new(response: reqwest::Response) -> Self {
        SseReader {
            response,
            buffer: String::new(),
        }
    }

    /// The next event; `None` at the end of the body.
    pub async fn next(&mut self) -> Option<SseEvent> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let mut event = SseEvent {
                    at: Instant::now(),
                    event: None,
                    data: None,
                    comment: None,
                };
                for line in block.lines() {
                    if let Some(name) = line.strip_prefix("event:") {
                        event.event = Some(name.trim_start().to_string());
                    } else if let Some(d) = line.strip_prefix("data:") {
                        event.data = Some(d.trim_start().to_string());
                    } else if let Some(c) = line.strip_prefix(':') {
                        event.comment = Some(c.trim().to_string());
                    }
                }
                return Some(event);
            }
            match self.response.chunk().await.expect("stream reads") {
                Some(bytes) => self.buffer.push_str(&String::from_utf8_lossy(&bytes)),
                None => return None,
            }
        }
    }

    pub async fn all(mut self) -> Vec<SseEvent> {
        let mut out = Vec::new();
        while let Some(e) = self.next().await {
            out.push(e);
        }
        out
    }
}

/// Starts a streamed POST and checks the SSE headers.
pub async fn stream(server: &TestServer, path: &str, body: &Value) -> SseReader {
    let r = server
        .client
        .post(server.url(path))
        .json(body)
        .send()
        .await
        .expect("request sent");
    assert_eq!(r.status().as_u16(), 200, "stream refused");
    let h = r.headers();
    assert_eq!(h["content-type"], "text/event-stream");
    assert_eq!(h["cache-control"], "no-cache");
    assert_eq!(h["x-accel-buffering"], "no");
    SseReader::new(r)
}

/// The `data:` payloads of events, `[DONE]` excluded.
pub fn chunks(events: &[SseEvent]) -> Vec<Value> {
    events.iter().filter_map(SseEvent::json).collect()
}

/// Checks an OpenAI error body: status, type string, param.
pub fn assert_error(status: u16, body: &Value, want_status: u16, want_param: Option<&str>) {
    assert_eq!(status, want_status, "{body}");
    let e = &body["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{body}");
    assert!(e["type"].is_string(), "{body}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{body}");
    if let Some(p) = want_param {
        assert_eq!(e["param"], p, "{body}");
    }
}

pub const LOST_GPU: &str = "tensor-parallel all-reduce over GPUs 0,1 did not finish within 30 s (step 17): \
                        GPU 1 stopped responding; communicators aborted";

/// The CPU executor with GPUs that are lost at its third batch submitted: from then on it refuses
/// every call, as a real one does after a fatal error.
pub struct LosesDevices {
    cpu: CpuExecutor,
    submitted: usize,
}

impl Executor for LosesDevices {
    fn config(&self) -> &ModelConfig {
        self.cpu.config()
    }

    fn submit(&mut self, batch: Vec<SeqChunk>, tokens_from: Option<Vec<usize>>) -> Result<(), ModelError> {
        self.submitted += 1;
        if self.submitted >= 3 {
            return Err(ModelError::Unavailable(LOST_GPU.into()));
        }
        self.cpu.submit(batch, tokens_from)
    }

    fn collect(&mut self) -> Result<Logits, ModelError> {
        self.cpu.collect()
    }

    fn kv_layout(&self) -> KvLayout {
        self.cpu.kv_layout()
    }

    fn device(&self) -> String {
        "2 GPUs (a CPU that loses them)".into()
    }
}

/// A server whose engine loses its GPUs at the third step.
pub async fn server_losing_gpus() -> TestServer {
    let model = default_model().await;
    let config = engine_config();
    let cpu = cpu_executor(model.transformer, &config).expect("the cache fits");
    let executor = Box::new(LosesDevices { cpu, submitted: 0 });
    let engine =
        EngineHandle::start_with(executor, model.tokenizer, model.chat_template, config).expect("engine starts");
    TestServer::serve(engine, server_config()).await
}
