//! The HTTP/1 accept loop and what bounds each connection: deadlines for a request's headers, its
//! body and the idle time between requests, a cap on open connections, back-off on accept errors.

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::Request;
use axum::response::Response;
use axum::Router;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::time::{Instant, Sleep};
use tower_service::Service;

use crate::error::ApiError;

/// The limits every connection is held to (`strata serve` flags).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ConnectionLimits {
    /// From a connection's start, or a request's first byte, until its headers are complete.
    pub header_read_timeout: Duration,
    /// From a request's headers until its whole body has arrived.
    pub body_read_timeout: Duration,
    /// How long a connection may sit idle between requests.
    pub keep_alive_timeout: Duration,
    /// Connections open at once; more are answered 503 and closed.
    pub max_connections: usize,
}

/// Descriptors kept for everything but connections (model files, logs, the engine's own).
pub const RESERVED_DESCRIPTORS: u64 = 128;
/// The default `--max-connections` where the descriptor limit allows more.
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;

/// The request body did not arrive within `--body-read-timeout`.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
pub struct BodyReadTimeout(pub Duration);

/// Raises the soft limit on open descriptors to the hard limit and returns the limit in force
/// (so that connections, not the default soft limit of 1024, are what runs out first).
#[cfg(unix)]
pub fn raise_descriptor_limit() -> io::Result<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            rlim_max: limit.rlim_max,
        };
        // SAFETY: setrlimit reads one rlimit through a valid pointer.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            limit.rlim_cur = limit.rlim_max;
        } else {
            tracing::warn!(
                "could not raise the open-descriptor limit from {} to {}: {}",
                limit.rlim_cur,
                limit.rlim_max,
                io::Error::last_os_error()
            );
        }
    }
    // rlim_t is u64 on 64-bit targets, narrower on some 32-bit ones.
    #[allow(clippy::unnecessary_cast)]
    Ok(limit.rlim_cur as u64)
}

#[cfg(not(unix))]
pub fn raise_descriptor_limit() -> io::Result<u64> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "descriptor limits are a Unix notion",
    ))
}

/// The default `--max-connections` under a descriptor limit: what is left after the reserve, at
/// most [`DEFAULT_MAX_CONNECTIONS`], at least 1.
pub fn max_connections_for(descriptor_limit: u64) -> usize {
    let room = descriptor_limit.saturating_sub(RESERVED_DESCRIPTORS).max(1);
    usize::try_from(room).unwrap_or(usize::MAX).min(DEFAULT_MAX_CONNECTIONS)
}

/// Which read deadline a connection is under.
#[derive(Debug, Clone, Copy, PartialEq)]
enum ReadPhase {
    /// Waiting for a request's headers, until the deadline.
    Headers(Instant),
    /// A request is being handled or answered: its body has a deadline of its own, and a long
    /// response (an SSE stream) none.
    Busy,
    /// Between requests, until the keep-alive deadline.
    Idle(Instant),
}

/// One connection's read phase, moved on by its reads, its requests and its responses.
#[derive(Debug)]
struct ConnectionClock {
    state: Mutex<ClockState>,
    limits: ConnectionLimits,
}

#[derive(Debug)]
struct ClockState {
    phase: ReadPhase,
    /// The task of a read left waiting without a deadline (while busy): woken when one starts,
    /// as hyper does not read again by itself when a response ends.
    waiting_reader: Option<Waker>,
}

impl ConnectionClock {
    fn new(limits: ConnectionLimits) -> Self {
        ConnectionClock {
            state: Mutex::new(ClockState {
                phase: ReadPhase::Headers(Instant::now() + limits.header_read_timeout),
                waiting_reader: None,
            }),
            limits,
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ClockState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The deadline of a read that waits now, and what it waits for; with none, `reader` is
    /// woken when a deadline starts.
    fn read_deadline(&self, reader: &Waker) -> Option<(Instant, &'static str)> {
        let mut state = self.state();
        match state.phase {
            ReadPhase::Headers(at) => Some((at, "the request headers did not arrive in time")),
            ReadPhase::Idle(at) => Some((at, "the connection was idle for the keep-alive timeout")),
            ReadPhase::Busy => {
                state.waiting_reader = Some(reader.clone());
                None
            }
        }
    }

    /// Bytes arrived: on an idle connection they begin a request, whose headers now have a deadline.
    fn bytes_arrived(&self) {
        let mut state = self.state();
        if let ReadPhase::Idle(_) = state.phase {
            state.phase = ReadPhase::Headers(Instant::now() + self.limits.header_read_timeout);
        }
    }

    fn request_started(&self) {
        self.state().phase = ReadPhase::Busy;
    }

    fn response_done(&self) {
        let waiting = {
            let mut state = self.state();
            state.phase = ReadPhase::Idle(Instant::now() + self.limits.keep_alive_timeout);
            state.waiting_reader.take()
        };
        if let Some(reader) = waiting {
            reader.wake();
        }
    }
}

/// A connection's socket whose reads fail with `TimedOut` past the clock's deadline.
struct DeadlineStream {
    inner: TcpStream,
    clock: Arc<ConnectionClock>,
    timer: Pin<Box<Sleep>>,
    armed_for: Option<Instant>,
}

impl DeadlineStream {
    fn new(inner: TcpStream, clock: Arc<ConnectionClock>) -> Self {
        DeadlineStream {
            inner,
            clock,
            timer: Box::pin(tokio::time::sleep(Duration::ZERO)),
            armed_for: None,
        }
    }
}

impl AsyncRead for DeadlineStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.clock.bytes_arrived();
                }
                return Poll::Ready(Ok(()));
            }
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => {}
        }
        let Some((deadline, why)) = this.clock.read_deadline(cx.waker()) else {
            return Poll::Pending;
        };
        if this.armed_for != Some(deadline) {
            this.timer.as_mut().reset(deadline);
            this.armed_for = Some(deadline);
        }
        match this.timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, why))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncWrite for DeadlineStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

/// A request body that fails with [`BodyReadTimeout`] when it has not all arrived by its
/// deadline (the handler then answers 408).
pub struct BodyWithDeadline {
    inner: Incoming,
    timeout: Duration,
    timer: Pin<Box<Sleep>>,
}

impl BodyWithDeadline {
    fn new(inner: Incoming, timeout: Duration) -> Self {
        BodyWithDeadline {
            inner,
            timeout,
            timer: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

impl Body for BodyWithDeadline {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = self.get_mut();
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(frame) => Poll::Ready(frame.map(|f| f.map_err(Into::into))),
            Poll::Pending => match this.timer.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(BodyReadTimeout(this.timeout).into()))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A response body that puts its connection back to idle (the keep-alive deadline) once it is
/// sent or given up: hyper drops a body when it is done with it.
struct BodyThenIdle {
    inner: axum::body::Body,
    clock: Arc<ConnectionClock>,
}

impl Body for BodyThenIdle {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.get_mut().inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for BodyThenIdle {
    fn drop(&mut self) {
        self.clock.response_done();
    }
}

/// Accept errors that concern one connection only: accept the next one at once.
fn is_connection_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionRefused | io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset
    )
}

/// How long to wait after an accept error that is the process's (no descriptors or memory
/// left): doubling from 10 ms to 1 s, back to the start after a successful accept.
#[derive(Debug, Default)]
struct AcceptBackoff {
    failures: u32,
}

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MAX: Duration = Duration::from_secs(1);

    /// The wait after one more failure, and whether it starts a run of failures (worth a warning;
    /// the rest of the run is logged at debug level).
    fn failed(&mut self) -> (Duration, bool) {
        self.failures = self.failures.saturating_add(1);
        let doublings = (self.failures - 1).min(10);
        let wait = Self::FIRST.saturating_mul(1 << doublings).min(Self::MAX);
        (wait, self.failures == 1)
    }

    fn succeeded(&mut self) {
        self.failures = 0;
    }
}

/// Refusals written at once; beyond, an extra connection is just closed.
const MAX_REFUSALS_IN_FLIGHT: usize = 64;
/// The most time a refusal may take (write the 503, read what the client sent, close).
const REFUSAL_TIME: Duration = Duration::from_secs(1);

/// Answers a connection over the cap with a 503 and closes it, without reading its request.
async fn refuse(mut stream: TcpStream, max_connections: usize) {
    let body = serde_json::to_string(&ApiError::too_many_connections(max_connections).body()).unwrap_or_default();
    let response = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         retry-after: 1\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_TIME, async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await?;
        // Closing with the request unread would reset the connection before the client reads the
        // 503: read (a bounded amount) until the client closes.
        let mut sink = [0u8; 4096];
        let mut left = 64 * 1024usize;
        while left > 0 {
            let n = stream.read(&mut sink).await?;
            if n == 0 {
                break;
            }
            left = left.saturating_sub(n);
        }
        io::Result::Ok(())
    })
    .await;
}

/// Serves `app` on `listener` until `shutdown` resolves: each connection under `limits`, in its
/// own task; then stops accepting, lets open connections finish their requests (idle ones close
/// at once) and returns when every connection has closed.
pub async fn serve_connections(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    let (stop_tx, stop_rx) = watch::channel(false);
    // Every connection task holds a receiver: `closed()` resolves when the last one ends.
    let (open_tx, open_rx) = watch::channel(());
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let refusals = Arc::new(Semaphore::new(MAX_REFUSALS_IN_FLIGHT));
    let mut backoff = AcceptBackoff::default();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = &mut shutdown => break,
        };
        let stream = match accepted {
            Ok((stream, _peer)) => {
                backoff.succeeded();
                stream
            }
            Err(e) if is_connection_error(&e) => continue,
            Err(e) => {
                let (wait, first) = backoff.failed();
                if first {
                    tracing::warn!(
                        "cannot accept connections: {e}; retrying with back-off (up to {:?}). If the \
                         descriptor limit is the cause, lower --max-connections or raise `ulimit -n`",
                        AcceptBackoff::MAX
                    );
                } else {
                    tracing::debug!("accept failed again: {e}; next try in {wait:?}");
                }
                tokio::select! {
                    _ = tokio::time::sleep(wait) => continue,
                    _ = &mut shutdown => break,
                }
            }
        };
        let _ = stream.set_nodelay(true);
        let Ok(slot) = Arc::clone(&slots).try_acquire_owned() else {
            if let Ok(refusal) = Arc::clone(&refusals).try_acquire_owned() {
                tracing::debug!("refusing a connection: {} are open", limits.max_connections);
                tokio::spawn(async move {
                    refuse(stream, limits.max_connections).await;
                    drop(refusal);
                });
            }
            continue;
        };
        let app = app.clone();
        let stop = stop_rx.clone();
        let open = open_rx.clone();
        tokio::spawn(async move {
            serve_connection(stream, app, limits, stop).await;
            drop(slot);
            drop(open);
        });
    }
    drop(listener);
    let _ = stop_tx.send(true);
    drop(open_rx);
    open_tx.closed().await;
}

/// One connection: HTTP/1 with keep-alive, read deadlines from its clock, and a graceful close
/// (after the request in flight, if any) once `stop` turns true.
async fn serve_connection(stream: TcpStream, app: Router, limits: ConnectionLimits, mut stop: watch::Receiver<bool>) {
    let clock = Arc::new(ConnectionClock::new(limits));
    let io = TokioIo::new(DeadlineStream::new(stream, Arc::clone(&clock)));
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        clock.request_started();
        let request: Request<BodyWithDeadline> =
            request.map(|body| BodyWithDeadline::new(body, limits.body_read_timeout));
        let mut app = app.clone();
        let clock = Arc::clone(&clock);
        async move {
            let response: Response = match app.call(request).await {
                Ok(r) => r,
                Err(never) => match never {},
            };
            Ok::<_, Infallible>(response.map(|inner| BodyThenIdle { inner, clock }))
        }
    });
    let connection = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .header_read_timeout(None)
        .serve_connection(io, service);
    let mut connection = std::pin::pin!(connection);
    let mut stopping = false;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(e) = result {
                    tracing::debug!("connection closed: {e}");
                }
                return;
            }
            _ = stop.wait_for(|s| *s), if !stopping => {
                stopping = true;
                connection.as_mut().graceful_shutdown();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_to_a_second_and_warns_once_per_run() {
        let mut b = AcceptBackoff::default();
        let waits: Vec<(Duration, bool)> = (0..10).map(|_| b.failed()).collect();
        assert_eq!(waits[0], (Duration::from_millis(10), true));
        assert_eq!(waits[1], (Duration::from_millis(20), false));
        assert_eq!(waits[6], (Duration::from_millis(640), false));
        assert!(waits[7..].iter().all(|&w| w == (Duration::from_secs(1), false)));
        b.succeeded();
        assert_eq!(b.failed(), (Duration::from_millis(10), true));
        for _ in 0..100 {
            assert!(b.failed().0 <= Duration::from_secs(1));
        }
    }

    /// A soft limit below the hard one (the usual 1024) is raised to it, and the limit reported is
    /// the one in force.
    #[cfg(unix)]
    #[test]
    fn the_descriptor_limit_is_raised_to_the_hard_limit() {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit and setrlimit read or write one rlimit through a valid pointer.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) }, 0);
        let lowered = libc::rlimit {
            rlim_cur: limit.rlim_max.min(256),
            rlim_max: limit.rlim_max,
        };
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lowered) }, 0);
        let raised = raise_descriptor_limit().expect("getrlimit works");
        #[allow(clippy::unnecessary_cast)]
        let hard = limit.rlim_max as u64;
        assert_eq!(raised, hard);
        let mut now = lowered;
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut now) }, 0);
        assert_eq!(now.rlim_cur, limit.rlim_max);
    }

    #[test]
    fn max_connections_stay_under_the_descriptor_limit() {
        assert_eq!(max_connections_for(1024), 896);
        assert_eq!(max_connections_for(1 << 20), DEFAULT_MAX_CONNECTIONS);
        assert_eq!(max_connections_for(100), 1);
    }

    /// Counts its wake-ups.
    struct CountingWaker(std::sync::atomic::AtomicUsize);

    impl std::task::Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn the_read_deadline_follows_the_phase() {
        let limits = ConnectionLimits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            keep_alive_timeout: Duration::from_secs(75),
            max_connections: 1,
        };
        let wakes = Arc::new(CountingWaker(Default::default()));
        let reader = Waker::from(Arc::clone(&wakes));
        let woken = || wakes.0.load(std::sync::atomic::Ordering::SeqCst);
        let clock = ConnectionClock::new(limits);
        let (at, why) = clock.read_deadline(&reader).expect("headers have a deadline");
        assert!(why.contains("headers") && at > Instant::now() + Duration::from_secs(9));
        clock.request_started();
        assert_eq!(
            clock.read_deadline(&reader),
            None,
            "a request being answered (SSE) has none"
        );
        clock.bytes_arrived();
        assert_eq!(
            clock.read_deadline(&reader),
            None,
            "pipelined bytes do not start a deadline"
        );
        assert_eq!(woken(), 0);
        clock.response_done();
        assert_eq!(woken(), 1, "the read left waiting is woken to start the idle deadline");
        let (at, why) = clock.read_deadline(&reader).expect("idle has a deadline");
        assert!(why.contains("idle") && at > Instant::now() + Duration::from_secs(74));
        clock.bytes_arrived();
        let (at, why) = clock.read_deadline(&reader).expect("a new request's headers");
        assert!(why.contains("headers") && at < Instant::now() + Duration::from_secs(11));
        clock.request_started();
        clock.response_done();
        assert_eq!(woken(), 1, "no read was left waiting this time");
    }
}
