//! When several requests want the model at once: decode them together plainly (one pass over
//! the weights a step for all of them, `crate::batch`), or let the request that speculates go
//! on alone while the others wait their turn. Batching gains with every sequence it adds (the
//! total rate of n sequences over one's); speculation gains its speed-up over plain decoding.
//! Whichever gains more serves more tokens a second — and, the waiting requests' answers
//! coming after the running one's instead of alongside it, finishes the requests sooner on
//! average too. Both gains depend on the machine and the model, so the tuner measures them
//! ([`measure_gains`], stored with the tuned depth) and the server's worker asks
//! [`BatchRule::batch_pays`] between a speculating request's cycles.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::batch::Batch;
use crate::{CancelToken, Engine, Event, GenerateRequest, Result};

/// `sequences` decoding together plainly run at `gain` times one sequence's rate (in total).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct BatchGain {
    pub sequences: usize,
    pub gain: f64,
}

/// What the worker decides with: batching's measured gains, and the speed-up the tuned draft
/// depth promised (for a request whose live figures do not say better).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct BatchRule {
    /// Ascending by `sequences`; empty when this machine was not measured.
    pub gains: Vec<BatchGain>,
    /// The tuned depth's speed-up over plain decoding (1 when it is plain decoding).
    pub tuned_speedup: f64,
}

impl BatchRule {
    pub fn new(mut gains: Vec<BatchGain>, tuned_speedup: f64) -> BatchRule {
        gains.retain(|g| g.sequences >= 2 && g.gain.is_finite() && g.gain > 0.0);
        gains.sort_by_key(|g| g.sequences);
        BatchRule { gains, tuned_speedup }
    }

    /// Batching's gain at `n` sequences: 1 alone, measured sizes as measured, linear between
    /// them (from 1 at one sequence to the first size), the largest size's beyond it. `None`
    /// when nothing was measured.
    pub fn gain(&self, n: usize) -> Option<f64> {
        let last = self.gains.last()?;
        if n <= 1 {
            return Some(1.0);
        }
        let mut below = BatchGain { sequences: 1, gain: 1.0 };
        for &g in &self.gains {
            if g.sequences >= n {
                let t = (n - below.sequences) as f64 / (g.sequences - below.sequences) as f64;
                return Some(below.gain + t * (g.gain - below.gain));
            }
            below = g;
        }
        Some(last.gain)
    }

    /// Whether `n` requests (the speculating one and those waiting) should decode together
    /// rather than the one at `speedup` going on alone. Unmeasured, they always do: without
    /// figures, nobody is kept waiting.
    pub fn batch_pays(&self, n: usize, speedup: f64) -> bool {
        match self.gain(n) {
            Some(gain) => gain >= speedup,
            None => true,
        }
    }

    /// The fewest requests that decode together rather than wait behind one at `speedup`, up
    /// to `max_sequences` (`None`: speculation wins at every size up to it).
    pub fn batch_from(&self, speedup: f64, max_sequences: usize) -> Option<usize> {
        (2..=max_sequences.max(2)).find(|&n| self.batch_pays(n, speedup))
    }
}

/// Measures batching's gain at each of `sizes` on this engine: `rounds` paired rounds, each one
/// sequence alone then each size together (plain greedy decoding of `tokens` new tokens, the
/// prompts taken in turn), the gain of a round being the size's total decode rate over the
/// alone run's beside it; the median of the rounds. Prefill is not timed; `prefill_chunk` is
/// the requests' own prefill pass (see `GenerateRequest::prefill_chunk`).
pub fn measure_gains(
    engine: &Engine,
    prompts: &[Vec<u32>],
    sizes: &[usize],
    tokens: usize,
    rounds: usize,
    prefill_chunk: Option<usize>,
) -> Result<Vec<BatchGain>> {
    if prompts.is_empty() {
        return Ok(Vec::new());
    }
    let request = |i: usize| {
        let mut r = GenerateRequest::greedy(prompts[i % prompts.len()].clone(), tokens);
        r.ignore_eos = true;
        r.draft_depth = 0;
        r.fixed_depth = true;
        r.prefill_chunk = prefill_chunk;
        r
    };
    let run = |n: usize| decode_rate(engine, &(0..n).map(request).collect::<Vec<_>>());
    run(sizes.iter().copied().max().unwrap_or(1))?; // warm-up: the largest shape compiles once
    let mut ratios: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
    for _ in 0..rounds.max(1) {
        let alone = run(1)?;
        for (k, &n) in sizes.iter().enumerate() {
            let together = run(n)?;
            if alone > 0.0 {
                ratios[k].push(together / alone);
            }
        }
    }
    Ok(sizes
        .iter()
        .zip(ratios)
        .filter(|(_, r)| !r.is_empty())
        .map(|(&sequences, mut r)| {
            r.sort_by(f64::total_cmp);
            BatchGain { sequences, gain: r[r.len() / 2] }
        })
        .collect())
}

/// Decode tok/s of `requests` stepped together, in total (their prefills not timed); also
/// `ferrite dev batch`'s measurement.
pub fn decode_rate(engine: &Engine, requests: &[GenerateRequest]) -> Result<f64> {
    let mut batch = Batch::default();
    for (i, r) in requests.iter().enumerate() {
        batch.join(i, engine.generate(r.clone(), CancelToken::default())?)?;
    }
    let started = Instant::now();
    // Every token but the first (drawn by the prefill) is decoded by a step.
    let mut decoded = 0usize;
    while !batch.is_empty() {
        for (_, event) in batch.step() {
            if let Event::Finished(summary) = event? {
                decoded += summary.usage.completion_tokens.saturating_sub(1);
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    Ok(if seconds > 0.0 { decoded as f64 / seconds } else { 0.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(gains: &[(usize, f64)], tuned_speedup: f64) -> BatchRule {
        BatchRule::new(gains.iter().map(|&(sequences, gain)| BatchGain { sequences, gain }).collect(), tuned_speedup)
    }

    #[test]
    fn gains_interpolate_between_measured_sizes_and_hold_beyond_them() {
        let r = rule(&[(4, 2.2), (2, 1.6), (8, 3.0)], 1.8);
        assert_eq!(r.gain(1), Some(1.0));
        assert_eq!(r.gain(2), Some(1.6));
        assert!((r.gain(3).unwrap() - 1.9).abs() < 1e-12);
        assert!((r.gain(6).unwrap() - 2.6).abs() < 1e-12);
        assert_eq!(r.gain(16), Some(3.0));
        assert_eq!(rule(&[], 2.0).gain(4), None);
    }

    #[test]
    fn requests_batch_from_the_size_whose_gain_beats_the_speculating_one() {
        let r = rule(&[(2, 1.14), (4, 1.29), (8, 2.4)], 1.8);
        assert!(!r.batch_pays(2, 1.8));
        // At 6: 1.29 + (6 - 4) / 4 × 1.11 = 1.845.
        assert_eq!(r.batch_from(1.8, 8), Some(6));
        // A request whose drafts stopped paying batches at once; one that pays more than any
        // measured batch stays alone up to the limit.
        assert_eq!(r.batch_from(1.0, 8), Some(2));
        assert_eq!(r.batch_from(3.0, 8), None);
    }

    #[test]
    fn an_unmeasured_machine_always_batches() {
        let r = BatchRule::default();
        assert!(r.batch_pays(2, 4.0));
        assert_eq!(r.batch_from(4.0, 4), Some(2));
    }

    #[test]
    fn nonsense_gains_are_dropped() {
        let r = rule(&[(1, 5.0), (2, f64::NAN), (4, -1.0), (8, 2.0)], 1.0);
        assert_eq!(r.gains, vec![BatchGain { sequences: 8, gain: 2.0 }]);
    }
}
