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

/// Set once a body has returned.
#[derive(Clone, Default)]
pub struct Finished(Arc<AtomicBool>);

impl Finished {
    pub fn is_finished(&self) -> bool {
        self.0.load(Ordering::SeqCst)
    }
}

/// Runs `body` on an idle engine thread, or on a new one.
pub fn run(body: impl FnOnce() + Send + 'static) -> std::io::Result<Finished> {
    let finished = Finished::default();
    let done = finished.clone();
    let mut job: Body = Box::new(move || {
        body();
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
