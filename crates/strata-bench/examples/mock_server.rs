//! A standalone mock OpenAI server, to check `strata bench` by hand (e.g. its TTFT against curl's).
//! Run: `cargo run --release -p strata-bench --example mock_server -- --port 8001 --ttft-ms 20 --tokens 16`.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use strata_bench::mock::{MockConfig, MockServer};

/// Serve canned streamed completions on 127.0.0.1.
#[derive(Parser)]
struct MockArgs {
    #[arg(long, default_value_t = 8001)]
    port: u16,
    /// Delay before the headers and first token, in ms.
    #[arg(long, default_value_t = 0)]
    ttft_ms: u64,
    /// Delay between tokens, in ms.
    #[arg(long, default_value_t = 0)]
    itl_ms: u64,
    /// Tokens per answer (default: the request's max_tokens).
    #[arg(long)]
    tokens: Option<u32>,
}

fn main() -> anyhow::Result<()> {
    let args = MockArgs::parse();
    let config = MockConfig {
        time_to_first_token: Duration::from_millis(args.ttft_ms),
        inter_token_delay: Duration::from_millis(args.itl_ms),
        output_tokens: args.tokens,
        tokenize_endpoint: true,
        ..MockConfig::default()
    };
    let runtime = tokio::runtime::Runtime::new()?;
    runtime.block_on(async {
        let server = MockServer::start_on(SocketAddr::from(([127, 0, 0, 1], args.port)), config)
            .await
            .map_err(|e| anyhow::anyhow!("cannot listen on port {}: {e}; pass another --port", args.port))?;
        println!("mock OpenAI server on {} (Ctrl-C to stop)", server.base_url());
        std::future::pending::<()>().await;
        Ok(())
    })
}
