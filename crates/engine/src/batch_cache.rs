//! The state of a batch's sequences stacked row by row, so that a decode step runs each layer
//! once for all of them, whatever the batch size: attention keys and values in one buffer per
//! layer, each row left-padded to the longest row (its padding masked out of attention), and
//! Gated DeltaNet states stacked on the batch axis. A sequence's own [`Cache`] moves in when
//! it joins ([`BatchCache::push`]) and is cut back out when it leaves ([`BatchCache::remove`]).
//!
//! Every row writes its next position into the same column, so a step is one `slice_update`
//! per buffer, and rows sit at different positions: RoPE takes each row's own offset (a row
//! after a prompt with images shifted as its own cache was: `KvCache::rope_shift`).

use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::transforms::eval;
use mlx_rs::{ops, Array};

use crate::cache::{Cache, KvCache, LayerCache, LinearState};
use crate::error::{Error, Result};
use crate::ffi;

/// One attention layer's keys and values for every row: [rows, heads, capacity, head_dim],
/// columns `..end` written (row i's from its padding on).
#[derive(Debug, Default)]
pub struct BatchKv {
    keys: Option<Array>,
    values: Option<Array>,
}

/// One layer's state for every row.
#[derive(Debug)]
pub enum BatchLayer {
    Kv(BatchKv),
    /// Conv tails and recurrent states of every row, stacked on axis 0.
    Linear(LinearState),
}

/// What one decode step's attention layers share: where each row's new position goes.
pub struct Step {
    /// The column every row writes its new position into.
    pub column: i32,
    /// Each row's position of the new token (its RoPE offset), [rows] int32.
    pub offsets: Array,
    /// Which of the columns `..=column` each row attends to, [rows, 1, 1, column + 1] bool
    /// (absent while no row has padding).
    pub mask: Option<Array>,
}

/// The stacked state of a batch; rows in the order they were pushed (less those removed).
#[derive(Debug, Default)]
pub struct BatchCache {
    pub(crate) layers: Vec<BatchLayer>,
    /// Each row's left padding: its first column.
    pads: Vec<i32>,
    /// How far each row's rotary positions run from its length (below 0 after images).
    shifts: Vec<i32>,
    /// Columns written so far (the longest row's length).
    end: i32,
}

/// Computes a layer's new buffers now, so the old ones are freed before the next layer's are
/// made: a join or a leave copies the batch's caches, and left lazy every layer's old and new
/// copies would be alive at once.
fn settle(layer: &BatchLayer) -> Result<()> {
    let arrays: Vec<&Array> = match layer {
        BatchLayer::Kv(b) => b.keys.iter().chain(b.values.iter()).collect(),
        BatchLayer::Linear(s) => s.state(),
    };
    Ok(eval(arrays)?)
}

fn concat(parts: &[Array], axis: i32) -> Result<Array> {
    Ok(ops::concatenate(parts, axis)?)
}

/// `a` with `n` zero columns before its first (axis 2).
fn pad_left(a: &Array, n: i32) -> Result<Array> {
    if n == 0 {
        return Ok(a.clone());
    }
    let s = a.shape();
    concat(&[ops::zeros_dtype(&[s[0], s[1], n, s[3]], a.dtype())?, a.clone()], 2)
}

/// Rows `keep` of `a` (axis 0).
fn take_rows(a: &Array, keep: &[i32]) -> Result<Array> {
    Ok(a.take_axis(crate::layers::linear::row_index(keep)?, 0)?)
}

impl BatchCache {
    /// Rows in the batch.
    pub fn rows(&self) -> usize {
        self.pads.len()
    }

    /// Row `row`'s positions so far.
    pub fn row_len(&self, row: usize) -> i32 {
        self.pads.get(row).map_or(0, |pad| self.end - pad)
    }

    /// Positions the buffers hold per row, padding included: what the batch's KV memory
    /// grows with (rows × this).
    pub fn padded_len(&self) -> i32 {
        self.end
    }

    /// Adds a sequence's cache as the last row. The batch is padded to the longer of the
    /// two: the new row on its left, or every other row when the new one is longer.
    pub fn push(&mut self, cache: Cache) -> Result<()> {
        let len = cache.offset();
        let shift =
            cache.layers.iter().find_map(|l| if let LayerCache::Kv(kv) = l { Some(kv.rope_shift) } else { None });
        if self.rows() == 0 {
            self.layers.clear();
            self.end = 0;
        } else if self.layers.len() != cache.layers.len() {
            return Err(Error::Request("a batch was given the cache of another model".into()));
        }
        let grow = (len - self.end).max(0);
        let pad = (self.end - len).max(0);
        let first = self.rows() == 0;
        for (i, layer) in cache.layers.into_iter().enumerate() {
            match (layer, first) {
                (LayerCache::Kv(kv), _) => {
                    let Some((k, v)) = kv.range(0, len)? else {
                        return Err(Error::Request("a sequence joined a batch before its prompt was read".into()));
                    };
                    let (k, v) = (pad_left(&k, pad)?, pad_left(&v, pad)?);
                    if first {
                        self.layers.push(BatchLayer::Kv(BatchKv { keys: Some(k), values: Some(v) }));
                    } else if let Some(BatchLayer::Kv(b)) = self.layers.get_mut(i) {
                        let stack = |buf: &mut Option<Array>, row: Array| -> Result<()> {
                            if let Some(all) = buf.take() {
                                let all = pad_left(&all.index((Ellipsis, ..self.end, ..)), grow)?;
                                *buf = Some(concat(&[all, row], 0)?);
                            }
                            Ok(())
                        };
                        stack(&mut b.keys, k)?;
                        stack(&mut b.values, v)?;
                    }
                }
                (LayerCache::Linear(state), true) => self.layers.push(BatchLayer::Linear(LinearState {
                    conv: state.conv,
                    recurrent: state.recurrent,
                    ..Default::default()
                })),
                (LayerCache::Linear(state), false) => {
                    let Some(BatchLayer::Linear(all)) = self.layers.get_mut(i) else {
                        return Err(Error::Request("a batch was given the cache of another model".into()));
                    };
                    for (buf, row) in [(&mut all.conv, state.conv), (&mut all.recurrent, state.recurrent)] {
                        let (Some(a), Some(r)) = (buf.take(), row) else {
                            return Err(Error::Request("a sequence joined a batch before its prompt was read".into()));
                        };
                        *buf = Some(concat(&[a, r], 0)?);
                    }
                }
            }
            if let Some(layer) = self.layers.get(i) {
                settle(layer)?;
            }
        }
        for p in &mut self.pads {
            *p += grow;
        }
        self.pads.push(pad);
        self.shifts.push(shift.unwrap_or(0));
        self.end = self.end.max(len);
        Ok(())
    }

    /// Takes row `row` out as a sequence's own cache (copies of its positions); the rows after
    /// it move up. Padding every remaining row has is dropped.
    pub fn remove(&mut self, row: usize) -> Result<Cache> {
        if row >= self.rows() {
            return Err(Error::Request(format!("a batch of {} rows has no row {row}", self.rows())));
        }
        let r = row as i32;
        let pad = self.pads.remove(row);
        let shift = self.shifts.remove(row);
        let keep: Vec<i32> = (0..self.rows() as i32 + 1).filter(|&i| i != r).collect();
        let trim = self.pads.iter().copied().min().unwrap_or(0);
        let mut layers = Vec::with_capacity(self.layers.len());
        for layer in &mut self.layers {
            match &mut *layer {
                BatchLayer::Kv(b) => {
                    let (Some(k), Some(v)) = (b.keys.take(), b.values.take()) else {
                        return Err(Error::Request("the batch's KV cache lost its buffers".into()));
                    };
                    let own =
                        |a: &Array| -> Result<Array> { Ok(a.index((r..r + 1, .., pad..self.end, ..)).contiguous()?) };
                    let mut kv = KvCache::restored(own(&k)?, own(&v)?);
                    kv.rope_shift = shift;
                    layers.push(LayerCache::Kv(kv));
                    if !keep.is_empty() {
                        let rest =
                            |a: &Array| -> Result<Array> { take_rows(&a.index((Ellipsis, trim..self.end, ..)), &keep) };
                        b.keys = Some(rest(&k)?);
                        b.values = Some(rest(&v)?);
                    }
                }
                BatchLayer::Linear(all) => {
                    let own = |a: &Option<Array>| -> Result<Option<Array>> {
                        a.as_ref().map(|a| Ok(a.index(r..r + 1).contiguous()?)).transpose()
                    };
                    layers.push(LayerCache::Linear(LinearState {
                        conv: own(&all.conv)?,
                        recurrent: own(&all.recurrent)?,
                        offset: self.end - pad,
                        ..Default::default()
                    }));
                    let rest = |a: &Option<Array>| -> Result<Option<Array>> {
                        a.as_ref().filter(|_| !keep.is_empty()).map(|a| take_rows(a, &keep)).transpose()
                    };
                    all.conv = rest(&all.conv)?;
                    all.recurrent = rest(&all.recurrent)?;
                }
            }
            eval(layers.last().map(LayerCache::state).unwrap_or_default())?;
            settle(layer)?;
        }
        for p in &mut self.pads {
            *p -= trim;
        }
        self.end -= trim;
        if self.pads.is_empty() {
            self.layers.clear();
            self.end = 0;
        }
        Ok(Cache { layers })
    }

    /// Where the next decode step writes, and each row's position there.
    pub fn step(&self) -> Result<Step> {
        let rows = self.rows() as i32;
        let offsets: Vec<i32> = self.pads.iter().zip(&self.shifts).map(|(p, s)| self.end - p + s).collect();
        let mask = if self.pads.iter().any(|&p| p > 0) {
            let pads = Array::from_slice(&self.pads, &[rows, 1, 1, 1]);
            let columns = ops::arange::<_, i32>(0, self.end + 1, None)?;
            Some(columns.ge(&pads)?)
        } else {
            None
        };
        Ok(Step { column: self.end, offsets: Array::from_slice(&offsets, &[rows]), mask })
    }

    /// Marks the step's position written in every row.
    pub fn advance(&mut self) {
        self.end += 1;
    }

    /// Arrays to evaluate so the state is materialised.
    pub fn arrays(&self) -> Vec<&Array> {
        self.layers
            .iter()
            .flat_map(|l| match l {
                BatchLayer::Kv(b) => b.keys.iter().chain(b.values.iter()).collect::<Vec<_>>(),
                BatchLayer::Linear(s) => s.state(),
            })
            .collect()
    }

    /// Bytes the buffers hold.
    pub fn nbytes(&self) -> usize {
        self.arrays().iter().map(|a| a.nbytes()).sum()
    }
}

impl BatchKv {
    /// Writes the step's keys and values ([rows, heads, 1, head_dim]) into its column and
    /// returns every column so far. The buffers grow by [`KvCache::STEP`] columns at a time.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array, column: i32) -> Result<(Array, Array)> {
        let (Some(k), Some(v)) = (self.keys.take(), self.values.take()) else {
            return Err(Error::Request("the batch's KV cache lost its buffers".into()));
        };
        let grow = |a: Array| -> Result<Array> {
            if column < a.dim(2) {
                return Ok(a);
            }
            let (s, dtype) = (a.shape().to_vec(), a.dtype());
            concat(
                &[a.index((Ellipsis, ..column, ..)), ops::zeros_dtype(&[s[0], s[1], KvCache::STEP, s[3]], dtype)?],
                2,
            )
        };
        let write = |buf: Array, new: &Array| -> Result<Array> {
            let s = buf.shape().to_vec();
            Ok(ffi::slice_update(&buf, new, &[0, 0, column, 0], &[s[0], s[1], column + 1, s[3]])?)
        };
        let (k, v) = (write(grow(k)?, keys)?, write(grow(v)?, values)?);
        let upto = |a: &Array| a.index((Ellipsis, ..column + 1, ..));
        let out = (upto(&k), upto(&v));
        self.keys = Some(k);
        self.values = Some(v);
        Ok(out)
    }
}
