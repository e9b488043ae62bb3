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

use mlx_rs::{transforms::eval, Array};
use serde::Serialize;

use crate::cache::{Cache, LayerCache};
use crate::error::Result;
use crate::speculation::DraftWith;

pub mod disk;
mod entry;
pub use disk::{DiskSettings, DiskStats, DiskTier};
use entry::{piece_bounds, Entry, Piece};
pub use entry::{Checkpoint, Hit, PIECE};

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
    /// memory too). `drafter`: what the request drafts with; the drafter's state is restored too
    /// when the entry kept that drafter's (a request drafting with another starts its drafter
    /// afresh at the prefix's end).
    pub fn lookup(&mut self, prompt: &[u32], limit: usize, drafter: Option<DraftWith>) -> Result<Option<Hit>> {
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
                    entry.hit(len, drafter)
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
                        entry.hit(len, drafter)
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
        drafter: Option<(DraftWith, &Cache)>,
        mut checkpoints: Vec<Checkpoint>,
    ) -> Result<()> {
        if self.budget == 0 || tokens.is_empty() || cache.offset() as usize != tokens.len() {
            return Ok(());
        }
        // An entry that already restores all of these tokens (the state after an earlier
        // answer that began with this prompt) is used again rather than copied.
        let len = tokens.len();
        if let Some(e) = self
            .entries
            .iter_mut()
            .find(|e| e.usable(tokens, len) == len && (drafter.is_none() || e.drafter == drafter.map(|d| d.0)))
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
        let mut pieces = self
            .entries
            .iter()
            .map(|e| e.shareable(tokens, drafter.map(|d| d.0)))
            .max_by_key(Vec::len)
            .unwrap_or_default();
        let shared_end = pieces.last().map_or(0, |p| p.end);
        let mut arrays = Vec::new();
        for (start, end) in piece_bounds(shared_end, len) {
            let kv = copies(cache, start, end)?;
            let mtp_kv = match drafter.map(|d| d.1) {
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
            drafter: drafter.map(|d| d.0),
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
