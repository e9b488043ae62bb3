//! Choosing the next token from logits: greedy at temperature 0, otherwise categorical
//! sampling after top-k, top-p (nucleus) and min-p filtering, reproducible with a seed.

use mlx_rs::ops::indexing::{Ellipsis, TryIndexOp};
use mlx_rs::{ops, random, Array};

use crate::error::{Error, Result};
use crate::logits::MAX_LOGIT_BIAS;
use crate::penalties::Penalties;

#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability adds up to `top_p` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: i32,
    /// Drop tokens less likely than `min_p` times the most likely one (0 = off).
    pub min_p: f32,
    pub seed: Option<u64>,
    /// Repetition, presence and frequency penalties (off by default).
    pub penalties: Penalties,
    /// Added to the logits of the token ids named (OpenAI's `logit_bias`), each within
    /// ±[`MAX_LOGIT_BIAS`]; empty by default.
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            penalties: Penalties::default(),
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, message: String| Err(Error::Field { field, message });
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", format!("must be >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", format!("must be in (0, 1], got {}", self.top_p));
        }
        if self.top_k < 0 {
            return bad("top_k", format!("must be >= 0, got {}", self.top_k));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad("min_p", format!("must be in [0, 1], got {}", self.min_p));
        }
        if let Some((id, b)) = self.logit_bias.iter().find(|(_, b)| b.is_nan() || b.abs() > MAX_LOGIT_BIAS) {
            return bad("logit_bias", format!("the bias of token {id} must be in [-100, 100], got {b}"));
        }
        self.penalties.validate()
    }

    /// Whether every `logit_bias` id is a token of a vocabulary of `vocab` (the server asks
    /// before it queues a request; the engine checks again when it starts one).
    pub fn check_vocabulary(&self, vocab: usize) -> Result<()> {
        crate::logits::check_ids(&self.logit_bias, vocab)
    }
}

/// Samples token ids from logits [B, vocab]; keeps its own PRNG key so a seed reproduces.
pub struct Sampler {
    params: SamplingParams,
    key: Option<Array>,
}

/// Temperatures below this are greedy: dividing logits by a subnormal or tiny temperature
/// overflows them to infinities, which sample as if hot, not cold.
pub const MIN_TEMPERATURE: f32 = 1e-4;

impl Sampler {
    pub fn new(mut params: SamplingParams) -> Result<Self> {
        params.validate()?;
        if params.temperature < MIN_TEMPERATURE {
            params.temperature = 0.0;
        }
        let key = match (params.temperature > 0.0, params.seed) {
            (true, Some(seed)) => Some(random::key(seed)?),
            (true, None) => Some(random::key(fresh_seed())?),
            _ => None,
        };
        Ok(Sampler { params, key })
    }

    pub fn is_greedy(&self) -> bool {
        self.key.is_none()
    }

    /// Token ids [B] (uint32), lazily: nothing is evaluated here.
    pub fn sample(&mut self, logits: &Array) -> Result<Array> {
        if self.is_greedy() {
            return Ok(ops::indexing::argmax_axis(logits, -1, None)?);
        }
        let scaled = self.scaled_logits(logits)?;
        self.draw(&scaled)
    }

    /// Draws from `softmax(scaled)` with the next key of this sampler's stream.
    pub fn draw(&mut self, scaled: &Array) -> Result<Array> {
        let key = match self.key.take() {
            Some(key) => key,
            None => random::key(fresh_seed())?,
        };
        let (key, sub) = random::split(&key, 2)?;
        self.key = Some(key);
        Ok(random::categorical(scaled, -1, None, &sub)?)
    }

    /// The logits whose softmax is the distribution `sample` draws from: log-probabilities
    /// after top-k, min-p and top-p filtering, divided by the temperature (f32).
    pub fn scaled_logits(&self, logits: &Array) -> Result<Array> {
        let p = &self.params;
        let logits = logits.as_dtype(mlx_rs::Dtype::Float32)?;
        if p.temperature == 0.0 {
            return Ok(logits);
        }
        let mut logprobs = logits.subtract(logits.logsumexp_axis(-1, true)?)?;
        let neg_inf = Array::from_f32(f32::NEG_INFINITY);
        let vocab = logprobs.dim(-1);
        if p.top_k > 0 && p.top_k < vocab {
            // Everything below the k-th largest logprob is dropped.
            let part = ops::partition_axis(&logprobs, vocab - p.top_k, -1)?;
            let kth = part.try_index((Ellipsis, (vocab - p.top_k)..(vocab - p.top_k + 1)))?;
            logprobs = ops::select(&logprobs.lt(&kth)?, &neg_inf, &logprobs)?;
        }
        if p.min_p > 0.0 {
            let top = logprobs.max_axis(-1, true)?;
            let floor = top.add(Array::from_f32(p.min_p.ln()))?;
            logprobs = ops::select(&logprobs.lt(&floor)?, &neg_inf, &logprobs)?;
        }
        if p.top_p < 1.0 {
            let order = ops::argsort_axis(&logprobs, -1)?; // ascending
            let sorted = ops::indexing::take_along_axis(&logprobs, &order, -1)?;
            let cumulative = ops::cumsum(ops::exp(&sorted)?, -1, None, None)?;
            let keep_sorted = cumulative.gt(Array::from_f32(1.0 - p.top_p))?;
            let filtered = ops::select(&keep_sorted, &sorted, &neg_inf)?;
            logprobs = ops::indexing::put_along_axis(&logprobs, &order, &filtered, -1)?;
        }
        Ok(logprobs.multiply(Array::from_f32(1.0 / p.temperature))?)
    }
}

pub(crate) fn fresh_seed() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Array {
        Array::from_slice(&[0.0f32, 3.0, 1.0, 2.9], &[1, 4])
    }

    fn draw(params: SamplingParams, n: usize) -> Vec<u32> {
        let mut s = Sampler::new(params).unwrap();
        (0..n).map(|_| s.sample(&logits()).unwrap().item_cast::<u32>()).collect()
    }

    #[test]
    fn greedy_takes_the_argmax() {
        assert_eq!(draw(SamplingParams::greedy(), 3), vec![1, 1, 1]);
    }

    #[test]
    fn seed_reproduces_and_filters_hold() {
        let p = SamplingParams { temperature: 1.0, seed: Some(7), ..Default::default() };
        assert_eq!(draw(p.clone(), 20), draw(p, 20));
        let top2 = SamplingParams { temperature: 5.0, top_k: 2, seed: Some(1), ..Default::default() };
        assert!(draw(top2, 50).iter().all(|t| *t == 1 || *t == 3));
        let nucleus = SamplingParams { temperature: 5.0, top_p: 0.5, seed: Some(2), ..Default::default() };
        assert!(draw(nucleus, 50).iter().all(|t| *t == 1 || *t == 3));
        let min_p = SamplingParams { temperature: 5.0, min_p: 0.5, seed: Some(3), ..Default::default() };
        assert!(draw(min_p, 50).iter().all(|t| *t == 1 || *t == 3));
    }

    #[test]
    fn rejects_bad_parameters() {
        let p = SamplingParams { top_p: 0.0, ..Default::default() };
        assert!(Sampler::new(p).err().unwrap().to_string().contains("top_p"));
    }
}
