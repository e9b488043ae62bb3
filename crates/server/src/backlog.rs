//! How far a streaming client is behind its answer. The engine never waits for a client (a
//! job's events go through an unbounded channel), so a client that stops reading — its socket
//! full, its process stopped — would keep its request generating to the end, holding a place
//! among the requests decoding together while the others wait. The worker counts what it
//! sends, the stream what the client took; a job whose client has taken nothing for
//! [`STALL`] while events wait for it is cancelled.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a client may leave events untaken before its request is cancelled.
pub const STALL: Duration = Duration::from_secs(30);

#[derive(Debug)]
pub struct Backlog {
    /// How long events may wait untaken.
    pub stall: Duration,
    sent: AtomicU64,
    taken: AtomicU64,
    /// When the client last took an event, or when the first of those waiting was sent.
    since: Mutex<Instant>,
}

impl Backlog {
    pub fn new(stall: Duration) -> Self {
        Backlog { stall, sent: AtomicU64::new(0), taken: AtomicU64::new(0), since: Mutex::new(Instant::now()) }
    }

    /// The worker sent an event.
    pub fn sent(&self) {
        if self.sent.fetch_add(1, Ordering::SeqCst) == self.taken.load(Ordering::SeqCst) {
            self.restart();
        }
    }

    /// The client took an event.
    pub fn taken(&self) {
        self.taken.fetch_add(1, Ordering::SeqCst);
        self.restart();
    }

    /// Whether events have waited for the client, untaken, for longer than its `stall`.
    pub fn stalled(&self) -> bool {
        self.sent.load(Ordering::SeqCst) > self.taken.load(Ordering::SeqCst)
            && self.since.lock().map(|t| t.elapsed() > self.stall).unwrap_or(false)
    }

    fn restart(&self) {
        if let Ok(mut t) = self.since.lock() {
            *t = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_events_left_untaken_stall() {
        let b = Backlog::new(Duration::from_millis(10));
        std::thread::sleep(Duration::from_millis(30));
        assert!(!b.stalled(), "nothing waits: a slow engine is no stall");
        b.sent();
        assert!(!b.stalled(), "just sent");
        std::thread::sleep(Duration::from_millis(30));
        assert!(b.stalled());
        b.taken();
        assert!(!b.stalled());
    }
}
