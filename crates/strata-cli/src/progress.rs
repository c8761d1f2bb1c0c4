//! Progress display for long work: a bar on a terminal, silence in logs and pipes.
//! Model loading and GPU upload report progress through a `Fn(done, total)` callback.

use std::io::IsTerminal;
use std::path::Path;

use indicatif::{ProgressBar, ProgressStyle};
use strata_model::loader::{load_model, LoadedModel};

/// A progress bar on stderr when it is a terminal; nothing otherwise.
pub struct TerminalProgress(Option<ProgressBar>);

/// A bar labelled `label`, counting bytes or steps.
pub fn bar(label: &str) -> TerminalProgress {
    if !std::io::stderr().is_terminal() {
        return TerminalProgress(None);
    }
    let bar = ProgressBar::new(0);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len}").unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(label.to_string());
    TerminalProgress(Some(bar))
}

impl TerminalProgress {
    /// `done` of `total` are finished.
    pub fn update(&self, done: u64, total: u64) {
        if let Some(b) = &self.0 {
            b.set_length(total);
            b.set_position(done);
        }
    }

    /// Clears the bar.
    pub fn finish(self) {
        if let Some(b) = self.0 {
            b.finish_and_clear();
        }
    }
}

/// Loads a model, with a progress bar when stderr is a terminal.
pub fn load_with_progress(path: &Path) -> anyhow::Result<LoadedModel> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let progress = bar(&format!("loading {name}"));
    let model = load_model(path, &|done, total| progress.update(done, total));
    progress.finish();
    Ok(model?)
}
