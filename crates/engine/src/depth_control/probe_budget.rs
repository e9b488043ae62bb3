//! What a plain request's probes may cost. A probe after plain steps costs several plain steps
//! (its drafter's catch-up pass, a draft, a verify pass) for a token or two; where drafting is
//! about break-even, probes that keep finding it so would cost more than drafting could win
//! back, on every request. So what they cost beyond the tokens they commit, each timed, stays
//! within a share of the plain steps' time.

use super::going_on::running;

/// The share of a request's plain steps its probes may cost beyond their tokens.
pub const PROBE_SHARE: f64 = 0.02;

/// One controller's plain steps and what its probes cost.
#[derive(Debug, Clone, Default)]
pub struct ProbeBudget {
    plain_steps: usize,
    /// Beyond the tokens they committed, in plain steps.
    spent: f64,
    /// Seconds a plain step of the request takes, running (the cost model's plain step was
    /// measured apart from it, and a test's is made up).
    plain_step_took: Option<f64>,
}

impl ProbeBudget {
    pub fn plain_step(&mut self) {
        self.plain_steps += 1;
    }

    pub fn timed_plain_step(&mut self, seconds: f64) {
        self.plain_step_took = Some(running(self.plain_step_took, seconds));
    }

    /// A probe took `seconds` and committed `committed` tokens; `plain_step_s` is what a plain
    /// step costs until the request has timed its own.
    pub fn probe_took(&mut self, seconds: f64, committed: usize, plain_step_s: f64) {
        let plain_step = self.plain_step_took.unwrap_or(plain_step_s);
        self.spent += (seconds / plain_step - committed as f64).max(0.0);
    }

    /// Whether another probe fits: the first always does.
    pub fn affords(&self) -> bool {
        self.spent <= PROBE_SHARE * self.plain_steps as f64
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{costs, mtp, run};
    use super::*;

    #[test]
    fn a_probe_costs_what_plain_steps_would_not_have() {
        let mut b = ProbeBudget::default();
        assert!(b.affords(), "the first probe");
        // Until the request times its plain steps, the cost model's plain step counts.
        b.probe_took(0.05, 1, 0.01);
        assert!((b.spent - 4.0).abs() < 1e-9);
        b.timed_plain_step(0.02);
        b.probe_took(0.05, 2, 0.01);
        assert!((b.spent - 4.5).abs() < 1e-9);
        // A probe that committed more than plain steps would have in its time costs nothing.
        b.probe_took(0.01, 3, 0.01);
        assert!((b.spent - 4.5).abs() < 1e-9);
        for _ in 0..224 {
            b.plain_step();
        }
        assert!(!b.affords(), "4.5 plain steps are more than 2% of 224");
        b.plain_step();
        b.plain_step();
        assert!(b.affords(), "and less than 2% of 226");
    }

    /// Probes that find drafting about break-even grow rarer only as the evidence falls short
    /// of it; what they cost beyond plain steps still stays within [`PROBE_SHARE`] of the plain
    /// steps' time.
    #[test]
    fn probes_cost_at_most_their_share_of_plain_decoding() {
        let probes_in = |cost: Option<f64>| {
            let mut c = mtp(costs(), 1);
            run(&mut c, 0.0, 8);
            assert_eq!(c.depth(), 0);
            let (mut probes, mut credit) = (0, 0.0);
            for _ in 0..2000 {
                let d = match c.next_depth() {
                    0 => 0,
                    _ if cost.is_some() => c.afford_probe(),
                    d => d,
                };
                if d > 0 {
                    probes += 1;
                    if let Some(steps) = cost {
                        c.probe_took(steps * c.plain_step_s(), 1);
                    }
                }
                // Probes hit at break-even's rate (30%): not enough to draft again.
                let hit = d > 0 && {
                    credit += 0.3;
                    credit >= 1.0
                };
                if hit {
                    credit -= 1.0;
                }
                c.record(d, usize::from(hit));
            }
            assert_eq!(c.depth(), 0);
            probes
        };
        let free = probes_in(None);
        let costly = probes_in(Some(6.0));
        assert!(free >= 12, "{free} probes at no cost");
        // 5 plain steps beyond its token each: one at first, then one per 250 plain steps.
        assert!((6..=9).contains(&costly), "{costly} probes costing 6 steps each");
    }
}
