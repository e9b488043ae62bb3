//! The prompt cache's disk tier: entries written as blocks of [`BLOCK`] tokens to a folder on
//! the models volume, so an agent's next turn still hits after a restart.
//!
//! A block holds one stretch of an entry: the attention layers' keys and values for its
//! positions, the MTP head's, its tokens, and (when the entry has one there) the hybrid's
//! checkpoint at its end. It is named after the chain hash of every token up to its end (the
//! model's identity first), so the blocks of one prompt are found by hashing the prompt, an
//! entry's shared start is written once, and a longer turn adds only its new blocks; the last
//! block of an entry ends where the entry does. The name also carries a keyed MAC
//! (HMAC-SHA256) of the whole file, under a key this installation keeps elsewhere
//! ([`DiskSettings::key`]): the folder sits on a shared volume, so a block another program
//! wrote or edited — its arrays, its metadata, its name — does not verify, and is removed and
//! never loaded. A block is read into memory once, verified, and parsed from those bytes (what
//! was checked is what loads); its metadata must name this model's layer count, and its arrays
//! must fit together.
//!
//! The folder holds one sub-folder per model identity (its config, weight files, weight form
//! and backend). Files are written whole to a temporary name and renamed, under a lock on the
//! folder, after the least recently used blocks of every model made room: two processes that
//! share the folder never see a half-written block and keep it under the byte budget together.
//! The writing happens on a thread of its own ([`writer`]).

mod folder;
mod writer;

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use mlx_rs::Array;
use serde::Serialize;
use sha2::{Digest, Sha256};

use super::entry::{Checkpoint, Entry};
use crate::speculation::DraftWith;
use folder::{all_blocks, blocks_in, hex, mac, parse_name, LOCK};
use writer::{evaluated, Counters, Folder, Pending, Writer};

/// Tokens per block: a multiple of every profile's prefill chunk, so a hybrid's checkpoints
/// fall on block ends.
pub const BLOCK: usize = 8192;
const FORMAT: &str = "ferrite-prompt-block-2";

/// What the disk tier holds and did, for `/v1/status` and `ferrite cache show`.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct DiskStats {
    pub dir: PathBuf,
    /// Blocks and bytes of every model in the folder.
    pub blocks: usize,
    pub bytes: u64,
    pub budget_bytes: u64,
    /// Blocks read into memory, written, removed to keep the budget, and removed as corrupt,
    /// truncated or foreign.
    pub loaded: u64,
    pub written: u64,
    pub evicted: u64,
    pub rejected: u64,
    /// Blocks this process has queued and not yet written.
    pub writing: usize,
}

/// Where the disk tier keeps its blocks, how many bytes it may take (every model together),
/// and the installation's key that every block's MAC is made with.
#[derive(Debug, Clone, PartialEq)]
pub struct DiskSettings {
    pub dir: PathBuf,
    pub budget: u64,
    pub key: [u8; 32],
}

pub struct DiskTier {
    folder: Folder,
    /// The model's layers: a block that says otherwise is not this model's.
    layers: usize,
    /// The chain hash before the first token: the model's identity.
    seed: [u8; 32],
    counters: Arc<Counters>,
    writer: Writer,
}

/// A block file found in the folder.
struct Found {
    path: PathBuf,
    checksum: String,
}

impl DiskTier {
    /// The tier `settings` describe for the model whose identity `identity` describes, with
    /// `layers` layers.
    pub fn open(settings: &DiskSettings, identity: &[u8], layers: usize) -> std::io::Result<Self> {
        let root = &settings.dir;
        let seed: [u8; 32] = Sha256::digest([FORMAT.as_bytes(), identity].concat()).into();
        let dir = root.join(hex(&seed[..8]));
        std::fs::create_dir_all(&dir)?;
        remove_stale_temporaries(&dir);
        let folder = Folder { root: root.to_path_buf(), dir, budget: settings.budget, key: settings.key };
        let counters = Arc::new(Counters::default());
        let writer = Writer::start(folder.clone(), counters.clone())?;
        Ok(DiskTier { folder, layers, seed, counters, writer })
    }

    pub fn stats(&self) -> DiskStats {
        let (blocks, bytes) = usage(&self.folder.root);
        let count = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
        DiskStats {
            dir: self.folder.root.clone(),
            blocks,
            bytes,
            budget_bytes: self.folder.budget,
            loaded: count(&self.counters.loaded),
            written: count(&self.counters.written),
            evicted: count(&self.counters.evicted),
            rejected: count(&self.counters.rejected),
            writing: self.writer.waiting(),
        }
    }

    /// Queues the blocks of `entry`'s first `len` tokens (its whole length, or a turn's end
    /// inside it) the folder does not hold yet: cut and evaluated now, written by the writer
    /// thread. A block that cannot be copied or written (a full disk) is dropped, with the
    /// blocks after it: the cache is an optimisation, never an error.
    pub(super) fn save(&mut self, entry: &Entry, len: usize) {
        let found = self.found();
        let mut parent = self.seed;
        let mut start = 0;
        let mut blocks = Vec::new();
        while start < len {
            let end = (start + BLOCK).min(len);
            let chain = chain(&parent, &entry.tokens[start..end]);
            let name = hex(&chain);
            if !found.contains_key(&name) && !self.writer.is_queued(&name) {
                match block_of(entry, start, end, len, name) {
                    Ok(block) => blocks.push(block),
                    Err(e) => {
                        tracing::warn!("prompt cache: a block was not written to {}: {e}", self.folder.dir.display());
                        break;
                    }
                }
            }
            parent = chain;
            start = end;
        }
        self.writer.send(blocks);
    }

    /// Waits until the blocks queued so far are written (or dropped).
    pub(super) fn flush(&self) {
        self.writer.flush();
    }

    /// The longest prefix of `prompt` (at most `limit` tokens) the folder can restore, as an
    /// entry, when it is longer than `at_least` tokens.
    pub(super) fn load(&mut self, prompt: &[u32], limit: usize, at_least: usize) -> Option<Entry> {
        let found = self.found();
        if found.is_empty() {
            return None;
        }
        // The chain of blocks present: whole blocks, then the longest last one.
        let mut chain_of = Vec::new(); // (start, end, name)
        let (mut parent, mut start) = (self.seed, 0);
        loop {
            let whole = start + BLOCK;
            if whole <= limit {
                let c = chain(&parent, &prompt[start..whole]);
                if found.contains_key(&hex(&c)) {
                    chain_of.push((start, whole, hex(&c)));
                    (parent, start) = (c, whole);
                    continue;
                }
            }
            if let Some((end, c)) = longest_present(&parent, &prompt[start..limit.min(whole)], &found) {
                chain_of.push((start, start + end, hex(&c)));
            }
            break;
        }
        if chain_of.last().is_none_or(|&(_, end, _)| end <= at_least) {
            return None;
        }
        let mut blocks = Vec::new();
        for (start, end, name) in &chain_of {
            match self.read(&found[name], &prompt[*start..*end], *start) {
                Ok(block) => blocks.push(block),
                Err(why) => {
                    tracing::warn!("prompt cache: {} removed: {why}", found[name].path.display());
                    let _ = std::fs::remove_file(&found[name].path);
                    self.counters.rejected.fetch_add(1, Ordering::Relaxed);
                    break;
                }
            }
        }
        let entry = assemble(prompt, blocks)?;
        (entry.tokens.len() > at_least).then_some(entry)
    }

    /// Block files of this model, by chain hash.
    fn found(&self) -> HashMap<String, Found> {
        let Ok(dir) = std::fs::read_dir(&self.folder.dir) else { return HashMap::new() };
        dir.flatten()
            .filter_map(|e| {
                let name = e.file_name().into_string().ok()?;
                let (chain, checksum) = parse_name(&name)?;
                Some((chain.to_string(), Found { path: e.path(), checksum: checksum.to_string() }))
            })
            .collect()
    }

    fn read(&mut self, found: &Found, tokens: &[u32], start: usize) -> Result<Block, String> {
        let bytes = std::fs::read(&found.path).map_err(|e| e.to_string())?;
        if !mac(&self.folder.key, &bytes).starts_with(&found.checksum) {
            return Err(
                "its bytes do not match its MAC (corrupt, truncated, or not written by this installation)".into()
            );
        }
        let (arrays, metadata) = parse_block(&bytes)?;
        let field = |k: &str| metadata.get(k).map(String::as_str);
        if field("format") != Some(FORMAT) || field("start") != Some(start.to_string().as_str()) {
            return Err("not a block of this chain (foreign)".into());
        }
        let stored = arrays.get("tokens").ok_or("it has no tokens")?;
        stored.eval().map_err(|e| e.to_string())?;
        if stored.try_as_slice::<u32>().map_err(|e| e.to_string())? != tokens {
            return Err("its tokens are not the prompt's (foreign)".into());
        }
        // Used now: the last to be evicted.
        if let Ok(f) = File::options().append(true).open(&found.path) {
            let _ = f.set_modified(SystemTime::now());
        }
        let count = |k: &str| field(k).and_then(|v| v.parse::<usize>().ok());
        let layers = count("layers").ok_or("it does not say its layers")?;
        if layers != self.layers {
            return Err(format!("it says {layers} layers where the model has {}", self.layers));
        }
        // A drafter's state is kept only with the name of the drafter it belongs to.
        let drafter = match field("drafter") {
            Some(name) => Some(DraftWith::parse(name).ok_or_else(|| format!("it names an unknown drafter {name:?}"))?),
            None => None,
        };
        let mtp_layers = count("mtp_layers").filter(|_| drafter.is_some());
        if mtp_layers.is_some_and(|n| n > layers) {
            return Err("it says more drafter layers than the model has layers".into());
        }
        let block = Block { end: start + tokens.len(), layers, drafter, mtp_layers, arrays };
        block.check_shapes(tokens.len())?;
        self.counters.loaded.fetch_add(1, Ordering::Relaxed);
        Ok(block)
    }
}

/// The block of `entry`'s tokens `start..end` (of its first `len`, which are being saved),
/// cut and evaluated.
fn block_of(entry: &Entry, start: usize, end: usize, len: usize, chain: String) -> Result<Pending, String> {
    let mut arrays: Vec<(String, Array)> = Vec::new();
    for (i, kv) in entry.kv_range(start, end, false).into_iter().enumerate() {
        if let Some((k, v)) = kv {
            arrays.push((format!("k.{i}"), k));
            arrays.push((format!("v.{i}"), v));
        }
    }
    // The MTP head has seen one position fewer than the trunk.
    let mtp_end = end.min(len - 1);
    if entry.drafter.is_some() && start < mtp_end {
        for (i, kv) in entry.kv_range(start, mtp_end, true).into_iter().enumerate() {
            if let Some((k, v)) = kv {
                arrays.push((format!("mtp_k.{i}"), k));
                arrays.push((format!("mtp_v.{i}"), v));
            }
        }
    }
    if let Some(c) = entry.checkpoints.iter().find(|c| c.position == end) {
        for (i, (conv, recurrent)) in c.linear().iter().enumerate().filter_map(|(i, l)| Some((i, l.as_ref()?))) {
            arrays.push((format!("conv.{i}"), conv.clone()));
            arrays.push((format!("rec.{i}"), recurrent.clone()));
        }
        if let Some(h) = c.last_hidden() {
            arrays.push(("hidden".into(), h.clone()));
        }
        arrays.push(("checkpoint".into(), Array::from_int(1)));
    }
    let tokens: Vec<u32> = entry.tokens[start..end].to_vec();
    arrays.push(("tokens".into(), Array::from_slice(&tokens, &[tokens.len() as i32])));
    let mut metadata = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("start".to_string(), start.to_string()),
        ("layers".to_string(), entry.layers.to_string()),
    ]);
    if let (Some(n), Some(drafter)) = (entry.mtp_layers(), entry.drafter) {
        metadata.insert("mtp_layers".into(), n.to_string());
        metadata.insert("drafter".into(), drafter.name().into());
    }
    Ok(Pending { chain, arrays: evaluated(arrays)?, metadata })
}

/// One block read back: where it ends, and its arrays by name.
struct Block {
    end: usize,
    /// The trunk's layers, and the drafter's when the entry kept its cache (and which drafter).
    layers: usize,
    drafter: Option<DraftWith>,
    mtp_layers: Option<usize>,
    arrays: HashMap<String, Array>,
}

impl Block {
    /// Whether its arrays are what a block of `len` positions holds: keys and values in
    /// pairs of one shape, `[batch, heads, len, dim]` (the MTP head's may be one shorter),
    /// and a layer's linear-attention state only where it has no keys.
    fn check_shapes(&self, len: usize) -> Result<(), String> {
        for (prefix, layers) in [("", self.layers), ("mtp_", self.mtp_layers.unwrap_or(0))] {
            for i in 0..layers {
                let (k, v) = (self.arrays.get(&format!("{prefix}k.{i}")), self.arrays.get(&format!("{prefix}v.{i}")));
                match (k, v) {
                    (None, None) => {}
                    (Some(k), Some(v)) => {
                        let positions = k.shape().get(2).copied().unwrap_or(-1) as isize;
                        let fits = k.ndim() == 4
                            && v.ndim() == 4
                            && k.shape()[..3] == v.shape()[..3]
                            && (positions == len as isize || (prefix == "mtp_" && positions + 1 == len as isize));
                        if !fits {
                            return Err(format!(
                                "its {prefix}keys and values of layer {i} are not shaped as its tokens"
                            ));
                        }
                    }
                    _ => return Err(format!("it holds only half of layer {i}'s {prefix}keys and values")),
                }
            }
        }
        for i in 0..self.layers {
            let linear =
                self.arrays.contains_key(&format!("conv.{i}")) || self.arrays.contains_key(&format!("rec.{i}"));
            if linear && self.arrays.contains_key(&format!("k.{i}")) {
                return Err(format!("its layer {i} holds both attention and linear-attention state"));
            }
        }
        Ok(())
    }
}

/// A block's arrays by name, and its metadata.
type Parsed = (HashMap<String, Array>, HashMap<String, String>);

/// A block's arrays and metadata, parsed from its bytes.
fn parse_block(bytes: &[u8]) -> Result<Parsed, String> {
    use safetensors::{Dtype as Stored, SafeTensors};
    let bad = |e: safetensors::SafeTensorError| format!("not a readable block: {e}");
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(bad)?;
    let metadata = header.metadata().clone().unwrap_or_default();
    let tensors = SafeTensors::deserialize(bytes).map_err(bad)?;
    let mut arrays = HashMap::new();
    for (name, view) in tensors.tensors() {
        let shape: Vec<i32> = view
            .shape()
            .iter()
            .map(|&d| i32::try_from(d))
            .collect::<Result<_, _>>()
            .map_err(|_| "a dimension too large")?;
        let data = view.data();
        let array = match view.dtype() {
            Stored::F32 => Array::from_slice(&bytemuck::pod_collect_to_vec::<u8, f32>(data), &shape),
            Stored::BF16 => Array::from_slice(&bytemuck::pod_collect_to_vec::<u8, half::bf16>(data), &shape),
            Stored::F16 => Array::from_slice(&bytemuck::pod_collect_to_vec::<u8, half::f16>(data), &shape),
            Stored::U32 => Array::from_slice(&bytemuck::pod_collect_to_vec::<u8, u32>(data), &shape),
            Stored::I32 => Array::from_slice(&bytemuck::pod_collect_to_vec::<u8, i32>(data), &shape),
            other => return Err(format!("it holds an array of type {other:?}, which no block has")),
        };
        arrays.insert(name, array);
    }
    Ok((arrays, metadata))
}

/// The entry the loaded blocks make, up to the last one it can be restored from (a hybrid's
/// last checkpoint); `None` when they make nothing usable or do not fit together.
fn assemble(prompt: &[u32], mut blocks: Vec<Block>) -> Option<Entry> {
    let first = blocks.first()?;
    let (layers, drafter, mtp_layers) = (first.layers, first.drafter, first.mtp_layers);
    if blocks.iter().any(|b| b.layers != layers || b.drafter != drafter || b.mtp_layers != mtp_layers) {
        return None;
    }
    let hybrid = blocks.iter().any(|b| b.arrays.keys().any(|k| k.starts_with("conv.")));
    if hybrid {
        let last = blocks.iter().rposition(|b| b.arrays.contains_key("checkpoint"))?;
        blocks.truncate(last + 1);
    }
    let end = blocks.last()?.end;
    let joined = |name: &str| -> Option<Array> {
        let parts: Vec<&Array> = blocks.iter().filter_map(|b| b.arrays.get(name)).collect();
        match parts.len() {
            0 => None,
            _ => mlx_rs::ops::concatenate(&parts, 2).ok(),
        }
    };
    let pair = |k: &str, v: &str| Some((joined(k)?, joined(v)?));
    let kv: Vec<Option<(Array, Array)>> = (0..layers).map(|i| pair(&format!("k.{i}"), &format!("v.{i}"))).collect();
    // Attention layers cover every position; a layer with no keys is linear attention.
    if kv.iter().flatten().any(|(k, _)| k.dim(2) as usize != end) {
        return None;
    }
    // The MTP head's keys and values cover one position fewer than the trunk's.
    let mtp_kv = mtp_layers
        .map(|n| (0..n).map(|i| pair(&format!("mtp_k.{i}"), &format!("mtp_v.{i}"))).collect::<Vec<_>>())
        .filter(|m| m.iter().all(|kv| kv.as_ref().is_some_and(|(k, _)| k.dim(2) as usize + 1 == end)));
    let checkpoints: Vec<Checkpoint> = blocks
        .iter()
        .filter(|b| b.arrays.contains_key("checkpoint"))
        .map(|b| {
            let linear = (0..layers)
                .map(|i| {
                    Some((b.arrays.get(&format!("conv.{i}"))?.clone(), b.arrays.get(&format!("rec.{i}"))?.clone()))
                })
                .collect();
            Checkpoint::new(b.end, linear, b.arrays.get("hidden").cloned())
        })
        .collect();
    let mut arrays: Vec<&Array> = kv.iter().flatten().flat_map(|(k, v)| [k, v]).collect();
    arrays.extend(mtp_kv.iter().flatten().flatten().flat_map(|(k, v)| [k, v]));
    mlx_rs::transforms::eval(arrays).ok()?;
    Some(Entry::new(prompt[..end].to_vec(), kv, drafter.zip(mtp_kv), checkpoints, 0))
}

/// The chain hash after `tokens`, from `parent`'s.
fn chain(parent: &[u8; 32], tokens: &[u32]) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(parent);
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    h.finalize().into()
}

/// The longest start of `tokens` (at least one) whose block is in `found`, and its hash.
fn longest_present(parent: &[u8; 32], tokens: &[u32], found: &HashMap<String, Found>) -> Option<(usize, [u8; 32])> {
    let mut h = Sha256::new();
    h.update(parent);
    let mut best = None;
    for (i, t) in tokens.iter().enumerate() {
        h.update(t.to_le_bytes());
        let c: [u8; 32] = h.clone().finalize().into();
        if found.contains_key(&hex(&c)) {
            best = Some((i + 1, c));
        }
    }
    best
}

/// Blocks and bytes in `root`.
pub fn usage(root: &Path) -> (usize, u64) {
    let blocks = all_blocks(root);
    (blocks.len(), blocks.iter().map(|b| b.1).sum())
}

/// Blocks and bytes of one model's folder in the root.
pub fn usage_of_model(dir: &Path) -> (usize, u64) {
    let blocks = blocks_in(dir);
    (blocks.len(), blocks.iter().map(|b| b.1).sum())
}

/// Removes every block in `root` (under its lock); returns the bytes freed.
pub fn clear(root: &Path) -> std::io::Result<u64> {
    let lock = File::options().create(true).truncate(false).write(true).open(root.join(LOCK))?;
    lock.lock()?;
    let mut freed = 0;
    for (path, size, _) in all_blocks(root) {
        if std::fs::remove_file(path).is_ok() {
            freed += size;
        }
    }
    Ok(freed)
}

/// Temporary files a crashed writer left (an hour old: no live writer takes that long).
fn remove_stale_temporaries(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let stale = e
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| SystemTime::now().duration_since(t).unwrap_or_default() > Duration::from_secs(3600));
        if e.file_name().to_string_lossy().starts_with(".tmp-") && stale {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// A safetensors file of arrays with any dtype, shape and offsets a header can state.
    fn block_bytes() -> impl Strategy<Value = Vec<u8>> {
        let dtype =
            prop_oneof![Just("F32"), Just("BF16"), Just("F16"), Just("U32"), Just("I32"), Just("F64"), Just("U8")];
        let name =
            prop_oneof![Just("k.0"), Just("v.0"), Just("mtp_k.0"), Just("conv.0"), Just("rec.0"), Just("tokens")];
        let array = (name, dtype, prop::collection::vec(0u64..5, 0..5), 0u64..64, 0u64..64);
        (
            prop::collection::vec(array, 0..5),
            prop::option::of(prop_oneof![Just("4000000000"), Just("18446744073709551615"), Just("2"), Just("-1")]),
            prop::collection::vec(any::<u8>(), 0..256),
        )
            .prop_map(|(arrays, layers, data)| {
                let mut header = serde_json::Map::new();
                for (name, dtype, shape, start, len) in arrays {
                    header.insert(
                        name.into(),
                        serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [start, start + len]}),
                    );
                }
                if let Some(l) = layers {
                    header.insert(
                        "__metadata__".into(),
                        serde_json::json!({"format": FORMAT, "layers": l, "start": "0"}),
                    );
                }
                let header = serde_json::Value::Object(header).to_string();
                let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
                bytes.extend(header.as_bytes());
                bytes.extend(data);
                bytes
            })
    }

    proptest! {
        /// A block's bytes, whatever they hold, parse to arrays or are refused by reason; a
        /// parsed block's shapes are checked without a crash.
        #[test]
        fn any_block_parses_or_is_refused(bytes in prop_oneof![block_bytes(), prop::collection::vec(any::<u8>(), 0..64)]) {
            if let Ok((arrays, metadata)) = parse_block(&bytes) {
                let layers = metadata.get("layers").and_then(|l| l.parse::<usize>().ok()).unwrap_or(0).min(4);
                let block = Block { end: 2, layers, drafter: Some(DraftWith::Mtp), mtp_layers: Some(layers), arrays };
                let _ = block.check_shapes(2);
            }
        }
    }
}
