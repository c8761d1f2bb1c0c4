//! Helpers the `strata` command's test binaries share: the binary, the default model, scratch
//! folders, and the check that a failure is one line with exit code 1.

use std::ffi::OsStr;
use std::path::PathBuf;
use std::process::Command;

/// The `strata` binary cargo built for these tests.
pub fn strata() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

/// The default model, which `make fetch` (scripts/fetch.py) puts in the cache.
pub fn default_model() -> PathBuf {
    let path = strata_model::loader::default_model_path();
    assert!(path.exists(), "{} is missing: run `make fetch` first", path.display());
    path
}

/// A scratch directory for one test.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("strata-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `strata args`, which must fail with exit code 1 (an error, not an abort) and one line.
pub fn exits_with_one_line<S: AsRef<OsStr> + std::fmt::Debug>(args: &[S]) -> String {
    let out = strata().args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: expected one line, got {stderr:?}");
    lines[0].to_string()
}
