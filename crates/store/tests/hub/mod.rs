//! A local server speaking the hub endpoints hf-hub uses, over project-made checkpoints:
//! repo info with file sizes and LFS hashes, `resolve/{revision}/{file}` with ETags, an
//! absolute redirect for LFS files (as the hub sends to its CDN) and Range requests. Faults
//! can be injected: a connection dropped after N bytes, a corrupted file, a slow stream.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use engine::checkpoint::{self, Architecture, MakeOptions};
use sha1::Digest;

pub struct File {
    pub name: String,
    pub bytes: Arc<Vec<u8>>,
    pub lfs: bool,
    pub etag: String,
}

#[derive(Default)]
pub struct Faults {
    /// Drop the connection of the request that reaches this byte offset of the file, once.
    pub drop_after: HashMap<String, usize>,
    /// Serve these files with one byte flipped (the ETag stays the true one).
    pub corrupt: HashSet<String>,
    /// Sleep this long between 16 KiB pieces of every body.
    pub slow: Option<Duration>,
    /// A hostile answer: this commit instead of the true one ...
    pub commit: Option<String>,
    /// ... this name for the first file ...
    pub first_name: Option<String>,
    /// ... this LFS hash for every LFS file ...
    pub sha256: Option<String>,
    /// ... these download headers (what hf-hub names its blob and snapshot folders after).
    pub etag_header: Option<String>,
    pub commit_header: Option<String>,
    /// ... and those headers only from this many resolve requests on: a hub whose second
    /// answer for a file differs from its first.
    pub headers_after: usize,
}

/// A repository's commit hash and files.
type Repo = (String, Vec<Arc<File>>);

#[derive(Default)]
pub struct Hub {
    pub repos: Mutex<HashMap<String, Repo>>,
    pub faults: Mutex<Faults>,
    /// `(repo, file, first byte)` of every body request.
    pub ranges: Mutex<Vec<(String, String, u64)>>,
    /// How many resolve requests were answered.
    pub resolves: std::sync::atomic::AtomicUsize,
}

pub struct Running {
    pub endpoint: String,
    pub hub: Arc<Hub>,
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

impl Hub {
    /// Publishes the files of `dir` as `repo` at a commit named after the content.
    pub fn publish(&self, repo: &str, dir: &Path) {
        let mut files = Vec::new();
        let mut names: Vec<_> = std::fs::read_dir(dir).unwrap().flatten().map(|e| e.path()).collect();
        names.sort();
        let mut commit = sha1::Sha1::new();
        for path in names {
            let bytes = std::fs::read(&path).unwrap();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let lfs = name.ends_with(".safetensors");
            let etag = if lfs {
                hex(&sha2::Sha256::digest(&bytes))
            } else {
                let mut h = sha1::Sha1::new();
                h.update(format!("blob {}\0", bytes.len()).as_bytes());
                h.update(&bytes);
                hex(&h.finalize())
            };
            commit.update(etag.as_bytes());
            files.push(Arc::new(File { name, bytes: Arc::new(bytes), lfs, etag }));
        }
        self.repos.lock().unwrap().insert(repo.to_string(), (hex(&commit.finalize()), files));
    }

    /// The repository's safetensors files, largest first.
    pub fn shards(&self, repo: &str) -> Vec<String> {
        let repos = self.repos.lock().unwrap();
        let mut files: Vec<_> =
            repos[repo].1.iter().filter(|f| f.lfs).map(|f| (f.bytes.len(), f.name.clone())).collect();
        files.sort_by(|a, b| b.cmp(a));
        files.into_iter().map(|(_, n)| n).collect()
    }

    fn file(&self, repo: &str, name: &str) -> Option<(String, Arc<File>)> {
        let repos = self.repos.lock().unwrap();
        let (commit, files) = repos.get(repo)?;
        files.iter().find(|f| f.name == name).map(|f| (commit.clone(), f.clone()))
    }
}

/// Makes a tiny project checkpoint (a hybrid with an MTP head unless `mtp` is false).
pub fn checkpoint(dir: &Path, mtp: bool, seed: u64) {
    let mut o = MakeOptions::new(Architecture::Qwen35, "tiny");
    o.bits = Some(8);
    o.group_size = 64;
    o.mtp = mtp;
    o.seed = seed;
    // Several shards, so an index names them.
    o.shard_bytes = 150_000;
    checkpoint::make(&o, dir).unwrap();
}

pub async fn start() -> Running {
    let hub = Arc::new(Hub::default());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    // The CDN is another host, as on the hub (hf-hub follows only same-host redirects when
    // it reads the metadata).
    let cdn_base = format!("http://localhost:{}", listener.local_addr().unwrap().port());
    let app = Router::new()
        .route("/api/models/{org}/{name}/revision/{rev}", get(info))
        .route("/{org}/{name}/resolve/{rev}/{file}", get(resolve))
        .route("/cdn/{org}/{name}/{file}", get(cdn))
        .with_state((hub.clone(), cdn_base));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Running { endpoint, hub }
}

type St = State<(Arc<Hub>, String)>;

async fn info(State((hub, _)): St, UrlPath((org, name, _rev)): UrlPath<(String, String, String)>) -> Response {
    let repos = hub.repos.lock().unwrap();
    let Some((commit, files)) = repos.get(&format!("{org}/{name}")) else {
        return (StatusCode::NOT_FOUND, Json(serde_json::json!({"error": "Repository not found"}))).into_response();
    };
    let faults = hub.faults.lock().unwrap();
    let siblings: Vec<_> = files
        .iter()
        .enumerate()
        .map(|(i, f)| {
            let name = faults.first_name.clone().filter(|_| i == 0).unwrap_or_else(|| f.name.clone());
            let mut s = serde_json::json!({"rfilename": name, "size": f.bytes.len(), "blobId": f.etag});
            if f.lfs {
                let sha = faults.sha256.clone().unwrap_or_else(|| f.etag.clone());
                s["lfs"] = serde_json::json!({"sha256": sha, "size": f.bytes.len()});
            }
            s
        })
        .collect();
    let commit = faults.commit.clone().unwrap_or_else(|| commit.clone());
    Json(serde_json::json!({"id": format!("{org}/{name}"), "sha": commit, "siblings": siblings})).into_response()
}

async fn resolve(
    State((hub, cdn_base)): St,
    UrlPath((org, name, _rev, file)): UrlPath<(String, String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let repo = format!("{org}/{name}");
    let Some((commit, f)) = hub.file(&repo, &file) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    let seen = hub.resolves.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let (commit, etag) = {
        let faults = hub.faults.lock().unwrap();
        if seen >= faults.headers_after {
            (
                faults.commit_header.clone().unwrap_or(commit),
                faults.etag_header.clone().unwrap_or_else(|| f.etag.clone()),
            )
        } else {
            (commit, f.etag.clone())
        }
    };
    if f.lfs {
        // As the hub does for LFS files: metadata on the redirect, bytes from elsewhere.
        return Response::builder()
            .status(StatusCode::FOUND)
            .header("location", format!("{cdn_base}/cdn/{repo}/{file}"))
            .header("x-repo-commit", commit)
            .header("x-linked-etag", format!("\"{etag}\""))
            .header("x-linked-size", f.bytes.len())
            .body(Body::empty())
            .unwrap();
    }
    body(&hub, &repo, &f, &headers, Some((commit, etag)))
}

async fn cdn(
    State((hub, _)): St,
    UrlPath((org, name, file)): UrlPath<(String, String, String)>,
    headers: HeaderMap,
) -> Response {
    let repo = format!("{org}/{name}");
    let Some((_, f)) = hub.file(&repo, &file) else {
        return StatusCode::NOT_FOUND.into_response();
    };
    body(&hub, &repo, &f, &headers, None)
}

/// The file's bytes, or the requested range of them, with the injected faults.
fn body(hub: &Hub, repo: &str, f: &File, headers: &HeaderMap, commit: Option<(String, String)>) -> Response {
    let len = f.bytes.len() as u64;
    let (start, end) = headers
        .get("range")
        .and_then(|r| r.to_str().ok())
        .and_then(|r| r.strip_prefix("bytes="))
        .and_then(|r| r.split_once('-'))
        .map(|(a, b)| (a.parse().unwrap_or(0), b.parse().unwrap_or(len - 1).min(len - 1)))
        .unwrap_or((0, len - 1));
    let mut data = f.bytes[start as usize..=end as usize].to_vec();
    let (drop_after, slow) = {
        let mut faults = hub.faults.lock().unwrap();
        if faults.corrupt.contains(&f.name) && !data.is_empty() {
            let mid = data.len() / 2;
            data[mid] ^= 0xff;
        }
        // Only body requests (not hf-hub's one-byte metadata probe) count and fail.
        let body_request = end > start;
        if body_request {
            hub.ranges.lock().unwrap().push((repo.to_string(), f.name.clone(), start));
        }
        let reaches = |offset: &usize| body_request && (start..=end).contains(&(*offset as u64));
        let drop_after = match faults.drop_after.get(&f.name) {
            Some(offset) if reaches(offset) => faults.drop_after.remove(&f.name).map(|o| o - start as usize),
            _ => None,
        };
        (drop_after, faults.slow)
    };
    let pieces: Vec<Vec<u8>> = data.chunks(16 << 10).map(|c| c.to_vec()).collect();
    let stream = futures_util::stream::unfold((pieces.into_iter(), 0usize), move |(mut it, sent)| async move {
        let piece = it.next()?;
        if let Some(slow) = slow {
            tokio::time::sleep(slow).await;
        }
        if drop_after.is_some_and(|n| sent + piece.len() > n) {
            return Some((
                Err(std::io::Error::other("connection dropped by the test hub")),
                (Vec::new().into_iter(), usize::MAX),
            ));
        }
        let n = piece.len();
        Some((Ok::<_, std::io::Error>(piece), (it, sent + n)))
    });
    let mut r = Response::builder()
        .status(StatusCode::PARTIAL_CONTENT)
        .header("content-range", format!("bytes {start}-{end}/{len}"))
        .header("accept-ranges", "bytes")
        .header("content-length", end - start + 1);
    if let Some((commit, etag)) = commit {
        r = r.header("x-repo-commit", commit).header("etag", format!("\"{etag}\""));
    }
    r.body(Body::from_stream(stream)).unwrap()
}
