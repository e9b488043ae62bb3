//! Downloads into the models folder with hf-hub: progress (bytes, rate, ETA), cancel, resume
//! (hf-hub keeps `*.sync.part` files with the bytes committed so far), a free-space check on
//! the volume that will hold the files, and verification before a model counts as installed.
//! Different models download concurrently; a second pull of the same model joins the first.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hf_hub::api::tokio::{ApiBuilder, ApiError};
use hf_hub::{Cache, Repo, RepoType};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::layout;
use crate::verify;

/// What to fetch.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub repo: String,
    pub revision: String,
    pub kind: Kind,
}

/// What a download is, which says how its folder is checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A model; `expect_mtp`: the catalog promises an MTP head, refuse it without one.
    Model { expect_mtp: bool },
    /// A block drafter: checked as one (no tokenizer of its own, no model check).
    Drafter,
}

impl Request {
    /// A model's download.
    pub fn model(repo: String, revision: String, expect_mtp: bool) -> Request {
        Request { repo, revision, kind: Kind::Model { expect_mtp } }
    }

    /// The download of the block drafter the catalog pairs with `entry`, when it is on the hub
    /// (an embedded one ships with Ferrite).
    pub fn drafter_of(entry: &crate::catalog::Entry) -> Option<Request> {
        let d = entry.drafter.as_ref().filter(|d| d.embedded.is_none())?;
        Some(Request { repo: d.repo.clone(), revision: d.revision.clone(), kind: Kind::Drafter })
    }
}

/// Where a download stands; sent to watchers whenever it changes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Progress {
    pub repo: String,
    pub state: State,
    pub file: String,
    pub done_bytes: u64,
    pub total_bytes: u64,
    pub bytes_per_s: f64,
    pub eta_s: Option<f64>,
    /// Set with [`State::Failed`]: the error itself, for callers that match on it.
    #[serde(skip)]
    pub error: Option<DownloadError>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "state", content = "detail", rename_all = "lowercase")]
pub enum State {
    Starting,
    Downloading,
    Verifying,
    /// Installed, at this folder.
    Done(PathBuf),
    Failed(String),
    Cancelled,
}

impl State {
    pub fn is_final(&self) -> bool {
        matches!(self, State::Done(_) | State::Failed(_) | State::Cancelled)
    }
}

#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum DownloadError {
    #[error("offline (HF_HUB_OFFLINE is set): installed models still run, downloads need the network")]
    Offline,
    #[error("cannot reach the hub at {endpoint}: {message}")]
    Network { endpoint: String, message: String },
    #[error("`{repo}` (revision {revision}) was not found on the hub")]
    NotFound { repo: String, revision: String },
    #[error("not enough space in {}: {needed} bytes needed (with a {margin}-byte margin), {available} free", dir.display())]
    NoSpace { dir: PathBuf, needed: u64, available: u64, margin: u64 },
    #[error("the disk holding {} is full: the {kept} bytes downloaded so far are kept, and a new pull resumes", dir.display())]
    DiskFull { dir: PathBuf, kept: u64 },
    #[error("the models folder {} is gone (volume unplugged?): the download stopped; a new pull resumes", dir.display())]
    FolderGone { dir: PathBuf },
    #[error("download of {file} failed: {message}; a new pull resumes")]
    Interrupted { file: String, message: String },
    #[error("verification failed, the bad file was removed: {0}")]
    Corrupt(String),
    #[error("cancelled")]
    Cancelled,
    /// A name the request carries, or a value of the hub's answer, that must not reach a path.
    #[error("{0}: refused (nothing was written)")]
    Unsafe(String),
}

/// A check of a downloaded model folder by the program that will run it (the server passes
/// the engine's): `Err(why)` and the download fails, its files removed, never installed.
pub type ModelCheck = Arc<dyn Fn(&Path) -> Result<(), String> + Send + Sync>;

/// Free bytes on the volume holding a folder; injectable so tests can play a full disk.
pub type SpaceProbe = Arc<dyn Fn(&Path) -> std::io::Result<u64> + Send + Sync>;

#[derive(Clone)]
pub struct Options {
    /// The hub's address (`$HF_ENDPOINT`, else huggingface.co).
    pub endpoint: String,
    pub token: Option<String>,
    pub space: SpaceProbe,
    /// Free space left over after the download, at least.
    pub margin_bytes: u64,
    /// Automatic resumes after a dropped connection, per file.
    pub retries: usize,
    /// Bytes per ranged request; a resume restarts at the last whole chunk.
    pub chunk_bytes: usize,
    /// No network: `$HF_HUB_OFFLINE`.
    pub offline: bool,
    /// Run on the folder once every file is verified (`None`: the store's own checks only).
    pub model_check: Option<ModelCheck>,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            endpoint: std::env::var("HF_ENDPOINT")
                .ok()
                .filter(|e| !e.is_empty())
                .unwrap_or_else(|| "https://huggingface.co".into()),
            token: std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()),
            space: Arc::new(|p: &Path| free_space(p)),
            margin_bytes: 512 << 20,
            retries: 2,
            chunk_bytes: 8 << 20,
            offline: offline(),
            model_check: None,
        }
    }
}

/// Free bytes on the volume that holds `dir`.
pub fn free_space(dir: &Path) -> std::io::Result<u64> {
    fs4::available_space(dir)
}

/// True when the user asked hub tools to stay offline.
pub fn offline() -> bool {
    std::env::var("HF_HUB_OFFLINE")
        .is_ok_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"))
}

/// One running download; every pull of the same model gets the same one.
pub struct Download {
    progress: watch::Receiver<Progress>,
    cancel: watch::Sender<bool>,
}

impl Download {
    pub fn progress(&self) -> watch::Receiver<Progress> {
        self.progress.clone()
    }

    /// Stops the download; the bytes so far stay for a later resume.
    pub fn cancel(&self) {
        let _ = self.cancel.send(true);
    }

    /// Waits for the end: the installed folder, or why not.
    pub async fn wait(&self) -> Result<PathBuf, DownloadError> {
        let mut rx = self.progress.clone();
        loop {
            let state = rx.borrow_and_update().state.clone();
            match state {
                State::Done(dir) => return Ok(dir),
                State::Cancelled => return Err(DownloadError::Cancelled),
                State::Failed(_) => return Err(rx.borrow().error.clone().unwrap_or(DownloadError::Cancelled)),
                _ => {}
            }
            if rx.changed().await.is_err() {
                return Err(DownloadError::Cancelled);
            }
        }
    }
}

/// The running downloads by (repository, revision).
type Running = HashMap<(String, String), Arc<Download>>;

/// The downloads of one models folder.
#[derive(Clone)]
pub struct Downloader {
    models_dir: PathBuf,
    options: Options,
    running: Arc<Mutex<Running>>,
}

impl Downloader {
    pub fn new(models_dir: PathBuf, options: Options) -> Self {
        Downloader { models_dir, options, running: Default::default() }
    }

    /// Starts a download, or joins the one already running for the same model.
    pub fn pull(&self, request: Request) -> Arc<Download> {
        let key = (request.repo.clone(), request.revision.clone());
        let mut running = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(d) = running.get(&key).filter(|d| !d.progress.borrow().state.is_final()) {
            return d.clone();
        }
        let initial = Progress {
            repo: request.repo.clone(),
            state: State::Starting,
            file: String::new(),
            done_bytes: 0,
            total_bytes: 0,
            bytes_per_s: 0.0,
            eta_s: None,
            error: None,
        };
        let (tx, rx) = watch::channel(initial);
        let (cancel_tx, cancel_rx) = watch::channel(false);
        let download = Arc::new(Download { progress: rx, cancel: cancel_tx });
        running.insert(key, download.clone());
        let job =
            Job { models_dir: self.models_dir.clone(), options: self.options.clone(), request, tx, cancel: cancel_rx };
        tokio::spawn(job.run());
        download
    }
}

/// A file of the repository, as the hub lists it.
#[derive(Debug, Clone, Deserialize)]
struct Sibling {
    rfilename: String,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Debug, Clone, Deserialize)]
struct Lfs {
    sha256: String,
    size: u64,
}

#[derive(Debug, Deserialize)]
struct RepoInfo {
    sha: String,
    siblings: Vec<Sibling>,
}

/// A repository id (`ORG/NAME`) and revision that can safely name folders and URLs.
fn check_names(repo: &str, revision: &str) -> Result<(), DownloadError> {
    let part = |p: &str| {
        !p.is_empty()
            && p != "."
            && p != ".."
            && p.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    };
    if !repo.split_once('/').is_some_and(|(org, name)| part(org) && part(name)) {
        return Err(DownloadError::Unsafe(format!(
            "`{repo}` is not a repository id (ORG/NAME of letters, digits, . _ -)"
        )));
    }
    if !revision.split('/').all(part) {
        return Err(DownloadError::Unsafe(format!("`{revision}` is not a revision name")));
    }
    Ok(())
}

fn is_hex(s: &str, len: usize) -> bool {
    s.len() == len && s.bytes().all(|b| b.is_ascii_hexdigit())
}

/// The hub's answer is untrusted: its commit names a folder, its file names name files, its
/// hashes name blobs. (The download's own headers, which hf-hub names its paths after, are
/// checked by `check_download_headers` and `check_written`.)
fn check_answer(repo: &str, info: &RepoInfo) -> Result<(), DownloadError> {
    let bad = |what: String| Err(DownloadError::Unsafe(format!("the hub's answer for `{repo}`: {what}")));
    if !is_hex(&info.sha, 40) {
        let shown: String = info.sha.chars().take(48).collect();
        return bad(format!("the commit `{shown}` is not 40 hexadecimal characters"));
    }
    for file in &info.siblings {
        let name = &file.rfilename;
        let plain = !name.is_empty() && name.split('/').all(|p| !p.is_empty() && p != "." && p != "..");
        if !plain || name.starts_with('/') || name.contains('\\') || name.contains('\0') {
            return bad(format!("the file name `{}` is not a path inside the repository", name.escape_debug()));
        }
        if let Some(lfs) = file.lfs.as_ref().filter(|l| !is_hex(&l.sha256, 64)) {
            return bad(format!(
                "the hash of {name} is not 64 hexadecimal characters (`{}`)",
                lfs.sha256.escape_debug()
            ));
        }
    }
    Ok(())
}

/// Where hf-hub wrote a file must be the repository's `blobs/`, linked from the snapshot: a
/// file written elsewhere (a hub that named another path the second time it was asked) is
/// removed and the download refused.
fn check_written(repo_dir: &Path, snapshot: &Path, written: &Path) -> Result<(), DownloadError> {
    let blobs = repo_dir.join("blobs").canonicalize().ok();
    let blob = written.canonicalize().ok();
    let inside = matches!((&blob, &blobs), (Some(b), Some(dir)) if b.starts_with(dir)) && written.starts_with(snapshot);
    if inside {
        return Ok(());
    }
    if let Some(blob) = blob {
        let _ = std::fs::remove_file(blob);
    }
    let _ = std::fs::remove_file(written);
    Err(DownloadError::Unsafe(format!("hf-hub wrote {} outside the repository's folder", written.display())))
}

/// Files a model needs (weights, configs, tokenizer, template); not other formats' weights.
fn wanted(name: &str) -> bool {
    let base = name.rsplit('/').next().unwrap_or(name);
    !name.contains('/')
        && [".safetensors", ".json", ".jinja", ".txt", ".model", ".tiktoken", ".md"].iter().any(|x| base.ends_with(x))
}

struct Job {
    models_dir: PathBuf,
    options: Options,
    request: Request,
    tx: watch::Sender<Progress>,
    cancel: watch::Receiver<bool>,
}

impl Job {
    async fn run(self) {
        let result = self.fetch().await;
        self.tx.send_modify(|p| match result {
            Ok(dir) => p.state = State::Done(dir),
            Err(DownloadError::Cancelled) => p.state = State::Cancelled,
            Err(e) => {
                p.state = State::Failed(e.to_string());
                p.error = Some(e);
            }
        });
    }

    async fn fetch(&self) -> Result<PathBuf, DownloadError> {
        if self.options.offline {
            return Err(DownloadError::Offline);
        }
        let Request { repo, revision, .. } = &self.request;
        check_names(repo, revision)?;
        let endpoint = self.options.endpoint.trim_end_matches('/').to_string();
        let info = self.repo_info(&endpoint).await?;
        check_answer(repo, &info)?;
        let files: Vec<Sibling> = info.siblings.into_iter().filter(|s| wanted(&s.rfilename)).collect();
        let size = |s: &Sibling| s.lfs.as_ref().map(|l| l.size).or(s.size).unwrap_or(0);
        let repo_dir = self.models_dir.join(layout::repo_folder(repo));
        let snapshot = repo_dir.join("snapshots").join(&info.sha);
        let missing: Vec<&Sibling> = files.iter().filter(|s| !snapshot.join(&s.rfilename).exists()).collect();
        let total: u64 = files.iter().map(size).sum();
        let already = total - missing.iter().map(|s| size(s)).sum::<u64>();
        self.check_space(&repo_dir, missing.iter().map(|s| size(s)).sum())?;

        let done = Arc::new(AtomicU64::new(already));
        self.tx.send_modify(|p| {
            p.state = State::Downloading;
            p.total_bytes = total;
            p.done_bytes = already;
        });
        let api = ApiBuilder::from_cache(Cache::new(self.models_dir.clone()))
            .with_endpoint(endpoint.clone())
            .with_token(self.options.token.clone())
            .with_progress(false)
            .with_chunk_size(Some(self.options.chunk_bytes.max(1)))
            .build()
            .map_err(|e| DownloadError::Network { endpoint: endpoint.clone(), message: e.to_string() })?;
        let api_repo = api.repo(Repo::with_revision(repo.clone(), RepoType::Model, revision.clone()));
        let started = Instant::now();
        for file in missing {
            self.tx.send_modify(|p| p.file = file.rfilename.clone());
            let mut attempt = 0;
            loop {
                let before = done.load(Ordering::Relaxed);
                let counter = Counter {
                    done: done.clone(),
                    tx: self.tx.clone(),
                    started,
                    from: already,
                    last: Arc::new(Mutex::new(Instant::now())),
                };
                let mut cancel = self.cancel.clone();
                self.check_download_headers(&endpoint, &info.sha, &file.rfilename).await?;
                let result = tokio::select! {
                    r = api_repo.download_with_progress(&file.rfilename, counter) => r,
                    _ = cancel.wait_for(|c| *c) => return Err(DownloadError::Cancelled),
                };
                match result {
                    Ok(written) => {
                        check_written(&repo_dir, &snapshot, &written)?;
                        break;
                    }
                    Err(e) => {
                        let e = self.classify(&repo_dir, &file.rfilename, e);
                        let resumable = matches!(e, DownloadError::Interrupted { .. } | DownloadError::Network { .. });
                        if !resumable || attempt >= self.options.retries {
                            return Err(e);
                        }
                        attempt += 1;
                        tracing::warn!("{repo}: {e}; resuming (attempt {attempt})");
                        // What the interrupted attempt counted is counted again on resume.
                        done.store(before, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
            done.store(complete_bytes(&files, &snapshot, size), Ordering::Relaxed);
        }
        self.tx.send_modify(|p| {
            p.state = State::Verifying;
            p.done_bytes = total;
        });
        self.verify(&snapshot, &files)?;
        // The revision's ref, for tools that resolve it (hf-hub writes it too; be explicit).
        let refs = repo_dir.join("refs");
        let _ = std::fs::create_dir_all(&refs);
        let _ = std::fs::write(refs.join(revision), &info.sha);
        Ok(snapshot)
    }

    /// hf-hub names a file's blob after the `ETag` (or `X-Linked-Etag`) header of its download
    /// and its snapshot folder after `X-Repo-Commit`, as the hub sends them. Before hf-hub
    /// asks, Ferrite asks the same way and refuses values that are not the hashes they should
    /// be (a hub whose second answer differs is caught after the download: `check_written`).
    async fn check_download_headers(&self, endpoint: &str, commit: &str, file: &str) -> Result<(), DownloadError> {
        let Request { repo, revision, .. } = &self.request;
        let url = format!("{endpoint}/{repo}/resolve/{}/{file}", revision.replace('/', "%2F"));
        let network =
            |e: reqwest::Error| DownloadError::Network { endpoint: endpoint.to_string(), message: e.to_string() };
        let client = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().map_err(network)?;
        let mut req = client.get(&url).header(reqwest::header::RANGE, "bytes=0-0");
        if let Some(token) = &self.options.token {
            req = req.bearer_auth(token);
        }
        let res = req.send().await.map_err(network)?;
        let header = |name: &str| res.headers().get(name).and_then(|v| v.to_str().ok()).map(|v| v.replace('"', ""));
        let bad = |what: String| Err(DownloadError::Unsafe(format!("the hub's answer for `{repo}`: {what}")));
        if let Some(etag) = header("x-linked-etag").or_else(|| header("etag")) {
            if !(is_hex(&etag, 40) || is_hex(&etag, 64)) {
                return bad(format!("the ETag of {file} (`{}`) is not a hash", etag.escape_debug()));
            }
        }
        if let Some(head) = header("x-repo-commit").filter(|c| c != commit) {
            return bad(format!("the commit of {file} (`{}`) is not the repository's `{commit}`", head.escape_debug()));
        }
        Ok(())
    }

    async fn repo_info(&self, endpoint: &str) -> Result<RepoInfo, DownloadError> {
        let Request { repo, revision, .. } = &self.request;
        let url = format!("{endpoint}/api/models/{repo}/revision/{revision}?blobs=true");
        let network =
            |e: reqwest::Error| DownloadError::Network { endpoint: endpoint.to_string(), message: e.to_string() };
        let mut req = reqwest::Client::new().get(&url);
        if let Some(token) = &self.options.token {
            req = req.bearer_auth(token);
        }
        let res = req.send().await.map_err(network)?;
        if res.status() == reqwest::StatusCode::NOT_FOUND {
            return Err(DownloadError::NotFound { repo: repo.clone(), revision: revision.clone() });
        }
        res.error_for_status().map_err(network)?.json().await.map_err(network)
    }

    fn check_space(&self, repo_dir: &Path, missing_bytes: u64) -> Result<(), DownloadError> {
        std::fs::create_dir_all(repo_dir).map_err(|_| DownloadError::FolderGone { dir: self.models_dir.clone() })?;
        // Bytes already in unfinished files need no new space.
        let needed = missing_bytes.saturating_sub(layout::partial_bytes(repo_dir));
        let available =
            (self.options.space)(repo_dir).map_err(|_| DownloadError::FolderGone { dir: self.models_dir.clone() })?;
        let margin = self.options.margin_bytes;
        if available < needed + margin {
            return Err(DownloadError::NoSpace {
                dir: repo_dir.to_path_buf(),
                needed: needed + margin,
                available,
                margin,
            });
        }
        Ok(())
    }

    /// Turns hf-hub's error into one that says what happened to the user's data.
    fn classify(&self, repo_dir: &Path, file: &str, e: ApiError) -> DownloadError {
        if !self.models_dir.exists() {
            return DownloadError::FolderGone { dir: self.models_dir.clone() };
        }
        // The patched hf-hub (third_party/hf-hub.patch) refuses an ETag or commit header that
        // is not a hash, before it names a path after it.
        if let ApiError::InvalidHeader(header) = &e {
            let repo = &self.request.repo;
            return DownloadError::Unsafe(format!(
                "the hub's answer for `{repo}`: the `{header}` header of {file} is not a hash: refused before anything was written"
            ));
        }
        let io = match &e {
            ApiError::IoError(io) => Some(io),
            ApiError::TooManyRetries(inner) => match inner.as_ref() {
                ApiError::IoError(io) => Some(io),
                _ => None,
            },
            _ => None,
        };
        if let Some(io) = io {
            if io.raw_os_error() == Some(28) || io.kind() == std::io::ErrorKind::StorageFull {
                let kept = std::fs::read_dir(repo_dir.join("blobs"))
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter_map(|e| e.metadata().ok())
                    .map(|m| m.len())
                    .sum();
                return DownloadError::DiskFull { dir: repo_dir.to_path_buf(), kept };
            }
        }
        DownloadError::Interrupted { file: file.to_string(), message: e.to_string() }
    }

    /// Every file against the hub's hash, then the folder's own checks. A bad file is
    /// removed (blob and link) so the next pull fetches it again.
    fn verify(&self, snapshot: &Path, files: &[Sibling]) -> Result<(), DownloadError> {
        for file in files {
            let link = snapshot.join(&file.rfilename);
            let blob = link.canonicalize().map_err(|e| DownloadError::Corrupt(format!("{}: {e}", link.display())))?;
            let etag = blob.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let expected = file.lfs.as_ref().map(|l| l.sha256.clone()).unwrap_or(etag);
            let size_ok = file
                .lfs
                .as_ref()
                .map(|l| l.size)
                .or(file.size)
                .is_none_or(|s| blob.metadata().is_ok_and(|m| m.len() == s));
            let check = if size_ok {
                verify::check_hash(&blob, &expected).map_err(|e| e.to_string())
            } else {
                Err(format!("{}: wrong size", file.rfilename))
            };
            if let Err(why) = check {
                let _ = std::fs::remove_file(&blob);
                let _ = std::fs::remove_file(&link);
                return Err(DownloadError::Corrupt(format!("{}: {why}", file.rfilename)));
            }
        }
        let expect_mtp = match self.request.kind {
            Kind::Drafter => {
                // The engine checks a drafter against its target when it loads the pair.
                verify::check_drafter_dir(snapshot).map_err(|e| DownloadError::Corrupt(e.to_string()))?;
                return Ok(());
            }
            Kind::Model { expect_mtp } => expect_mtp,
        };
        verify::check_model_dir(snapshot, expect_mtp).map_err(|e| DownloadError::Corrupt(e.to_string()))?;
        if let Some(check) = &self.options.model_check {
            if let Err(why) = check(snapshot) {
                // Not a model that runs: nothing of it stays to be listed as installed.
                for file in files {
                    let link = snapshot.join(&file.rfilename);
                    if let Ok(blob) = link.canonicalize() {
                        let _ = std::fs::remove_file(blob);
                    }
                    let _ = std::fs::remove_file(&link);
                }
                let _ = std::fs::remove_dir_all(snapshot);
                return Err(DownloadError::Corrupt(format!("the model does not load: {why}")));
            }
        }
        Ok(())
    }
}

/// Bytes of the files already complete in the snapshot (the progress after each file).
fn complete_bytes(files: &[Sibling], snapshot: &Path, size: impl Fn(&Sibling) -> u64) -> u64 {
    files.iter().filter(|s| snapshot.join(&s.rfilename).exists()).map(size).sum()
}

/// hf-hub's progress callback: adds to the shared count and, at most every 100 ms, tells
/// the watchers (rate and ETA over the whole download).
#[derive(Clone)]
struct Counter {
    done: Arc<AtomicU64>,
    tx: watch::Sender<Progress>,
    started: Instant,
    /// Bytes that were already there when this pull started (not part of the rate).
    from: u64,
    last: Arc<Mutex<Instant>>,
}

impl hf_hub::api::tokio::Progress for Counter {
    async fn init(&mut self, _size: usize, _filename: &str) {}

    async fn update(&mut self, size: usize) {
        let done = self.done.fetch_add(size as u64, Ordering::Relaxed) + size as u64;
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() < Duration::from_millis(100) {
            return;
        }
        *last = Instant::now();
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        let rate = done.saturating_sub(self.from) as f64 / secs;
        self.tx.send_modify(|p| {
            p.done_bytes = done.min(p.total_bytes);
            p.bytes_per_s = rate;
            p.eta_s = (rate > 0.0).then(|| p.total_bytes.saturating_sub(done) as f64 / rate);
        });
    }

    async fn finish(&mut self) {}
}
