//! The `strata` command line: serve the OpenAI API, run a model, load-test, benchmark, show GPUs, plan layouts, quantize.
//! Errors end the process with one line saying what went wrong and how to fix it.

#[cfg(feature = "cuda")]
mod bench_attention;
#[cfg(feature = "cuda")]
mod bench_gpu;
mod bench_local;
mod device;
mod plan;
mod progress;
mod quantize;
mod random_weights;
mod run;
mod serve;
mod synthetic_prompt;
mod tokenize;
mod topo;

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
    /// Serve the OpenAI-compatible HTTP API (chat, completions, streaming, metrics).
    Serve(serve::ServeArgs),
    /// Generate a continuation of a prompt (greedy unless told otherwise) and print tokens/s.
    Run(run::RunArgs),
    /// Measure prompt processing and single-stream decode speed on this machine's CPU.
    BenchLocal(bench_local::BenchLocalArgs),
    /// Measure one GPU through the engine: TTFT, single-stream decode vs the memory roofline,
    /// throughput at many concurrent requests, fp8 vs bf16 KV cache.
    #[cfg(feature = "cuda")]
    BenchGpu(bench_gpu::BenchGpuArgs),
    /// Print the token ids of texts as JSON (as `run` would feed them to the model).
    Tokenize(tokenize::TokenizeArgs),
    /// Load-test an OpenAI-compatible server (strata, vLLM, llama.cpp, ...) and report latency and throughput.
    Bench(strata_bench::BenchArgs),
    /// Show the GPUs and the links between them (NVLink, P2P, PCIe, NUMA).
    Topo(topo::TopoArgs),
    /// Choose how to spread a model over the GPUs (tensor / pipeline parallel, layer ranges) and say why.
    Plan(plan::PlanArgs),
    /// Re-quantize a GGUF model's weights (Q4_K_M, Q4_K, Q5_K, Q6_K, Q8_0, Q4_0, ...) into a new GGUF file.
    Quantize(quantize::QuantizeArgs),
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = strata_runtime::cpu::isa::isa_cap_from_env() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
    // Before any thread starts: may re-execute with the CUDA library path set.
    match &cli.command {
        Command::Serve(a) => device::prepare_libraries(a.device.device),
        Command::Run(a) => device::prepare_libraries(a.device.device),
        Command::Topo(a) if a.measure => device::prepare_libraries(device::Device::Cuda(0)),
        #[cfg(feature = "cuda")]
        Command::BenchGpu(_) => device::prepare_libraries(device::Device::Cuda(0)),
        _ => {}
    }
    // A server says what it is doing (capacity, address, shutdown); one-shot commands stay quiet.
    let default_filter = if matches!(cli.command, Command::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG").unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Serve(args) => serve::serve(args),
        Command::Bench(args) => strata_bench::run(args),
        Command::Run(args) => run::run(args),
        Command::BenchLocal(args) => bench_local::bench_local(args),
        #[cfg(feature = "cuda")]
        Command::BenchGpu(args) => bench_gpu::bench_gpu(args),
        Command::Tokenize(args) => tokenize::tokenize(args),
        Command::Topo(args) => topo::topo(args),
        Command::Plan(args) => plan::plan(args),
        Command::Quantize(args) => quantize::quantize_command(args),
    };
    if let Err(e) = result {
        eprintln!("error: {}", one_line(&e));
        std::process::exit(1);
    }
}

/// The error and its causes on one line (as `{:#}` prints them), each text once: a cause whose
/// text the line already holds, because an error both shows and returns it, is left out.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::one_line;

    /// An error that shows its source's text and also returns it as its source.
    #[derive(Debug)]
    struct ShowsAndReturns(std::io::Error);

    impl std::fmt::Display for ShowsAndReturns {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot read x.json: {}", self.0)
        }
    }

    impl std::error::Error for ShowsAndReturns {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn one_line_says_each_cause_once_and_keeps_context() {
        let inner = std::io::Error::other("disk on fire");
        let e = anyhow::Error::new(ShowsAndReturns(inner)).context("loading the model");
        assert_eq!(
            format!("{e:#}"),
            "loading the model: cannot read x.json: disk on fire: disk on fire"
        );
        assert_eq!(one_line(&e), "loading the model: cannot read x.json: disk on fire");
    }
}
