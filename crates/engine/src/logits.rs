//! The one chain a position's logits go through before sampling, wherever they come from — a
//! plain decode step, an MTP draft, a row of the verify pass: the penalties over the tokens
//! before the position, then the grammar's mask for the state those tokens leave. The sampler
//! takes what comes out. Every site applying the same chain in the same order is what keeps
//! speculation exact under penalties and grammars.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{ops, Array, Dtype};

use crate::error::{Error, Result};
use crate::penalties::Recent;

/// What applies to one position's logits.
#[derive(Default, Clone, Copy)]
pub struct Processors<'a> {
    /// The penalties and the tokens they look at.
    pub recent: Option<&'a Recent>,
    /// The grammar's additive mask [1, vocab] (0 allowed, -inf not) for the position.
    pub mask: Option<&'a Array>,
}

impl Processors<'_> {
    /// `logits` [1, vocab] processed.
    pub fn apply(self, logits: &Array) -> Result<Array> {
        apply_rows(logits, &[self])
    }
}

/// `logits` [rows, vocab] with row i processed by `rows[i]` (the verify pass: each row has the
/// window and the grammar state of the drafts before it).
pub fn apply_rows(logits: &Array, rows: &[Processors]) -> Result<Array> {
    let penalised = if rows.iter().any(|r| r.recent.is_some()) {
        let each = rows
            .iter()
            .enumerate()
            .map(|(j, r)| {
                let row = logits.try_index(j as i32..j as i32 + 1)?;
                match r.recent {
                    Some(recent) => recent.apply(&row),
                    None => Ok(row),
                }
            })
            .collect::<Result<Vec<_>>>()?;
        ops::concatenate(&each, 0)?
    } else {
        logits.clone()
    };
    let masks: Vec<&Array> = rows.iter().filter_map(|r| r.mask).collect();
    if masks.is_empty() {
        return Ok(penalised);
    }
    if masks.len() != rows.len() {
        return Err(Error::Request("a grammar's mask is missing for a verified position".into()));
    }
    Ok(penalised.as_dtype(Dtype::Float32)?.add(ops::concatenate(&masks, 0)?)?)
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
        let open = Array::from_slice(&[0.0f32, 0.0, 0.0], &[1, 3]);
        let only_last = Array::from_slice(&[f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0], &[1, 3]);
        let rows = [
            Processors { recent: Some(&recent), mask: Some(&open) },
            Processors { recent: None, mask: Some(&only_last) },
        ];
        let out = values(&apply_rows(&logits, &rows).unwrap());
        assert_eq!(&out[..3], [1.5, -1.0, 0.5]);
        assert_eq!(&out[3..5], [f32::NEG_INFINITY, f32::NEG_INFINITY]);
        assert_eq!(out[5], -2.0);
        // Nothing to apply: the logits as they were.
        let same = Processors::default().apply(&logits.try_index(0..1).unwrap()).unwrap();
        assert_eq!(values(&same), [2.0, -1.0, 0.5]);
    }
}
