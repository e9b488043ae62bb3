//! Several projections of one input (q, k and v; gate and up; a router and its shared
//! expert's gate), joined at load into one matrix when they are stored alike: a step runs
//! one matmul where the checkpoint has several. Each output row is the same dot product
//! either way, so the numbers do not change; at decode, where every dispatch costs host
//! time, the count of matmuls does.

use mlx_rs::{ops, Array};

use super::packed::Packed;
use super::Linear;
use crate::error::Result;

#[derive(Debug, Clone)]
pub enum Projections {
    /// As the checkpoint stores them (mixed dtypes or quantization specs, or biases).
    Separate(Vec<Linear>),
    /// One matrix: each part's rows in order; `ends` are the parts' end columns.
    Joined { all: Linear, ends: Vec<i32> },
}

impl Projections {
    /// Joins `parts` when all are dense in one dtype, or all quantized with one spec, and none
    /// has a bias. The joined matrix is evaluated at once, so the originals can go.
    pub fn new(parts: Vec<Linear>) -> Result<Projections> {
        if parts.len() < 2 {
            return Ok(Projections::Separate(parts));
        }
        let mut ends = Vec::with_capacity(parts.len());
        let mut end = 0;
        for part in &parts {
            end += part.out_features();
            ends.push(end);
        }
        let joined = match parts.as_slice() {
            [Linear::Dense { weight: first, bias: None }, rest @ ..]
                if rest
                    .iter()
                    .all(|p| matches!(p, Linear::Dense { weight, bias: None } if weight.dtype() == first.dtype())) =>
            {
                let weights: Vec<&Array> = parts
                    .iter()
                    .filter_map(|p| match p {
                        Linear::Dense { weight, .. } => Some(weight),
                        _ => None,
                    })
                    .collect();
                let weight = ops::concatenate(&weights, 0)?;
                weight.eval()?;
                Linear::Dense { weight, bias: None }
            }
            [Linear::Quantized { packed: first, bias: None }, rest @ ..]
                if rest
                    .iter()
                    .all(|p| matches!(p, Linear::Quantized { packed, bias: None } if packed.spec == first.spec)) =>
            {
                let packs: Vec<&Packed> = parts
                    .iter()
                    .filter_map(|p| match p {
                        Linear::Quantized { packed, .. } => Some(packed),
                        _ => None,
                    })
                    .collect();
                let packed = Packed::concat(&packs, 0)?;
                packed.eval()?;
                Linear::Quantized { packed, bias: None }
            }
            _ => return Ok(Projections::Separate(parts)),
        };
        Ok(Projections::Joined { all: joined, ends })
    }

    /// Each projection of `x`, in the order they were given.
    pub fn forward(&self, x: &Array) -> Result<Vec<Array>> {
        match self {
            Projections::Separate(parts) => parts.iter().map(|p| p.forward(x)).collect(),
            Projections::Joined { all, ends } => {
                let y = all.forward(x)?;
                Ok(y.split_at_indices(&ends[..ends.len() - 1], -1)?)
            }
        }
    }

    /// The projections of `x` side by side in one array, as the joined matmul gives them (the
    /// separate ones concatenated).
    pub fn forward_joined(&self, x: &Array) -> Result<Array> {
        match self {
            Projections::Separate(parts) => {
                let outputs = parts.iter().map(|p| p.forward(x)).collect::<Result<Vec<_>>>()?;
                Ok(ops::concatenate(&outputs, -1)?)
            }
            Projections::Joined { all, .. } => all.forward(x),
        }
    }

    /// The parts' output widths.
    pub fn widths(&self) -> Vec<i32> {
        match self {
            Projections::Separate(parts) => parts.iter().map(Linear::out_features).collect(),
            Projections::Joined { ends, .. } => ends
                .iter()
                .scan(0, |start, &end| {
                    let width = end - *start;
                    *start = end;
                    Some(width)
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::QuantSpec;
    use mlx_rs::random;

    fn quantized(rows: i32, bits: i32, seed: u64) -> Linear {
        let key = random::key(seed).unwrap();
        let w = random::normal::<f32>(&[rows, 64], None, None, Some(&key)).unwrap();
        let (weight, scales, biases) = ops::quantize(&w, 32, bits).unwrap();
        Linear::Quantized {
            packed: Packed { weight, scales, biases, spec: QuantSpec { group_size: 32, bits } },
            bias: None,
        }
    }

    #[test]
    fn joined_projections_give_each_part_exactly() {
        let parts = vec![quantized(48, 4, 1), quantized(16, 4, 2), quantized(16, 4, 3)];
        let x = random::normal::<f32>(&[1, 3, 64], None, None, Some(&random::key(9).unwrap())).unwrap();
        let separate: Vec<Array> = parts.iter().map(|p| p.forward(&x).unwrap()).collect();
        let joined = Projections::new(parts).unwrap();
        assert!(matches!(joined, Projections::Joined { .. }));
        assert_eq!(joined.widths(), vec![48, 16, 16]);
        for (a, b) in joined.forward(&x).unwrap().iter().zip(&separate) {
            assert_eq!(a.shape(), b.shape());
            let diff = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>();
            assert_eq!(diff, 0.0);
        }
    }

    #[test]
    fn the_joined_output_is_the_parts_side_by_side() {
        let x = random::normal::<f32>(&[1, 2, 64], None, None, Some(&random::key(5).unwrap())).unwrap();
        for (projections, joined) in [
            (Projections::new(vec![quantized(48, 4, 1), quantized(16, 4, 2)]).unwrap(), true),
            (Projections::new(vec![quantized(16, 8, 1), quantized(32, 4, 2)]).unwrap(), false),
        ] {
            assert_eq!(matches!(projections, Projections::Joined { .. }), joined);
            let parts = projections.forward(&x).unwrap();
            let expected = ops::concatenate(&parts, -1).unwrap();
            let got = projections.forward_joined(&x).unwrap();
            assert_eq!(got.shape(), [1, 2, projections.widths().iter().sum::<i32>()]);
            let diff = got.subtract(&expected).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>();
            assert_eq!(diff, 0.0);
        }
    }

    #[test]
    fn projections_stored_differently_stay_separate() {
        let mixed = Projections::new(vec![quantized(16, 8, 1), quantized(16, 4, 2)]).unwrap();
        assert!(matches!(mixed, Projections::Separate(_)));
        assert_eq!(mixed.forward(&ops::ones::<f32>(&[1, 64]).unwrap()).unwrap().len(), 2);
    }
}
