//! Lap times inside a layer, for `graph::prefill_times`: off unless that probe turns them on
//! for its thread, so a layer's own code pays one thread-local check per lap. Only the long
//! (prompt) paths lap; the compiled decode steps never do (a lap evaluates, which a trace
//! being compiled cannot).

use std::cell::RefCell;
use std::time::Instant;

use mlx_rs::Array;

use crate::error::Result;

struct Laps {
    last: Instant,
    /// Milliseconds by part, in the order the parts first ran.
    ms_by_part: Vec<(String, f64)>,
}

thread_local! {
    static LAPS: RefCell<Option<Laps>> = const { RefCell::new(None) };
}

/// Turns lap timing on for this thread, with no times yet.
#[cfg(feature = "dev")]
pub(crate) fn start() {
    LAPS.set(Some(Laps { last: Instant::now(), ms_by_part: Vec::new() }));
}

/// Turns it off and returns the milliseconds recorded, by part, in the order parts first ran.
#[cfg(feature = "dev")]
pub(crate) fn finish() -> Vec<(String, f64)> {
    LAPS.take().map(|laps| laps.ms_by_part).unwrap_or_default()
}

/// Restarts the clock: what a layer reads is ready.
#[cfg(feature = "dev")]
pub(crate) fn restart() {
    LAPS.with_borrow_mut(|laps| {
        if let Some(laps) = laps {
            laps.last = Instant::now();
        }
    });
}

/// When on: evaluates `arrays` (what `part` made) and adds the time since the last lap to it.
pub(crate) fn lap(part: &str, arrays: &[&Array]) -> Result<()> {
    if LAPS.with_borrow(Option::is_none) {
        return Ok(());
    }
    mlx_rs::transforms::eval(arrays.iter().copied())?;
    LAPS.with_borrow_mut(|laps| {
        if let Some(laps) = laps {
            let now = Instant::now();
            let ms = (now - laps.last).as_secs_f64() * 1e3;
            match laps.ms_by_part.iter_mut().find(|(name, _)| name == part) {
                Some((_, total)) => *total += ms,
                None => laps.ms_by_part.push((part.to_string(), ms)),
            }
            laps.last = now;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_are_recorded_only_while_on() {
        let x = Array::from_f32(1.0);
        lap("off", &[&x]).unwrap();
        start();
        lap("a", &[&x]).unwrap();
        lap("a", &[&x]).unwrap();
        lap("b", &[&x]).unwrap();
        lap("a", &[&x]).unwrap();
        let times = finish();
        assert_eq!(times.iter().map(|(part, _)| part.as_str()).collect::<Vec<_>>(), ["a", "b"]);
        lap("after", &[&x]).unwrap();
        assert!(finish().is_empty());
    }
}
