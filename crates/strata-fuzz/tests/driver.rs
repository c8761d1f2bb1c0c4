//! The driver fails a target on a panic or on a case allocating past its bound, with the input
//! shrunk and saved; regressions replay from a folder.

use std::panic::catch_unwind;
use std::time::Duration;

use proptest::prelude::any;
use strata_fuzz::{fuzz, replay_dir, Bounds, CountingAllocator, Outcome, Target};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

fn target(name: &'static str) -> Target {
    Target {
        name,
        default_cases: 200,
        bounds: Bounds {
            bytes_per_input_byte: 16,
            fixed_bytes: 1 << 20,
            time: Duration::from_secs(2),
        },
    }
}

fn failure_message(name: &'static str, check: fn(&[u8]) -> Outcome) -> String {
    let inputs = proptest::collection::vec(any::<u8>(), 0..64);
    let panic = catch_unwind(|| fuzz(target(name), inputs, check)).expect_err("the target must fail");
    panic.downcast_ref::<String>().cloned().unwrap_or_default()
}

#[test]
fn a_panicking_check_fails_with_the_smallest_input_saved() {
    let message = failure_message("driver_panics", |input| {
        assert!(input.len() < 5, "boom");
        Outcome::Refused
    });
    assert!(
        message.contains("panicked at crates/strata-fuzz/tests/driver.rs:"),
        "{message}"
    );
    assert!(message.contains(": boom"), "{message}");
    let saved = std::env::temp_dir().join("strata-fuzz/driver_panics-seed0.bin");
    assert_eq!(
        std::fs::read(saved).unwrap().len(),
        5,
        "shrunk to the shortest failing input"
    );
}

#[test]
fn a_case_allocating_past_its_bound_fails() {
    let message = failure_message("driver_allocates", |input| {
        // As a loader trusting a count in the file would: 4 MiB for any input of 8+ bytes.
        if input.len() >= 8 {
            std::hint::black_box(vec![1u8; 4 << 20]);
        }
        Outcome::Refused
    });
    assert!(
        message.contains("allocated 4194304 bytes for a 8-byte input (bound 1048704)"),
        "{message}"
    );
}

#[test]
fn regressions_replay_from_a_folder() {
    let dir = std::env::temp_dir().join(format!("strata-fuzz-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("a.bin"), b"ok").unwrap();
    assert_eq!(replay_dir(target("replay"), &dir, |_| Outcome::Accepted), 1);
    std::fs::write(dir.join("b.bin"), b"bad").unwrap();
    let panic = catch_unwind(|| {
        replay_dir(target("replay"), &dir, |i| {
            if i == b"bad" {
                panic!("no")
            } else {
                Outcome::Accepted
            }
        })
    })
    .expect_err("b.bin fails");
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        message.contains("b.bin panicked at ") && message.ends_with(": no"),
        "{message}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(replay_dir(target("replay"), &dir, |_| Outcome::Accepted), 0);
}
