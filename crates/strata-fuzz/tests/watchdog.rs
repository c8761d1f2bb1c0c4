//! The driver's watchdog: a check that never returns ends the run with its input saved, rather
//! than stalling `make test` forever. The hang runs in a child process, which the watchdog aborts.

use std::process::Command;
use std::time::Duration;

use proptest::strategy::Just;
use strata_fuzz::{fuzz, Bounds, Target};

/// Set in the child process, which runs the hanging target.
const CHILD: &str = "STRATA_FUZZ_WATCHDOG_CHILD";

#[test]
fn a_hanging_check_is_aborted_with_its_input_saved() {
    if std::env::var_os(CHILD).is_some() {
        let target = Target {
            name: "watchdog_child",
            default_cases: 1,
            bounds: Bounds {
                bytes_per_input_byte: 1,
                fixed_bytes: 1 << 20,
                time: Duration::from_millis(100),
            },
        };
        fuzz(target, Just(b"hang".to_vec()), |_| loop {
            std::thread::sleep(Duration::from_millis(10));
        });
        return;
    }
    let saved = std::env::temp_dir().join("strata-fuzz/watchdog_child-seed0.bin");
    let _ = std::fs::remove_file(&saved);
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "a_hanging_check_is_aborted_with_its_input_saved",
            "--nocapture",
        ])
        .env(CHILD, "1")
        .env_remove("STRATA_FUZZ_SECONDS")
        .env_remove("STRATA_FUZZ_CASES")
        .env_remove("STRATA_FUZZ_SEED")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("strata-fuzz: watchdog_child: a case hung (ran 15 times its time bound)"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&saved).unwrap(), b"hang");
}
