//! How a drafter's drafts go on past the first position: per position, the share of the
//! cycles that had every draft before it accepted which had this one accepted too.
//!
//! A request's controller learns these from its own cycles, and the engine carries them from
//! one request to the next ([`AcceptanceMemory`]): a drafter that has not drafted deep in
//! this request (one standing by, tried at depth 1; one back from plain decoding on a probe)
//! is judged on how its deeper drafts went, not on its first position's rate carried on — a
//! block drafter's acceptance falls faster than that (bench/results/dflash.md), and judged
//! that way a lucky try at depth 1 looked like a drafter whose every draft is accepted.
//!
//! The memory also keeps where the last request ended ([`Remembered::ended`]): the next one
//! starts there, its first position's figure worth a couple of its own cycles, rather than at
//! the tuned depth with nothing known — an agent's requests follow one another on the same
//! work, and each restart from the tuned depth re-paid the cycles that had sent the last one
//! plain.

use crate::speculation::DraftWith;

/// Weight of the newest cycle in a running figure, once its first few are averaged (the
/// controller's acceptance figures and timings run on it too).
pub(super) const WEIGHT: f64 = 0.25;

/// The weight of a figure's next sample after `seen` of them: the first few are averaged (the
/// first replaces the guess), later ones move it by [`WEIGHT`] — one lucky or unlucky cycle is
/// not the figure.
pub(super) fn sample_weight(seen: usize) -> f64 {
    (1.0 / (seen + 1) as f64).max(WEIGHT)
}

/// A running figure moved by one more sample (the first sample sets it).
pub(super) fn running(figure: Option<f64>, sample: f64) -> f64 {
    figure.map_or(sample, |f| f + WEIGHT * (sample - f))
}

/// Cycles a carried figure counts for in a new request: the request's own soon outweigh it.
pub(super) const CARRIED_CYCLES: usize = 2;

/// The rates by position, from the second draft on.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GoingOn {
    /// Index i: draft position i + 1 (the first is 0): its running rate and how many cycles
    /// reached it.
    rates: Vec<(f64, usize)>,
}

impl GoingOn {
    /// A cycle drafted `drafted` tokens, the first `accepted` of them accepted.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        // Position i was reached when every draft before it was accepted.
        for i in 1..drafted.min(accepted + 1) {
            if self.rates.len() < i {
                self.rates.resize(i, (0.0, 0));
            }
            let (rate, seen) = &mut self.rates[i - 1];
            let hit = if i < accepted { 1.0 } else { 0.0 };
            *rate += sample_weight(*seen) * (hit - *rate);
            *seen += 1;
        }
    }

    /// The rate at draft position `i` (from 1), where some cycle reached it.
    pub fn rate(&self, i: usize) -> Option<f64> {
        let (rate, seen) = self.rates.get(i.checked_sub(1)?)?;
        (*seen > 0).then_some(*rate)
    }

    /// The figures as a new request starts from them: each worth at most a couple of cycles.
    fn carried(&self) -> GoingOn {
        GoingOn { rates: self.rates.iter().map(|&(rate, seen)| (rate, seen.min(CARRIED_CYCLES))).collect() }
    }
}

/// What a request's controller leaves the next request drafting with the same drafter.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Remembered {
    pub going_on: GoingOn,
    /// The first position's figure and the depth the request ended at, where it measured one.
    pub ended: Option<(f64, usize)>,
}

impl Remembered {
    /// What a new request starts from: the figures, worth a couple of its own cycles.
    fn carried(&self) -> Remembered {
        Remembered { going_on: self.going_on.carried(), ended: self.ended }
    }
}

/// Each drafter's [`Remembered`] as the last request that drafted with it left it.
#[derive(Debug, Clone, Default)]
pub struct AcceptanceMemory {
    mtp: Remembered,
    block: Remembered,
}

impl AcceptanceMemory {
    /// What a new request's controller for `with` starts from.
    pub fn of(&self, with: DraftWith) -> Remembered {
        self.slot(with).carried()
    }

    /// A request's figures for `with`, kept for the next one (a request that measured
    /// nothing leaves the last one's).
    pub fn keep(&mut self, with: DraftWith, remembered: Remembered) {
        let slot = self.slot_mut(with);
        if remembered.going_on.rates.iter().any(|&(_, seen)| seen > 0) {
            slot.going_on = remembered.going_on;
        }
        if remembered.ended.is_some() {
            slot.ended = remembered.ended;
        }
    }

    fn slot(&self, with: DraftWith) -> &Remembered {
        match with {
            DraftWith::Mtp => &self.mtp,
            DraftWith::Block => &self.block,
        }
    }

    fn slot_mut(&mut self, with: DraftWith) -> &mut Remembered {
        match with {
            DraftWith::Mtp => &mut self.mtp,
            DraftWith::Block => &mut self.block,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_position_counts_only_the_cycles_that_reached_it() {
        let mut g = GoingOn::default();
        g.record(3, 3); // all three accepted
        g.record(3, 1); // the second rejected: the third never reached
        g.record(3, 0); // nothing reached past the first
        assert_eq!(g.rate(0), None, "the first position is the controller's own figure");
        assert_eq!(g.rate(1), Some(0.5));
        assert_eq!(g.rate(2), Some(1.0));
        assert_eq!(g.rate(3), None);
    }

    #[test]
    fn a_new_request_starts_from_the_last_ones_figures_at_little_weight() {
        let mut memory = AcceptanceMemory::default();
        let mut g = GoingOn::default();
        for _ in 0..20 {
            g.record(4, 1);
        }
        memory.keep(DraftWith::Block, Remembered { going_on: g, ended: Some((0.7, 0)) });
        // A request that measured nothing leaves what the last one had.
        memory.keep(DraftWith::Block, Remembered::default());
        assert_eq!(memory.of(DraftWith::Mtp), Remembered::default());
        assert_eq!(memory.of(DraftWith::Block).ended, Some((0.7, 0)));
        let mut carried = memory.of(DraftWith::Block).going_on;
        assert_eq!(carried.rate(1), Some(0.0));
        // Two of the request's own cycles weigh as much as the carried figure.
        carried.record(2, 2);
        carried.record(2, 2);
        assert_eq!(carried.rate(1), Some(0.5));
    }
}
