//! The store tests' local hub as a program, for tests in other languages (the web UI's
//! browser tests): publishes a project-made checkpoint as REPO, serves it slowly enough that
//! progress can be watched, prints its endpoint on the first line of stdout and runs until
//! killed. Not part of Ferrite: a test fixture (`cargo test --all-targets` builds it).
//!
//!     cargo run -p ferrite-store --example test_hub -- REPO [MILLISECONDS_PER_16_KIB]

#[path = "../tests/hub/mod.rs"]
mod hub;

use std::io::Write;
use std::time::Duration;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let Some(repo) = args.next().filter(|r| r.split('/').count() == 2) else {
        eprintln!("usage: test_hub ORG/NAME [MILLISECONDS_PER_16_KIB]");
        std::process::exit(2);
    };
    let slow_ms: u64 = match args.next().map(|a| a.parse()) {
        None => 0,
        Some(Ok(ms)) => ms,
        Some(Err(e)) => {
            eprintln!("test_hub: the delay must be a number of milliseconds: {e}");
            std::process::exit(2);
        }
    };
    let source = tempfile::tempdir().map_err(|e| format!("test_hub: a temporary folder: {e}"))?;
    hub::checkpoint(source.path(), true, 7);
    let running = hub::start().await;
    running.hub.publish(&repo, source.path());
    if slow_ms > 0 {
        running.hub.faults.lock().map_err(|_| "test_hub: the fault settings are poisoned")?.slow =
            Some(Duration::from_millis(slow_ms));
    }
    println!("{}", running.endpoint);
    std::io::stdout().flush()?;
    std::future::pending::<()>().await;
    Ok(())
}
