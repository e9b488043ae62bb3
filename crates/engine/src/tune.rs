//! The draft-depth autotuner's core: measure plain decoding and every MTP draft depth on the
//! real model with a fixed suite of code prompts, then decide what may be stored. Storage,
//! machine fingerprints and process checks belong to the callers; this module only measures
//! and judges, so the rules are the same for the CLI and the app.

use serde::Serialize;

use crate::generate::{Engine, GenerateRequest};
use crate::speculative::{SpecStats, MAX_DRAFT_DEPTH};
use crate::Result;

/// What a coding agent asks: the suite every tune runs (thinking off).
pub const CODE_PROMPTS: [&str; 4] = [
    "Write a Python function that parses a line of CSV text into a list of fields, handling quoted fields.",
    "Implement binary search over a sorted slice in Rust, returning the index of the target or None.",
    "Write a Python class for a least-recently-used cache with get and put methods.",
    "Write a Rust function that counts the words in a string and returns them in a HashMap.",
];

#[derive(Debug, Clone)]
pub struct TuneOptions {
    /// New tokens per generation (end-of-sequence ignored, so every run is as long).
    pub gen_tokens: usize,
    /// Timed repetitions of the whole suite, per depth and temperature.
    pub reps: usize,
    /// Temperature 0 and the default sampler's.
    pub temperatures: Vec<f32>,
    /// Largest (max - min) / median of one candidate's repetitions that is still trusted.
    pub max_spread: f64,
    /// How much faster than plain decoding a depth must be to be stored.
    pub margin: f64,
    /// How many prompts of the suite to use (all by default).
    pub prompts: usize,
}

impl Default for TuneOptions {
    fn default() -> Self {
        TuneOptions {
            gen_tokens: 96,
            reps: 5,
            temperatures: vec![0.0, 0.7],
            max_spread: 0.15,
            margin: 0.05,
            prompts: CODE_PROMPTS.len(),
        }
    }
}

/// One depth at one temperature.
#[derive(Debug, Clone, Serialize)]
pub struct Candidate {
    pub depth: usize,
    pub temperature: f32,
    /// Decode tok/s of each repetition (tokens over decode time, whole suite).
    pub runs: Vec<f64>,
    pub median_tps: f64,
    /// (max - min) / median of `runs`.
    pub spread: f64,
    pub acceptance: Vec<f64>,
    pub tokens_per_cycle: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    pub candidates: Vec<Candidate>,
    /// Why the machine looked busy during the measurement, if it did.
    pub busy: Option<String>,
}

impl Measurement {
    pub fn get(&self, depth: usize, temperature: f32) -> Option<&Candidate> {
        self.candidates.iter().find(|c| c.depth == depth && c.temperature == temperature)
    }

    /// Speed over plain decoding, averaged over the temperatures.
    pub fn speedup(&self, depth: usize) -> f64 {
        let ratios: Vec<f64> = self
            .candidates
            .iter()
            .filter(|c| c.depth == depth)
            .filter_map(|c| self.get(0, c.temperature).map(|p| c.median_tps / p.median_tps.max(1e-9)))
            .collect();
        if ratios.is_empty() {
            0.0
        } else {
            ratios.iter().sum::<f64>() / ratios.len() as f64
        }
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
    /// 1-based; 0 during the warm-up.
    pub repetition: usize,
    pub repetitions: usize,
    /// Candidate runs finished, of `steps` (warm-up included).
    pub step: usize,
    pub steps: usize,
    /// Decode tok/s of the run that just finished (over the whole prompt suite).
    pub last_tps: Option<f64>,
}

/// The tuner's judgement.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "verdict", rename_all = "lowercase")]
pub enum Verdict {
    /// Store this depth (0: no depth beat plain decoding by the margin).
    Store { depth: usize, speedup: f64, why: String },
    /// Do not store anything: the measurement cannot be trusted.
    Refuse { why: String },
}

/// The code prompts as token ids: through the chat template with thinking off, or as plain
/// text for a model without one.
pub fn suite(engine: &Engine, count: usize) -> Result<Vec<Vec<u32>>> {
    let mut vars = serde_json::Map::new();
    vars.insert("enable_thinking".into(), false.into());
    CODE_PROMPTS
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
    s[s.len() / 2]
}

/// Range of the repetitions over their median; from five repetitions on, the fastest and the
/// slowest are left out, so one outlier does not condemn a whole run.
fn spread(v: &[f64], median: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let kept = if s.len() >= 5 { &s[1..s.len() - 1] } else { &s[..] };
    (kept[kept.len() - 1] - kept[0]) / median.max(1e-9)
}

/// Measures depth 0..=4 at each temperature, repetitions interleaved so that drift hits every
/// candidate alike, after one warm-up generation per depth. `busy` is asked between runs and
/// returns why the machine is not quiet; `progress` hears where the measurement is before and
/// after every run, and stops it by returning `false` (the result is then
/// [`Error::Cancelled`](crate::Error::Cancelled): nothing half-measured comes back).
pub fn measure(
    engine: &Engine,
    options: &TuneOptions,
    mut busy: impl FnMut() -> Option<String>,
    mut progress: impl FnMut(&Progress) -> bool,
) -> Result<Measurement> {
    let prompts = suite(engine, options.prompts)?;
    let max_depth = if engine.model().mtp().is_some() { MAX_DRAFT_DEPTH } else { 0 };
    let reps = options.reps.max(1);
    let candidates = options.temperatures.len() * (max_depth + 1);
    let mut at =
        Progress { phase: "warm-up", repetitions: reps, steps: candidates * (reps + 1), ..Progress::default() };
    let mut report = |at: &Progress| {
        if progress(at) {
            Ok(())
        } else {
            Err(crate::Error::Cancelled("tuning stopped; nothing stored".into()))
        }
    };
    let run = |depth: usize, temperature: f32, prompt: &[u32]| -> Result<(usize, f64, Option<SpecStats>)> {
        let mut req = GenerateRequest::greedy(prompt.to_vec(), options.gen_tokens);
        req.ignore_eos = true;
        req.draft_depth = depth;
        req.sampling.temperature = temperature;
        req.sampling.seed = Some(0);
        let (_, s) = engine.generate_text(req)?;
        let decoded = s.usage.completion_tokens.saturating_sub(1);
        let seconds = if s.timings.decode_tps > 0.0 { decoded as f64 / s.timings.decode_tps } else { 0.0 };
        Ok((decoded, seconds, s.speculative))
    };
    // A whole discarded pass first: every depth, temperature and prompt length compiles its
    // kernels here (on a GPU the first run of a new shape costs far more than the rest).
    for &t in &options.temperatures {
        for depth in 0..=max_depth {
            (at.depth, at.temperature) = (depth, t);
            report(&at)?;
            for prompt in &prompts {
                run(depth, t, prompt)?;
            }
            at.step += 1;
        }
    }
    at.phase = "measuring";
    let mut busy_seen = busy();
    let mut runs: Vec<(usize, f32, Vec<f64>, Option<SpecStats>)> = Vec::new();
    for &t in &options.temperatures {
        for depth in 0..=max_depth {
            runs.push((depth, t, Vec::new(), None));
        }
    }
    for rep in 0..reps {
        for (depth, t, tps, stats) in runs.iter_mut() {
            (at.depth, at.temperature, at.repetition) = (*depth, *t, rep + 1);
            report(&at)?;
            let (mut tokens, mut seconds) = (0usize, 0f64);
            for prompt in &prompts {
                let (n, s, spec) = run(*depth, *t, prompt)?;
                tokens += n;
                seconds += s;
                if let Some(spec) = spec {
                    match stats {
                        Some(all) => all.merge(&spec),
                        None => *stats = Some(spec),
                    }
                }
            }
            tps.push(if seconds > 0.0 { tokens as f64 / seconds } else { 0.0 });
            at.step += 1;
            at.last_tps = tps.last().copied();
            if busy_seen.is_none() {
                busy_seen = busy();
            }
        }
    }
    let candidates = runs
        .into_iter()
        .map(|(depth, temperature, tps, stats)| {
            let m = median(&tps);
            let spread = spread(&tps, m);
            let stats = stats.unwrap_or_default();
            Candidate {
                depth,
                temperature,
                median_tps: m,
                spread,
                runs: tps,
                acceptance: stats.acceptance(),
                tokens_per_cycle: stats.tokens_per_cycle(),
            }
        })
        .collect();
    report(&at)?;
    Ok(Measurement { candidates, busy: busy_seen })
}

/// Decides what may be stored. `previous`: the first-position acceptance per temperature of
/// the result stored earlier for the same machine, model and profile.
pub fn decide(m: &Measurement, previous: Option<&[(f32, f64)]>, options: &TuneOptions) -> Verdict {
    if let Some(why) = &m.busy {
        return Verdict::Refuse {
            why: format!("the machine was busy while measuring ({why}); close it and tune again"),
        };
    }
    if let Some(c) =
        m.candidates.iter().filter(|c| c.spread > options.max_spread).max_by(|a, b| a.spread.total_cmp(&b.spread))
    {
        return Verdict::Refuse {
            why: format!(
                "depth {} at temperature {} varied by {:.0}% between repetitions (more than {:.0}%): something else was using the machine, or it throttled",
                c.depth, c.temperature, c.spread * 100.0, options.max_spread * 100.0
            ),
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
    let best =
        m.candidates.iter().map(|c| c.depth).filter(|d| *d > 0).max_by(|a, b| m.speedup(*a).total_cmp(&m.speedup(*b)));
    match best {
        Some(d) if m.speedup(d) >= 1.0 + options.margin => Verdict::Store {
            depth: d,
            speedup: m.speedup(d),
            why: format!("depth {d} decodes {:.2}x as fast as plain decoding", m.speedup(d)),
        },
        Some(d) => Verdict::Store {
            depth: 0,
            speedup: 1.0,
            why: format!(
                "no depth beats plain decoding by {:.0}% (best: depth {d} at {:.2}x): plain decoding",
                options.margin * 100.0,
                m.speedup(d)
            ),
        },
        None => Verdict::Store { depth: 0, speedup: 1.0, why: "the model has no MTP head: plain decoding".into() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(depth: usize, t: f32, runs: &[f64], acc: f64) -> Candidate {
        let m = median(runs);
        let spread = spread(runs, m);
        Candidate {
            depth,
            temperature: t,
            runs: runs.to_vec(),
            median_tps: m,
            spread,
            acceptance: if depth > 0 { vec![acc; depth] } else { vec![] },
            tokens_per_cycle: 1.0,
        }
    }

    fn measurement(d1: f64, acc: f64) -> Measurement {
        Measurement {
            candidates: vec![
                cand(0, 0.0, &[100.0, 101.0, 99.0], 0.0),
                cand(1, 0.0, &[d1, d1 + 1.0, d1 - 1.0], acc),
                cand(2, 0.0, &[d1 - 10.0; 3], acc),
            ],
            busy: None,
        }
    }

    #[test]
    fn stores_the_fastest_depth_or_plain() {
        let o = TuneOptions::default();
        assert!(matches!(decide(&measurement(140.0, 0.9), None, &o), Verdict::Store { depth: 1, .. }));
        assert!(matches!(decide(&measurement(103.0, 0.9), None, &o), Verdict::Store { depth: 0, .. }));
    }

    #[test]
    fn one_outlier_in_five_is_forgiven() {
        assert!(spread(&[100.0, 101.0, 99.0, 100.0, 60.0], 100.0) < 0.05);
        assert!(spread(&[100.0, 60.0, 99.0], 99.0) > 0.3);
    }

    #[test]
    fn refuses_untrustworthy_measurements() {
        let o = TuneOptions::default();
        let mut noisy = measurement(140.0, 0.9);
        noisy.candidates[1] = cand(1, 0.0, &[100.0, 140.0, 180.0], 0.9);
        assert!(matches!(decide(&noisy, None, &o), Verdict::Refuse { ref why } if why.contains("varied")));
        let mut busy = measurement(140.0, 0.9);
        busy.busy = Some("process `make` used 180% CPU".into());
        assert!(matches!(decide(&busy, None, &o), Verdict::Refuse { ref why } if why.contains("busy")));
        // Acceptance near 0 where the stored run had 85%: the accelerator was shared.
        let collapsed = measurement(60.0, 0.02);
        assert!(
            matches!(decide(&collapsed, Some(&[(0.0, 0.85)]), &o), Verdict::Refuse { ref why } if why.contains("collapsed"))
        );
        // Without an earlier run there is nothing to compare with: plain decoding is stored.
        assert!(matches!(decide(&collapsed, None, &o), Verdict::Store { depth: 0, .. }));
    }
}
