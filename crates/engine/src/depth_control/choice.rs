//! With two drafters (the MTP head and a block drafter): when the request tries the one
//! standing by, and whether a try puts it in use.

use super::{DepthController, HYSTERESIS};

/// With two drafters, one cycle with the one standing by this often...
const TRY_STANDBY_EVERY: usize = 32;
/// ...twice as long after each try that promised less, up to this: a try costs about a
/// cycle's drafting, and the drafter standing by takes in what it missed first.
const MAX_TRY_STANDBY_EVERY: usize = 256;
/// A try that promises more is tried again this many cycles later, and the drafter switches
/// only if that one promises more too: one cycle's acceptance is mostly luck (a request that
/// began on the better drafter would otherwise leave it on one lucky try).
const TRY_AGAIN_AFTER: usize = 4;

/// With two drafters (the MTP head and a block drafter): when to try the one standing by, and
/// whether a try puts it in use.
#[derive(Debug, Clone)]
pub struct DrafterChoice {
    wait: usize,
    every: usize,
    /// While the drafter in use is plain: whether the next probe is the other one's.
    others_turn: bool,
    /// The last try promised more: the next one comes soon and decides.
    promising: bool,
    pub switches: usize,
}

/// What a try of the drafter standing by settles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TryVerdict {
    /// It takes over.
    Switch,
    /// It promised more once: back to the one in use, and tried again soon.
    Again,
    /// Back to the one in use; the next try waits twice as long.
    Back,
}

impl Default for DrafterChoice {
    fn default() -> Self {
        DrafterChoice::new()
    }
}

impl DrafterChoice {
    pub fn new() -> Self {
        DrafterChoice { wait: 0, every: TRY_STANDBY_EVERY, others_turn: true, promising: false, switches: 0 }
    }

    /// A plain drafter's probe is due: whether it goes to the drafter standing by (every
    /// other one does, so two drafters probe no more often than one; a promising try's
    /// second look comes at the next).
    pub fn take_turn(&mut self) -> bool {
        if self.promising {
            return true;
        }
        self.others_turn = !self.others_turn;
        !self.others_turn
    }

    /// Counts a cycle or plain step; whether the next one tries the drafter standing by.
    pub fn try_standby(&mut self) -> bool {
        self.wait += 1;
        if self.wait < self.every {
            return false;
        }
        self.wait = 0;
        true
    }

    /// After a try: whether `tried` (its figures now include the try) takes over from
    /// `current` — on the second try in a row that promises more than `current`. A try that
    /// promises less makes the next one wait twice as long.
    pub fn settle(&mut self, tried: &DepthController, current: &DepthController) -> TryVerdict {
        let better = tried.depth() > 0 && tried.expected_speedup() > current.expected_speedup() * (1.0 + HYSTERESIS);
        match (better, std::mem::take(&mut self.promising)) {
            (true, true) => {
                self.switches += 1;
                self.every = TRY_STANDBY_EVERY;
                TryVerdict::Switch
            }
            (true, false) => {
                self.promising = true;
                self.wait = self.every.saturating_sub(TRY_AGAIN_AFTER);
                TryVerdict::Again
            }
            (false, _) => {
                self.every = (2 * self.every).min(MAX_TRY_STANDBY_EVERY);
                TryVerdict::Back
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{costs, mtp, run};
    use super::super::{EVERY, MAX_PROBE_EVERY};
    use super::*;
    use crate::depth_control::going_on::{GoingOn, Remembered};
    use crate::speculation::DraftWith;

    /// A drafter tried at depth 1 is judged on how its deeper drafts went in earlier requests:
    /// two hits there no longer promise that every deeper draft would be accepted.
    #[test]
    fn a_try_at_depth_one_is_judged_on_the_drafters_deeper_record() {
        let mut current = mtp(costs(), 2);
        run(&mut current, 0.8, 16);
        let tried = |going_on: GoingOn| {
            let remembered = Remembered { going_on, ended: None };
            let mut block = DepthController::untuned(costs(), DraftWith::Block).remembering(remembered);
            block.record_probe(1, 1);
            block.record_probe(1, 1);
            block
        };
        let unknown = tried(GoingOn::default());
        assert!(unknown.expected_speedup() > 2.0 * current.expected_speedup(), "every deeper draft looks accepted");
        assert_eq!(DrafterChoice::new().settle(&unknown, &current), TryVerdict::Again);
        // Earlier requests: its second drafts were never accepted.
        let mut earlier = GoingOn::default();
        for _ in 0..8 {
            earlier.record(3, 1);
        }
        let known = tried(earlier);
        assert_eq!(known.estimated_reach()[1..], [0.0; 6]);
        assert_eq!(DrafterChoice::new().settle(&known, &current), TryVerdict::Back);
    }

    /// Two drafters: a plain drafter's probe turns alternate with tries of the other; a try
    /// that takes over resets the schedule, one that does not makes tries (and, in a plain
    /// drafter's turn, its probes) rarer; an untuned drafter may go as deep as its costs.
    #[test]
    fn two_drafters_take_turns_and_a_better_one_takes_over() {
        let mut choice = DrafterChoice::new();
        let turns: Vec<bool> = (0..4).map(|_| choice.take_turn()).collect();
        assert_eq!(turns, [true, false, true, false]);
        let tries = |choice: &mut DrafterChoice, n| (0..n).filter(|_| choice.try_standby()).count();
        assert_eq!(tries(&mut choice, TRY_STANDBY_EVERY), 1);

        let block = DepthController::untuned(costs(), DraftWith::Block);
        assert_eq!((block.depth(), block.max_depth), (1, 7));
        let mut good = DepthController::untuned(costs(), DraftWith::Block);
        good.record_probe(1, 1);
        let mut plain = mtp(costs(), 1);
        run(&mut plain, 0.0, EVERY);
        assert_eq!(plain.depth(), 0);
        // One try that promises more is looked at again soon, in the next probe turn too; the
        // second such try switches.
        assert_eq!(choice.settle(&good, &plain), TryVerdict::Again, "{:?}", good.reach);
        assert_eq!(choice.switches, 0);
        assert!(choice.take_turn() && choice.take_turn(), "a promising try's second look is due");
        assert_eq!(tries(&mut choice, TRY_AGAIN_AFTER), 1, "tried again soon");
        good.record_probe(1, 1);
        assert_eq!(choice.settle(&good, &plain), TryVerdict::Switch);
        assert_eq!(choice.switches, 1);
        let mut bad = DepthController::untuned(costs(), DraftWith::Block);
        bad.record_probe(1, 0);
        assert_eq!(choice.settle(&bad, &good), TryVerdict::Back);
        assert_eq!(tries(&mut choice, 2 * TRY_STANDBY_EVERY), 1, "twice as long after a try that failed");
        // A promising try followed by a failed one does not switch.
        let mut lucky = DepthController::untuned(costs(), DraftWith::Block);
        lucky.record_probe(1, 1);
        assert_eq!(choice.settle(&lucky, &plain), TryVerdict::Again);
        lucky.record_probe(1, 0);
        lucky.record_probe(1, 0);
        assert_eq!(choice.settle(&lucky, &plain), TryVerdict::Back, "{:?}", lucky.reach);
        assert_eq!(choice.switches, 1);

        let every = plain.probe_every;
        plain.probe_elsewhere_failed();
        assert_eq!(plain.probe_every, (2 * every).min(MAX_PROBE_EVERY));
    }
}
