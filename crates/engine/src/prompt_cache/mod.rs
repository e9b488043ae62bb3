//! The prompt cache: the model state after a prompt, kept so the next request that starts with
//! the same tokens (an agent's next turn resends the whole conversation) prefills only what is
//! new.
//!
//! An entry holds the state after a prompt's tokens (all but the last, which the request
//! always runs to get its first token's logits). Attention layers keep keys and values: any
//! prefix of them is the state after that prefix, so a KV-only model reuses the longest common
//! prefix. Gated DeltaNet layers keep one recurrent state that cannot be rewound, so hybrids
//! also keep checkpoints: their linear-attention state (and the MTP head's last hidden state)
//! at every prefill chunk boundary, at positions that are multiples of the chunk, so a prompt
//! that diverges anywhere reuses all but less than a chunk. The MTP head's own KV is kept like
//! the trunk's. Keys and values are kept in pieces of [`PIECE`] positions: entries that start
//! alike (a prompt and its answer, the turns of one conversation) hold their common whole
//! pieces once, as they hold their common checkpoints once. Entries are evicted least recently
//! used first when what they hold together outgrows the byte budget (a piece another entry
//! still holds stays); an entry that extends another replaces it.
//! With a disk tier ([`disk`]), each request's entry is also written to disk once it has
//! answered, and a prefix longer than memory holds is read back from there.

use std::collections::HashSet;
use std::rc::Rc;

use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::{transforms::eval, Array};
use serde::Serialize;

use crate::cache::{Cache, KvCache, LayerCache, LinearState};
use crate::error::Result;

pub mod disk;
pub use disk::{DiskSettings, DiskStats, DiskTier};

/// Positions per piece of an entry's keys and values (pieces start at multiples of it).
pub const PIECE: usize = 1024;

/// The linear-attention state of every layer (None for attention layers) at one position, and
/// the trunk's hidden state there (what the MTP head drafts from). Clones share the state.
#[derive(Clone)]
pub struct Checkpoint {
    pub position: usize,
    state: Rc<CheckpointState>,
}

struct CheckpointState {
    linear: Vec<Option<(Array, Array)>>,
    last_hidden: Option<Array>,
}

impl Checkpoint {
    fn new(position: usize, linear: Vec<Option<(Array, Array)>>, last_hidden: Option<Array>) -> Self {
        Checkpoint { position, state: Rc::new(CheckpointState { linear, last_hidden }) }
    }

    fn linear(&self) -> &[Option<(Array, Array)>] {
        &self.state.linear
    }

    fn last_hidden(&self) -> Option<&Array> {
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

    fn nbytes(&self) -> usize {
        let pair = |p: &Option<(Array, Array)>| p.as_ref().map_or(0, |(a, b)| a.nbytes() + b.nbytes());
        self.linear().iter().map(pair).sum::<usize>() + self.last_hidden().map_or(0, Array::nbytes)
    }
}

/// Keys and values of positions `start..end`: every attention layer's (None for linear
/// attention) and, when the entry kept it, the MTP head's, which has seen one position fewer
/// than the trunk (an entry's last piece holds one position fewer of it).
struct Piece {
    start: usize,
    end: usize,
    kv: Vec<Option<(Array, Array)>>,
    mtp_kv: Option<Vec<Option<(Array, Array)>>>,
    bytes: usize,
}

impl Piece {
    fn new(
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
fn positions((k, v): &(Array, Array), from: usize, to: usize) -> (Array, Array) {
    let (from, to) = (from as i32, to as i32);
    (k.index((Ellipsis, from..to, ..)), v.index((Ellipsis, from..to, ..)))
}

/// The pieces' layer `layer` joined over positions `from..to` (`mtp`: the head's layers).
fn joined(pieces: &[Rc<Piece>], layer: usize, from: usize, to: usize, mtp: bool) -> Option<(Array, Array)> {
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

/// What a request restores: the state after `len` prompt tokens.
pub struct Hit {
    pub len: usize,
    layers: Vec<LayerCache>,
    mtp: Option<(Vec<LayerCache>, Option<Array>)>,
    /// The checkpoints at or before `len`, for the entry the request will store.
    pub checkpoints: Vec<Checkpoint>,
}

impl Hit {
    /// Puts the trunk's state into `cache`; returns the MTP head's (its cache's layers and the
    /// trunk's hidden state at the last position), when the entry had one.
    pub fn restore(self, cache: &mut Cache) -> Option<(Vec<LayerCache>, Option<Array>)> {
        cache.layers = self.layers;
        self.mtp
    }
}

struct Entry {
    /// The tokens whose state this is.
    tokens: Vec<u32>,
    /// Keys and values of every position, in pieces (some shared with other entries).
    pieces: Vec<Rc<Piece>>,
    /// Whether every layer is attention (any prefix can be restored).
    attention_only: bool,
    /// The trunk's layers, and whether the MTP head's keys and values were kept.
    layers: usize,
    with_mtp: bool,
    /// Hybrids: the linear-attention state at chunk boundaries and at the end, by position.
    checkpoints: Vec<Checkpoint>,
    last_used: u64,
}

impl Entry {
    /// An entry from whole keys and values (a loaded block's): cut into pieces that are views
    /// of them.
    fn new(
        tokens: Vec<u32>,
        kv: Vec<Option<(Array, Array)>>,
        mtp_kv: Option<Vec<Option<(Array, Array)>>>,
        checkpoints: Vec<Checkpoint>,
        last_used: u64,
    ) -> Self {
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
            with_mtp: mtp_kv.is_some(),
            checkpoints,
            last_used,
        }
    }

    /// Bytes this entry holds, shared or not.
    fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.bytes).sum::<usize>()
            + self.checkpoints.iter().map(Checkpoint::nbytes).sum::<usize>()
            + self.tokens.len() * 4
    }

    /// The MTP head's layers, when the entry kept its keys and values.
    fn mtp_layers(&self) -> Option<usize> {
        self.pieces.first().and_then(|p| p.mtp_kv.as_ref()).map(Vec::len)
    }

    /// Every attention layer's keys and values over positions `from..to` (None for linear
    /// attention), or the MTP head's (`mtp`).
    fn kv_range(&self, from: usize, to: usize, mtp: bool) -> Vec<Option<(Array, Array)>> {
        let layers = if mtp { self.mtp_layers().unwrap_or(0) } else { self.layers };
        (0..layers).map(|i| joined(&self.pieces, i, from, to, mtp)).collect()
    }

    /// The state after this entry's first `len` tokens (`usable` said they can be restored).
    fn hit(&self, len: usize, with_mtp: bool) -> Option<Hit> {
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
        let mtp = match self.with_mtp && with_mtp {
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
    fn usable(&self, prompt: &[u32], limit: usize) -> usize {
        let common = self.tokens.iter().zip(prompt).take(limit).take_while(|(a, b)| a == b).count();
        if self.attention_only {
            return common; // attention only: any prefix
        }
        self.checkpoints.iter().map(|c| c.position).filter(|&p| p <= common).max().unwrap_or(0)
    }

    /// The whole pieces of this entry a new entry starting with `tokens` can hold as they are:
    /// those inside the common start, before this entry's end (whose MTP part is complete).
    fn shareable(&self, tokens: &[u32], with_mtp: bool) -> Vec<Rc<Piece>> {
        if with_mtp && !self.with_mtp {
            return Vec::new();
        }
        let common = self.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        self.pieces.iter().take_while(|p| p.end <= common && p.end < self.tokens.len()).cloned().collect()
    }
}

/// The pieces' bounds over positions `from..to` (`from` a multiple of [`PIECE`]).
fn piece_bounds(from: usize, to: usize) -> impl Iterator<Item = (usize, usize)> {
    (from..to).step_by(PIECE).map(move |start| (start, (start + PIECE).min(to)))
}

/// Counters for `/v1/status`, the metrics and the UI.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct CacheStats {
    pub entries: usize,
    pub bytes: usize,
    pub budget_bytes: usize,
    pub hits: u64,
    pub misses: u64,
    /// Prompt tokens served from the cache, and prompt tokens looked up, over all requests.
    pub hit_tokens: u64,
    pub lookup_tokens: u64,
    pub evictions: u64,
    /// The disk tier, when there is one.
    pub disk: Option<DiskStats>,
}

pub struct PromptCache {
    entries: Vec<Entry>,
    budget: usize,
    clock: u64,
    stats: CacheStats,
    /// Blocks on disk, when the server gave it a folder.
    disk: Option<DiskTier>,
    /// The tokens whose state the last request kept (its prompt's, its answer's), not yet
    /// given to the disk tier.
    unsaved: Vec<Vec<u32>>,
}

impl PromptCache {
    /// A cache of at most `budget` bytes (0: off).
    pub fn new(budget: usize) -> Self {
        PromptCache {
            entries: Vec::new(),
            budget,
            clock: 0,
            stats: CacheStats::default(),
            disk: None,
            unsaved: Vec::new(),
        }
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            entries: self.entries.len(),
            bytes: self.bytes(),
            budget_bytes: self.budget,
            disk: self.disk.as_ref().map(DiskTier::stats),
            ..self.stats.clone()
        }
    }

    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Bytes the entries hold together (a piece or checkpoint several hold counts once).
    fn bytes(&self) -> usize {
        let mut pieces = HashSet::new();
        let mut checkpoints = HashSet::new();
        let mut total = 0;
        for e in &self.entries {
            total += e.tokens.len() * 4;
            for p in &e.pieces {
                if pieces.insert(Rc::as_ptr(p)) {
                    total += p.bytes;
                }
            }
            for c in &e.checkpoints {
                if checkpoints.insert(Rc::as_ptr(&c.state)) {
                    total += c.nbytes();
                }
            }
        }
        total
    }

    /// The state after the longest cached prefix of `prompt`'s first `limit` tokens, if any:
    /// from memory, or from the disk tier when it holds a longer one (which then stays in
    /// memory too). `with_mtp`: the request speculates, so the head's state is wanted too.
    pub fn lookup(&mut self, prompt: &[u32], limit: usize, with_mtp: bool) -> Result<Option<Hit>> {
        if self.budget == 0 {
            return Ok(None);
        }
        self.stats.lookup_tokens += limit as u64;
        let best = |entries: &[Entry]| entries.iter().enumerate().map(|(i, e)| (e.usable(prompt, limit), i)).max();
        let in_memory = best(&self.entries).map_or(0, |(len, _)| len);
        self.clock += 1;
        let from_disk = self.disk.as_mut().and_then(|d| d.load(prompt, limit, in_memory));
        let hit = match from_disk {
            Some(mut entry) if entry.bytes() > self.budget => {
                // Larger than memory may keep: used once, straight from disk.
                entry.last_used = self.clock;
                let len = entry.usable(prompt, limit);
                if len > 0 {
                    entry.hit(len, with_mtp)
                } else {
                    None
                }
            }
            from_disk => {
                if let Some(mut entry) = from_disk {
                    entry.last_used = self.clock;
                    self.keep(entry);
                }
                match best(&self.entries).filter(|&(len, _)| len > 0) {
                    Some((len, i)) => {
                        let entry = &mut self.entries[i];
                        entry.last_used = self.clock;
                        entry.hit(len, with_mtp)
                    }
                    None => None,
                }
            }
        };
        match &hit {
            Some(h) => {
                self.stats.hits += 1;
                self.stats.hit_tokens += h.len as u64;
            }
            None => self.stats.misses += 1,
        }
        Ok(hit)
    }

    /// Gives the disk tier the entry the last request kept (called once the request has
    /// answered; the tier copies the blocks it lacks and writes them on its own thread).
    pub fn persist(&mut self) {
        let unsaved = std::mem::take(&mut self.unsaved);
        let Some(disk) = self.disk.as_mut() else { return };
        // Each turn's end gets its own last block: the next turn may share the prompt but not
        // the answer as it was generated (a template writes it back in its own way).
        for tokens in unsaved {
            let len = tokens.len();
            if let Some(entry) = self.entries.iter().find(|e| e.usable(&tokens, len) == len) {
                disk.save(entry, len);
            }
        }
    }

    /// Waits until the disk tier has written what it was given.
    pub fn flush_disk(&self) {
        if let Some(disk) = &self.disk {
            disk.flush();
        }
    }

    /// Adds a disk tier (or takes it away).
    pub fn set_disk(&mut self, disk: Option<DiskTier>) {
        self.disk = disk;
    }

    /// Keeps the state of `cache` after `tokens` (its offset must be their count), with the
    /// MTP head's cache when the request speculated, and the hybrid's checkpoints (the last
    /// at the end). An entry whose tokens this one extends is replaced.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        cache: &Cache,
        mtp: Option<&Cache>,
        mut checkpoints: Vec<Checkpoint>,
    ) -> Result<()> {
        if self.budget == 0 || tokens.is_empty() || cache.offset() as usize != tokens.len() {
            return Ok(());
        }
        // An entry that already restores all of these tokens (the state after an earlier
        // answer that began with this prompt) is used again rather than copied.
        let len = tokens.len();
        if let Some(e) = self.entries.iter_mut().find(|e| e.usable(tokens, len) == len && (mtp.is_none() || e.with_mtp))
        {
            self.clock += 1;
            e.last_used = self.clock;
            self.unsaved.push(tokens.to_vec());
            return Ok(());
        }
        let hybrid = cache.layers.iter().any(|l| matches!(l, LayerCache::Linear(_)));
        if !hybrid {
            checkpoints.clear();
        }
        // The whole pieces of the entry that shares the most are held as they are; the rest
        // is copied out of the request's cache (whose buffers its next updates overwrite).
        let mut pieces =
            self.entries.iter().map(|e| e.shareable(tokens, mtp.is_some())).max_by_key(Vec::len).unwrap_or_default();
        let shared_end = pieces.last().map_or(0, |p| p.end);
        let mut arrays = Vec::new();
        for (start, end) in piece_bounds(shared_end, len) {
            let kv = copies(cache, start, end)?;
            let mtp_kv = match mtp {
                Some(m) => Some(copies(m, start.min(len - 1), end.min(len - 1))?),
                None => None,
            };
            arrays.extend(kv.iter().chain(mtp_kv.iter().flatten()).flatten().flat_map(|(k, v)| [k.clone(), v.clone()]));
            pieces.push(Rc::new(Piece::new(start, end, kv, mtp_kv)));
        }
        eval(&arrays)?;
        self.clock += 1;
        let entry = Entry {
            tokens: tokens.to_vec(),
            pieces,
            attention_only: !hybrid,
            layers: cache.layers.len(),
            with_mtp: mtp.is_some(),
            checkpoints,
            last_used: self.clock,
        };
        if entry.bytes() > self.budget {
            return Ok(());
        }
        self.unsaved.push(entry.tokens.clone());
        self.keep(entry);
        Ok(())
    }

    /// Adds `entry` to memory, evicting the least recently used beyond the budget.
    fn keep(&mut self, entry: Entry) {
        // An older entry whose every token starts this one says nothing this one does not.
        let tokens = &entry.tokens;
        self.entries.retain(|e| !(e.tokens.len() <= tokens.len() && tokens.starts_with(&e.tokens)));
        self.entries.push(entry);
        while self.bytes() > self.budget {
            let Some(oldest) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i) else {
                break;
            };
            self.entries.remove(oldest);
            self.stats.evictions += 1;
        }
    }
}

/// Copies of each attention layer's keys and values for positions `from..to` (None for
/// linear attention).
fn copies(cache: &Cache, from: usize, to: usize) -> Result<Vec<Option<(Array, Array)>>> {
    cache
        .layers
        .iter()
        .map(|l| match l {
            LayerCache::Kv(kv) => kv.range(from as i32, to as i32),
            LayerCache::Linear(_) => Ok(None),
        })
        .collect()
}
