//! Failures against the mock land in the error breakdown under the right kind, and never in the latency figures.
//! Owns injected HTTP statuses, dropped connections, closed keep-alive connections, malformed streams, timeouts
//! and an unreachable server.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use strata_bench::mock::{MockConfig, MockFault, MockServer};
use strata_bench::{run_bench, LoadShape};

#[tokio::test]
async fn injected_faults_are_counted_by_kind() {
    let warmup = 2;
    let faults = BTreeMap::from([
        (warmup + 1, MockFault::Status(500)),
        (warmup + 3, MockFault::DropMidStream),
        (warmup + 5, MockFault::MalformedChunk),
        (warmup + 7, MockFault::MissingDone),
        (warmup + 9, MockFault::ErrorEvent),
        (warmup + 11, MockFault::Status(429)),
    ]);
    let mock = MockServer::start(MockConfig {
        faults,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let mut cfg = common::small_config(mock.base_url());
    cfg.warmup = warmup;
    cfg.load = LoadShape::ClosedLoop { users: 2 };
    let report = run_bench(&cfg).await.unwrap();

    let c = &report.requests;
    assert_eq!((c.sent, c.completed, c.failed, c.warmup_failed), (20, 14, 6, 0));
    assert_eq!(
        c.retried, 0,
        "a stream dropped after its first bytes is an error, never resent"
    );
    let e = &report.errors;
    assert_eq!(e.total, 6);
    assert_eq!(e.http_status, BTreeMap::from([(429, 1), (500, 1)]));
    assert_eq!((e.disconnect, e.malformed_stream, e.stream_error_event), (1, 2, 1));
    assert_eq!((e.timeout, e.connect), (0, 0));
    assert!(e.first_message["http_500"].contains("injected status 500"));
    assert!(e.first_message["stream_error_event"].contains("injected error event"));
    assert!((report.error_rate - 0.3).abs() < 1e-9);
    assert_eq!(
        report.e2e_ms.unwrap().count,
        14,
        "failed requests stay out of latencies"
    );
    assert_eq!(report.output_tokens.total, 14 * 5);
}

#[tokio::test]
async fn keep_alive_connections_the_server_closed_are_retried_not_failed() {
    let mock = MockServer::start(MockConfig {
        one_request_per_connection: true,
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let mut cfg = common::small_config(mock.base_url());
    cfg.warmup = 0;
    let report = run_bench(&cfg).await.unwrap();

    let c = &report.requests;
    assert_eq!((c.sent, c.completed, c.failed), (20, 20, 0));
    assert_eq!(report.errors.total, 0, "{:?}", report.errors.first_message);
    assert!(c.retried > 0, "the pool reuses connections, which the mock closed");
    // hyper may resend a request it had not yet written on its own; each resend of ours is one closing.
    assert!(c.retried <= mock.closed_unanswered());
    assert_eq!(mock.completion_requests(), 20, "each request generated once");
    assert_eq!(report.output_tokens.total, 20 * 5);
    let json = serde_json::to_value(&report).unwrap();
    assert_eq!(json["requests"]["retried"], c.retried);
    let details = strata_bench::table::run_details(&report);
    assert!(
        details.contains(&format!("retried: {} requests resent on a new connection", c.retried)),
        "{details}"
    );
}

#[tokio::test]
async fn slow_answers_time_out() {
    let mock = MockServer::start(MockConfig {
        time_to_first_token: Duration::from_secs(5),
        ..MockConfig::default()
    })
    .await
    .unwrap();
    let mut cfg = common::small_config(mock.base_url());
    cfg.num_requests = Some(3);
    cfg.load = LoadShape::ClosedLoop { users: 3 };
    cfg.timeout_s = 0.2;
    let report = run_bench(&cfg).await.unwrap();
    assert_eq!((report.requests.failed, report.errors.timeout), (3, 3));
}

#[tokio::test]
async fn an_unreachable_server_is_one_clear_error() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let cfg = common::small_config(format!("http://127.0.0.1:{port}"));
    let message = run_bench(&cfg).await.unwrap_err().to_string();
    assert!(message.contains("cannot reach the server"), "{message}");
    assert!(message.contains("--base-url"), "{message}");
}
