//! Connection limits over raw sockets: stalled headers and bodies and idle keep-alive connections
//! are closed at their deadlines, connections over the cap get a quick 503, streams outlive
//! every deadline.

mod common;

use std::time::Duration;

use common::{engine_config, server_config, stream, TestServer, MODEL};
use serde_json::{json, Value};
use strata_server::connections::ConnectionLimits;
use strata_server::ServerConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Bounds every wait on the server, so that a missing deadline fails the test instead of hanging
/// it; the deadlines under test are a second or less.
const GUARD: Duration = Duration::from_secs(20);

fn limits(deadline: Duration, max_connections: usize) -> ServerConfig {
    ServerConfig {
        connections: ConnectionLimits {
            header_read_timeout: deadline,
            body_read_timeout: deadline,
            keep_alive_timeout: deadline,
            max_connections,
        },
        ..server_config()
    }
}

async fn server(config: ServerConfig) -> TestServer {
    TestServer::start(engine_config(), config).await
}

/// Everything the server sends until it closes the connection (a reset counts as a close).
async fn read_until_closed(socket: &mut TcpStream) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout(GUARD, socket.read(&mut buf)).await {
            Err(_) => panic!(
                "the server kept the connection open; it sent {:?}",
                String::from_utf8_lossy(&got)
            ),
            Ok(Ok(0)) | Ok(Err(_)) => return got,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// One response read off a kept-alive connection: (status, body).
async fn read_response(socket: &mut TcpStream) -> (u16, String) {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let text = String::from_utf8_lossy(&got).to_string();
        if let Some(end) = text.find("\r\n\r\n") {
            let length: usize = text[..end]
                .lines()
                .find_map(|l| {
                    l.to_ascii_lowercase()
                        .strip_prefix("content-length:")
                        .map(|v| v.trim().to_string())
                })
                .and_then(|v| v.parse().ok())
                .expect("a content-length");
            if got.len() >= end + 4 + length {
                let status = text[9..12].parse().expect("a status");
                return (status, text[end + 4..end + 4 + length].to_string());
            }
        }
        let n = tokio::time::timeout(GUARD, socket.read(&mut buf))
            .await
            .expect("the response arrives")
            .expect("reads");
        assert!(
            n > 0,
            "closed before the whole response: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
    }
}

fn error_code(body: &str) -> Value {
    let v: Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("not JSON: {body}"));
    assert!(v["error"]["message"].is_string(), "{body}");
    v["error"]["code"].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_headers_and_idle_connections_are_closed_at_their_deadlines() {
    let s = server(limits(Duration::from_secs(1), 64)).await;
    // Half a request line, then nothing.
    let mut stalled = s.connect().await;
    stalled
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    // Nothing at all.
    let mut silent = s.connect().await;
    // A request, its answer, then idle.
    let mut idle = s.connect().await;
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let (status, _) = read_response(&mut idle).await;
    assert_eq!(status, 200);
    // A request answered after a while (hyper reads while it waits), then idle.
    let mut answered_late = s.connect().await;
    let body = json!({"prompt": "Once upon a time", "max_tokens": 8, "ignore_eos": true}).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    answered_late.write_all(request.as_bytes()).await.unwrap();
    let (status, r) = read_response(&mut answered_late).await;
    assert_eq!(status, 200, "{r}");
    // Each is closed without an answer at its deadline.
    for socket in [&mut stalled, &mut silent, &mut idle, &mut answered_late] {
        assert_eq!(read_until_closed(socket).await, b"");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_gets_408_and_the_connection_closes() {
    let s = server(limits(Duration::from_secs(1), 64)).await;
    let mut socket = s.connect().await;
    socket
        .write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":")
        .await
        .unwrap();
    let answer = String::from_utf8(read_until_closed(&mut socket).await).unwrap();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("connection: close"), "{answer}");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    assert_eq!(error_code(body), "request_timeout");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_get_503_while_open_ones_still_answer() {
    let s = server(limits(Duration::from_secs(30), 3)).await;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = s.connect().await;
        // One exchange each: the server has taken the connection into a slot.
        c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        assert_eq!(read_response(&mut c).await.0, 200);
        held.push(c);
    }
    let mut extra = s.connect().await;
    let answer = String::from_utf8(read_until_closed(&mut extra).await).unwrap();
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("retry-after: 1"), "{answer}");
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    assert_eq!(error_code(body), "too_many_connections");
    // The connections already open keep working.
    for c in &mut held {
        c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        assert_eq!(read_response(c).await.0, 200);
    }
    // A closed one frees its slot for a newcomer.
    drop(held.pop());
    let served = tokio::time::timeout(GUARD, async {
        loop {
            let mut c = s.connect().await;
            c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
            let answer = read_until_closed_or_response(&mut c).await;
            if answer.starts_with("HTTP/1.1 200") {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(served.is_ok(), "the freed slot was never given to a new connection");
}

/// The first bytes of an answer (a 503 closes, a 200 stays open).
async fn read_until_closed_or_response(socket: &mut TcpStream) -> String {
    let mut buf = [0u8; 4096];
    let n = tokio::time::timeout(GUARD, socket.read(&mut buf))
        .await
        .expect("an answer")
        .unwrap_or(0);
    String::from_utf8_lossy(&buf[..n]).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_outlives_every_deadline() {
    let deadline = Duration::from_millis(250);
    let s = server(limits(deadline, 64)).await;
    let body =
        json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 6, "ignore_eos": true, "stream": true});
    let mut events = stream(&s, "/v1/completions", &body).await;
    let mut texts = 0;
    let mut done = false;
    // Reading slowly makes the response last several deadlines whatever the server's speed.
    while let Some(event) = events.next().await {
        tokio::time::sleep(deadline * 2).await;
        match event.data.as_deref() {
            Some("[DONE]") => done = true,
            Some(_) => texts += 1,
            None => {}
        }
    }
    assert!(done, "the stream was cut after {texts} chunks");
    assert!(texts >= 3, "{texts} chunks");
    // The same client's next request, on a fresh or reused connection, is answered.
    let (status, r) = s
        .post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 2}))
        .await;
    assert_eq!(status, 200, "{r}");
}
