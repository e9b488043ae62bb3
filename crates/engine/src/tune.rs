//! The speculation autotuner's core: measure plain decoding, every MTP draft depth and a block
//! drafter's depths (when one is loaded) on the real model, in the same paired rounds, with a
//! fixed suite of prompts, then decide what may be stored. Storage, machine fingerprints and
//! process checks belong to the callers; this module only measures and judges, so the rules
//! are the same for the CLI and the app.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::batch_rule::{measure_gains, BatchGain};
use crate::costs::MAX_DRAFT_DEPTH;
use crate::engine::Engine;
use crate::paired::{differences, mean_interval, ranked, show};
use crate::request::GenerateRequest;
use crate::speculation::{DraftWith, Speculation};
use crate::speculative::SpecStats;
use crate::workload::{PromptClass, WorkloadClass};
use crate::Result;

/// The suite of a tune without a workload class: code prompts (thinking off).
pub const CODE_PROMPTS: &[&str] = PromptClass::Code.prompts();

#[derive(Debug, Clone)]
pub struct TuneOptions {
    /// New tokens per generation (end-of-sequence ignored, so every run is as long).
    pub gen_tokens: usize,
    /// Paired rounds measured before any verdict (a round runs each candidate once, with plain
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

/// One way of speculating (plain decoding: depth 0) at one temperature.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    #[serde(flatten)]
    pub choice: Speculation,
    pub temperature: f32,
    /// Decode tok/s of each run (tokens over decode time, whole suite).
    pub runs: Vec<f64>,
    pub median_tps: f64,
    /// (max - min) / median of `runs`: how noisy the machine was.
    pub spread: f64,
    pub acceptance: Vec<f64>,
    pub tokens_per_cycle: f64,
}

/// A candidate's speed over plain decoding, from the paired ratios of every round (each run
/// over the plain runs just before and after it, all temperatures together).
#[derive(Debug, Clone, Serialize)]
pub struct Speedup {
    #[serde(flatten)]
    pub choice: Speculation,
    /// Geometric mean of the paired ratios.
    pub speedup: f64,
    /// Its 95% confidence interval (Student's t over the rounds' log ratios).
    pub interval: [f64; 2],
}

/// What the measurement found, before the busy and acceptance rules of [`decide`].
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "outcome", rename_all = "lowercase")]
pub enum Outcome {
    /// `choice` (depth 0: plain decoding) is the one to store, beyond the measurement's noise.
    Decided {
        #[serde(flatten)]
        choice: Speculation,
        why: String,
    },
    /// The time budget ran out before the candidates were separated.
    Undecided { why: String },
}

#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    pub candidates: Vec<Candidate>,
    /// Each candidate's speed-up over plain decoding, with its interval.
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
    pub fn get(&self, choice: Speculation, temperature: f32) -> Option<&Candidate> {
        let plain = |c: &&Candidate| choice.is_plain() && c.choice.is_plain();
        self.candidates.iter().find(|c| (c.choice == choice || plain(c)) && c.temperature == temperature)
    }

    /// Speed over plain decoding (1 for plain decoding, 0 for a choice not measured).
    pub fn speedup(&self, choice: Speculation) -> f64 {
        match choice.is_plain() {
            true => 1.0,
            false => self.speedups.iter().find(|s| s.choice == choice).map_or(0.0, |s| s.speedup),
        }
    }

    /// The speed-up's interval of `choice`, if it was measured.
    pub fn interval(&self, choice: Speculation) -> Option<[f64; 2]> {
        self.speedups.iter().find(|s| s.choice == choice).map(|s| s.interval)
    }

    /// First-position acceptance at each temperature (what a later run is compared with): the
    /// MTP head's at depth 1, else the first drafting candidate's.
    pub fn first_acceptance(&self) -> Vec<(f32, f64)> {
        let first = self
            .candidates
            .iter()
            .map(|c| c.choice)
            .filter(|c| !c.is_plain())
            .min_by_key(|c| (c.drafter != DraftWith::Mtp, c.depth));
        self.candidates
            .iter()
            .filter(|c| Some(c.choice) == first)
            .map(|c| (c.temperature, c.acceptance.first().copied().unwrap_or(0.0)))
            .collect()
    }
}

/// Where a measurement is, for a progress bar or the app's live view.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Progress {
    /// "warm-up" (discarded) or "measuring".
    pub phase: &'static str,
    /// The candidate running.
    #[serde(flatten)]
    pub choice: Speculation,
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
    /// Store this choice (depth 0: nothing beat plain decoding by the margin), with its
    /// speed-up and that speed-up's interval.
    Store {
        #[serde(flatten)]
        choice: Speculation,
        speedup: f64,
        interval: Option<[f64; 2]>,
        why: String,
    },
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

/// The candidates a tune measures beside plain decoding on this engine: every MTP depth when
/// the model has a head, and a block drafter's depths when one is loaded (see
/// [`block_depths`]).
pub fn candidates(engine: &Engine) -> Vec<Speculation> {
    let mtp = if engine.model().mtp().is_some() { MAX_DRAFT_DEPTH } else { 0 };
    let block = engine.drafter().map_or(0, |d| d.max_drafts());
    (1..=mtp).map(Speculation::mtp).chain(block_depths(block).into_iter().map(Speculation::block)).collect()
}

/// The block depths worth measuring for a drafter of `max_drafts` drafts a block: powers of
/// two from 2, and the whole block. A block's drafts come from one pass, so its depths differ
/// only in the verify pass; acceptance falls along the block, and the halving steps find
/// where the verify pass stops paying in a few candidates instead of every depth.
pub fn block_depths(max_drafts: usize) -> Vec<usize> {
    let mut depths: Vec<usize> =
        std::iter::successors(Some(2), |d| Some(d * 2)).take_while(|&d| d < max_drafts).collect();
    if max_drafts > 0 {
        depths.push(max_drafts);
    }
    depths
}

/// Measures plain decoding and every candidate of [`candidates`] on the engine's model (see
/// [`measure_with`]).
pub fn measure(
    engine: &Engine,
    options: &TuneOptions,
    busy: impl FnMut() -> Option<String>,
    progress: impl FnMut(&Progress) -> bool,
) -> Result<Measurement> {
    let prompts = suite(engine, options.prompts, options.class)?;
    let choices = candidates(engine);
    let run = |choice: Speculation, temperature: f32| -> Result<Run> {
        let mut total = Run::default();
        for prompt in &prompts {
            let mut req = GenerateRequest::greedy(prompt.to_vec(), options.gen_tokens);
            req.ignore_eos = true;
            req.speculate(choice);
            req.fixed_depth = true; // each depth as it is, whatever the engine's controller
            req.sampling.temperature = temperature;
            req.sampling.seed = Some(0);
            req.prefill_chunk = Some(PREFILL_ROWS);
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
        &choices,
        options,
        run,
        || started.elapsed(),
        busy,
        |p: &Progress| {
            // What the warm-up compiled so far goes to the next process now, not only at a
            // clean exit: a first run on a fresh GPU machine that is stopped mid-warm-up
            // leaves its kernels to the next.
            if p.phase == "warm-up" {
                crate::kernel_cache::publish();
            }
            last = p.clone();
            progress(p)
        },
    )?;
    // Batching's gains matter where a request may speculate while others wait.
    let sizes: Vec<usize> = BATCH_SIZES.into_iter().filter(|&n| n <= engine.profile().max_sequences).collect();
    if !choices.is_empty() && !sizes.is_empty() && engine.group().is_none() {
        let at = Progress { phase: "batching", elapsed_s: started.elapsed().as_secs_f64(), last_tps: None, ..last };
        if !progress(&at) {
            return Err(crate::Error::Cancelled("tuning stopped; nothing stored".into()));
        }
        let tokens = options.gen_tokens.clamp(8, BATCH_TOKENS);
        measurement.batch_gains = measure_gains(engine, &prompts, &sizes, tokens, BATCH_ROUNDS, Some(PREFILL_ROWS))?;
    }
    Ok(measurement)
}

/// Prompt tokens per prefill pass in the tuner's requests. On CUDA, MLX compiles its
/// quantized matmul once per tile of rows (16, 32 or 64: the next power of two of the rows;
/// fewer than 8 rows take a precompiled kernel), each tile tens of seconds on a fresh machine.
/// The verify passes of the deepest blocks and the batching measure run 8-16 rows, so prompts
/// fed 16 tokens at a time keep the whole tune on the one tile they need (only prefill is
/// chunked; the decoding it measures is the same).
pub const PREFILL_ROWS: usize = 16;

/// The batch sizes the tuner measures (up to the profile's limit), the tokens each sequence
/// decodes and the paired rounds.
const BATCH_SIZES: [usize; 3] = [2, 4, 8];
const BATCH_TOKENS: usize = 64;
const BATCH_ROUNDS: usize = 3;

/// The measurement itself, on any runner and clock (tests give it planted timings): one
/// discarded pass over plain decoding and every candidate at every temperature (kernels compile
/// there, so the budget measures and does not wait on compilers), then paired rounds — plain
/// decoding, the first candidate, plain, the second, …, plain, at each temperature — until the
/// best is separated from plain decoding and from the runner-up (or equivalent to it), or the
/// budget runs out. `busy` is asked between runs and says why the machine is not quiet;
/// `progress` hears where the measurement is before and after every run and stops it by
/// returning `false` (then [`Error::Cancelled`](crate::Error::Cancelled): nothing
/// half-measured comes back).
pub fn measure_with(
    choices: &[Speculation],
    options: &TuneOptions,
    mut run: impl FnMut(Speculation, f32) -> Result<Run>,
    mut clock: impl FnMut() -> Duration,
    mut busy: impl FnMut() -> Option<String>,
    mut progress: impl FnMut(&Progress) -> bool,
) -> Result<Measurement> {
    // Index 0 is plain decoding, every paired ratio's reference.
    let all: Vec<Speculation> = std::iter::once(Speculation::PLAIN).chain(choices.iter().copied()).collect();
    let temperatures = if options.temperatures.is_empty() { vec![0.0] } else { options.temperatures.clone() };
    let min_rounds = options.min_rounds.max(2);
    let mut at = Progress {
        phase: "warm-up",
        repetitions: min_rounds,
        steps: temperatures.len() * all.len(),
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
        for &choice in &all {
            (at.choice, at.temperature) = (choice, t);
            report(&at)?;
            run(choice, t)?;
            at.step += 1;
        }
    }
    at.phase = "measuring";
    let start = clock();
    let mut busy_seen = busy();
    // Every run's tok/s per (candidate, temperature), and each round's log ratio per candidate.
    let mut tps: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); temperatures.len()]; all.len()];
    let mut stats: Vec<Vec<Option<SpecStats>>> = vec![vec![None; temperatures.len()]; all.len()];
    let mut log_ratios: Vec<Vec<f64>> = vec![Vec::new(); all.len()];
    let mut rounds = 0;
    let outcome = loop {
        if choices.is_empty() {
            break Outcome::Decided {
                choice: Speculation::PLAIN,
                why: "the model has no MTP head and no block drafter: plain decoding".into(),
            };
        }
        rounds += 1;
        at.repetition = rounds;
        let mut round = vec![0.0; all.len()];
        for (ti, &t) in temperatures.iter().enumerate() {
            let mut timed = |i: usize, at: &mut Progress| -> Result<f64> {
                (at.choice, at.temperature) = (all[i], t);
                at.elapsed_s = (clock() - start).as_secs_f64();
                report(at)?;
                let r = run(all[i], t)?;
                if let Some(spec) = &r.spec {
                    stats[i][ti].get_or_insert_with(SpecStats::default).merge(spec);
                }
                tps[i][ti].push(r.tps());
                at.last_tps = Some(r.tps());
                if busy_seen.is_none() {
                    busy_seen = busy();
                }
                Ok(r.tps())
            };
            let mut before = timed(0, &mut at)?;
            for (i, sum) in round.iter_mut().enumerate().skip(1) {
                let candidate = timed(i, &mut at)?;
                let after = timed(0, &mut at)?;
                *sum += (candidate.max(1e-9) / (before * after).sqrt().max(1e-9)).ln() / temperatures.len() as f64;
                before = after;
            }
        }
        for (i, x) in round.into_iter().enumerate().skip(1) {
            log_ratios[i].push(x);
        }
        at.elapsed_s = (clock() - start).as_secs_f64();
        if rounds >= min_rounds {
            if let Some(decided) = separate(&log_ratios, &all, options) {
                break decided;
            }
        }
        // A round that would end past the budget is not started (once the first rounds are in).
        let elapsed = clock() - start;
        let next_ends = elapsed + elapsed / rounds as u32;
        if (rounds >= min_rounds && next_ends > options.budget) || rounds >= MAX_ROUNDS {
            break Outcome::Undecided { why: undecided(&log_ratios, &all, options, at.elapsed_s) };
        }
    };
    report(&at)?;
    let candidates = (0..all.len())
        .flat_map(|i| temperatures.iter().enumerate().map(move |(ti, &t)| (i, ti, t)))
        .map(|(i, ti, temperature)| {
            let runs = tps[i][ti].clone();
            let m = median(&runs);
            let stats = stats[i][ti].clone().unwrap_or_default();
            Candidate {
                choice: all[i],
                temperature,
                median_tps: m,
                spread: spread(&runs, m),
                runs,
                acceptance: stats.acceptance(),
                tokens_per_cycle: stats.tokens_per_cycle(),
            }
        })
        .collect();
    let speedups = (1..all.len())
        .map(|i| {
            let (mean, half) = mean_interval(&log_ratios[i]);
            Speedup { choice: all[i], speedup: mean.exp(), interval: [(mean - half).exp(), (mean + half).exp()] }
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

/// A verdict, once the intervals allow one: every candidate surely below the margin over plain
/// decoding (plain), or the best surely above it and surely ahead of the runner-up (or surely
/// within the equivalence of it: the cheaper of the two, [`Speculation::cheaper`]).
fn separate(log_ratios: &[Vec<f64>], all: &[Speculation], options: &TuneOptions) -> Option<Outcome> {
    let threshold = (1.0 + options.margin).ln();
    let bound = |i: usize| {
        let (m, h) = mean_interval(&log_ratios[i]);
        (m - h, m + h)
    };
    let ranked = ranked(log_ratios);
    let &best = ranked.first()?;
    if ranked.iter().all(|&i| bound(i).1 < threshold) {
        return Some(Outcome::Decided {
            choice: Speculation::PLAIN,
            why: format!(
                "nothing beats plain decoding by {:.0}% (best: {} at {}): plain decoding",
                options.margin * 100.0,
                all[best],
                show(&log_ratios[best])
            ),
        });
    }
    if bound(best).0 <= threshold {
        return None;
    }
    let Some(&second) = ranked.get(1) else {
        return Some(Outcome::Decided {
            choice: all[best],
            why: format!("{} decodes {}", all[best], show(&log_ratios[best])),
        });
    };
    let (m, h) = mean_interval(&differences(&log_ratios[best], &log_ratios[second]));
    let same = (1.0 + options.equivalence).ln();
    if m - h > 0.0 {
        Some(Outcome::Decided {
            choice: all[best],
            why: format!(
                "{} decodes {}, ahead of {} ({})",
                all[best],
                show(&log_ratios[best]),
                all[second],
                show(&log_ratios[second])
            ),
        })
    } else if m - h > -same && m + h < same && bound(second).0 > threshold {
        let choice = all[best].cheaper(all[second]);
        Some(Outcome::Decided {
            choice,
            why: format!(
                "{} ({}) and {} ({}) are within {:.0}% of each other: the cheaper, {choice}",
                all[best],
                show(&log_ratios[best]),
                all[second],
                show(&log_ratios[second]),
                options.equivalence * 100.0
            ),
        })
    } else {
        None
    }
}

/// Why the budget ended undecided: which candidates could not be told apart, and by how much.
fn undecided(log_ratios: &[Vec<f64>], all: &[Speculation], options: &TuneOptions, elapsed_s: f64) -> String {
    let threshold = (1.0 + options.margin).ln();
    let ranked = ranked(log_ratios);
    let Some(&best) = ranked.first() else { return "nothing was measured".into() };
    let (m, h) = mean_interval(&log_ratios[best]);
    let what = if m - h <= threshold {
        format!(
            "{} ({}) could not be separated from plain decoding with a {:.0}% margin",
            all[best],
            show(&log_ratios[best]),
            options.margin * 100.0
        )
    } else {
        let second = ranked.get(1).copied().unwrap_or(best);
        let (dm, dh) = mean_interval(&differences(&log_ratios[best], &log_ratios[second]));
        format!(
            "{} ({}) and {} ({}) could not be separated: they differ by {:+.1}% [{:+.1}%, {:+.1}%]",
            all[best],
            show(&log_ratios[best]),
            all[second],
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
        Outcome::Decided { choice, why } => Verdict::Store {
            choice: *choice,
            speedup: m.speedup(*choice),
            interval: m.interval(*choice),
            why: why.clone(),
        },
        Outcome::Undecided { why } => Verdict::Refuse { why: why.clone() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// A planted machine: each candidate's true speed (tok/s; plain decoding first, then MTP
    /// depths 1, 2, … unless [`Planted::choices`] names others), the noise of each run (a
    /// factor drawn uniformly within ±`noise`), a clock that advances by each run's time.
    struct Planted {
        speed: Vec<f64>,
        choices: Vec<Speculation>,
        noise: f64,
        rng: rand::rngs::StdRng,
        now: std::rc::Rc<std::cell::Cell<f64>>,
    }

    impl Planted {
        fn new(speed: &[f64], noise: f64, seed: u64) -> Self {
            Planted {
                speed: speed.to_vec(),
                choices: (1..speed.len()).map(Speculation::mtp).collect(),
                noise,
                rng: rand::rngs::StdRng::seed_from_u64(seed),
                now: Default::default(),
            }
        }

        /// The candidates past plain decoding, in `speed`'s order.
        fn choices(mut self, choices: &[Speculation]) -> Self {
            self.choices = choices.to_vec();
            self
        }

        fn measure(&mut self, options: &TuneOptions) -> Measurement {
            let now = self.now.clone();
            let clock = move || Duration::from_secs_f64(now.get());
            let (speed, noise, rng, now) = (self.speed.clone(), self.noise, &mut self.rng, self.now.clone());
            let choices = self.choices.clone();
            let index = move |c: Speculation| choices.iter().position(|&x| x == c).map_or(0, |i| i + 1);
            let run = move |choice: Speculation, _t: f32| -> Result<Run> {
                let tps = speed[index(choice)] * (1.0 + rng.random_range(-noise..=noise));
                let tokens = 384;
                now.set(now.get() + tokens as f64 / tps);
                Ok(Run { tokens, seconds: tokens as f64 / tps, spec: None })
            };
            measure_with(&self.choices, options, run, clock, || None, |_| true).unwrap()
        }
    }

    fn options() -> TuneOptions {
        TuneOptions { budget: Duration::from_secs(600), ..TuneOptions::default() }
    }

    /// The MTP depth or block depth stored, if any (plain decoding: MTP depth 0).
    fn stored(m: &Measurement) -> Option<usize> {
        stored_choice(m).map(|c| c.depth)
    }

    fn stored_choice(m: &Measurement) -> Option<Speculation> {
        match decide(m, None, &options()) {
            Verdict::Store { choice, .. } => Some(choice),
            Verdict::Refuse { .. } => None,
        }
    }

    #[test]
    fn a_clear_winner_is_stored_with_its_interval_after_the_first_rounds() {
        let m = Planted::new(&[100.0, 130.0, 160.0, 140.0, 120.0], 0.02, 1).measure(&options());
        assert_eq!(stored(&m), Some(2), "{:?}", m.outcome);
        assert_eq!(m.rounds, 3);
        let [lo, hi] = m.interval(Speculation::mtp(2)).unwrap();
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
    fn mtp_and_block_depths_compete_in_the_same_rounds() {
        let choices = [Speculation::mtp(1), Speculation::mtp(2), Speculation::block(2), Speculation::block(4)];
        // The block drafter's depth 4 is fastest: it is stored as a block choice.
        let m = Planted::new(&[100.0, 120.0, 130.0, 125.0, 170.0], 0.02, 6).choices(&choices).measure(&options());
        assert_eq!(stored_choice(&m), Some(Speculation::block(4)), "{:?}", m.outcome);
        assert!(m.get(Speculation::block(4), 0.0).is_some() && m.get(Speculation::PLAIN, 0.7).is_some());
        assert_eq!(m.speedups.len(), 4);
        // As fast as MTP at the same depth: the MTP head, which needs no second model.
        let m = Planted::new(&[100.0, 120.0, 150.0, 150.0, 110.0], 0.01, 7).choices(&choices).measure(&options());
        assert_eq!(stored_choice(&m), Some(Speculation::mtp(2)), "{:?}", m.outcome);
        // A drafter alone (no MTP head) is measured against plain decoding all the same.
        let block_only = [Speculation::block(2), Speculation::block(4), Speculation::block(7)];
        let m = Planted::new(&[100.0, 80.0, 70.0, 60.0], 0.02, 8).choices(&block_only).measure(&options());
        assert_eq!(stored_choice(&m), Some(Speculation::PLAIN), "{:?}", m.outcome);
        let Outcome::Decided { why, .. } = &m.outcome else { panic!() };
        assert!(why.contains("block depth 2"), "{why}");
    }

    #[test]
    fn block_depths_halve_down_from_the_whole_block() {
        assert_eq!(block_depths(7), vec![2, 4, 7]);
        assert_eq!(block_depths(15), vec![2, 4, 8, 15]);
        assert_eq!(block_depths(2), vec![2]);
        assert_eq!(block_depths(1), vec![1]);
        assert_eq!(block_depths(0), Vec::<usize>::new());
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
        for c in m.candidates.iter_mut().filter(|c| c.choice == Speculation::mtp(1)) {
            c.acceptance = vec![0.02];
        }
        // Acceptance near 0 where the stored run had 85%: the accelerator was shared.
        assert!(
            matches!(decide(&m, Some(&[(0.0, 0.85)]), &options()), Verdict::Refuse { ref why } if why.contains("collapsed"))
        );
        assert!(matches!(decide(&m, None, &options()), Verdict::Store { choice, .. } if choice == Speculation::mtp(2)));
    }

    #[test]
    fn a_model_without_a_head_is_plain_decoding_at_once() {
        let m = Planted::new(&[100.0], 0.1, 5).measure(&options());
        assert_eq!((stored(&m), m.rounds), (Some(0), 0));
    }
}
