//! Tensor parallelism, the way mlx-lm's `shard()` splits a model across the ranks of a
//! distributed group: each rank holds a contiguous part of every layer's heads (attention and
//! Gated DeltaNet) and of every feed-forward's hidden width (dense and each expert's), so the
//! projections into those parts are split by their output rows and the projections out of
//! them by their input columns; the partial outputs of the latter are summed across the
//! ranks ([`AllSum`]) before the residual. Embeddings, norms, routers and the output head stay
//! whole on every rank.

use std::sync::Arc;

use mlx_rs::Array;

use super::packed::Packed;
use crate::distributed::Group;
use crate::error::{Error, Result};

/// The part of the model this process holds: its rank's share of a group.
#[derive(Clone)]
pub struct Shard {
    group: Arc<Group>,
}

impl Shard {
    pub fn new(group: Arc<Group>) -> Shard {
        Shard { group }
    }

    pub fn rank(&self) -> i32 {
        self.group.rank() as i32
    }

    pub fn size(&self) -> i32 {
        self.group.size() as i32
    }

    pub fn group(&self) -> Arc<Group> {
        self.group.clone()
    }

    /// This rank's contiguous part of `n` units (`what`: heads, channels, ...), as (start,
    /// count); `n` must divide evenly.
    pub fn part(&self, n: i32, what: &str) -> std::result::Result<(i32, i32), String> {
        let size = self.size();
        if n % size != 0 {
            return Err(format!("its {n} {what} cannot be split evenly across {size} ranks"));
        }
        let count = n / size;
        Ok((self.rank() * count, count))
    }
}

/// How one weight is split: some of its output rows (any order), or a contiguous range of its
/// input columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Split {
    Rows(Vec<i32>),
    Columns { start: i32, count: i32 },
}

impl Split {
    /// Rows `first * width .. (first + count) * width` shifted by `offset`: `count` units of
    /// `width` rows each.
    pub fn unit_rows(offset: i32, first: i32, count: i32, width: i32) -> Vec<i32> {
        (offset + first * width..offset + (first + count) * width).collect()
    }

    /// This split of a dense matrix [.., out, in] (a copy: the whole matrix can go).
    pub fn dense(&self, weight: &Array) -> Result<Array> {
        match self {
            Split::Rows(rows) => take(weight, rows, -2),
            Split::Columns { start, count } => take(weight, &(*start..start + count).collect::<Vec<_>>(), -1),
        }
    }

    /// This split of a quantized matrix: rows move with their scales; columns must start and
    /// end on a quantization group.
    pub fn packed(&self, p: &Packed) -> std::result::Result<Packed, String> {
        let (weight, scales) = match self {
            Split::Rows(rows) => (Split::Rows(rows.clone()), Split::Rows(rows.clone())),
            Split::Columns { start, count } => {
                let (gs, bits) = (p.spec.group_size, p.spec.bits);
                if start % gs != 0 || count % gs != 0 || (start * bits) % 32 != 0 || (count * bits) % 32 != 0 {
                    return Err(format!(
                        "its input columns {start}..{} do not fall on its quantization groups of {gs}",
                        start + count
                    ));
                }
                (
                    Split::Columns { start: start * bits / 32, count: count * bits / 32 },
                    Split::Columns { start: start / gs, count: count / gs },
                )
            }
        };
        let part = || -> Result<Packed> {
            Ok(Packed {
                weight: weight.dense(&p.weight)?,
                scales: scales.dense(&p.scales)?,
                biases: scales.dense(&p.biases)?,
                spec: p.spec,
            })
        };
        part().map_err(|e| e.to_string())
    }

    /// This split of a bias [out]: its rows, or (columns) the whole bias on rank 0 only, since
    /// the ranks' partial outputs are summed.
    pub fn bias(&self, bias: Array, rank: i32) -> Result<Option<Array>> {
        match self {
            Split::Rows(rows) => Ok(Some(take(&bias, rows, 0)?)),
            Split::Columns { .. } => Ok((rank == 0).then_some(bias)),
        }
    }
}

/// `indices` of `a` along `axis`, evaluated now: a gather copies, so the source is not kept
/// alive by a view, and the source (a whole tensor read from the file) is freed at once.
pub fn take(a: &Array, indices: &[i32], axis: i32) -> Result<Array> {
    let part = a.take_axis(super::linear::row_index(indices)?, axis)?;
    part.eval()?;
    Ok(part)
}

/// The sum across the group of a row-split projection's partial outputs (nothing without a
/// group).
#[derive(Clone, Default)]
pub struct AllSum(Option<Arc<Group>>);

impl AllSum {
    pub fn new(group: Option<Arc<Group>>) -> AllSum {
        AllSum(group)
    }

    pub fn is_split(&self) -> bool {
        self.0.is_some()
    }

    pub fn apply(&self, x: Array) -> Result<Array> {
        match &self.0 {
            Some(group) => group.all_sum(&x),
            None => Ok(x),
        }
    }
}

impl std::fmt::Debug for AllSum {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(group) => write!(f, "AllSum(rank {} of {})", group.rank(), group.size()),
            None => write!(f, "AllSum(none)"),
        }
    }
}

/// A split the loader could not make, as a load error naming the checkpoint.
pub fn split_error(path: &std::path::Path, what: &str, message: String) -> Error {
    Error::malformed(path, format!("cannot split `{what}` for tensor parallelism: {message}"))
}

#[cfg(test)]
mod tests {
    use mlx_rs::ops::indexing::IndexOp;
    use mlx_rs::{ops, Array};

    use super::*;
    use crate::config::QuantSpec;

    fn matrix(rows: i32, cols: i32) -> Array {
        let values: Vec<f32> = (0..rows * cols).map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0).collect();
        Array::from_slice(&values, &[rows, cols])
    }

    fn packed(w: &Array, group_size: i32, bits: i32) -> Packed {
        let (weight, scales, biases) = ops::quantize(w, group_size, bits).unwrap();
        Packed { weight, scales, biases, spec: QuantSpec { group_size, bits } }
    }

    fn values(a: &Array) -> Vec<f32> {
        let flat = a.reshape(&[-1]).unwrap();
        flat.eval().unwrap();
        flat.as_slice::<f32>().to_vec()
    }

    fn dequantized(p: &Packed) -> Array {
        ops::dequantize(&p.weight, &p.scales, &p.biases, p.spec.group_size, p.spec.bits).unwrap()
    }

    #[test]
    fn unit_rows_are_a_rank_s_units_of_rows() {
        assert_eq!(Split::unit_rows(0, 1, 2, 3), vec![3, 4, 5, 6, 7, 8]);
        assert_eq!(Split::unit_rows(100, 0, 1, 2), vec![100, 101]);
    }

    /// Each rank's part of a quantized matrix holds exactly those entries of the whole one:
    /// rows with their scales, columns on whole quantization groups.
    #[test]
    fn a_quantized_matrix_splits_into_the_parts_of_its_entries() {
        let w = matrix(8, 128);
        let p = packed(&w, 32, 4);
        let whole = dequantized(&p);
        let rows = Split::Rows(vec![2, 3, 6]).packed(&p).unwrap();
        let expected = whole.take_axis(Array::from_slice(&[2, 3, 6], &[3]), 0).unwrap();
        assert_eq!(values(&dequantized(&rows)), values(&expected));
        let columns = Split::Columns { start: 64, count: 64 }.packed(&p).unwrap();
        assert_eq!(values(&dequantized(&columns)), values(&whole.index((.., 64..128))));
        let dense = Split::Columns { start: 32, count: 32 }.dense(&w).unwrap();
        assert_eq!(values(&dense), values(&w.index((.., 32..64))));
    }

    #[test]
    fn columns_off_the_quantization_groups_are_refused_by_range() {
        let p = packed(&matrix(4, 128), 64, 4);
        let err = Split::Columns { start: 32, count: 64 }.packed(&p).unwrap_err();
        assert!(err.contains("32..96") && err.contains("groups of 64"), "{err}");
    }

    #[test]
    fn a_row_split_bias_follows_its_rows_and_a_column_split_one_stays_on_rank_0() {
        let bias = Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4]);
        let rows = Split::Rows(vec![1, 3]).bias(bias.clone(), 1).unwrap().unwrap();
        assert_eq!(values(&rows), [2.0, 4.0]);
        let columns = Split::Columns { start: 0, count: 2 };
        assert_eq!(columns.bias(bias.clone(), 0).unwrap().map(|b| values(&b)), Some(values(&bias)));
        assert!(columns.bias(bias, 1).unwrap().is_none());
    }
}
