//! Watching the models folder, so a model another tool adds (or removes) shows up in the
//! app without a restart. Events are coalesced: one call per burst of file changes.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

/// Calls `on_change` (from a thread of its own) after changes in `models_dir` settle for
/// `settle`. Watching stops when the returned watcher is dropped.
pub fn watch(
    models_dir: &Path,
    settle: Duration,
    on_change: impl Fn() + Send + 'static,
) -> notify::Result<notify::RecommendedWatcher> {
    std::fs::create_dir_all(models_dir).map_err(notify::Error::io)?;
    let (tx, rx) = mpsc::channel::<()>();
    let mut watcher = notify::recommended_watcher(move |event: notify::Result<notify::Event>| {
        if event.is_ok() {
            let _ = tx.send(());
        }
    })?;
    watcher.watch(models_dir, RecursiveMode::Recursive)?;
    std::thread::Builder::new()
        .name("ferrite-store-watch".into())
        .spawn(move || {
            while rx.recv().is_ok() {
                // Drain the burst, then report once.
                while rx.recv_timeout(settle).is_ok() {}
                on_change();
            }
        })
        .map_err(notify::Error::io)?;
    Ok(watcher)
}
