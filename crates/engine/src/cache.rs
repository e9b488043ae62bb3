//! Per-layer generation state. Full-attention layers keep keys and values in a buffer that
//! grows in steps of [`KvCache::STEP`] positions, so decoding does not reallocate per token.

use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::{ops, Array};

use crate::error::Result;
use crate::ffi;

#[derive(Debug, Default)]
pub struct KvCache {
    keys: Option<Array>,
    values: Option<Array>,
    /// Number of positions written so far.
    pub offset: i32,
    /// How far the rotary positions of the next tokens run from `offset`: 0, or below 0
    /// after a prompt with images ([`crate::vision::RopePositions::delta`]).
    pub rope_shift: i32,
    /// The rotary angles [L, rotary dims / 2] of the next pass's L tokens when they are not
    /// consecutive positions (a prompt part holding an image's grid); taken by that pass.
    pub angles: Option<Array>,
}

impl KvCache {
    pub const STEP: i32 = 256;

    /// Appends `keys`/`values` ([B, heads, L, head_dim]) and returns all positions so far.
    pub fn update_and_fetch(&mut self, keys: &Array, values: &Array) -> Result<(Array, Array)> {
        let prev = self.offset;
        let new_len = keys.dim(2);
        let capacity = self.keys.as_ref().map_or(0, |k| k.dim(2));
        if self.keys.is_none() || prev + new_len > capacity {
            let steps = (Self::STEP + new_len - 1) / Self::STEP;
            let grow = |like: &Array| -> Result<Array> {
                let s = like.shape();
                Ok(ops::zeros_dtype(&[s[0], s[1], steps * Self::STEP, s[3]], like.dtype())?)
            };
            let (new_k, new_v) = (grow(keys)?, grow(values)?);
            match (self.keys.take(), self.values.take()) {
                (Some(mut k), Some(mut v)) => {
                    if prev % Self::STEP != 0 {
                        k = k.index((Ellipsis, ..prev, ..));
                        v = v.index((Ellipsis, ..prev, ..));
                    }
                    self.keys = Some(ops::concatenate(&[k, new_k], 2)?);
                    self.values = Some(ops::concatenate(&[v, new_v], 2)?);
                }
                _ => {
                    self.keys = Some(new_k);
                    self.values = Some(new_v);
                }
            }
        }
        self.offset += new_len;
        let write = |buf: &mut Option<Array>, new: &Array| -> Result<()> {
            if let Some(b) = buf.take() {
                let s = b.shape().to_vec();
                *buf = Some(ffi::slice_update(&b, new, &[0, 0, prev, 0], &[s[0], s[1], self.offset, s[3]])?);
            }
            Ok(())
        };
        write(&mut self.keys, keys)?;
        write(&mut self.values, values)?;
        let (Some(k), Some(v)) = (self.keys.as_ref(), self.values.as_ref()) else {
            return Err(crate::error::Error::Request("the KV cache lost its buffers".into()));
        };
        if self.offset < k.dim(2) {
            Ok((k.index((Ellipsis, ..self.offset, ..)), v.index((Ellipsis, ..self.offset, ..))))
        } else {
            Ok((k.clone(), v.clone()))
        }
    }

    /// Forgets the last `n` positions (their slots are overwritten by the next update).
    pub fn trim(&mut self, n: i32) {
        self.offset -= n.min(self.offset);
    }

    /// Bytes held by the buffers (capacity, not just the used part).
    pub fn nbytes(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.nbytes()) + self.values.as_ref().map_or(0, |v| v.nbytes())
    }

    /// Copies of the keys and values of positions `from..to` (their own buffers, so the
    /// cache's in-place updates never touch them), lazy.
    pub fn range(&self, from: i32, to: i32) -> Result<Option<(Array, Array)>> {
        let (Some(k), Some(v)) = (&self.keys, &self.values) else { return Ok(None) };
        let to = to.min(self.offset);
        let copy = |a: &Array| -> Result<Array> { Ok(a.index((Ellipsis, from..to, ..)).contiguous()?) };
        Ok(Some((copy(k)?, copy(v)?)))
    }

    /// A cache holding `keys` and `values` ([B, heads, L, head_dim]) for positions `..L`.
    pub fn restored(keys: Array, values: Array) -> Self {
        let offset = keys.dim(2);
        KvCache { keys: Some(keys), values: Some(values), offset, ..Default::default() }
    }

    pub fn state(&self) -> Vec<&Array> {
        self.keys.iter().chain(self.values.iter()).collect()
    }
}

/// The state of a Gated DeltaNet layer: the last `kernel - 1` inputs of its causal
/// convolution, [B, kernel - 1, channels], and the recurrent state, [B, Hv, Dv, Dk] in f32.
#[derive(Debug, Default)]
pub struct LinearState {
    pub conv: Option<Array>,
    pub recurrent: Option<Array>,
    pub offset: i32,
    /// While set, each forward keeps what [`LinearState::rollback`] needs.
    pub record: bool,
    /// The recurrent state after each position of the last forward (when recording).
    pub steps: Vec<Array>,
    /// The last forward's conv input: the cached tail followed by its new positions.
    pub conv_window: Option<Array>,
}

impl LinearState {
    /// Returns to the state after the first `L - n` positions of the last (recorded) forward
    /// of `L` positions: recurrent state and conv tail exactly as they were then.
    pub fn rollback(&mut self, n: i32) -> Result<()> {
        let Some(window) = self.recorded_window(n)?.cloned() else {
            return Ok(());
        };
        let len = self.steps.len() as i32;
        let keep = len - n;
        let tail = window.dim(1) - len; // kernel - 1
        self.conv = Some(window.index((.., keep..keep + tail, ..)).contiguous()?);
        self.recurrent = Some(self.steps[(keep - 1) as usize].clone());
        self.offset -= n;
        self.steps.truncate(keep as usize);
        // What is left can be rolled back further (an answer that ended inside the cycle).
        self.conv_window = Some(window.index((.., ..tail + keep, ..)));
        Ok(())
    }

    /// Whether [`LinearState::rollback`] of `n` positions can be done: the last forward was
    /// recorded and had more than `n` positions (the state before its first is not kept).
    pub fn check_rollback(&self, n: i32) -> Result<()> {
        self.recorded_window(n).map(|_| ())
    }

    /// The last forward's conv window when `n` of its recorded positions can be rolled back;
    /// `None` for `n` = 0 (nothing to do).
    fn recorded_window(&self, n: i32) -> Result<Option<&Array>> {
        let len = self.steps.len() as i32;
        if n == 0 {
            return Ok(None);
        }
        let Some(window) = self.conv_window.as_ref().filter(|_| len > 0) else {
            return Err(crate::error::Error::Request(
                "rollback of a linear-attention state that was not recorded".into(),
            ));
        };
        if !(0..len).contains(&n) {
            return Err(crate::error::Error::Request(format!(
                "cannot roll back {n} of {len} recorded positions (the state before the first is not kept)"
            )));
        }
        Ok(Some(window))
    }

    pub fn nbytes(&self) -> usize {
        self.conv.as_ref().map_or(0, |c| c.nbytes()) + self.recurrent.as_ref().map_or(0, |r| r.nbytes())
    }

    pub fn state(&self) -> Vec<&Array> {
        self.conv.iter().chain(self.recurrent.iter()).collect()
    }
}

/// The state of one layer.
#[derive(Debug)]
pub enum LayerCache {
    Kv(KvCache),
    Linear(LinearState),
}

impl LayerCache {
    fn offset(&self) -> i32 {
        match self {
            LayerCache::Kv(kv) => kv.offset,
            LayerCache::Linear(l) => l.offset,
        }
    }

    fn nbytes(&self) -> usize {
        match self {
            LayerCache::Kv(kv) => kv.nbytes(),
            LayerCache::Linear(l) => l.nbytes(),
        }
    }

    pub fn state(&self) -> Vec<&Array> {
        match self {
            LayerCache::Kv(kv) => kv.state(),
            LayerCache::Linear(l) => l.state(),
        }
    }
}

/// The state of a whole model for one sequence.
#[derive(Debug, Default)]
pub struct Cache {
    pub layers: Vec<LayerCache>,
}

impl Cache {
    pub fn kv(n_layers: usize) -> Self {
        Cache { layers: (0..n_layers).map(|_| LayerCache::Kv(KvCache::default())).collect() }
    }

    /// Positions processed so far.
    pub fn offset(&self) -> i32 {
        self.layers.first().map_or(0, LayerCache::offset)
    }

    pub fn nbytes(&self) -> usize {
        self.layers.iter().map(LayerCache::nbytes).sum()
    }

    /// Forgets the last `n` positions of every layer (attention: trimmed; linear attention:
    /// restored from the states recorded during the last forward).
    pub fn rollback(&mut self, n: i32) -> Result<()> {
        // Checked first, so a refused rollback leaves every layer as it was.
        for layer in &self.layers {
            if let LayerCache::Linear(l) = layer {
                l.check_rollback(n)?;
            }
        }
        for layer in &mut self.layers {
            match layer {
                LayerCache::Kv(kv) => kv.trim(n),
                LayerCache::Linear(l) => l.rollback(n)?,
            }
        }
        Ok(())
    }

    /// Gives the next pass's tokens these rotary angles ([`crate::vision::angles`]) in every
    /// attention layer, and the tokens after them positions shifted by `shift` from their
    /// index: a prompt part with images ([`crate::vision::RopePositions`]).
    pub fn place_next(&mut self, angles: &Array, shift: i32) {
        for layer in &mut self.layers {
            if let LayerCache::Kv(kv) = layer {
                kv.angles = Some(angles.clone());
                kv.rope_shift = shift;
            }
        }
    }

    /// Continues every attention layer's rotary positions `shift` from their index (a cache
    /// restored after a prefix with images: [`crate::vision::ImagePrefill::shift_at`]).
    pub fn set_rope_shift(&mut self, shift: i32) {
        for layer in &mut self.layers {
            if let LayerCache::Kv(kv) = layer {
                kv.rope_shift = shift;
            }
        }
    }

    /// Makes linear-attention layers keep per-position states (for a verify pass).
    pub fn set_record(&mut self, record: bool) {
        for layer in &mut self.layers {
            if let LayerCache::Linear(l) = layer {
                l.record = record;
                l.steps.clear();
                l.conv_window = None;
            }
        }
    }

    /// Arrays to evaluate so the cache is materialised between prefill chunks.
    pub fn arrays(&self) -> Vec<&Array> {
        self.layers.iter().flat_map(LayerCache::state).collect()
    }
}
