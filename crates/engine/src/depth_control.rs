//! The draft depth a speculating request runs at, chosen as it goes.
//!
//! A tuned depth is right on average, but a request's acceptance moves with what it writes: code
//! after prose, a quoted file after free text. Every few cycles the controller takes the live
//! acceptance at each draft position and the cost model (the drafting — `d` MTP head steps, or
//! one block drafter pass — and a verify pass of `d + 1` positions, each relative to a plain
//! decode step) and picks the depth with the most expected tokens per second: down to plain
//! decoding (depth 0) when acceptance falls below break-even, back up when a probe shows it
//! recovered. It never goes past the tuned depth + 1, nor past what the drafter drafts. Where
//! the costs say that no depth would pay even with every draft accepted (a small model on a GPU,
//! whose verify passes cost several plain steps), it does not probe once plain: a probe could
//! only lose there. (It still drafts until its first decision: the costs are one measurement,
//! and a busy moment may have inflated them.)
//!
//! A request starts where the last one with its drafter ended, and positions it does not draft
//! are judged by how that drafter's drafts went on there ([`going_on`]).
//!
//! Only the amount of drafting changes: every cycle is still exact (greedy output is plain
//! decoding's, sampled output keeps its distribution).

use serde::Serialize;

use crate::costs::{Costs, MAX_DRAFT_DEPTH};
use crate::speculation::DraftWith;

pub mod choice;
pub mod going_on;
pub mod probe_budget;
use going_on::{running, GoingOn, Remembered, WEIGHT};
use probe_budget::ProbeBudget;

/// Cycles between two decisions.
const EVERY: usize = 4;
/// While plain, one depth-1 cycle this often measures whether drafts would pay again...
const PROBE_EVERY: usize = 16;
/// ...twice as long after each probe that leaves the evidence short of break-even, up to this:
/// a probe costs a few plain steps (its drafter catches up, a verify pass) for little more than
/// one token, and a request whose drafts seldom pay would spend that every 16 tokens. A probe
/// whose evidence could reach break-even keeps the interval (its hit or miss alone says little
/// where break-even asks most drafts to be accepted); a return to drafting, or a new fall to
/// plain, starts it again.
const MAX_PROBE_EVERY: usize = 128;
/// A timed step counts for at most this many times, and at least this fraction of, what the
/// cost model says it costs: one stalled step (the machine busy for a moment) moves the
/// running figure by a bounded amount, and a cost model far off (a test's made-up one) by at
/// most this much either way.
const MOST_OFF: f64 = 2.0;
/// A depth must promise this much more than the current one to replace it (and a drafter
/// the one in use)...
const HYSTERESIS: f64 = 0.03;
/// ...and a move to or from plain decoding twice as much after each fall to plain, up to
/// this many doublings: near break-even the running figures cross it back and forth, and each
/// crossing costs probes and a drafter's catching up. A request that keeps crossing settles.
const MAX_PLAIN_DOUBLINGS: usize = 3;
/// While plain, the first position's figure is a count: what the running figure held when the
/// request went plain, worth this many cycles (the running figure's own memory, 1 / WEIGHT)...
const PLAIN_PRIOR: f64 = 1.0 / WEIGHT;
/// ...plus every probe since, the oldest fading once there are this many. A string of lucky
/// probes then moves it by their share of all the evidence, not a quarter of the way to 1
/// each, and a request whose acceptance stays below break-even stays plain.
const PROBE_MEMORY: f64 = 16.0;

/// What drafting and the verify passes cost, each relative to one plain decode step.
#[derive(Debug, Clone, Serialize)]
pub struct CostModel {
    /// An MTP head's draft step (`None`: the model has no head).
    pub draft: Option<f64>,
    /// `block[d - 1]`: a block drafter's pass drafting `d` tokens (empty: no drafter).
    pub block: Vec<f64>,
    /// `verify[d - 1]`: a verify pass of `d + 1` positions.
    pub verify: Vec<f64>,
    /// Seconds a plain decode step took when measured (what a measured speed-up is against).
    pub plain_step_s: f64,
}

impl From<&Costs> for CostModel {
    /// The measured ratios, held to what cannot be otherwise: a verify pass does at least a
    /// plain step's work, more positions never cost less, and neither does drafting more. A
    /// noisy measurement (a busy machine inflating the plain step) would otherwise make drafts
    /// look free, and a drafter whose drafts all fail would keep drafting.
    fn from(c: &Costs) -> Self {
        let rising = |ratios: &mut dyn Iterator<Item = f64>, mut floor: f64| -> Vec<f64> {
            ratios
                .map(|r| {
                    floor = r.max(floor);
                    floor
                })
                .collect()
        };
        let verify = rising(&mut (1..=c.verify_s.len()).map(|d| c.verify_ratio(d)), 1.0);
        let block = rising(&mut c.block_draft_s.iter().map(|s| s / c.plain_step_s), 0.0);
        CostModel { draft: c.draft_ratio().map(|r| r.max(0.0)), block, verify, plain_step_s: c.plain_step_s }
    }
}

impl CostModel {
    /// The deepest draft `with` has costs for (0: it cannot draft here).
    pub fn deepest(&self, with: DraftWith) -> usize {
        match with {
            DraftWith::Mtp if self.draft.is_some() => MAX_DRAFT_DEPTH.min(self.verify.len()),
            DraftWith::Mtp => 0,
            DraftWith::Block => self.block.len().min(self.verify.len()),
        }
    }

    /// The most any depth up to `max_depth` could give over plain decoding: every draft
    /// accepted.
    pub fn ceiling(&self, with: DraftWith, max_depth: usize) -> f64 {
        (1..=max_depth).map(|d| self.speedup(with, d, &vec![1.0; d])).fold(1.0, f64::max)
    }

    /// Expected speed-up over plain decoding drafting `depth` tokens with `with`, where
    /// `reach[i]` is the chance that the first `i + 1` drafts are all accepted.
    pub fn speedup(&self, with: DraftWith, depth: usize, reach: &[f64]) -> f64 {
        if depth == 0 {
            return 1.0;
        }
        let Some(cycle) = self.cycle_cost(with, depth) else { return 0.0 };
        let tokens = 1.0 + reach.iter().take(depth).sum::<f64>();
        tokens / cycle
    }

    /// A cycle drafting `depth` tokens with `with`, in plain steps: the drafting and the
    /// verify pass (`None` where the model has no figure for it).
    pub fn cycle_cost(&self, with: DraftWith, depth: usize) -> Option<f64> {
        let drafting = match with {
            DraftWith::Mtp => self.draft.map(|d| depth as f64 * d),
            DraftWith::Block => self.block.get(depth.checked_sub(1)?).copied(),
        }?;
        Some(self.verify.get(depth.checked_sub(1)?)? + drafting)
    }
}

/// How often the controller changed the depth, by kind.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DepthChanges {
    pub deeper: usize,
    pub shallower: usize,
    pub to_plain: usize,
    pub from_plain: usize,
}

impl DepthChanges {
    pub fn merge(&mut self, other: &DepthChanges) {
        self.deeper += other.deeper;
        self.shallower += other.shallower;
        self.to_plain += other.to_plain;
        self.from_plain += other.from_plain;
    }
}

#[derive(Debug, Clone)]
pub struct DepthController {
    costs: CostModel,
    /// What drafts: the depths' costs follow it.
    with: DraftWith,
    max_depth: usize,
    depth: usize,
    /// Running estimate, per draft position, of the chance that drafts up to it are accepted.
    reach: Vec<f64>,
    /// Cycles that drafted at each position.
    seen: Vec<usize>,
    /// How drafts went on past the first position, this request's cycles and what the engine
    /// carried from earlier requests: what positions not drafted now promise.
    going_on: GoingOn,
    cycles_since_decision: usize,
    cycles_plain: usize,
    probing: bool,
    /// While plain: first-position hits and trials ([`PLAIN_PRIOR`], [`PROBE_MEMORY`]).
    probe_evidence: (f64, f64),
    /// While plain: plain cycles between probes now ([`MAX_PROBE_EVERY`]).
    probe_every: usize,
    /// What its probes may still cost.
    probe_budget: ProbeBudget,
    /// Whether probes can pay at all ([`CostModel::ceiling`] above 1).
    probes: bool,
    /// The request's own plain steps against the cost model's plain step, running (`None`
    /// until two came in a row).
    plain_scale: Option<f64>,
    /// The request's own cycles against what the cost model says they cost, running.
    cycle_scale: Option<f64>,
    pub changes: DepthChanges,
}

impl DepthController {
    /// Starts at `tuned` drafts by `with` and may go up to `tuned + 1` (within what the cost
    /// model covers); once plain, probes only where some depth would pay with every draft
    /// accepted.
    pub fn new(costs: CostModel, with: DraftWith, tuned: usize) -> Self {
        let max_depth = (tuned + 1).min(costs.deepest(with));
        DepthController::ranging(costs, with, tuned, max_depth)
    }

    /// A drafter no tuning chose for the request, standing by beside the one in use: it
    /// starts at depth 1 and may go as deep as the cost model covers.
    pub fn untuned(costs: CostModel, with: DraftWith) -> Self {
        let deepest = costs.deepest(with);
        DepthController::ranging(costs, with, 1, deepest)
    }

    /// Starts at `start` drafts (within `max_depth`).
    fn ranging(costs: CostModel, with: DraftWith, start: usize, max_depth: usize) -> Self {
        // Not even a perfect drafter beats plain decoding here: probes would only cost.
        let probes = costs.ceiling(with, max_depth) > 1.0;
        // Tuned to plain decoding: the tuner found no drafts paying, evidence like a request's.
        let probe_evidence = if start == 0 { (0.0, PLAIN_PRIOR) } else { (0.0, 0.0) };
        DepthController {
            costs,
            with,
            max_depth,
            depth: start.min(max_depth),
            reach: vec![0.0; max_depth],
            seen: vec![0; max_depth],
            going_on: GoingOn::default(),
            cycles_since_decision: 0,
            cycles_plain: 0,
            probing: false,
            probe_evidence,
            probe_every: PROBE_EVERY,
            probe_budget: ProbeBudget::default(),
            probes,
            plain_scale: None,
            cycle_scale: None,
            changes: DepthChanges::default(),
        }
    }

    /// Starts where the last request with this drafter ended ([`going_on::AcceptanceMemory`]): its
    /// depth (within this one's range) and first position's figure, worth a couple of cycles,
    /// and how its drafts went on.
    pub fn remembering(mut self, remembered: Remembered) -> Self {
        self.going_on = remembered.going_on;
        if let (Some((first, depth)), Some(reach), Some(seen)) =
            (remembered.ended, self.reach.first_mut(), self.seen.first_mut())
        {
            (*reach, *seen) = (first, going_on::CARRIED_CYCLES);
            self.depth = depth.min(self.max_depth);
            if self.depth == 0 {
                self.probe_evidence = (first * PLAIN_PRIOR, PLAIN_PRIOR);
            }
        }
        self
    }

    /// What the next request with this drafter starts from.
    pub fn remembered(&self) -> Remembered {
        let ended = self.seen.first().filter(|&&seen| seen > 0).map(|_| (self.reach[0], self.depth));
        Remembered { going_on: self.going_on.clone(), ended }
    }

    /// Whether some depth would pay with every draft accepted.
    pub fn can_pay(&self) -> bool {
        self.probes
    }

    /// While plain: the other drafter, tried in this one's probe turn, did not take over;
    /// this one's probes grow rarer as after a failed probe of its own.
    pub fn probe_elsewhere_failed(&mut self) {
        self.probe_every = (2 * self.probe_every).min(MAX_PROBE_EVERY);
    }

    /// The depth decided on (a probe's one cycle aside).
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The depth for the next cycle.
    pub fn next_depth(&mut self) -> usize {
        if self.depth == 0 && self.max_depth > 0 && self.probes {
            self.cycles_plain += 1;
            self.probe_budget.plain_step();
            if self.cycles_plain >= self.probe_every {
                self.cycles_plain = 0;
                self.probing = true;
                return 1;
            }
        }
        self.depth
    }

    /// A cycle the request ran with this drafter while it stood by: counted as a probe (a
    /// decision follows at once).
    pub fn record_probe(&mut self, drafted: usize, accepted: usize) {
        self.probing = true;
        self.record(drafted, accepted);
    }

    /// A cycle that drafted `drafted` tokens of which the first `accepted` were accepted.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if self.depth == 0 && drafted > 0 {
            // A probe: counted with the evidence that sent the request plain.
            let (hits, trials) = &mut self.probe_evidence;
            if *trials >= PROBE_MEMORY {
                let keep = (PROBE_MEMORY - 1.0) / PROBE_MEMORY;
                (*hits, *trials) = (*hits * keep, *trials * keep);
            }
            *hits += if accepted > 0 { 1.0 } else { 0.0 };
            *trials += 1.0;
            // Leaning up by two more hits: a short string of evidence may still be unlucky.
            let optimistic = (*hits + 2.0) / (*trials + 2.0);
            let estimate = *hits / *trials;
            if optimistic < self.break_even() {
                self.probe_every = (2 * self.probe_every).min(MAX_PROBE_EVERY);
            }
            self.reach[0] = estimate;
            self.seen[0] += 1;
        }
        let running = if self.depth == 0 { 0 } else { drafted.min(self.max_depth) };
        self.going_on.record(running, accepted.min(running));
        for i in 0..running {
            let hit = if i < accepted { 1.0 } else { 0.0 };
            self.reach[i] += going_on::sample_weight(self.seen[i]) * (hit - self.reach[i]);
            self.seen[i] += 1;
        }
        self.cycles_since_decision += 1;
        if std::mem::take(&mut self.probing) || self.cycles_since_decision >= EVERY {
            self.cycles_since_decision = 0;
            self.decide();
        }
    }

    /// The acceptance figures, the positions not drafted now (those past the current depth;
    /// what they had is stale) filled in by [`DepthController::carry_on`]. The first position
    /// is always measured (while plain, by the probes).
    pub fn estimated_reach(&self) -> Vec<f64> {
        let mut reach = self.reach.clone();
        let from = (0..reach.len()).find(|&i| self.seen[i] == 0 || i >= self.depth.max(1));
        if let Some(from) = from {
            if from == 0 {
                reach[0] = 0.0;
            }
            self.carry_on(&mut reach, from);
        }
        reach
    }

    /// Fills `reach` in from position `from` on: each position goes on from the one before
    /// at its own rate where cycles measured one ([`GoingOn`]), else at the last known
    /// position's.
    fn carry_on(&self, reach: &mut [f64], from: usize) {
        for i in from.max(1)..reach.len() {
            let rate = match self.going_on.rate(i) {
                Some(rate) => rate,
                None if i == 1 => reach[0],
                None if reach[i - 2] > 0.0 => (reach[i - 1] / reach[i - 2]).min(1.0),
                None => 0.0,
            };
            reach[i] = reach[i - 1] * rate;
        }
    }

    /// The first position's acceptance from which some depth pays, the deeper positions going
    /// on as [`DepthController::estimated_reach`] extends a probe's figure.
    fn break_even(&self) -> f64 {
        let pays = |a: f64| {
            let mut reach = vec![a; self.max_depth];
            self.carry_on(&mut reach, 1);
            (1..=self.max_depth).any(|d| self.promise(d, &reach[..d]) >= 1.0)
        };
        if !pays(1.0) {
            return f64::INFINITY;
        }
        let (mut low, mut high) = (0.0, 1.0);
        for _ in 0..20 {
            let mid = (low + high) / 2.0;
            if pays(mid) {
                high = mid;
            } else {
                low = mid;
            }
        }
        high
    }

    /// The plain step time the cost model was measured with.
    pub fn plain_step_s(&self) -> f64 {
        self.costs.plain_step_s
    }

    /// A plain step of the request took `seconds` (from the end of the one before).
    pub fn timed_plain_step(&mut self, seconds: f64) {
        let ratio = (seconds / self.costs.plain_step_s).clamp(1.0 / MOST_OFF, MOST_OFF);
        self.plain_scale = Some(running(self.plain_scale, ratio));
        self.probe_budget.timed_plain_step(seconds);
    }

    /// A probe of this plain controller's (or a try in its turn) took `seconds` and committed
    /// `committed` tokens ([`ProbeBudget::probe_took`]).
    pub fn probe_took(&mut self, seconds: f64, committed: usize) {
        self.probe_budget.probe_took(seconds, committed, self.costs.plain_step_s);
    }

    /// A probe [`DepthController::next_depth`] asked for, unless what probes cost already
    /// reaches their share of the plain steps ([`probe_budget::PROBE_SHARE`]): then plain
    /// decoding (depth 0), and the probe is due again at the next step. (A try of the other
    /// drafter in the probe's turn is not held back: it is how a plain request finds the
    /// drafter that pays, and it backs off on its own.)
    pub fn afford_probe(&mut self) -> usize {
        if self.probe_budget.affords() {
            return 1;
        }
        self.probing = false;
        self.cycles_plain = self.probe_every - 1;
        0
    }

    /// A cycle of the request drafting `depth` tokens took `seconds` (from the end of the one
    /// before).
    pub fn timed_cycle(&mut self, depth: usize, seconds: f64) {
        let Some(cycle) = self.costs.cycle_cost(self.with, depth) else { return };
        let ratio = (seconds / (cycle * self.costs.plain_step_s)).clamp(1.0 / MOST_OFF, MOST_OFF);
        self.cycle_scale = Some(running(self.cycle_scale, ratio));
    }

    /// What drafting `depth` tokens promises over plain decoding with `reach`: the cost
    /// model's figure, its costs scaled by what the request's own steps took once it has timed
    /// both plain steps and cycles — where plain steps ran slower than measured, or cycles
    /// faster, drafting pays more than the model says. A cycle still costs at least one plain
    /// step and its drafting however the timings scale it (its verify pass does a plain step's
    /// work): a machine busier during the request's plain steps than during its cycles must not
    /// make a drafter whose drafts all fail look worth drafting with.
    fn promise(&self, depth: usize, reach: &[f64]) -> f64 {
        let in_loop = match (self.plain_scale, self.cycle_scale) {
            (Some(plain), Some(cycle)) => plain / cycle,
            _ => 1.0,
        };
        if depth == 0 {
            return 1.0;
        }
        let (Some(cycle), Some(verify)) = (self.costs.cycle_cost(self.with, depth), self.costs.verify.get(depth - 1))
        else {
            return 0.0;
        };
        let least = 1.0 + cycle - verify;
        let tokens = 1.0 + reach.iter().take(depth).sum::<f64>();
        tokens / (cycle / in_loop).max(least)
    }

    /// The speed-up over plain decoding the current figures promise at the current depth.
    pub fn expected_speedup(&self) -> f64 {
        self.promise(self.depth, &self.estimated_reach())
    }

    fn decide(&mut self) {
        let reach = self.estimated_reach();
        let now = self.promise(self.depth, &reach);
        let to_or_from_plain = HYSTERESIS * (1 << self.changes.to_plain.min(MAX_PLAIN_DOUBLINGS)) as f64;
        let margin = |to: usize| if (self.depth == 0) != (to == 0) { to_or_from_plain } else { HYSTERESIS };
        let best = (0..=self.max_depth)
            .filter(|&d| d != self.depth)
            .map(|d| (d, self.promise(d, &reach)))
            .filter(|&(d, promise)| promise >= now * (1.0 + margin(d)))
            .max_by(|a, b| a.1.total_cmp(&b.1));
        let Some((best, _)) = best else {
            return;
        };
        match (self.depth, best) {
            (_, 0) => {
                self.changes.to_plain += 1;
                self.probe_every = PROBE_EVERY;
                self.probe_evidence = (self.reach.first().copied().unwrap_or(0.0) * PLAIN_PRIOR, PLAIN_PRIOR);
            }
            (0, _) => {
                self.changes.from_plain += 1;
                self.probe_every = PROBE_EVERY;
            }
            (from, to) if to > from => self.changes.deeper += 1,
            _ => self.changes.shallower += 1,
        }
        self.depth = best;
        self.cycles_plain = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::going_on::AcceptanceMemory;
    use super::*;

    /// A busy machine inflated the plain step (verifies measured cheaper than it, and not in
    /// order): the model holds each verify to at least a plain step and to its shallower
    /// ones, so drafts that are never accepted never look worth it.
    #[test]
    fn noisy_costs_never_make_failed_drafts_pay() {
        let noisy = Costs {
            plain_step_s: 0.030,
            draft_step_s: Some(0.004),
            block_draft_s: vec![0.006, 0.005, 0.007],
            verify_s: vec![0.024, 0.047, 0.034, 0.034],
            verify_build_s: vec![0.002; 4],
        };
        let model = CostModel::from(&noisy);
        assert_eq!(model.verify[0], 1.0);
        assert!(model.verify.windows(2).all(|w| w[0] <= w[1]), "{:?}", model.verify);
        assert!(model.block.windows(2).all(|w| w[0] <= w[1]), "{:?}", model.block);
        for with in [DraftWith::Mtp, DraftWith::Block] {
            assert!((1..=4).all(|d| model.speedup(with, d, &[0.0; 4]) < 1.0));
        }
    }

    /// A verify pass costs a little more per position; a draft a fifth of a step; a block
    /// drafter's pass, whatever it drafts, a little more than one draft step.
    pub(super) fn costs() -> CostModel {
        CostModel {
            draft: Some(0.2),
            block: vec![0.3, 0.3, 0.31, 0.31, 0.32, 0.32, 0.33],
            verify: vec![1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
            plain_step_s: 0.01,
        }
    }

    pub(super) fn mtp(costs: CostModel, tuned: usize) -> DepthController {
        DepthController::new(costs, DraftWith::Mtp, tuned)
    }

    /// Cycles at whatever depth the controller picks, each position accepted with `rate`
    /// (deterministically: the fraction is spread evenly over the cycles).
    pub(super) fn run(c: &mut DepthController, rate: f64, cycles: usize) -> Vec<usize> {
        let mut depths = Vec::new();
        let mut credit = 0.0;
        for _ in 0..cycles {
            let d = c.next_depth();
            depths.push(d);
            let mut accepted = 0;
            for _ in 0..d {
                credit += rate;
                if credit >= 1.0 {
                    credit -= 1.0;
                    accepted += 1;
                } else {
                    break;
                }
            }
            c.record(d, accepted);
        }
        depths
    }

    /// A request starts where the last one with its drafter ended: plain after one whose
    /// drafts failed (probing as a plain request does), deep after one whose drafts paid.
    #[test]
    fn a_request_starts_where_the_last_one_ended() {
        let mut memory = AcceptanceMemory::default();
        let mut failing = mtp(costs(), 2);
        run(&mut failing, 0.0, 3 * EVERY);
        assert_eq!(failing.depth(), 0);
        memory.keep(DraftWith::Mtp, failing.remembered());
        let mut next = mtp(costs(), 2).remembering(memory.of(DraftWith::Mtp));
        assert_eq!(next.depth(), 0, "the next request starts plain");
        assert_eq!(run(&mut next, 0.0, PROBE_EVERY), [[0; PROBE_EVERY - 1].as_slice(), &[1]].concat());

        let mut paying = mtp(costs(), 2);
        run(&mut paying, 0.95, 6 * EVERY);
        assert_eq!(paying.depth(), 3);
        memory.keep(DraftWith::Mtp, paying.remembered());
        let next = mtp(costs(), 2).remembering(memory.of(DraftWith::Mtp));
        assert_eq!(next.depth(), 3, "the next request starts as deep");
        assert!(next.expected_speedup() > 1.5, "{:?}", next.estimated_reach());
        // The first of the next request's own cycles moves the carried figure by a third.
        let mut next = next;
        next.record(3, 0);
        assert!((next.reach[0] - 2.0 / 3.0 * paying.reach[0]).abs() < 1e-9, "{:?}", next.reach);
    }

    #[test]
    fn the_cost_model_breaks_even_where_drafts_pay_for_themselves() {
        let c = costs();
        assert_eq!(c.speedup(DraftWith::Mtp, 0, &[]), 1.0);
        // Depth 1 costs 1.3 steps: it pays from 30% acceptance on.
        assert!(c.speedup(DraftWith::Mtp, 1, &[0.29]) < 1.0 && c.speedup(DraftWith::Mtp, 1, &[0.31]) > 1.0);
        assert!((c.speedup(DraftWith::Mtp, 2, &[0.9, 0.8]) - 2.7 / 1.6).abs() < 1e-9);
        assert_eq!(c.speedup(DraftWith::Mtp, 8, &[1.0; 8]), 0.0, "a depth the model has no cost for is never chosen");
        assert_eq!(c.deepest(DraftWith::Mtp), MAX_DRAFT_DEPTH);
        assert_eq!(c.deepest(DraftWith::Block), 7);
    }

    #[test]
    fn collapsing_acceptance_goes_plain_and_a_recovery_comes_back() {
        let mut c = mtp(costs(), 2);
        assert_eq!(c.next_depth(), 2);
        run(&mut c, 0.9, 40);
        assert!(c.depth() >= 2, "high acceptance keeps drafting: {}", c.depth());
        assert!(c.depth() <= 3, "never past the tuned depth + 1");
        run(&mut c, 0.0, 40);
        assert_eq!(c.depth(), 0, "nothing accepted: plain decoding");
        assert!(c.changes.to_plain >= 1);
        // While plain, a probe now and then; when acceptance is back, drafting resumes.
        let depths = run(&mut c, 0.9, 3 * MAX_PROBE_EVERY);
        assert!(depths.iter().take(MAX_PROBE_EVERY + 1).any(|&d| d == 1), "a probe: {depths:?}");
        assert!(c.depth() >= 2, "back up: {}", c.depth());
        assert!(c.changes.from_plain >= 1);
    }

    #[test]
    fn plain_stays_plain_while_probes_fail() {
        let mut c = mtp(costs(), 1);
        run(&mut c, 0.0, 8);
        assert_eq!(c.depth(), 0);
        let depths = run(&mut c, 0.1, 200);
        assert_eq!(c.depth(), 0);
        // Probes grow rarer while they fail: after 16, 32, 64 cycles, then every 128.
        let probes = depths.iter().filter(|&&d| d > 0).count();
        assert!((2..=5).contains(&probes), "{probes} probes: {depths:?}");
    }

    /// Acceptance hovering about break-even (a busy machine's noise moves the real costs
    /// around the measured ones): each fall back to plain asks more of drafting before it
    /// resumes, so the request settles instead of going to and fro.
    #[test]
    fn acceptance_about_break_even_does_not_go_to_and_fro() {
        for rate in [0.28, 0.32, 0.36, 0.40] {
            let mut c = mtp(costs(), 1);
            run(&mut c, rate, 2000);
            let trips = c.changes.to_plain;
            assert!(trips <= 4, "rate {rate}: {:?}", c.changes);
        }
    }

    #[test]
    fn a_middling_rate_settles_on_a_middle_depth() {
        // At 60% a position, depth 1 promises 1.6/1.3 = 1.23x, depth 2 (1.6+0.36)/1.6 = 1.23x,
        // depth 3 less: never deeper than 2, never plain.
        let mut c = mtp(costs(), 3);
        let depths = run(&mut c, 0.6, 200);
        assert!(depths[100..].iter().all(|&d| (1..=2).contains(&d)), "{:?}", &depths[100..]);
    }

    /// A block pass costs about the same whatever it drafts: while drafts are accepted the
    /// controller drafts as deep as it may (the tuned depth + 1, within the block); when
    /// nothing is accepted it goes plain, and comes back when probes show acceptance recovered.
    #[test]
    fn a_block_drafter_goes_deep_while_accepted_and_plain_when_not() {
        let c = costs();
        // Depth 1 costs 1.4 steps with a block pass (1.3 with a head step); depth 4, 1.71
        // against the head's 2.2: the block's deep drafts are the cheap ones.
        assert!(c.speedup(DraftWith::Block, 1, &[0.35]) < 1.0 && c.speedup(DraftWith::Block, 1, &[0.45]) > 1.0);
        assert!(c.speedup(DraftWith::Block, 4, &[0.9; 4]) > c.speedup(DraftWith::Mtp, 4, &[0.9; 4]));
        let mut block = DepthController::new(costs(), DraftWith::Block, 5);
        run(&mut block, 0.95, 40);
        assert_eq!(block.depth(), 6, "deeper while drafts are accepted");
        let mut whole = DepthController::new(costs(), DraftWith::Block, 7);
        run(&mut whole, 0.95, 40);
        assert_eq!(whole.depth(), 7, "never past the block's drafts");
        run(&mut block, 0.0, 40);
        assert_eq!(block.depth(), 0, "nothing accepted: plain decoding");
        run(&mut block, 0.95, 3 * MAX_PROBE_EVERY);
        assert!(block.depth() >= 3, "back up: {:?}", block.reach);
        assert!(block.changes.from_plain >= 1 && block.changes.to_plain >= 1, "{:?}", block.changes);
    }

    /// The H200's costs for the embedded model (2026-12-05): a verify pass of two positions
    /// three plain steps, of more four. No MTP depth pays even with every draft accepted, so
    /// once the controller is plain it never probes, however well drafts would be accepted;
    /// the block drafter's one pass could pay, so it probes as usual.
    #[test]
    fn where_no_depth_could_pay_plain_is_never_probed() {
        let h200 = CostModel {
            draft: Some(0.29),
            block: vec![0.8; 7],
            verify: vec![3.05, 4.04, 4.04, 4.04, 4.04, 4.04, 4.04],
            plain_step_s: 0.0016,
        };
        assert!(h200.ceiling(DraftWith::Mtp, 4) <= 1.0 && h200.ceiling(DraftWith::Block, 7) > 1.0);
        let mut c = mtp(h200.clone(), 2);
        let depths = run(&mut c, 1.0, 4 * MAX_PROBE_EVERY);
        assert!(depths[..EVERY].iter().all(|&d| d == 2), "the tuned depth until the first decision: {depths:?}");
        assert!(depths[EVERY..].iter().all(|&d| d == 0), "plain, and not a probe: {depths:?}");
        assert_eq!(c.changes, DepthChanges { to_plain: 1, ..Default::default() });
        let mut block = DepthController::new(h200, DraftWith::Block, 4);
        run(&mut block, 0.0, EVERY);
        assert_eq!(block.depth(), 0);
        let depths = run(&mut block, 0.0, 2 * MAX_PROBE_EVERY);
        assert!(depths.contains(&1), "the block drafter probes: {depths:?}");
        // A drafter that is barely better than nothing: even its ceiling allows drafting.
        let mut costs = costs();
        costs.verify = vec![1.75; 7];
        assert!(costs.ceiling(DraftWith::Mtp, 1) > 1.0);
        let mut c = mtp(costs, 1);
        run(&mut c, 0.0, EVERY);
        assert!(run(&mut c, 0.0, 2 * MAX_PROBE_EVERY).contains(&1), "probes while a perfect drafter could pay");
    }

    /// The H100's costs for the embedded model (2026-12-06): a verify pass of two positions 1.75
    /// plain steps, so drafting pays only where most drafts are accepted (about 3 in 4 at the
    /// first position). Probes accepted half the time leave the evidence far short of that:
    /// each makes the next wait twice as long, hit or miss, where a hit kept the interval.
    #[test]
    fn probes_far_below_break_even_grow_rarer_hit_or_miss() {
        let h100 =
            CostModel { draft: Some(0.27), block: vec![], verify: vec![1.75, 1.75, 1.76, 1.87], plain_step_s: 0.00093 };
        let mut c = mtp(h100, 2);
        run(&mut c, 0.0, EVERY);
        assert_eq!(c.depth(), 0);
        assert!((0.6..0.9).contains(&c.break_even()), "{}", c.break_even());
        let depths = run(&mut c, 0.5, 16 * MAX_PROBE_EVERY);
        let probes: Vec<usize> = (0..depths.len()).filter(|&i| depths[i] > 0).collect();
        let gaps: Vec<usize> = probes.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(&gaps[..3], [32, 64, 128], "probes at {probes:?}");
        assert!(gaps.iter().all(|&g| g <= MAX_PROBE_EVERY), "{gaps:?}");
        assert_eq!(c.changes.from_plain, 0, "{:?}", c.reach);
    }

    /// The controller went plain at a first-position rate below break-even; a few accepted
    /// probes in a row (each would have moved a running figure a quarter of the way to 1) are
    /// weighed against all the evidence, and drafting does not resume for them.
    #[test]
    fn a_lucky_string_of_probes_does_not_bring_drafting_back() {
        let mut c = mtp(costs(), 1);
        run(&mut c, 0.0, 8);
        assert_eq!(c.depth(), 0);
        run(&mut c, 0.2, 16 * PROBE_EVERY);
        assert_eq!(c.depth(), 0, "break-even is 0.3: {:?}", c.reach);
        // Two probes in a row accepted.
        let mut probes = 0;
        while probes < 2 {
            probes += run(&mut c, 1.0, 1)[0].min(1);
        }
        assert_eq!(c.depth(), 0, "two lucky probes against {PROBE_MEMORY}: {:?}", c.reach);
        assert_eq!(c.changes.from_plain, 0);
        // A lasting recovery brings it back.
        run(&mut c, 1.0, 8 * MAX_PROBE_EVERY);
        assert!(c.depth() > 0, "{:?}", c.reach);
    }

    /// The request's own steps scale the costs: where its plain steps take longer than the
    /// cost model's (the loop's own work, a busy machine), drafts the model puts below
    /// break-even pay, and where its cycles take far longer than the model says, drafts it
    /// puts above break-even do not. (The drafting stays on top of a plain step: at these
    /// timings a depth-1 cycle counts 1.2 plain steps, not 0.87.)
    #[test]
    fn the_requests_own_step_times_scale_the_costs() {
        // Depth 1 costs 1.3 plain steps: at 25% acceptance 0.96x by the model alone.
        let mut untimed = mtp(costs(), 1);
        run(&mut untimed, 0.25, 40);
        assert_eq!(untimed.depth(), 0, "{:?}", untimed.changes);
        let mut slow_plain = mtp(costs(), 1);
        let cycle_s = slow_plain.costs.cycle_cost(DraftWith::Mtp, 1).unwrap() * slow_plain.plain_step_s();
        for _ in 0..8 {
            slow_plain.timed_plain_step(1.5 * slow_plain.plain_step_s());
            slow_plain.timed_cycle(1, cycle_s);
        }
        run(&mut slow_plain, 0.25, 40);
        assert!(slow_plain.depth() > 0 && slow_plain.changes.to_plain == 0, "{:?}", slow_plain.changes);
        assert!(slow_plain.expected_speedup() > 1.0);

        // At 90% the model promises 1.46x at depth 1 and more deeper; cycles taking three
        // times their cost (counted as twice: `MOST_OFF`) send the request plain.
        let mut slow_cycles = mtp(costs(), 1);
        for _ in 0..8 {
            slow_cycles.timed_plain_step(slow_cycles.plain_step_s());
            slow_cycles.timed_cycle(1, 3.0 * cycle_s);
        }
        run(&mut slow_cycles, 0.9, 8);
        assert_eq!(slow_cycles.depth(), 0, "{:?}", slow_cycles.changes);
        // One stalled step moves the figures by a bounded amount.
        let mut stalled = mtp(costs(), 1);
        stalled.timed_cycle(1, 1000.0);
        assert_eq!(stalled.cycle_scale, Some(MOST_OFF));
        // Timed one way only, the model stands as it is.
        let mut half = mtp(costs(), 1);
        half.timed_plain_step(1.5 * half.plain_step_s());
        assert_eq!(half.expected_speedup(), mtp(costs(), 1).expected_speedup());
    }

    /// Plain steps timed at the most the scale counts (twice the model's) and cycles at the
    /// least (half) make a depth-1 cycle look like a third of a plain step; drafts that are
    /// never accepted still send the request plain and never bring it back: a cycle costs at
    /// least a plain step and its drafting.
    #[test]
    fn timings_however_skewed_never_make_failed_drafts_pay() {
        let mut c = mtp(costs(), 1);
        for _ in 0..8 {
            c.timed_plain_step(10.0 * c.plain_step_s());
            c.timed_cycle(1, 0.0);
        }
        run(&mut c, 0.0, 400);
        assert_eq!((c.depth(), c.changes.to_plain, c.changes.from_plain), (0, 1, 0), "{:?}", c.changes);
        assert!((1..=c.max_depth).all(|d| c.promise(d, &vec![0.0; d]) < 1.0));
        // Accepted drafts still gain from the scale.
        let mut accepted = mtp(costs(), 1);
        for _ in 0..8 {
            accepted.timed_plain_step(10.0 * accepted.plain_step_s());
            accepted.timed_cycle(1, 0.0);
        }
        run(&mut accepted, 0.9, 40);
        assert!(accepted.depth() > 0 && accepted.expected_speedup() > 1.5, "{:?}", accepted.changes);
    }
}
