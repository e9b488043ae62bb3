//! What each cycle and plain step tells the statistics and the depth controllers: acceptance,
//! and how long the request's own steps took. The cost model's figures are measured apart from
//! any request (a verify pass, a plain step, each timed alone); the request's steps carry the
//! loop's own costs too (reading tokens back, the host's work between steps, a busy machine),
//! which may move a depth across break-even. So the wall time between two plain steps in a row,
//! and between two cycles in a row, goes to the controllers, which scale their costs by it.

use std::time::{Duration, Instant};

use super::{ControlStats, LastStep, Speculator};
use crate::depth_control::choice::TryVerdict;

impl Speculator<'_> {
    /// A cycle's figures into the statistics and the controller: `drafted` drafts of which
    /// the first `accepted` were kept, `committed` tokens.
    pub(super) fn account(
        &mut self,
        drafted: usize,
        accepted: usize,
        committed: usize,
        draft: Duration,
        verify: Duration,
    ) {
        let s = &mut self.stats;
        s.cycles += 1;
        s.committed += committed;
        for i in 0..drafted {
            s.drafted[i] += 1;
            s.accepted[i] += usize::from(i < accepted);
        }
        s.draft_time += draft;
        s.verify_time += verify;
        let Some(control) = &mut self.active.control else { return };
        match (self.trying, drafted) {
            // The plain step before a try (or a try whose grammar let nothing be drafted).
            (true, 0) => {}
            (true, _) => control.record_probe(drafted, accepted),
            (false, _) => control.record(drafted, accepted),
        }
        if self.trying && drafted > 0 {
            self.settle_try();
        }
        let Some(control) = &self.active.control else { return };
        let s = &mut self.stats;
        let cycles_s = (s.draft_time + s.verify_time).as_secs_f64();
        let measured = if cycles_s > 0.0 { s.committed as f64 * control.plain_step_s() / cycles_s } else { 0.0 };
        let after_plain = s.control.as_ref().map(|c| c.after_plain.clone()).unwrap_or_default();
        let mut changes = control.changes.clone();
        if let Some(other) = self.standby.as_ref().and_then(|s| s.control.as_ref()) {
            changes.merge(&other.changes);
        }
        s.control = Some(Box::new(ControlStats {
            depth_now: control.depth(),
            expected_speedup: control.expected_speedup(),
            measured_speedup: measured,
            drafter_now: self.active.drafter.draft_with(),
            switches: self.choice.switches,
            changes,
            after_plain,
        }));
    }

    /// After a cycle that tried the drafter standing by: it stays in use if it now promises
    /// more than the one it replaced, else that one comes back.
    fn settle_try(&mut self) {
        self.trying = false;
        let tried = self.active.control.as_ref();
        let other = self.standby.as_ref().and_then(|s| s.control.as_ref());
        let verdict = match (tried, other) {
            (Some(tried), Some(other)) => self.choice.settle(tried, other),
            _ => TryVerdict::Back,
        };
        if verdict != TryVerdict::Switch {
            self.swap();
        }
        // A try in a plain drafter's probe turn that failed did as its own probe would have:
        // its probes grow rarer alike.
        if let (TryVerdict::Back, Some(control)) = (verdict, self.active.control.as_mut().filter(|c| c.depth() == 0)) {
            control.probe_elsewhere_failed();
        }
    }

    /// A plain step just gave its token: after another plain step, its wall time goes to both
    /// controllers (a plain step costs the same whichever drafter stands by).
    pub(super) fn timed_plain_step(&mut self) {
        let now = Instant::now();
        if let Some(LastStep { at, plain: true }) = self.last_step {
            let seconds = (now - at).as_secs_f64();
            for control in self.slots_mut().filter_map(|slot| slot.control.as_mut()) {
                control.timed_plain_step(seconds);
            }
        }
        self.last_step = Some(LastStep { at: now, plain: true });
    }

    /// A cycle drafting `depth` tokens just committed `committed` tokens (`took` from its
    /// drafting to its verdict): after another cycle, its wall time goes to the controller of
    /// the drafter that drafted it. Not a try of the drafter standing by, nor the first cycle
    /// after plain steps: each first catches its drafter up on what it missed, which is not a
    /// cycle's usual cost (the statistics count those apart, and a plain controller counts its
    /// probes' against what it may spend probing).
    pub(super) fn timed_cycle(&mut self, depth: usize, committed: usize, took: Duration) {
        let now = Instant::now();
        if depth > 0 && self.last_step.is_some_and(|last| last.plain) {
            if let Some(control) = &mut self.stats.control {
                control.after_plain.cycles += 1;
                control.after_plain.time += took;
            }
            // A try runs the drafter standing by in the plain one's probe turn.
            let prober = if self.trying { self.standby.as_mut() } else { Some(&mut self.active) };
            if let Some(control) = prober.and_then(|slot| slot.control.as_mut()).filter(|c| c.depth() == 0) {
                control.probe_took(took.as_secs_f64(), committed);
            }
        }
        let control = self.active.control.as_mut().filter(|_| !self.trying);
        if let (Some(LastStep { at, plain: false }), Some(control)) = (self.last_step, control) {
            control.timed_cycle(depth, (now - at).as_secs_f64());
        }
        self.last_step = (depth > 0).then_some(LastStep { at: now, plain: false });
    }
}

/// A duration in milliseconds, as the statistics' other times (serde's own form splits seconds
/// and nanoseconds).
pub(super) fn milliseconds<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}
