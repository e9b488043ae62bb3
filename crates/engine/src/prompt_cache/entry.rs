//! What the prompt cache keeps for one prompt, in memory and as the disk tier reads it back:
//! keys and values in shared pieces, the hybrids' checkpoints, and the state a hit restores.

use std::rc::Rc;

use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::Array;

use crate::cache::{Cache, KvCache, LayerCache, LinearState};
use crate::speculation::DraftWith;

/// Positions per piece of an entry's keys and values (pieces start at multiples of it).
pub const PIECE: usize = 1024;

/// The linear-attention state of every layer (None for attention layers) at one position, and
/// the trunk's hidden state there (what the MTP head drafts from). Clones share the state.
#[derive(Clone)]
pub struct Checkpoint {
    pub position: usize,
    pub(super) state: Rc<CheckpointState>,
}

pub(super) struct CheckpointState {
    pub(super) linear: Vec<Option<(Array, Array)>>,
    pub(super) last_hidden: Option<Array>,
}

impl Checkpoint {
    pub(super) fn new(position: usize, linear: Vec<Option<(Array, Array)>>, last_hidden: Option<Array>) -> Self {
        Checkpoint { position, state: Rc::new(CheckpointState { linear, last_hidden }) }
    }

    pub(super) fn linear(&self) -> &[Option<(Array, Array)>] {
        &self.state.linear
    }

    pub(super) fn last_hidden(&self) -> Option<&Array> {
        self.state.last_hidden.as_ref()
    }

    /// The state of `cache` (its linear-attention layers) at its current position.
    pub fn of(cache: &Cache, last_hidden: Option<&Array>) -> Self {
        let linear = cache
            .layers
            .iter()
            .map(|l| match l {
                LayerCache::Linear(s) => s.conv.clone().zip(s.recurrent.clone()),
                LayerCache::Kv(_) => None,
            })
            .collect();
        Checkpoint::new(cache.offset() as usize, linear, last_hidden.cloned())
    }

    pub(super) fn nbytes(&self) -> usize {
        let pair = |p: &Option<(Array, Array)>| p.as_ref().map_or(0, |(a, b)| a.nbytes() + b.nbytes());
        self.linear().iter().map(pair).sum::<usize>() + self.last_hidden().map_or(0, Array::nbytes)
    }
}

/// Keys and values of positions `start..end`: every attention layer's (None for linear
/// attention) and, when the entry kept it, the MTP head's, which has seen one position fewer
/// than the trunk (an entry's last piece holds one position fewer of it).
pub(super) struct Piece {
    pub(super) start: usize,
    pub(super) end: usize,
    pub(super) kv: Vec<Option<(Array, Array)>>,
    pub(super) mtp_kv: Option<Vec<Option<(Array, Array)>>>,
    pub(super) bytes: usize,
}

impl Piece {
    pub(super) fn new(
        start: usize,
        end: usize,
        kv: Vec<Option<(Array, Array)>>,
        mtp_kv: Option<Vec<Option<(Array, Array)>>>,
    ) -> Self {
        let pairs = |kv: &[Option<(Array, Array)>]| -> usize {
            kv.iter().flatten().map(|(k, v)| k.nbytes() + v.nbytes()).sum()
        };
        let bytes = pairs(&kv) + mtp_kv.as_deref().map_or(0, pairs);
        Piece { start, end, kv, mtp_kv, bytes }
    }
}

/// Positions `from..to` of [B, heads, L, head_dim] keys and values.
pub(super) fn positions((k, v): &(Array, Array), from: usize, to: usize) -> (Array, Array) {
    let (from, to) = (from as i32, to as i32);
    (k.index((Ellipsis, from..to, ..)), v.index((Ellipsis, from..to, ..)))
}

/// The pieces' layer `layer` joined over positions `from..to` (`mtp`: the head's layers).
pub(super) fn joined(pieces: &[Rc<Piece>], layer: usize, from: usize, to: usize, mtp: bool) -> Option<(Array, Array)> {
    let mut keys = Vec::new();
    let mut values = Vec::new();
    for p in pieces.iter().filter(|p| p.start < to && p.end > from) {
        let kv = if mtp { p.mtp_kv.as_ref()?.get(layer)? } else { p.kv.get(layer)? };
        let kv = kv.as_ref()?;
        let end = (p.start + kv.0.dim(2) as usize).min(to);
        let (k, v) = positions(kv, from.max(p.start) - p.start, end.max(from) - p.start);
        keys.push(k);
        values.push(v);
    }
    match keys.len() {
        0 => None,
        1 => Some((keys.pop()?, values.pop()?)),
        _ => Some((mlx_rs::ops::concatenate(&keys, 2).ok()?, mlx_rs::ops::concatenate(&values, 2).ok()?)),
    }
}

/// Keys and values per layer (`None`: a layer that keeps none, linear attention).
pub(super) type LayerPairs = Vec<Option<(Array, Array)>>;

/// What a request restores: the state after `len` prompt tokens.
pub struct Hit {
    pub len: usize,
    pub(super) layers: Vec<LayerCache>,
    pub(super) mtp: Option<(Vec<LayerCache>, Option<Array>)>,
    /// The checkpoints at or before `len`, for the entry the request will store.
    pub checkpoints: Vec<Checkpoint>,
}

impl Hit {
    /// Puts the trunk's state into `cache`; returns the drafter's (its cache's layers and the
    /// trunk's features it reads at the last position), when the entry kept the state of the
    /// drafter the request drafts with.
    pub fn restore(self, cache: &mut Cache) -> Option<(Vec<LayerCache>, Option<Array>)> {
        cache.layers = self.layers;
        self.mtp
    }
}

pub(super) struct Entry {
    /// The tokens whose state this is.
    pub(super) tokens: Vec<u32>,
    /// Keys and values of every position, in pieces (some shared with other entries).
    pub(super) pieces: Vec<Rc<Piece>>,
    /// Whether every layer is attention (any prefix can be restored).
    pub(super) attention_only: bool,
    /// The trunk's layers, and whose keys and values `Piece::mtp_kv` keeps: the MTP head's or
    /// a block drafter's (they differ in layers and shapes, and a drafter's last hidden state in
    /// the checkpoints is what that drafter reads), or none.
    pub(super) layers: usize,
    pub(super) drafter: Option<DraftWith>,
    /// Hybrids: the linear-attention state at chunk boundaries and at the end, by position.
    pub(super) checkpoints: Vec<Checkpoint>,
    pub(super) last_used: u64,
}

impl Entry {
    /// An entry from whole keys and values (a loaded block's): cut into pieces that are views
    /// of them.
    pub(super) fn new(
        tokens: Vec<u32>,
        kv: Vec<Option<(Array, Array)>>,
        drafter: Option<(DraftWith, LayerPairs)>,
        checkpoints: Vec<Checkpoint>,
        last_used: u64,
    ) -> Self {
        let (drafter, mtp_kv) = drafter.unzip();
        let len = tokens.len();
        let cut = |kv: &[Option<(Array, Array)>], from: usize, to: usize| -> Vec<Option<(Array, Array)>> {
            kv.iter().map(|p| p.as_ref().map(|p| positions(p, from, to))).collect()
        };
        let pieces = piece_bounds(0, len)
            .map(|(start, end)| {
                let last = len.saturating_sub(1);
                let mtp = mtp_kv.as_deref().map(|m| cut(m, start.min(last), end.min(last)));
                Rc::new(Piece::new(start, end, cut(&kv, start, end), mtp))
            })
            .collect();
        Entry {
            tokens,
            pieces,
            attention_only: kv.iter().all(Option::is_some),
            layers: kv.len(),
            drafter,
            checkpoints,
            last_used,
        }
    }

    /// Bytes this entry holds, shared or not.
    pub(super) fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.bytes).sum::<usize>()
            + self.checkpoints.iter().map(Checkpoint::nbytes).sum::<usize>()
            + self.tokens.len() * 4
    }

    /// The MTP head's layers, when the entry kept its keys and values.
    pub(super) fn mtp_layers(&self) -> Option<usize> {
        self.pieces.first().and_then(|p| p.mtp_kv.as_ref()).map(Vec::len)
    }

    /// Every attention layer's keys and values over positions `from..to` (None for linear
    /// attention), or the MTP head's (`mtp`).
    pub(super) fn kv_range(&self, from: usize, to: usize, mtp: bool) -> Vec<Option<(Array, Array)>> {
        let layers = if mtp { self.mtp_layers().unwrap_or(0) } else { self.layers };
        (0..layers).map(|i| joined(&self.pieces, i, from, to, mtp)).collect()
    }

    /// The state after this entry's first `len` tokens (`usable` said they can be restored).
    pub(super) fn hit(&self, len: usize, drafter: Option<DraftWith>) -> Option<Hit> {
        let checkpoint = self.checkpoints.iter().find(|c| c.position == len);
        let kv = self.kv_range(0, len, false);
        let mut layers = Vec::with_capacity(kv.len());
        for (i, kv) in kv.into_iter().enumerate() {
            layers.push(match (kv, checkpoint.and_then(|c| c.linear()[i].clone())) {
                (Some((k, v)), _) => LayerCache::Kv(KvCache::restored(k, v)),
                (None, Some((conv, recurrent))) => LayerCache::Linear(LinearState {
                    conv: Some(conv),
                    recurrent: Some(recurrent),
                    offset: len as i32,
                    ..Default::default()
                }),
                (None, None) => return None,
            });
        }
        let mtp = match drafter.is_some() && self.drafter == drafter {
            true => {
                let layers = self
                    .kv_range(0, len - 1, true)
                    .into_iter()
                    .map(|kv| match kv {
                        Some((k, v)) => LayerCache::Kv(KvCache::restored(k, v)),
                        None => LayerCache::Kv(KvCache::default()),
                    })
                    .collect();
                Some((layers, checkpoint.and_then(|c| c.last_hidden().cloned())))
            }
            false => None,
        };
        let checkpoints = self.checkpoints.iter().filter(|c| c.position <= len).cloned().collect();
        Some(Hit { len, layers, mtp, checkpoints })
    }

    /// The longest prefix of `prompt` (at most `limit` tokens) this entry can restore.
    pub(super) fn usable(&self, prompt: &[u32], limit: usize) -> usize {
        let common = self.tokens.iter().zip(prompt).take(limit).take_while(|(a, b)| a == b).count();
        if self.attention_only {
            return common; // attention only: any prefix
        }
        self.checkpoints.iter().map(|c| c.position).filter(|&p| p <= common).max().unwrap_or(0)
    }

    /// The whole pieces of this entry a new entry starting with `tokens` can hold as they are:
    /// those inside the common start, before this entry's end (whose MTP part is complete).
    pub(super) fn shareable(&self, tokens: &[u32], drafter: Option<DraftWith>) -> Vec<Rc<Piece>> {
        if drafter.is_some() && self.drafter != drafter {
            return Vec::new();
        }
        let common = self.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        self.pieces.iter().take_while(|p| p.end <= common && p.end < self.tokens.len()).cloned().collect()
    }
}

/// The pieces' bounds over positions `from..to` (`from` a multiple of [`PIECE`]).
pub(super) fn piece_bounds(from: usize, to: usize) -> impl Iterator<Item = (usize, usize)> {
    (from..to).step_by(PIECE).map(move |start| (start, (start + PIECE).min(to)))
}
