//! Load shapes against the mock: open loop by count and by duration, constant arrivals, concurrency caps.
//! Owns checks that the right number of requests goes out; no test here asserts a timing.

mod common;

use strata_bench::mock::{MockConfig, MockServer};
use strata_bench::{run_bench, Arrival, LoadShape};

#[tokio::test]
async fn open_loop_poisson_sends_exactly_the_count() {
    let mock = MockServer::start(MockConfig::default()).await.unwrap();
    let mut cfg = common::small_config(mock.base_url());
    cfg.load = common::open_loop(500.0, Arrival::Poisson, None);
    cfg.num_requests = Some(40);
    cfg.warmup = 2;
    let report = run_bench(&cfg).await.unwrap();
    assert_eq!((report.requests.sent, report.requests.completed), (40, 40));
    assert_eq!(report.request_rate, Some(500.0));
    assert_eq!(report.concurrency, None);
    assert_eq!(mock.completion_requests(), 42);
}

#[tokio::test]
async fn open_loop_by_duration_sends_about_rate_times_duration() {
    let mock = MockServer::start(MockConfig::default()).await.unwrap();
    let mut cfg = common::small_config(mock.base_url());
    cfg.load = common::open_loop(100.0, Arrival::Poisson, Some(8));
    cfg.num_requests = None;
    cfg.duration_s = Some(0.3);
    let report = run_bench(&cfg).await.unwrap();
    let sent = report.requests.sent;
    assert!((10..=60).contains(&sent), "sent {sent}, expected about 30");
    assert_eq!(report.requests.completed + report.requests.failed, sent);
    assert_eq!(mock.completion_requests(), sent);
}

#[tokio::test]
async fn constant_arrivals_and_closed_loop_by_duration_both_stop() {
    let mock = MockServer::start(MockConfig::default()).await.unwrap();
    let mut cfg = common::small_config(mock.base_url());
    cfg.load = common::open_loop(1000.0, Arrival::Constant, Some(2));
    cfg.num_requests = Some(10);
    assert_eq!(run_bench(&cfg).await.unwrap().requests.completed, 10);

    cfg.load = LoadShape::ClosedLoop { users: 2 };
    cfg.num_requests = None;
    cfg.duration_s = Some(0.2);
    let report = run_bench(&cfg).await.unwrap();
    assert!(report.requests.sent > 0);
    assert_eq!(report.requests.completed, report.requests.sent);
    assert!(report.notes.iter().any(|n| n.contains("cycles through")));
}
