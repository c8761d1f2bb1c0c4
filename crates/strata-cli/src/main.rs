//! The `strata` command line: run a model, benchmark it locally (serve, plan and topo come later).
//! Errors end the process with one line saying what went wrong and how to fix it.

mod bench_local;
mod progress;
mod run;
mod tokenize;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "LLM inference server: paged attention, continuous batching, multi-GPU planning"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt (greedy unless told otherwise) and print tokens/s.
    Run(run::RunArgs),
    /// Measure prompt processing and single-stream decode speed on this machine's CPU.
    BenchLocal(bench_local::BenchLocalArgs),
    /// Print the token ids of texts as JSON (as `run` would feed them to the model).
    Tokenize(tokenize::TokenizeArgs),
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG").unwrap_or_else(|_| "warn".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Run(args) => run::run(args),
        Command::BenchLocal(args) => bench_local::bench_local(args),
        Command::Tokenize(args) => tokenize::tokenize(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
