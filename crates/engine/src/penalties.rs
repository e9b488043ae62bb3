//! Repetition, presence and frequency penalties, as mlx-lm's logits processors apply them
//! (and its server exposes them): each looks at the last [`WINDOW`] tokens of the prompt and
//! the output so far, and changes those tokens' logits before sampling.
//!
//! The window lives on the device, so a decode step's penalty is built from the previous
//! token before that token is read back: the decode loop stays pipelined. Speculative
//! decoding penalises each drafted and verified position with the drafts before it in its
//! window (`speculative.rs`), so its output stays exactly the plain output.

use mlx_rs::ops::indexing::{put_along_axis, scatter_add_single, take_axis, TryIndexOp};
use mlx_rs::{ops, Array, Dtype};

use crate::error::{Error, Result};

/// How many of the latest tokens the penalties look at (mlx-lm's default context size).
pub const WINDOW: usize = 20;

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Penalties {
    /// A repeated token's logit is divided by this when positive, multiplied when negative
    /// (1 = off).
    pub repetition: f32,
    /// Subtracted once from the logit of every token in the window (0 = off; OpenAI's name).
    pub presence: f32,
    /// Subtracted from a token's logit once for each time it is in the window (0 = off).
    pub frequency: f32,
}

impl Default for Penalties {
    fn default() -> Self {
        Penalties { repetition: 1.0, presence: 0.0, frequency: 0.0 }
    }
}

impl Penalties {
    pub fn is_off(&self) -> bool {
        *self == Penalties::default()
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |field: &'static str, message: String| Err(Error::Field { field, message });
        if !(self.repetition > 0.0 && self.repetition.is_finite()) {
            return bad("repetition_penalty", format!("must be > 0, got {}", self.repetition));
        }
        if !(-2.0..=2.0).contains(&self.presence) {
            return bad("presence_penalty", format!("must be in [-2, 2], got {}", self.presence));
        }
        if !(-2.0..=2.0).contains(&self.frequency) {
            return bad("frequency_penalty", format!("must be in [-2, 2], got {}", self.frequency));
        }
        Ok(())
    }
}

/// The part of `tokens` the penalties look at: the last [`WINDOW`].
pub fn window_of(tokens: &[u32]) -> &[u32] {
    &tokens[tokens.len().saturating_sub(WINDOW)..]
}

/// The tokens the penalties look at: the prompt's last [`WINDOW`], then each new token.
pub struct Recent {
    penalties: Penalties,
    /// uint32 [n], n ≤ WINDOW.
    window: Array,
}

impl Recent {
    pub fn new(penalties: Penalties, prompt: &[u32]) -> Self {
        let tail = window_of(prompt);
        Recent { penalties, window: Array::from_slice(tail, &[tail.len() as i32]) }
    }

    /// Adds a sampled token (any shape holding one id; lazy is fine).
    pub fn push(&mut self, token: &Array) -> Result<()> {
        let token = token.as_dtype(Dtype::Uint32)?.reshape(&[1])?;
        let joined = ops::concatenate(&[&self.window, &token], 0)?;
        let n = joined.dim(0);
        self.window = if n as usize > WINDOW { joined.try_index((n - WINDOW as i32)..n)? } else { joined };
        Ok(())
    }

    /// `logits` [1, vocab] with the penalties applied, in mlx-lm's order (repetition, presence,
    /// frequency) and in the logits' own dtype.
    pub fn apply(&self, logits: &Array) -> Result<Array> {
        let p = &self.penalties;
        let n = self.window.dim(0);
        if n == 0 {
            return Ok(logits.clone());
        }
        let scalar = |v: f32| Array::from_f32(v).as_dtype(logits.dtype());
        let columns = self.window.reshape(&[1, n])?;
        let mut logits = logits.clone();
        if p.repetition != 1.0 {
            // Each repeated id gets the same new value, however often it appears.
            let picked = take_axis(&logits, &self.window, -1)?;
            let scaled = ops::select(
                &picked.lt(scalar(0.0)?)?,
                &picked.multiply(scalar(p.repetition)?)?,
                &picked.divide(scalar(p.repetition)?)?,
            )?;
            logits = put_along_axis(&logits, &columns, &scaled, -1)?;
        }
        if p.presence != 0.0 {
            let picked = take_axis(&logits, &self.window, -1)?;
            logits = put_along_axis(&logits, &columns, picked.subtract(scalar(p.presence)?)?, -1)?;
        }
        if p.frequency != 0.0 {
            // A scatter-add: an id that appears k times loses k penalties.
            let updates = ops::full::<f32>(&[n, 1, 1], Array::from_f32(-p.frequency))?.as_dtype(logits.dtype())?;
            logits = scatter_add_single(&logits, &self.window, &updates, 1)?;
        }
        Ok(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(a: &Array) -> Vec<f32> {
        a.as_dtype(Dtype::Float32).unwrap().as_slice::<f32>().to_vec()
    }

    fn logits() -> Array {
        Array::from_slice(&[2.0f32, -1.0, 0.5, 4.0, -3.0], &[1, 5])
    }

    #[test]
    fn each_penalty_changes_the_window_tokens_as_mlx_lm_does() {
        // Token 0 twice, token 1 once, token 3 never.
        let recent = |p: Penalties| Recent::new(p, &[0, 1, 0]);
        let repetition = recent(Penalties { repetition: 2.0, ..Default::default() }).apply(&logits()).unwrap();
        assert_eq!(values(&repetition), [1.0, -2.0, 0.5, 4.0, -3.0]);
        let presence = recent(Penalties { presence: 0.5, ..Default::default() }).apply(&logits()).unwrap();
        assert_eq!(values(&presence), [1.5, -1.5, 0.5, 4.0, -3.0]);
        let frequency = recent(Penalties { frequency: 0.5, ..Default::default() }).apply(&logits()).unwrap();
        assert_eq!(values(&frequency), [1.0, -1.5, 0.5, 4.0, -3.0]);
        let all = recent(Penalties { repetition: 2.0, presence: 0.5, frequency: 0.25 }).apply(&logits()).unwrap();
        assert_eq!(values(&all), [0.0, -2.75, 0.5, 4.0, -3.0]);
    }

    #[test]
    fn the_window_keeps_the_latest_tokens() {
        let prompt: Vec<u32> = (0..30).map(|i| i % 5).collect();
        let mut recent = Recent::new(Penalties { frequency: 1.0, ..Default::default() }, &prompt);
        assert_eq!(recent.window.dim(0), WINDOW as i32);
        recent.push(&Array::from_slice(&[3u32], &[1])).unwrap();
        assert_eq!(recent.window.dim(0), WINDOW as i32);
        assert_eq!(recent.window.as_slice::<u32>().last(), Some(&3));
        // Ids 0..5 four times each in the last 20, then a 3 pushed out a 0.
        let out = values(&recent.apply(&Array::zeros::<f32>(&[1, 6]).unwrap()).unwrap());
        assert_eq!(out, [-3.0, -4.0, -4.0, -5.0, -4.0, 0.0]);
    }

    #[test]
    fn bf16_logits_stay_bf16_and_bad_values_are_named() {
        let recent = Recent::new(Penalties { presence: 1.0, ..Default::default() }, &[1]);
        let out = recent.apply(&logits().as_dtype(Dtype::Bfloat16).unwrap()).unwrap();
        assert_eq!(out.dtype(), Dtype::Bfloat16);
        let e = Penalties { repetition: 0.0, ..Default::default() }.validate().unwrap_err().to_string();
        assert!(e.contains("repetition_penalty"), "{e}");
        let e = Penalties { presence: 3.0, ..Default::default() }.validate().unwrap_err().to_string();
        assert!(e.contains("presence_penalty"), "{e}");
        assert!(Penalties::default().is_off());
    }
}
