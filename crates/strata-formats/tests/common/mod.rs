//! Helpers shared by the integration tests of strata-formats: where the real default model is.
//! Each test binary includes this module with `mod common;`.

use std::path::PathBuf;

const DEFAULT_MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The default model in the strata cache (`$STRATA_CACHE`, else `~/.cache/strata`).
pub fn default_model_path() -> PathBuf {
    let cache = match std::env::var_os("STRATA_CACHE") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/strata"),
    };
    let path = cache.join("models").join(DEFAULT_MODEL);
    assert!(path.is_file(), "{} is missing: run `make fetch` first", path.display());
    path
}
