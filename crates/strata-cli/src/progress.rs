//! Progress display for long work: a bar on a terminal, silence in logs and pipes.
//! Model loading reports bytes paged in through a `Fn(done, total)` callback.

use std::io::IsTerminal;
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use strata_model::loader::{load_model, LoadedModel};

/// Loads a model, with a progress bar when stderr is a terminal.
pub fn load_with_progress(path: &Path) -> anyhow::Result<LoadedModel> {
    let bar = if std::io::stderr().is_terminal() {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template("loading {msg} [{bar:30}] {bytes}/{total_bytes}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.set_message(
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        );
        Some(bar)
    } else {
        None
    };
    let model = load_model(path, &|done, total| {
        if let Some(b) = &bar {
            b.set_length(total);
            b.set_position(done);
        }
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    Ok(model?)
}
