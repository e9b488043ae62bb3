//! The threads engines run on, kept and reused. MLX gives every thread that computes its own
//! default stream, served by a scheduler thread that stays for the life of the process: a new
//! engine thread per model swap would leave one such thread behind each time (the soak test
//! counts them). Engines instead run on threads that, once their engine is done, wait for the
//! next one; there are at most as many as engines ever ran at once (two during a swap).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex, OnceLock};

type Body = Box<dyn FnOnce() + Send>;

/// Engine threads waiting for work.
fn idle() -> &'static Mutex<Vec<mpsc::Sender<Body>>> {
    static IDLE: OnceLock<Mutex<Vec<mpsc::Sender<Body>>>> = OnceLock::new();
    IDLE.get_or_init(Default::default)
}

/// Set once a body has returned, with the message of the panic that ended it if one did.
#[derive(Clone, Default)]
pub struct Finished(Arc<AtomicBool>, Arc<Mutex<Option<String>>>);

impl Finished {
    pub fn is_finished(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }

    /// Why the body ended early: the message of the panic that ended it.
    pub fn panicked(&self) -> Option<String> {
        self.1.lock().ok().and_then(|p| p.clone())
    }
}

/// Runs `body` on an idle engine thread, or on a new one.
pub fn run(body: impl FnOnce() + Send + 'static) -> std::io::Result<Finished> {
    let finished = Finished::default();
    let done = finished.clone();
    let mut job: Body = Box::new(move || {
        // A panic ends this engine, not the thread: it is recorded for `/health` and the
        // requests that come after, and the thread waits for the next engine.
        if let Err(panic) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)) {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a panic without a message".into());
            if let Ok(mut p) = done.1.lock() {
                *p = Some(message);
            }
        }
        done.0.store(true, Ordering::SeqCst);
    });
    while let Some(thread) = idle().lock().ok().and_then(|mut idle| idle.pop()) {
        match thread.send(job) {
            Ok(()) => return Ok(finished),
            Err(mpsc::SendError(back)) => job = back, // that thread is gone: try another
        }
    }
    let (tx, rx) = mpsc::channel::<Body>();
    tx.send(job).map_err(|_| std::io::Error::other("a new engine thread's queue closed"))?;
    std::thread::Builder::new().name("ferrite-engine".into()).spawn(move || {
        while let Ok(job) = rx.recv() {
            job();
            // Ready for the next engine.
            match idle().lock() {
                Ok(mut idle) => idle.push(tx.clone()),
                Err(_) => return,
            }
        }
    })?;
    Ok(finished)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wait(finished: &Finished) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !finished.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(finished.is_finished());
    }

    #[test]
    fn a_panicking_engine_is_reported_and_its_thread_serves_the_next() {
        let crashed = run(|| panic!("usize::MAX layers")).unwrap();
        wait(&crashed);
        assert_eq!(crashed.panicked().as_deref(), Some("usize::MAX layers"));
        let next = run(|| {}).unwrap();
        wait(&next);
        assert_eq!(next.panicked(), None);
    }
}
