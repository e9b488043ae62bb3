//! The one chain a position's logits go through before sampling, wherever they come from — a
//! plain decode step, an MTP draft, a row of the verify pass. The chain is an ordered list of
//! processors, built by [`Chain::at`] alone: the request's own processors first (its
//! `logit_bias`), then the penalties over the tokens before the position, then the grammar's
//! mask for the state those tokens leave. The sampler takes what comes out. Every site applying
//! the same chain is what keeps speculation exact under biases, penalties and grammars; a new
//! processor is a [`LogitsProcessor`] added to that list.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};

use crate::error::{Error, Result};
use crate::penalties::Recent;

/// The last position's row of `a` [batch, positions, vocab], as [batch, vocab]: a slice and a
/// squeeze, views of `a`. An integer index would be a gather (mlx-rs takes it as `take`): a
/// kernel on every step and, on a fresh CUDA machine, one more module compiled for each dtype.
pub fn last_position(a: &Array) -> Result<Array> {
    Ok(a.try_index((.., -1.., ..))?.squeeze_axes(&[1])?)
}

/// `a` [1, ...] without its batch axis (a view, as [`last_position`] is); an error if the
/// batch holds more than one row.
pub fn only_row(a: &Array) -> Result<Array> {
    Ok(a.squeeze_axes(&[0])?)
}

/// One step of the chain: a position's logits [1, vocab] in, processed logits out.
pub trait LogitsProcessor {
    fn process(&self, logits: &Array) -> Result<Array>;
}

/// The penalties over the tokens before the position.
impl LogitsProcessor for Recent {
    fn process(&self, logits: &Array) -> Result<Array> {
        self.apply(logits)
    }
}

/// The grammar's additive mask [1, vocab] (0 allowed, -inf not) for a position.
pub struct GrammarMask(pub Array);

impl LogitsProcessor for GrammarMask {
    fn process(&self, logits: &Array) -> Result<Array> {
        Ok(logits.as_dtype(Dtype::Float32)?.add(&self.0)?)
    }
}

/// The most a `logit_bias` entry may add or take away (OpenAI's range: ±100 bans or forces).
pub const MAX_LOGIT_BIAS: f32 = 100.0;

/// A request's additive biases for chosen token ids (OpenAI's `logit_bias`), the same at
/// every position.
pub struct LogitBias {
    /// float32 [1, vocab]: the bias of each id, 0 for the others.
    bias: Array,
}

impl LogitBias {
    /// The biases `pairs` (token id, bias) over a vocabulary of `vocab`; `None` when there
    /// are none. A later pair for the same id replaces an earlier one.
    pub fn new(pairs: &[(u32, f32)], vocab: usize) -> Result<Option<Self>> {
        if pairs.is_empty() {
            return Ok(None);
        }
        check_ids(pairs, vocab)?;
        let mut dense = vec![0.0f32; vocab];
        for &(id, bias) in pairs {
            if let Some(slot) = dense.get_mut(id as usize) {
                *slot = bias;
            }
        }
        Ok(Some(LogitBias { bias: Array::from_slice(&dense, &[1, vocab as i32]) }))
    }
}

/// Every id of `pairs` names a token of a vocabulary of `vocab`, or an error naming the first
/// that does not.
pub fn check_ids(pairs: &[(u32, f32)], vocab: usize) -> Result<()> {
    match pairs.iter().find(|(id, _)| *id as usize >= vocab) {
        Some((id, _)) => Err(Error::Field {
            field: "logit_bias",
            message: format!("token id {id} is outside the vocabulary ({vocab})"),
        }),
        None => Ok(()),
    }
}

impl LogitsProcessor for LogitBias {
    fn process(&self, logits: &Array) -> Result<Array> {
        Ok(logits.as_dtype(Dtype::Float32)?.add(&self.bias)?)
    }
}

/// The processors of one position, in the order they apply.
#[derive(Default)]
pub struct Chain<'a> {
    steps: Vec<&'a dyn LogitsProcessor>,
}

impl<'a> Chain<'a> {
    /// The chain of a position — the one place its order is decided: the request's own
    /// processors, the penalties over the tokens before the position (`recent`), the
    /// grammar's mask for the state they leave.
    pub fn at(
        request: &'a [Box<dyn LogitsProcessor>],
        recent: Option<&'a Recent>,
        mask: Option<&'a GrammarMask>,
    ) -> Self {
        let mut steps: Vec<&'a dyn LogitsProcessor> = request.iter().map(|p| p.as_ref()).collect();
        if let Some(recent) = recent {
            steps.push(recent);
        }
        if let Some(mask) = mask {
            steps.push(mask);
        }
        Chain { steps }
    }

    /// `logits` [1, vocab] through every step in order.
    pub fn apply(&self, logits: &Array) -> Result<Array> {
        let mut out = logits.clone();
        for step in &self.steps {
            out = step.process(&out)?;
        }
        Ok(out)
    }
}

/// `logits` [rows, vocab] with row i through `rows[i]` (the verify pass: each row has the
/// window and the grammar state of the drafts before it).
pub fn apply_rows(logits: &Array, rows: &[Chain]) -> Result<Array> {
    if rows.iter().all(|r| r.steps.is_empty()) {
        return Ok(logits.clone());
    }
    let each = rows
        .iter()
        .enumerate()
        .map(|(j, chain)| chain.apply(&logits.try_index(j as i32..j as i32 + 1)?))
        .collect::<Result<Vec<_>>>()?;
    Ok(ops::concatenate(&each, 0)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::penalties::Penalties;

    fn values(a: &Array) -> Vec<f32> {
        a.as_dtype(Dtype::Float32).unwrap().as_slice::<f32>().to_vec()
    }

    #[test]
    fn penalties_then_the_mask_row_by_row() {
        let logits = Array::from_slice(&[2.0f32, -1.0, 0.5, 1.0, 3.0, -2.0], &[2, 3]);
        let recent = Recent::new(Penalties { presence: 0.5, ..Default::default() }, &[0]);
        let open = GrammarMask(Array::from_slice(&[0.0f32, 0.0, 0.0], &[1, 3]));
        let only_last = GrammarMask(Array::from_slice(&[f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0], &[1, 3]));
        let rows = [Chain::at(&[], Some(&recent), Some(&open)), Chain::at(&[], None, Some(&only_last))];
        let out = values(&apply_rows(&logits, &rows).unwrap());
        assert_eq!(&out[..3], [1.5, -1.0, 0.5]);
        assert_eq!(&out[3..5], [f32::NEG_INFINITY, f32::NEG_INFINITY]);
        assert_eq!(out[5], -2.0);
        // Nothing to apply: the logits as they were.
        let same = Chain::default().apply(&logits.try_index(0..1).unwrap()).unwrap();
        assert_eq!(values(&same), [2.0, -1.0, 0.5]);
    }

    #[test]
    fn the_request_bias_comes_first_and_a_mask_still_wins() {
        let logits = Array::from_slice(&[2.0f32, -1.0, 0.5], &[1, 3]);
        let bias: Vec<Box<dyn LogitsProcessor>> =
            vec![Box::new(LogitBias::new(&[(1, 5.0), (2, -MAX_LOGIT_BIAS)], 3).unwrap().unwrap())];
        // The repetition penalty divides a positive logit: applied after the bias, it sees 4.0.
        let recent = Recent::new(Penalties { repetition: 2.0, ..Default::default() }, &[1]);
        assert_eq!(values(&Chain::at(&bias, Some(&recent), None).apply(&logits).unwrap()), [2.0, 2.0, -99.5]);
        let only_first = GrammarMask(Array::from_slice(&[0.0f32, f32::NEG_INFINITY, f32::NEG_INFINITY], &[1, 3]));
        let out = values(&Chain::at(&bias, None, Some(&only_first)).apply(&logits).unwrap());
        assert_eq!(out, [2.0, f32::NEG_INFINITY, f32::NEG_INFINITY]);
    }

    #[test]
    fn a_bias_outside_the_vocabulary_is_refused_by_name() {
        assert!(LogitBias::new(&[], 3).unwrap().is_none());
        let e = LogitBias::new(&[(3, 1.0)], 3).err().unwrap();
        assert!(matches!(e, Error::Field { field: "logit_bias", .. }), "{e}");
        assert!(e.to_string().contains("token id 3"), "{e}");
    }
}
