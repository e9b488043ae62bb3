//! A test device: an answer fixed in advance, enforced on the logits. Each position's logits
//! keep only the script's token there (then end-of-sequence), and the sampler picks it, so the
//! answer still goes through the model's forward pass, the sampler, the detokenizer and
//! everything that reads the stream (tool-call parsing, the HTTP protocols). Agent tests use
//! it to make a small model call a client's own tool.

use mlx_rs::Array;

use crate::error::Result;

pub struct ForcedAnswer {
    tokens: Vec<u32>,
    /// What follows the script: the end of the answer.
    end: u32,
    /// The position the next logits are for.
    at: usize,
}

impl ForcedAnswer {
    pub fn new(tokens: Vec<u32>, end: u32) -> Self {
        ForcedAnswer { tokens, end, at: 0 }
    }

    /// The next logits are for answer position `at` (the tokens before it came another way:
    /// a speculative cycle's verify pass takes the script's tokens itself).
    pub fn skip_to(&mut self, at: usize) {
        self.at = at;
    }

    /// Logits [1, vocab] of the next position → the same with every other token at -inf.
    pub fn apply(&mut self, logits: &Array) -> Result<Array> {
        let token = self.tokens.get(self.at).copied().unwrap_or(self.end) as usize;
        self.at += 1;
        let vocab = logits.dim(-1);
        let mut mask = vec![f32::NEG_INFINITY; vocab as usize];
        if let Some(slot) = mask.get_mut(token) {
            *slot = 0.0;
        }
        let mask = Array::from_slice(&mask, &[1, vocab]);
        Ok(logits.as_dtype(mlx_rs::Dtype::Float32)?.add(&mask)?)
    }
}
