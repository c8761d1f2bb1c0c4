//! Helpers shared by the integration tests of this crate (and, by path, the CLI tests).
//! Each test binary includes what it needs.

pub mod fp8_hf;
pub mod tiny_hf;
