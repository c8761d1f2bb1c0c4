//! A tiny OpenAI-compatible server for tests and the client-overhead benchmark (not a model: it streams canned words).
//! Owns /v1/models, /v1/chat/completions, /v1/completions and /tokenize, with set delays and injected faults.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{header, Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What the mock does to one completion request instead of answering it well.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MockFault {
    /// Answer with this HTTP status and an OpenAI-style error body.
    Status(u16),
    /// Close the connection halfway through the stream.
    DropMidStream,
    /// Send one chunk that is not JSON.
    MalformedChunk,
    /// End the stream without `data: [DONE]`.
    MissingDone,
    /// Send `{"error": ...}` as a stream event.
    ErrorEvent,
}

/// How the mock answers.
#[derive(Clone, Debug)]
pub struct MockConfig {
    /// The one model /v1/models lists.
    pub model: String,
    /// Tokens per answer; None follows the request's max_tokens.
    pub output_tokens: Option<u32>,
    /// Delay before the response headers and the first token go out.
    pub time_to_first_token: Duration,
    /// Delay between streamed tokens.
    pub inter_token_delay: Duration,
    /// Send `usage` (at the end of a stream when asked with stream_options.include_usage).
    pub send_usage: bool,
    /// Serve POST /tokenize (counting whitespace-separated words).
    pub tokenize_endpoint: bool,
    /// Faults by the arrival number (from 0) of completion requests.
    pub faults: BTreeMap<u64, MockFault>,
    /// Answer one request per connection without saying `Connection: close`, as a server that
    /// closes idle keep-alive connections does (llama.cpp's): a later request on that connection
    /// finds it closed, with no byte of response.
    pub one_request_per_connection: bool,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            model: "mock-model".to_string(),
            output_tokens: None,
            time_to_first_token: Duration::ZERO,
            inter_token_delay: Duration::ZERO,
            send_usage: true,
            tokenize_endpoint: false,
            faults: BTreeMap::new(),
            one_request_per_connection: false,
        }
    }
}

struct MockState {
    config: MockConfig,
    completion_requests: AtomicU64,
    closed_unanswered: AtomicU64,
}

/// A running mock server on 127.0.0.1; it stops accepting when dropped.
pub struct MockServer {
    addr: SocketAddr,
    state: Arc<MockState>,
    accept: JoinHandle<()>,
}

impl MockServer {
    /// Starts on a free port of 127.0.0.1, on the current tokio runtime.
    pub async fn start(config: MockConfig) -> io::Result<Self> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), config).await
    }

    /// Starts on the given address, on the current tokio runtime.
    pub async fn start_on(addr: SocketAddr, config: MockConfig) -> io::Result<Self> {
        let listener = TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(MockState {
            config,
            completion_requests: AtomicU64::new(0),
            closed_unanswered: AtomicU64::new(0),
        });
        let accept = tokio::spawn(accept_loop(listener, state.clone()));
        Ok(Self { addr, state, accept })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Completion requests received so far (chat and completions, faulty ones included).
    pub fn completion_requests(&self) -> u64 {
        self.state.completion_requests.load(Ordering::Relaxed)
    }

    /// Requests that found their connection closed (`one_request_per_connection`), unanswered.
    pub fn closed_unanswered(&self) -> u64 {
        self.state.closed_unanswered.load(Ordering::Relaxed)
    }
}

impl Drop for MockServer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn accept_loop(listener: TcpListener, state: Arc<MockState>) {
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let state = state.clone();
        let served_here = Arc::new(AtomicU64::new(0));
        tokio::spawn(async move {
            let service = service_fn(move |request| {
                let state = state.clone();
                let earlier = served_here.fetch_add(1, Ordering::Relaxed);
                async move {
                    if state.config.one_request_per_connection && earlier > 0 {
                        // An error from the service makes hyper drop the connection unanswered.
                        state.closed_unanswered.fetch_add(1, Ordering::Relaxed);
                        return Err(io::Error::other("mock: connection already closed"));
                    }
                    Ok::<_, io::Error>(handle(request, state).await)
                }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

async fn handle(request: Request<Incoming>, state: Arc<MockState>) -> Response<MockBody> {
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let body: Value = match request.into_body().collect().await {
        Ok(collected) => serde_json::from_slice(&collected.to_bytes()).unwrap_or(Value::Null),
        Err(_) => Value::Null,
    };
    let config = &state.config;
    let response = match (method, path.as_str()) {
        (Method::GET, "/v1/models") => json_response(
            StatusCode::OK,
            json!({"object": "list", "data": [{"id": config.model, "object": "model", "owned_by": "mock"}]}),
        ),
        (Method::POST, "/tokenize") if config.tokenize_endpoint => {
            let text = body
                .get("prompt")
                .or_else(|| body.get("content"))
                .and_then(Value::as_str)
                .unwrap_or("");
            let count = text.split_whitespace().count();
            json_response(
                StatusCode::OK,
                json!({"tokens": (0..count).collect::<Vec<_>>(), "count": count}),
            )
        }
        (Method::POST, "/v1/chat/completions") => completion(&state, &body, true).await,
        (Method::POST, "/v1/completions") => completion(&state, &body, false).await,
        _ => json_response(
            StatusCode::NOT_FOUND,
            json!({"error": {"message": format!("mock: no route {path}"), "type": "not_found"}}),
        ),
    };
    response
}

fn json_response(status: StatusCode, value: Value) -> Response<MockBody> {
    let mut response = Response::new(MockBody::full(Bytes::from(value.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    response
}

fn prompt_words(body: &Value, chat: bool) -> usize {
    if chat {
        body.get("messages")
            .and_then(Value::as_array)
            .map(|messages| {
                messages
                    .iter()
                    .filter_map(|m| m.get("content").and_then(Value::as_str))
                    .map(|c| c.split_whitespace().count())
                    .sum()
            })
            .unwrap_or(0)
    } else {
        body.get("prompt")
            .and_then(Value::as_str)
            .map(|p| p.split_whitespace().count())
            .unwrap_or(0)
    }
}

async fn completion(state: &MockState, body: &Value, chat: bool) -> Response<MockBody> {
    let config = &state.config;
    let arrival = state.completion_requests.fetch_add(1, Ordering::Relaxed);
    let fault = config.faults.get(&arrival).copied();
    if let Some(MockFault::Status(code)) = fault {
        let status = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        return json_response(
            status,
            json!({"error": {"message": format!("mock: injected status {code}"), "type": "mock", "code": code}}),
        );
    }
    let max_tokens = body.get("max_tokens").and_then(Value::as_u64).unwrap_or(16) as u32;
    let tokens = config.output_tokens.unwrap_or(max_tokens).max(1) as usize;
    let prompt_tokens = prompt_words(body, chat);
    let stream = body.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let include_usage = config.send_usage
        && (!stream
            || body
                .pointer("/stream_options/include_usage")
                .and_then(Value::as_bool)
                .unwrap_or(false));
    let usage =
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": tokens, "total_tokens": prompt_tokens + tokens});
    if !config.time_to_first_token.is_zero() {
        tokio::time::sleep(config.time_to_first_token).await;
    }
    if !stream {
        let text = " word".repeat(tokens);
        let mut answer = if chat {
            json!({"id": "mock", "object": "chat.completion", "model": config.model,
                   "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}]})
        } else {
            json!({"id": "mock", "object": "text_completion", "model": config.model,
                   "choices": [{"index": 0, "text": text, "finish_reason": "length"}]})
        };
        if include_usage {
            answer["usage"] = usage;
        }
        return json_response(StatusCode::OK, answer);
    }
    let chunk = |piece: Value, finish: Value| -> String {
        let choice = if chat {
            json!({"index": 0, "delta": piece, "finish_reason": finish})
        } else {
            json!({"index": 0, "text": piece["content"], "finish_reason": finish})
        };
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        format!(
            "data: {}\n\n",
            json!({"id": "mock", "object": object, "model": config.model, "choices": [choice]})
        )
    };
    let mut frames: Vec<String> = (0..tokens)
        .map(|i| {
            let finish = if i + 1 == tokens { json!("length") } else { Value::Null };
            chunk(json!({"content": " word"}), finish)
        })
        .collect();
    if chat {
        frames[0].insert_str(0, &chunk(json!({"role": "assistant", "content": ""}), Value::Null));
    }
    let middle = tokens / 2;
    match fault {
        Some(MockFault::MalformedChunk) => frames[middle] = "data: {\"choices\": [\n\n".to_string(),
        Some(MockFault::ErrorEvent) => {
            frames[middle] = "data: {\"error\": {\"message\": \"mock: injected error event\"}}\n\n".to_string()
        }
        _ => {}
    }
    let last = frames.len() - 1;
    if include_usage {
        frames[last].push_str(&format!(
            "data: {}\n\n",
            json!({"id": "mock", "model": config.model, "choices": [], "usage": usage})
        ));
    }
    if fault != Some(MockFault::MissingDone) {
        frames[last].push_str("data: [DONE]\n\n");
    }
    let fail_after = (fault == Some(MockFault::DropMidStream)).then_some(middle.max(1));
    let mut body = MockBody::stream(frames.into_iter().map(Bytes::from).collect(), config.inter_token_delay);
    body.fail_after = fail_after;
    let mut response = Response::new(body);
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, header::HeaderValue::from_static("no-cache"));
    response
}

/// A response body of prepared frames, with a delay between them and an optional failure.
pub struct MockBody {
    frames: VecDeque<Bytes>,
    gap: Duration,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Fail (closing the connection) after this many frames.
    fail_after: Option<usize>,
    flushed_before_failing: bool,
    sent: usize,
    exact_len: Option<u64>,
}

impl MockBody {
    fn full(bytes: Bytes) -> Self {
        Self {
            exact_len: Some(bytes.len() as u64),
            frames: VecDeque::from([bytes]),
            gap: Duration::ZERO,
            sleep: None,
            fail_after: None,
            flushed_before_failing: false,
            sent: 0,
        }
    }

    fn stream(frames: VecDeque<Bytes>, gap: Duration) -> Self {
        Self {
            frames,
            gap,
            sleep: None,
            fail_after: None,
            flushed_before_failing: false,
            sent: 0,
            exact_len: None,
        }
    }
}

impl Body for MockBody {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = &mut *self;
        if let Some(sleep) = this.sleep.as_mut() {
            ready!(sleep.as_mut().poll(cx));
            this.sleep = None;
        }
        if this.fail_after == Some(this.sent) {
            if !this.flushed_before_failing {
                // Pause first: hyper flushes what it holds, so the client has bytes before the drop.
                this.flushed_before_failing = true;
                this.sleep = Some(Box::pin(tokio::time::sleep(Duration::from_millis(20))));
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            this.fail_after = None;
            this.frames.clear();
            return Poll::Ready(Some(Err(io::Error::other("mock: connection dropped mid-stream"))));
        }
        match this.frames.pop_front() {
            None => Poll::Ready(None),
            Some(frame) => {
                this.sent += 1;
                if !this.gap.is_zero() && !this.frames.is_empty() {
                    this.sleep = Some(Box::pin(tokio::time::sleep(this.gap)));
                }
                Poll::Ready(Some(Ok(Frame::data(frame))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.frames.is_empty() && self.fail_after.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match self.exact_len {
            Some(n) if self.sent == 0 => SizeHint::with_exact(n),
            _ => SizeHint::default(),
        }
    }
}
