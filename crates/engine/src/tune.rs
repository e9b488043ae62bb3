//! The draft-depth autotuner's core: measure plain decoding and every MTP draft depth on the
//! real model with a fixed suite of code prompts, then decide what may be stored. Storage,
//! machine fingerprints and process checks belong to the callers; this module only measures
//! and judges, so the rules are the same for the CLI and the app.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::batch_rule::{measure_gains, BatchGain};
use crate::costs::MAX_DRAFT_DEPTH;
use crate::engine::Engine;
use crate::request::GenerateRequest;
use crate::speculative::SpecStats;
use crate::workload::{PromptClass, WorkloadClass};
use crate::Result;

/// The suite of a tune without a workload class: code prompts (thinking off).
pub const CODE_PROMPTS: &[&str] = PromptClass::Code.prompts();

#[derive(Debug, Clone)]
pub struct TuneOptions {
    /// New tokens per generation (end-of-sequence ignored, so every run is as long).
    pub gen_tokens: usize,
    /// Paired rounds measured before any verdict (a round runs each depth once, with plain
    /// decoding before and after it, at every temperature).
    pub min_rounds: usize,
    /// Time the measuring may take after the warm-up; undecided then, nothing is stored.
    pub budget: Duration,
    /// Temperature 0 and the default sampler's.
    pub temperatures: Vec<f32>,
    /// How much faster than plain decoding a depth must be to be stored.
    pub margin: f64,
    /// Two depths whose speed-ups differ by less than this (both ways, beyond doubt) are as
    /// good as each other: the shallower is stored.
    pub equivalence: f64,
    /// How many prompts of the suite to use (all by default).
    pub prompts: usize,
    /// The workload class measured: its suite, at its temperature only. `None`: the code suite
    /// at every temperature of `temperatures` (one depth for every request).
    pub class: Option<WorkloadClass>,
}

impl Default for TuneOptions {
    fn default() -> Self {
        TuneOptions {
            gen_tokens: 96,
            min_rounds: 3,
            budget: Duration::from_secs(120),
            temperatures: vec![0.0, 0.7],
            margin: 0.05,
            equivalence: 0.03,
            prompts: CODE_PROMPTS.len(),
            class: None,
        }
    }
}

/// One depth at one temperature.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub depth: usize,
    pub temperature: f32,
    /// Decode tok/s of each run (tokens over decode time, whole suite).
    pub runs: Vec<f64>,
    pub median_tps: f64,
    /// (max - min) / median of `runs`: how noisy the machine was.
    pub spread: f64,
    pub acceptance: Vec<f64>,
    pub tokens_per_cycle: f64,
}

/// A depth's speed over plain decoding, from the paired ratios of every round (each run over
/// the plain runs just before and after it, all temperatures together).
#[derive(Debug, Clone, Serialize)]
pub struct Speedup {
    pub depth: usize,
    /// Geometric mean of the paired ratios.
    pub speedup: f64,
    /// Its 95% confidence interval (Student's t over the rounds' log ratios).
    pub interval: [f64; 2],
}

/// What the measurement found, before the busy and acceptance rules of [`decide`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "lowercase")]
pub enum Outcome {
    /// `depth` (0: plain decoding) is the one to store, beyond the measurement's noise.
    Decided { depth: usize, why: String },
    /// The time budget ran out before the candidates were separated.
    Undecided { why: String },
}

#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    pub candidates: Vec<Candidate>,
    /// Each depth's speed-up over plain decoding, with its interval.
    pub speedups: Vec<Speedup>,
    pub outcome: Outcome,
    /// Paired rounds measured, and the seconds they took.
    pub rounds: usize,
    pub elapsed_s: f64,
    /// Why the machine looked busy during the measurement, if it did.
    pub busy: Option<String>,
    /// Plain decoding of several sequences together against one alone, measured after the
    /// depths (the server's rule for a speculating request when others come:
    /// [`crate::batch_rule`]); empty where requests never decode together.
    pub batch_gains: Vec<BatchGain>,
}

impl Measurement {
    pub fn get(&self, depth: usize, temperature: f32) -> Option<&Candidate> {
        self.candidates.iter().find(|c| c.depth == depth && c.temperature == temperature)
    }

    /// Speed over plain decoding (1 for plain decoding, 0 for a depth not measured).
    pub fn speedup(&self, depth: usize) -> f64 {
        match depth {
            0 => 1.0,
            d => self.speedups.iter().find(|s| s.depth == d).map_or(0.0, |s| s.speedup),
        }
    }

    /// The speed-up's interval of `depth`, if it was measured.
    pub fn interval(&self, depth: usize) -> Option<[f64; 2]> {
        self.speedups.iter().find(|s| s.depth == depth).map(|s| s.interval)
    }

    /// First-position acceptance at each temperature (what a later run is compared with).
    pub fn first_acceptance(&self) -> Vec<(f32, f64)> {
        self.candidates
            .iter()
            .filter(|c| c.depth == 1)
            .map(|c| (c.temperature, c.acceptance.first().copied().unwrap_or(0.0)))
            .collect()
    }
}

/// Where a measurement is, for a progress bar or the app's live view.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Progress {
    /// "warm-up" (discarded) or "measuring".
    pub phase: &'static str,
    pub depth: usize,
    pub temperature: f32,
    /// The paired round (1-based; 0 during the warm-up), and the rounds measured before any
    /// verdict.
    pub repetition: usize,
    pub repetitions: usize,
    /// Warm-up runs finished, of `steps`; while measuring, rounds go on until a verdict or the
    /// budget, so the measuring phase reports `elapsed_s` of `budget_s`.
    pub step: usize,
    pub steps: usize,
    pub elapsed_s: f64,
    pub budget_s: f64,
    /// Decode tok/s of the run that just finished (over the whole prompt suite).
    pub last_tps: Option<f64>,
}

/// The tuner's judgement.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "lowercase")]
pub enum Verdict {
    /// Store this depth (0: no depth beat plain decoding by the margin), with its speed-up
    /// and that speed-up's interval.
    Store { depth: usize, speedup: f64, interval: Option<[f64; 2]>, why: String },
    /// Do not store anything: the measurement cannot be trusted, or could not decide.
    Refuse { why: String },
}

impl TuneOptions {
    /// The options for one workload class: its suite, at its temperature only.
    pub fn for_class(self, class: WorkloadClass) -> TuneOptions {
        TuneOptions { temperatures: vec![class.temperature()], class: Some(class), ..self }
    }
}

/// A suite's prompts as token ids (the code suite without a class): through the chat template
/// with thinking off (an agent suite's with its tools offered), or as plain text for a model
/// without one.
pub fn suite(engine: &Engine, count: usize, class: Option<WorkloadClass>) -> Result<Vec<Vec<u32>>> {
    let prompts = class.map_or(PromptClass::Code, |c| c.prompts);
    let mut vars = serde_json::Map::new();
    vars.insert("enable_thinking".into(), false.into());
    if let Some(tools) = prompts.tools() {
        vars.insert("tools".into(), tools);
    }
    prompts
        .prompts()
        .iter()
        .take(count.max(1))
        .map(|p| {
            let text = engine
                .tokenizer()
                .apply_chat_template(&[crate::tokenizer::ChatMessage::new("user", p)], true, &vars)
                .unwrap_or_else(|_| p.to_string());
            engine.tokenizer().encode(&text)
        })
        .collect()
}

fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    s.get(s.len() / 2).copied().unwrap_or(0.0)
}

/// Range of the runs over their median; from five runs on, the fastest and the slowest are
/// left out.
fn spread(v: &[f64], median: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let kept = if s.len() >= 5 { &s[1..s.len() - 1] } else { &s[..] };
    match kept {
        [] => 0.0,
        [first, .., last] => (last - first) / median.max(1e-9),
        [_] => 0.0,
    }
}

/// One timed run of the suite: tokens decoded, the seconds they took, the speculative figures.
#[derive(Debug, Clone, Default)]
pub struct Run {
    pub tokens: usize,
    pub seconds: f64,
    pub spec: Option<SpecStats>,
}

impl Run {
    fn tps(&self) -> f64 {
        if self.seconds > 0.0 {
            self.tokens as f64 / self.seconds
        } else {
            0.0
        }
    }
}

/// Measures plain decoding and depth 1..=4 on the engine's model (see [`measure_with`]).
pub fn measure(
    engine: &Engine,
    options: &TuneOptions,
    busy: impl FnMut() -> Option<String>,
    progress: impl FnMut(&Progress) -> bool,
) -> Result<Measurement> {
    let prompts = suite(engine, options.prompts, options.class)?;
    let max_depth = if engine.model().mtp().is_some() { MAX_DRAFT_DEPTH } else { 0 };
    let run = |depth: usize, temperature: f32| -> Result<Run> {
        let mut total = Run::default();
        for prompt in &prompts {
            let mut req = GenerateRequest::greedy(prompt.to_vec(), options.gen_tokens);
            req.ignore_eos = true;
            req.draft_depth = depth;
            req.fixed_depth = true; // each depth as it is, whatever the engine's controller
            req.sampling.temperature = temperature;
            req.sampling.seed = Some(0);
            let (_, s) = engine.generate_text(req)?;
            let decoded = s.usage.completion_tokens.saturating_sub(1);
            total.tokens += decoded;
            total.seconds += if s.timings.decode_tps > 0.0 { decoded as f64 / s.timings.decode_tps } else { 0.0 };
            if let Some(spec) = s.speculative {
                total.spec.get_or_insert_with(SpecStats::default).merge(&spec);
            }
        }
        Ok(total)
    };
    let started = Instant::now();
    let mut progress = progress;
    let mut last = Progress::default();
    let mut measurement = measure_with(
        max_depth,
        options,
        run,
        || started.elapsed(),
        busy,
        |p: &Progress| {
            last = p.clone();
            progress(p)
        },
    )?;
    // Batching's gains matter where a request may speculate while others wait.
    let sizes: Vec<usize> = BATCH_SIZES.into_iter().filter(|&n| n <= engine.profile().max_sequences).collect();
    if max_depth > 0 && !sizes.is_empty() && engine.group().is_none() {
        let at = Progress { phase: "batching", elapsed_s: started.elapsed().as_secs_f64(), last_tps: None, ..last };
        if !progress(&at) {
            return Err(crate::Error::Cancelled("tuning stopped; nothing stored".into()));
        }
        let tokens = options.gen_tokens.clamp(8, BATCH_TOKENS);
        measurement.batch_gains = measure_gains(engine, &prompts, &sizes, tokens, BATCH_ROUNDS)?;
    }
    Ok(measurement)
}

/// The batch sizes the tuner measures (up to the profile's limit), the tokens each sequence
/// decodes and the paired rounds.
const BATCH_SIZES: [usize; 3] = [2, 4, 8];
const BATCH_TOKENS: usize = 64;
const BATCH_ROUNDS: usize = 3;

/// The measurement itself, on any runner and clock (tests give it planted timings): one
/// discarded pass over every depth and temperature (kernels compile there), then paired
/// rounds — plain decoding, depth 1, plain, depth 2, …, plain, at each temperature — until
/// the best depth is separated from plain decoding and from the runner-up (or equivalent to
/// it), or the budget runs out. `busy` is asked between runs and says why the machine is not
/// quiet; `progress` hears where the measurement is before and after every run and stops it by
/// returning `false` (then [`Error::Cancelled`](crate::Error::Cancelled): nothing
/// half-measured comes back).
pub fn measure_with(
    max_depth: usize,
    options: &TuneOptions,
    mut run: impl FnMut(usize, f32) -> Result<Run>,
    mut clock: impl FnMut() -> Duration,
    mut busy: impl FnMut() -> Option<String>,
    mut progress: impl FnMut(&Progress) -> bool,
) -> Result<Measurement> {
    let temperatures = if options.temperatures.is_empty() { vec![0.0] } else { options.temperatures.clone() };
    let min_rounds = options.min_rounds.max(2);
    let mut at = Progress {
        phase: "warm-up",
        repetitions: min_rounds,
        steps: temperatures.len() * (max_depth + 1),
        budget_s: options.budget.as_secs_f64(),
        ..Progress::default()
    };
    let mut report = |at: &Progress| {
        if progress(at) {
            Ok(())
        } else {
            Err(crate::Error::Cancelled("tuning stopped; nothing stored".into()))
        }
    };
    for &t in &temperatures {
        for depth in 0..=max_depth {
            (at.depth, at.temperature) = (depth, t);
            report(&at)?;
            run(depth, t)?;
            at.step += 1;
        }
    }
    at.phase = "measuring";
    let start = clock();
    let mut busy_seen = busy();
    // Every run's tok/s per (depth, temperature), and each round's log ratio per depth.
    let mut tps: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); temperatures.len()]; max_depth + 1];
    let mut stats: Vec<Vec<Option<SpecStats>>> = vec![vec![None; temperatures.len()]; max_depth + 1];
    let mut log_ratios: Vec<Vec<f64>> = vec![Vec::new(); max_depth + 1];
    let mut rounds = 0;
    let outcome = loop {
        if max_depth == 0 {
            break Outcome::Decided { depth: 0, why: "the model has no MTP head: plain decoding".into() };
        }
        rounds += 1;
        at.repetition = rounds;
        let mut round = vec![0.0; max_depth + 1];
        for (ti, &t) in temperatures.iter().enumerate() {
            let mut timed = |depth: usize, at: &mut Progress| -> Result<f64> {
                (at.depth, at.temperature) = (depth, t);
                at.elapsed_s = (clock() - start).as_secs_f64();
                report(at)?;
                let r = run(depth, t)?;
                if let Some(spec) = &r.spec {
                    stats[depth][ti].get_or_insert_with(SpecStats::default).merge(spec);
                }
                tps[depth][ti].push(r.tps());
                at.last_tps = Some(r.tps());
                if busy_seen.is_none() {
                    busy_seen = busy();
                }
                Ok(r.tps())
            };
            let mut before = timed(0, &mut at)?;
            for (depth, sum) in round.iter_mut().enumerate().skip(1) {
                let candidate = timed(depth, &mut at)?;
                let after = timed(0, &mut at)?;
                *sum += (candidate.max(1e-9) / (before * after).sqrt().max(1e-9)).ln() / temperatures.len() as f64;
                before = after;
            }
        }
        for (depth, x) in round.into_iter().enumerate().skip(1) {
            log_ratios[depth].push(x);
        }
        at.elapsed_s = (clock() - start).as_secs_f64();
        if rounds >= min_rounds {
            if let Some(decided) = separate(&log_ratios, options) {
                break decided;
            }
        }
        // A round that would end past the budget is not started (once the first rounds are in).
        let elapsed = clock() - start;
        let next_ends = elapsed + elapsed / rounds as u32;
        if (rounds >= min_rounds && next_ends > options.budget) || rounds >= MAX_ROUNDS {
            break Outcome::Undecided { why: undecided(&log_ratios, options, at.elapsed_s) };
        }
    };
    report(&at)?;
    let candidates = (0..=max_depth)
        .flat_map(|depth| temperatures.iter().enumerate().map(move |(ti, &t)| (depth, ti, t)))
        .map(|(depth, ti, temperature)| {
            let runs = tps[depth][ti].clone();
            let m = median(&runs);
            let stats = stats[depth][ti].clone().unwrap_or_default();
            Candidate {
                depth,
                temperature,
                median_tps: m,
                spread: spread(&runs, m),
                runs,
                acceptance: stats.acceptance(),
                tokens_per_cycle: stats.tokens_per_cycle(),
            }
        })
        .collect();
    let speedups = (1..=max_depth)
        .map(|depth| {
            let (mean, half) = mean_interval(&log_ratios[depth]);
            Speedup { depth, speedup: mean.exp(), interval: [(mean - half).exp(), (mean + half).exp()] }
        })
        .collect();
    Ok(Measurement {
        candidates,
        speedups,
        outcome,
        rounds,
        elapsed_s: at.elapsed_s,
        busy: busy_seen,
        batch_gains: Vec::new(),
    })
}

/// Rounds measured at most, whatever the budget (a clock that does not move cannot loop).
const MAX_ROUNDS: usize = 200;

/// The mean of `x` and the half-width of its 95% confidence interval (Student's t).
fn mean_interval(x: &[f64]) -> (f64, f64) {
    let n = x.len();
    if n == 0 {
        return (0.0, f64::INFINITY);
    }
    let mean = x.iter().sum::<f64>() / n as f64;
    if n == 1 {
        return (mean, f64::INFINITY);
    }
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
    (mean, t95(n - 1) * (var / n as f64).sqrt())
}

/// Student's t at 97.5% (two-sided 95%) for `df` degrees of freedom.
fn t95(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11, 2.10,
        2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04,
    ];
    T.get(df.max(1) - 1).copied().unwrap_or(1.96)
}

/// The depths ranked by mean log ratio, best first.
fn ranked(log_ratios: &[Vec<f64>]) -> Vec<usize> {
    let mut depths: Vec<usize> = (1..log_ratios.len()).collect();
    depths.sort_by(|&a, &b| mean_interval(&log_ratios[b]).0.total_cmp(&mean_interval(&log_ratios[a]).0));
    depths
}

/// The paired differences of two depths' rounds.
fn differences(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x - y).collect()
}

/// A verdict, once the intervals allow one: every depth surely below the margin over plain
/// decoding (plain), or the best surely above it and surely ahead of the runner-up (or surely
/// within the equivalence of it: the shallower of the two).
fn separate(log_ratios: &[Vec<f64>], options: &TuneOptions) -> Option<Outcome> {
    let threshold = (1.0 + options.margin).ln();
    let bound = |d: usize| {
        let (m, h) = mean_interval(&log_ratios[d]);
        (m - h, m + h)
    };
    let ranked = ranked(log_ratios);
    let &best = ranked.first()?;
    if ranked.iter().all(|&d| bound(d).1 < threshold) {
        return Some(Outcome::Decided {
            depth: 0,
            why: format!(
                "no depth beats plain decoding by {:.0}% (best: depth {best} at {}): plain decoding",
                options.margin * 100.0,
                show(&log_ratios[best])
            ),
        });
    }
    if bound(best).0 <= threshold {
        return None;
    }
    let Some(&second) = ranked.get(1) else {
        return Some(Outcome::Decided {
            depth: best,
            why: format!("depth {best} decodes {}", show(&log_ratios[best])),
        });
    };
    let (m, h) = mean_interval(&differences(&log_ratios[best], &log_ratios[second]));
    let same = (1.0 + options.equivalence).ln();
    if m - h > 0.0 {
        Some(Outcome::Decided {
            depth: best,
            why: format!(
                "depth {best} decodes {}, ahead of depth {second} ({})",
                show(&log_ratios[best]),
                show(&log_ratios[second])
            ),
        })
    } else if m - h > -same && m + h < same && bound(second).0 > threshold {
        let depth = best.min(second);
        Some(Outcome::Decided {
            depth,
            why: format!(
                "depths {best} ({}) and {second} ({}) are within {:.0}% of each other: the shallower, {depth}",
                show(&log_ratios[best]),
                show(&log_ratios[second]),
                options.equivalence * 100.0
            ),
        })
    } else {
        None
    }
}

/// Why the budget ended undecided: which candidates could not be told apart, and by how much.
fn undecided(log_ratios: &[Vec<f64>], options: &TuneOptions, elapsed_s: f64) -> String {
    let threshold = (1.0 + options.margin).ln();
    let ranked = ranked(log_ratios);
    let Some(&best) = ranked.first() else { return "nothing was measured".into() };
    let (m, h) = mean_interval(&log_ratios[best]);
    let what = if m - h <= threshold {
        format!(
            "depth {best} ({}) could not be separated from plain decoding with a {:.0}% margin",
            show(&log_ratios[best]),
            options.margin * 100.0
        )
    } else {
        let second = ranked.get(1).copied().unwrap_or(best);
        let (dm, dh) = mean_interval(&differences(&log_ratios[best], &log_ratios[second]));
        format!(
            "depth {best} ({}) and depth {second} ({}) could not be separated: they differ by {:+.1}% [{:+.1}%, {:+.1}%]",
            show(&log_ratios[best]),
            show(&log_ratios[second]),
            (dm.exp() - 1.0) * 100.0,
            ((dm - dh).exp() - 1.0) * 100.0,
            ((dm + dh).exp() - 1.0) * 100.0
        )
    };
    format!(
        "undecided after {} rounds in {elapsed_s:.0} s (another would pass the {:.0} s budget): {what}; the machine was too noisy for a verdict, nothing stored",
        log_ratios.get(best).map_or(0, Vec::len),
        options.budget.as_secs_f64()
    )
}

/// A depth's speed-up with its interval, as a person reads it.
fn show(log_ratios: &[f64]) -> String {
    let (m, h) = mean_interval(log_ratios);
    format!("{:.2}x [{:.2}-{:.2}]", m.exp(), (m - h).exp(), (m + h).exp())
}

/// Decides what may be stored. `previous`: the first-position acceptance per temperature of
/// the result stored earlier for the same machine, model and profile.
pub fn decide(m: &Measurement, previous: Option<&[(f32, f64)]>, _options: &TuneOptions) -> Verdict {
    if let Some(why) = &m.busy {
        return Verdict::Refuse {
            why: format!("the machine was busy while measuring ({why}); close it and tune again"),
        };
    }
    for (t, now) in m.first_acceptance() {
        let before = previous.and_then(|p| p.iter().find(|(pt, _)| *pt == t)).map(|(_, a)| *a);
        if let Some(before) = before.filter(|b| *b >= 0.2 && now < 0.5 * b) {
            return Verdict::Refuse {
                why: format!(
                    "acceptance at temperature {t} collapsed from {:.0}% (stored run) to {:.0}%: another job on the accelerator, or a changed model; not stored",
                    before * 100.0,
                    now * 100.0
                ),
            };
        }
    }
    match &m.outcome {
        Outcome::Decided { depth, why } => {
            Verdict::Store { depth: *depth, speedup: m.speedup(*depth), interval: m.interval(*depth), why: why.clone() }
        }
        Outcome::Undecided { why } => Verdict::Refuse { why: why.clone() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A planted machine: each depth's true speed (tok/s), the noise of each run (a factor
    /// drawn uniformly within ±`noise`), a clock that advances by each run's time.
    struct Planted {
        speed: Vec<f64>,
        noise: f64,
        rng: rand::rngs::StdRng,
        now: std::rc::Rc<std::cell::Cell<f64>>,
    }

    impl Planted {
        fn new(speed: &[f64], noise: f64, seed: u64) -> Self {
            Planted {
                speed: speed.to_vec(),
                noise,
                rng: rand::rngs::StdRng::seed_from_u64(seed),
                now: Default::default(),
            }
        }

        fn measure(&mut self, options: &TuneOptions) -> Measurement {
            let now = self.now.clone();
            let clock = move || Duration::from_secs_f64(now.get());
            let (speed, noise, rng, now) = (self.speed.clone(), self.noise, &mut self.rng, self.now.clone());
            let run = move |depth: usize, _t: f32| -> Result<Run> {
                let tps = speed[depth] * (1.0 + rng.random_range(-noise..=noise));
                let tokens = 384;
                now.set(now.get() + tokens as f64 / tps);
                Ok(Run { tokens, seconds: tokens as f64 / tps, spec: None })
            };
            measure_with(speed_depths(&self.speed), options, run, clock, || None, |_| true).unwrap()
        }
    }

    fn speed_depths(speed: &[f64]) -> usize {
        speed.len() - 1
    }

    fn options() -> TuneOptions {
        TuneOptions { budget: Duration::from_secs(600), ..TuneOptions::default() }
    }

    fn stored(m: &Measurement) -> Option<usize> {
        match decide(m, None, &options()) {
            Verdict::Store { depth, .. } => Some(depth),
            Verdict::Refuse { .. } => None,
        }
    }

    #[test]
    fn a_clear_winner_is_stored_with_its_interval_after_the_first_rounds() {
        let m = Planted::new(&[100.0, 130.0, 160.0, 140.0, 120.0], 0.02, 1).measure(&options());
        assert_eq!(stored(&m), Some(2), "{:?}", m.outcome);
        assert_eq!(m.rounds, 3);
        let [lo, hi] = m.interval(2).unwrap();
        assert!(lo < 1.6 && 1.6 < hi && hi - lo < 0.2, "{lo}-{hi}");
        let Verdict::Store { interval: Some(i), .. } = decide(&m, None, &options()) else { panic!() };
        assert_eq!(i, [lo, hi]);
    }

    #[test]
    fn planted_noise_stretches_the_rounds_not_the_verdict() {
        let patient = TuneOptions { budget: Duration::from_secs(3600), ..TuneOptions::default() };
        for seed in 0..5 {
            let quiet = Planted::new(&[100.0, 110.0, 130.0, 115.0, 105.0], 0.01, seed).measure(&patient);
            let noisy = Planted::new(&[100.0, 110.0, 130.0, 115.0, 105.0], 0.2, seed).measure(&patient);
            assert_eq!(stored(&quiet), Some(2), "{:?}", quiet.outcome);
            assert_eq!(stored(&noisy), Some(2), "seed {seed}: {:?}", noisy.outcome);
            assert!(noisy.rounds > quiet.rounds, "seed {seed}: {} rounds noisy, {} quiet", noisy.rounds, quiet.rounds);
        }
    }

    #[test]
    fn no_depth_ahead_by_the_margin_stores_plain_decoding() {
        let m = Planted::new(&[100.0, 96.0, 90.0, 80.0, 70.0], 0.03, 2).measure(&options());
        assert_eq!(stored(&m), Some(0), "{:?}", m.outcome);
    }

    #[test]
    fn equal_depths_store_the_shallower() {
        let m = Planted::new(&[100.0, 150.0, 150.0, 120.0, 110.0], 0.01, 3).measure(&options());
        assert_eq!(stored(&m), Some(1), "{:?}", m.outcome);
        assert!(matches!(&m.outcome, Outcome::Decided { why, .. } if why.contains("within 3%")), "{:?}", m.outcome);
    }

    #[test]
    fn a_budget_that_ends_undecided_refuses_and_says_by_how_much() {
        // A planted round takes about 70 s: four fit in the budget.
        let tight = TuneOptions { budget: Duration::from_secs(300), ..TuneOptions::default() };
        let m = Planted::new(&[100.0, 104.0, 105.5, 101.0, 99.0], 0.2, 4).measure(&tight);
        let Verdict::Refuse { why } = decide(&m, None, &tight) else { panic!("{:?}", m.outcome) };
        assert!(why.contains("undecided") && why.contains("could not be separated") && why.contains("depth"), "{why}");
        assert!(m.elapsed_s > 150.0 && m.elapsed_s <= 300.0, "the budget holds: {} s", m.elapsed_s);
    }

    #[test]
    fn busy_machines_and_collapsed_acceptance_are_refused() {
        let mut m = Planted::new(&[100.0, 130.0, 160.0, 140.0, 120.0], 0.02, 1).measure(&options());
        m.busy = Some("process `make` used 180% CPU".into());
        assert!(matches!(decide(&m, None, &options()), Verdict::Refuse { ref why } if why.contains("busy")));
        m.busy = None;
        for c in m.candidates.iter_mut().filter(|c| c.depth == 1) {
            c.acceptance = vec![0.02];
        }
        // Acceptance near 0 where the stored run had 85%: the accelerator was shared.
        assert!(
            matches!(decide(&m, Some(&[(0.0, 0.85)]), &options()), Verdict::Refuse { ref why } if why.contains("collapsed"))
        );
        assert!(matches!(decide(&m, None, &options()), Verdict::Store { depth: 2, .. }));
    }

    #[test]
    fn a_model_without_a_head_is_plain_decoding_at_once() {
        let m = Planted::new(&[100.0], 0.1, 5).measure(&options());
        assert_eq!((stored(&m), m.rounds), (Some(0), 0));
    }
}
