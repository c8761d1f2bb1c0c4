//! Helpers the engine's test binaries share: the default model, and requests run side by side.
//! Each binary uses some of them.
#![allow(dead_code)]

use strata_engine::{complete, Completion, EngineHandle, GenerationRequest};
use strata_model::loader::{default_model_path, load_model, LoadedModel};

/// The default model (SmolLM2-135M-Instruct Q4_1), fetched by `make fetch`.
pub fn default_model() -> LoadedModel {
    let path = default_model_path();
    assert!(path.exists(), "{} is missing: run `make fetch` first", path.display());
    load_model(&path, &|_, _| {}).expect("default model loads")
}

/// Submits every request, then waits for each: they run side by side.
pub fn run_together(e: &EngineHandle, reqs: Vec<GenerationRequest>) -> Vec<Completion> {
    let streams: Vec<_> = reqs.into_iter().map(|r| e.submit(r).expect("submit")).collect();
    streams
        .into_iter()
        .map(|s| complete(s, &mut |_| {}).expect("request succeeds"))
        .collect()
}
