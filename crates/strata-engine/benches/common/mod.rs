//! What the engine's bench programs share: ending on a bad flag, and the default model, each
//! with a clear message instead of a panic.

#![allow(dead_code)]

use std::path::PathBuf;

use strata_model::loader::{default_model_path, load_model, LoadedModel};

/// The parsed options, or the program ends with the parser's message (exit code 2).
pub fn options_or_exit<T>(parsed: Result<T, String>) -> T {
    match parsed {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}

/// The default model and its path, or the program ends saying how to fetch it.
pub fn default_model_or_exit() -> (PathBuf, LoadedModel) {
    let path = default_model_path();
    match load_model(&path, &|_, _| {}) {
        Ok(model) => (path, model),
        Err(e) => {
            eprintln!("error: cannot load {}: {e}; run `make fetch` first", path.display());
            std::process::exit(1);
        }
    }
}

/// The program's arguments, less the `--bench` cargo adds.
pub fn bench_args() -> Vec<String> {
    std::env::args().skip(1).filter(|a| a != "--bench").collect()
}

/// `--levels 1,4,16`: the concurrency levels.
pub fn levels(value: &str) -> Result<Vec<usize>, String> {
    value
        .split(',')
        .map(|s| s.trim().parse().map_err(|e| format!("--levels: {e}")))
        .collect()
}

/// A results file: `name` under bench/results/ by default, or `--out PATH` relative to the
/// workspace root (cargo runs benches from the crate's folder).
pub fn results_path(out: Option<&str>, name: &str) -> PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    match out {
        Some(path) => root.join(path),
        None => root.join("bench/results").join(name),
    }
}
