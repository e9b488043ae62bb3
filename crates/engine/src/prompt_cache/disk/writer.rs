//! The disk tier's writer. A block's arrays are cut from the entry and evaluated on the
//! request's thread (where every MLX operation runs); a thread of its own then reads their
//! bytes, writes each block to a temporary file, checksums it and places it under the folder's
//! lock, after making room. Neither the request's client nor the next request waits for the
//! disk (or for the bytes to come over from a GPU); a block still being written is in memory
//! anyway, since the entry it came from is.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use mlx_rs::{Array, Dtype};
use safetensors::tensor::TensorView;

use super::folder::{all_blocks, mac, LOCK};

/// Named arrays (lazy slices of a cache entry) made row-contiguous and evaluated together, on
/// the thread that runs MLX: what is left for the writer is reading memory that is ready.
pub(super) fn evaluated(arrays: Vec<(String, Array)>) -> Result<Vec<(String, Array)>, String> {
    let arrays: Vec<(String, Array)> = arrays
        .into_iter()
        .map(|(n, a)| a.contiguous().map(|a| (n, a)))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    mlx_rs::transforms::eval(arrays.iter().map(|(_, a)| a)).map_err(|e| e.to_string())?;
    Ok(arrays)
}

/// An evaluated, row-contiguous array's bytes, as safetensors stores them. Reading them is no
/// MLX operation (evaluating an array already evaluated returns at once), so it may happen on
/// the writer's thread.
fn view(a: &Array) -> Result<TensorView<'_>, String> {
    let (dtype, data): (safetensors::Dtype, &[u8]) = match a.dtype() {
        Dtype::Float32 => {
            (safetensors::Dtype::F32, bytemuck::cast_slice(a.try_as_slice::<f32>().map_err(|e| e.to_string())?))
        }
        Dtype::Bfloat16 => {
            (safetensors::Dtype::BF16, bytemuck::cast_slice(a.try_as_slice::<half::bf16>().map_err(|e| e.to_string())?))
        }
        Dtype::Float16 => {
            (safetensors::Dtype::F16, bytemuck::cast_slice(a.try_as_slice::<half::f16>().map_err(|e| e.to_string())?))
        }
        Dtype::Uint32 => {
            (safetensors::Dtype::U32, bytemuck::cast_slice(a.try_as_slice::<u32>().map_err(|e| e.to_string())?))
        }
        Dtype::Int32 => {
            (safetensors::Dtype::I32, bytemuck::cast_slice(a.try_as_slice::<i32>().map_err(|e| e.to_string())?))
        }
        other => return Err(format!("a cached array of type {other:?} cannot be written")),
    };
    TensorView::new(dtype, a.shape().iter().map(|&d| d as usize).collect(), data).map_err(|e| e.to_string())
}

/// A block ready to be written: its name (the chain hash, hex), evaluated arrays and metadata.
pub(super) struct Pending {
    pub chain: String,
    pub arrays: Vec<(String, Array)>,
    pub metadata: HashMap<String, String>,
}

/// What the reader and the writer count, for [`super::DiskStats`].
#[derive(Default)]
pub(super) struct Counters {
    pub loaded: AtomicU64,
    pub written: AtomicU64,
    pub evicted: AtomicU64,
    pub rejected: AtomicU64,
}

/// Where blocks go: the shared root (its lock and budget cover every model) and this model's
/// folder in it.
#[derive(Clone)]
pub(super) struct Folder {
    pub root: PathBuf,
    pub dir: PathBuf,
    pub budget: u64,
    /// The installation's key, which each block's MAC is made with.
    pub key: [u8; 32],
}

/// Numbers this process's temporary files.
static NEXT_TMP: AtomicU64 = AtomicU64::new(0);

impl Folder {
    /// Writes `block` whole to a temporary file, then, under the lock, makes room and renames
    /// it to `<chain>.<checksum>.safetensors`.
    fn write(&self, block: Pending, counters: &Counters) -> std::io::Result<()> {
        // Unique among every writer: other processes (the pid) and other engines of this one.
        let n = NEXT_TMP.fetch_add(1, Ordering::Relaxed);
        let tmp = self.dir.join(format!(".tmp-{}-{n}.safetensors", std::process::id()));
        let written = (|| -> std::io::Result<String> {
            let views = block
                .arrays
                .iter()
                .map(|(name, a)| Ok((name.as_str(), view(a)?)))
                .collect::<Result<Vec<_>, String>>()
                .map_err(std::io::Error::other)?;
            let bytes = safetensors::serialize(views, Some(block.metadata)).map_err(std::io::Error::other)?;
            std::fs::write(&tmp, &bytes)?;
            Ok(mac(&self.key, &bytes))
        })();
        let checksum = match written {
            Ok(c) => c,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
        };
        let size = std::fs::metadata(&tmp)?.len();
        let lock = self.lock()?;
        let placed = self.make_room(size, counters).and_then(|()| {
            std::fs::rename(&tmp, self.dir.join(format!("{}.{}.safetensors", block.chain, &checksum[..16])))
        });
        drop(lock);
        match placed {
            Ok(()) => {
                counters.written.fetch_add(1, Ordering::Relaxed);
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                Err(e)
            }
        }
    }

    /// A lock on the whole root, held while blocks are removed and placed.
    pub fn lock(&self) -> std::io::Result<File> {
        let file = File::options().create(true).truncate(false).write(true).open(self.root.join(LOCK))?;
        file.lock()?;
        Ok(file)
    }

    /// Removes the least recently used blocks of every model until `incoming` more bytes fit
    /// the budget (the caller holds the lock).
    fn make_room(&self, incoming: u64, counters: &Counters) -> std::io::Result<()> {
        if incoming > self.budget {
            return Err(std::io::Error::other(format!("a block of {incoming} bytes exceeds the whole budget")));
        }
        let mut blocks = all_blocks(&self.root);
        let mut total: u64 = blocks.iter().map(|b| b.1).sum();
        blocks.sort_by_key(|b| b.2);
        for (path, size, _) in blocks {
            if total + incoming <= self.budget {
                break;
            }
            if std::fs::remove_file(&path).is_ok() {
                counters.evicted.fetch_add(1, Ordering::Relaxed);
            }
            total -= size;
        }
        Ok(())
    }
}

/// The blocks queued and not yet placed (by chain), and a signal each time one is done.
type Queued = Arc<(Mutex<HashSet<String>>, Condvar)>;

/// The writing thread and its queue. Dropping it writes what is queued first.
pub(super) struct Writer {
    jobs: Option<mpsc::Sender<Vec<Pending>>>,
    thread: Option<JoinHandle<()>>,
    queued: Queued,
}

impl Writer {
    pub fn start(folder: Folder, counters: Arc<Counters>) -> std::io::Result<Writer> {
        let (jobs, incoming) = mpsc::channel::<Vec<Pending>>();
        let queued: Queued = Default::default();
        let done = queued.clone();
        let thread = std::thread::Builder::new().name("ferrite-prompt-disk".into()).spawn(move || {
            // One job is one entry's missing blocks, in order: after a block that cannot be
            // written (a full disk), the later ones would hang off nothing.
            for blocks in incoming {
                let mut failed = false;
                for block in blocks {
                    let chain = block.chain.clone();
                    if !failed {
                        if let Err(e) = folder.write(block, &counters) {
                            tracing::warn!("prompt cache: a block was not written to {}: {e}", folder.dir.display());
                            failed = true;
                        }
                    }
                    let (names, signal) = &*done;
                    if let Ok(mut names) = names.lock() {
                        names.remove(&chain);
                    }
                    signal.notify_all();
                }
            }
        })?;
        Ok(Writer { jobs: Some(jobs), thread: Some(thread), queued })
    }

    /// Whether a block of this chain is waiting to be written.
    pub fn is_queued(&self, chain: &str) -> bool {
        self.queued.0.lock().is_ok_and(|names| names.contains(chain))
    }

    /// Blocks waiting to be written.
    pub fn waiting(&self) -> usize {
        self.queued.0.lock().map_or(0, |names| names.len())
    }

    pub fn send(&self, blocks: Vec<Pending>) {
        if blocks.is_empty() {
            return;
        }
        if let Ok(mut names) = self.queued.0.lock() {
            names.extend(blocks.iter().map(|b| b.chain.clone()));
        }
        let sent = self.jobs.as_ref().map(|jobs| jobs.send(blocks));
        if !matches!(sent, Some(Ok(()))) {
            tracing::warn!("prompt cache: the disk writer has stopped; blocks dropped");
            if let Ok(mut names) = self.queued.0.lock() {
                names.clear();
            }
        }
    }

    /// Waits until every queued block is written (or dropped).
    pub fn flush(&self) {
        let (names, signal) = &*self.queued;
        let Ok(mut names) = names.lock() else { return };
        while !names.is_empty() {
            names = match signal.wait(names) {
                Ok(n) => n,
                Err(_) => return,
            };
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        // Closing the queue ends the thread once it has written what was queued.
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let waiting = self.waiting();
            if waiting > 0 {
                tracing::info!("prompt cache: writing {waiting} block(s) to disk before stopping");
            }
            let _ = thread.join();
        }
    }
}
