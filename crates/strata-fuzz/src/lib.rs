//! strata-fuzz: fuzzing of strata's file loaders on stable Rust, inside ordinary `cargo test`s.
//! Mutation strategies (bytes and JSON), a counting allocator, and a driver bounding memory and time.
//!
//! A fuzz test binary installs the allocator and hands the driver a strategy of inputs and a
//! check; the driver runs a bounded number of cases (`make test`) or a time budget (`make fuzz`),
//! and fails on a panic, on a case that allocates more than its bound, or on a case that hangs.
//!
//! ```text
//! #[global_allocator]
//! static ALLOCATOR: strata_fuzz::CountingAllocator = strata_fuzz::CountingAllocator;
//! ```

mod alloc;
mod driver;
mod mutate;

pub use alloc::{peak_allocation, CountingAllocator};
pub use driver::{fuzz, regressions_dir, replay_dir, Bounds, Outcome, Target};
pub use mutate::{interesting_integer, json_mutated, mutated, ByteMutation, JsonEdit};
