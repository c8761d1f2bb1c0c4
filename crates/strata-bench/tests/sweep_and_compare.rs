//! The `strata bench` command end to end against the mock: a sweep writes JSON and an SVG, `--compare` prints ratios.
//! Owns the CLI surface (`BenchArgs` parsing and `run`), driven from a plain thread as the binary does.

mod common;

use clap::Parser;
use strata_bench::mock::{MockConfig, MockServer};
use strata_bench::{compare_files, BenchArgs, BenchResults};

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

fn bench_args(args: &[&str]) -> BenchArgs {
    Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
        .unwrap()
        .bench
}

#[test]
fn sweep_writes_json_and_svg_and_compare_prints_ratios() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let mock = runtime.block_on(MockServer::start(MockConfig::default())).unwrap();
    let url = mock.base_url();
    let dir = common::temp_dir("sweep");
    let (sweep_json, single_json) = (dir.join("sweep.json"), dir.join("single.json"));
    let common_flags = ["--base-url", &url, "-n", "6", "--input-len", "8", "--output-len", "4"];

    let mut sweep = common_flags.to_vec();
    sweep.extend([
        "--sweep",
        "1,2,4",
        "--label",
        "mock",
        "-o",
        sweep_json.to_str().unwrap(),
    ]);
    strata_bench::run(bench_args(&sweep)).unwrap();
    let results = BenchResults::read(&sweep_json).unwrap();
    let levels: Vec<_> = results.runs.iter().map(|r| r.concurrency).collect();
    assert_eq!(levels, [Some(1), Some(2), Some(4)]);
    let svg = std::fs::read_to_string(sweep_json.with_extension("svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert_eq!(svg.matches("<circle").count(), 6, "three levels in each of two panels");
    assert!(svg.contains("TTFT P95") && svg.contains("Output throughput"));

    let mut single = common_flags.to_vec();
    single.extend(["-c", "2", "--label", "other", "-o", single_json.to_str().unwrap()]);
    strata_bench::run(bench_args(&single)).unwrap();

    let plot = dir.join("compare.svg");
    let table = compare_files(&sweep_json, &single_json, Some(&plot)).unwrap();
    assert!(table.contains("A = mock") && table.contains("B = other"), "{table}");
    assert!(table.contains("B/A") && table.contains("TTFT p95 ms") && table.contains("output tok/s"));
    assert!(table.contains("comparing 1 pair(s)"), "{table}");
    assert!(
        table.contains("concurrency A 2 / B 2"),
        "runs pair by concurrency: {table}"
    );
    assert!(table.contains("1.00x"), "equal request counts give 1.00x: {table}");
    assert!(std::fs::read_to_string(plot).unwrap().contains("other"));

    let compared = bench_args(&["--compare", sweep_json.to_str().unwrap(), single_json.to_str().unwrap()]);
    strata_bench::run(compared).unwrap();
}
