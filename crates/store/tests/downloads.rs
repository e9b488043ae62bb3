//! Downloads against a local hub (tests/hub): complete, resumed, corrupt, no space, the
//! folder vanishing, concurrent pulls, offline, and what the listing shows meanwhile.

mod hub;

use std::sync::Arc;
use std::time::Duration;

use store::download::{DownloadError, Downloader, Options, Request, State};
use store::Store;

struct Setup {
    _tmp: tempfile::TempDir,
    store: Store,
    hub: hub::Running,
}

async fn setup(repos: &[(&str, bool)]) -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let hub = hub::start().await;
    for (i, (repo, mtp)) in repos.iter().enumerate() {
        let dir = tmp.path().join(format!("src{i}"));
        hub::checkpoint(&dir, *mtp, i as u64);
        hub.hub.publish(repo, &dir);
    }
    let mut store = Store::open(&tmp.path().join("config")).unwrap();
    store.set_models_dir(&tmp.path().join("models")).unwrap();
    // Only what the test puts in the models folder (not the embedded model).
    store.assets_dir = tmp.path().join("no-assets");
    Setup { _tmp: tmp, store, hub }
}

fn options(s: &Setup) -> Options {
    Options {
        endpoint: s.hub.endpoint.clone(),
        token: None,
        space: Arc::new(|p: &std::path::Path| fs4::available_space(p)),
        margin_bytes: 0,
        retries: 0,
        chunk_bytes: 64 << 10,
        offline: false,
        model_check: None,
    }
}

fn request(repo: &str, mtp: bool) -> Request {
    Request::model(repo.into(), "main".into(), mtp)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_complete_download_is_verified_installed_and_loads() {
    let s = setup(&[("test/hybrid", true)]).await;
    let d = Downloader::new(s.store.models_dir.clone(), options(&s));
    let pull = d.pull(request("test/hybrid", true));
    let dir = pull.wait().await.unwrap();
    let last = pull.progress().borrow().clone();
    assert!(matches!(last.state, State::Done(_)));
    assert_eq!(last.done_bytes, last.total_bytes);
    assert!(last.total_bytes > 200_000, "{}", last.total_bytes);
    // Installed, in the hub layout other tools read, resolvable by repository.
    let listing = s.store.list();
    assert_eq!(listing.installed.len(), 1, "{listing:?}");
    assert!(listing.installed[0].has_mtp);
    assert!(dir.starts_with(s.store.models_dir.join("models--test--hybrid/snapshots")));
    assert_eq!(s.store.resolve("test/hybrid").unwrap().dir, dir);
    let engine = engine::Engine::load(&dir).unwrap();
    assert!(engine.model().mtp().is_some());
    // Pulling again downloads nothing.
    let before = s.hub.hub.ranges.lock().unwrap().len();
    d.pull(request("test/hybrid", true)).wait().await.unwrap();
    assert_eq!(s.hub.hub.ranges.lock().unwrap().len(), before);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_interrupted_download_resumes_where_it_stopped() {
    let s = setup(&[("test/hybrid", true)]).await;
    let shard = s.hub.hub.shards("test/hybrid")[0].clone();
    s.hub.hub.faults.lock().unwrap().drop_after.insert(shard.clone(), 100_000);
    let d = Downloader::new(s.store.models_dir.clone(), options(&s));
    let err = d.pull(request("test/hybrid", true)).wait().await.unwrap_err();
    assert!(matches!(err, DownloadError::Interrupted { ref file, .. } if *file == shard), "{err}");
    // Not installed meanwhile; the partial data is kept.
    let listing = s.store.list();
    assert!(listing.installed.is_empty());
    assert!(listing.incomplete.iter().any(|i| i.partial_bytes > 0), "{listing:?}");
    assert!(s.store.resolve("test/hybrid").is_err());
    d.pull(request("test/hybrid", true)).wait().await.unwrap();
    let ranges = s.hub.hub.ranges.lock().unwrap().clone();
    let resumed_from = ranges.iter().filter(|(_, f, _)| *f == shard).map(|(_, _, start)| *start).max().unwrap();
    assert!(resumed_from > 0, "{ranges:?}");
    assert_eq!(s.store.list().installed.len(), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn automatic_retry_resumes_a_dropped_connection() {
    let s = setup(&[("test/hybrid", true)]).await;
    let shard = s.hub.hub.shards("test/hybrid")[0].clone();
    s.hub.hub.faults.lock().unwrap().drop_after.insert(shard, 100_000);
    let d = Downloader::new(s.store.models_dir.clone(), Options { retries: 2, ..options(&s) });
    d.pull(request("test/hybrid", true)).wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_corrupt_file_is_caught_and_removed() {
    let s = setup(&[("test/hybrid", true)]).await;
    let shard = s.hub.hub.shards("test/hybrid")[1].clone();
    s.hub.hub.faults.lock().unwrap().corrupt.insert(shard.clone());
    let d = Downloader::new(s.store.models_dir.clone(), options(&s));
    let err = d.pull(request("test/hybrid", true)).wait().await.unwrap_err();
    assert!(matches!(err, DownloadError::Corrupt(ref m) if m.contains(&shard)), "{err}");
    assert!(s.store.list().installed.is_empty());
    // Once the hub serves the right bytes, only that file is fetched again.
    s.hub.hub.faults.lock().unwrap().corrupt.clear();
    s.hub.hub.ranges.lock().unwrap().clear();
    d.pull(request("test/hybrid", true)).wait().await.unwrap();
    let files: std::collections::BTreeSet<String> =
        s.hub.hub.ranges.lock().unwrap().iter().map(|(_, f, _)| f.clone()).collect();
    assert_eq!(files.into_iter().collect::<Vec<_>>(), vec![shard]);
}

#[tokio::test(flavor = "multi_thread")]
async fn not_enough_space_is_refused_before_any_byte() {
    let s = setup(&[("test/hybrid", true)]).await;
    let probe_dir = Arc::new(std::sync::Mutex::new(None));
    let seen = probe_dir.clone();
    let space = Arc::new(move |p: &std::path::Path| {
        *seen.lock().unwrap() = Some(p.to_path_buf());
        Ok(10_000)
    });
    let d = Downloader::new(s.store.models_dir.clone(), Options { space, ..options(&s) });
    let err = d.pull(request("test/hybrid", true)).wait().await.unwrap_err();
    assert!(matches!(err, DownloadError::NoSpace { available: 10_000, .. }), "{err}");
    assert!(err.to_string().contains("not enough space"));
    // The volume asked is the one that holds the models folder, not the boot volume.
    assert!(probe_dir.lock().unwrap().as_ref().unwrap().starts_with(&s.store.models_dir));
    assert!(s.hub.hub.ranges.lock().unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_folder_vanishing_stops_the_download_cleanly() {
    let s = setup(&[("test/hybrid", true)]).await;
    s.hub.hub.faults.lock().unwrap().slow = Some(Duration::from_millis(20));
    let d = Downloader::new(s.store.models_dir.clone(), options(&s));
    let pull = d.pull(request("test/hybrid", true));
    let mut progress = pull.progress();
    progress.wait_for(|p| p.done_bytes > 0).await.unwrap();
    std::fs::remove_dir_all(&s.store.models_dir).unwrap();
    let err = tokio::time::timeout(Duration::from_secs(60), pull.wait()).await.unwrap().unwrap_err();
    assert!(matches!(err, DownloadError::FolderGone { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_pulls_share_one_download_per_model() {
    let s = setup(&[("test/a", true), ("test/b", false)]).await;
    s.hub.hub.faults.lock().unwrap().slow = Some(Duration::from_millis(2));
    let d = Downloader::new(s.store.models_dir.clone(), options(&s));
    let a1 = d.pull(request("test/a", true));
    let a2 = d.pull(request("test/a", true));
    let b = d.pull(request("test/b", false));
    assert!(Arc::ptr_eq(&a1, &a2));
    let (ra1, ra2, rb) = tokio::join!(a1.wait(), a2.wait(), b.wait());
    assert_eq!(ra1.unwrap(), ra2.unwrap());
    rb.unwrap();
    // Each byte range of each file was asked for once.
    let ranges = s.hub.hub.ranges.lock().unwrap().clone();
    let unique: std::collections::BTreeSet<_> = ranges.iter().cloned().collect();
    assert_eq!(unique.len(), ranges.len(), "{ranges:?}");
    assert_eq!(s.store.list().installed.len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_keeps_the_partial_data() {
    let s = setup(&[("test/hybrid", true)]).await;
    s.hub.hub.faults.lock().unwrap().slow = Some(Duration::from_millis(20));
    let d = Downloader::new(s.store.models_dir.clone(), options(&s));
    let pull = d.pull(request("test/hybrid", true));
    pull.progress().wait_for(|p| p.done_bytes > 100_000).await.unwrap();
    pull.cancel();
    assert_eq!(pull.wait().await.unwrap_err(), DownloadError::Cancelled);
    assert!(s.store.list().installed.is_empty());
    s.hub.hub.faults.lock().unwrap().slow = None;
    d.pull(request("test/hybrid", true)).wait().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn offline_and_unknown_repositories_say_so() {
    let s = setup(&[("test/hybrid", true)]).await;
    let d = Downloader::new(s.store.models_dir.clone(), Options { offline: true, ..options(&s) });
    assert_eq!(d.pull(request("test/hybrid", true)).wait().await.unwrap_err(), DownloadError::Offline);
    let d = Downloader::new(s.store.models_dir.clone(), options(&s));
    let err = d.pull(request("test/none", false)).wait().await.unwrap_err();
    assert!(matches!(err, DownloadError::NotFound { .. }), "{err}");
    let d =
        Downloader::new(s.store.models_dir.clone(), Options { endpoint: "http://127.0.0.1:9".into(), ..options(&s) });
    let err = d.pull(request("test/hybrid", true)).wait().await.unwrap_err();
    assert!(matches!(err, DownloadError::Network { .. }), "{err}");
    // A promised MTP head that is missing fails verification.
    let s = setup(&[("test/plain", false)]).await;
    let d = Downloader::new(s.store.models_dir.clone(), options(&s));
    let err = d.pull(request("test/plain", true)).wait().await.unwrap_err();
    assert!(err.to_string().contains("MTP"), "{err}");
}

/// Unmounts the test's small tmpfs, whatever happens.
struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).status();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_disk_filling_up_mid_download_stops_cleanly_and_keeps_the_data() {
    let s = setup(&[("test/hybrid", true)]).await;
    let volume = s._tmp.path().join("small-volume");
    std::fs::create_dir_all(&volume).unwrap();
    let mounted =
        std::process::Command::new("mount").args(["-t", "tmpfs", "-o", "size=200k", "tmpfs"]).arg(&volume).status();
    if !mounted.is_ok_and(|st| st.success()) {
        eprintln!("SKIPPED: mounting a small tmpfs needs root (CI runs as root)");
        return;
    }
    let _guard = Mount(volume.clone());
    // The free-space check passes (another program fills the disk after it).
    let space = Arc::new(|_: &std::path::Path| Ok(u64::MAX / 4));
    let d = Downloader::new(volume.clone(), Options { space, ..options(&s) });
    let err = d.pull(request("test/hybrid", true)).wait().await.unwrap_err();
    let DownloadError::DiskFull { kept, .. } = err else { panic!("{err}") };
    assert!(kept > 0, "the bytes downloaded so far stay for a resume");
    let mut store = s.store.clone();
    store.models_dir = volume;
    assert!(store.list().installed.is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_names_and_hub_answers_never_reach_a_path() {
    let s = setup(&[("test/hybrid", true)]).await;
    let d = Downloader::new(s.store.models_dir.clone(), options(&s));
    let outside = s.store.models_dir.parent().unwrap().to_path_buf();
    let before: Vec<_> = std::fs::read_dir(&outside).unwrap().flatten().map(|e| e.file_name()).collect();
    // Names in the request.
    for (repo, revision) in
        [("../escape/x", "main"), ("test/..", "main"), ("a/b/c", "main"), ("test/hybrid", "../../x")]
    {
        let err = d.pull(Request::model(repo.into(), revision.into(), false)).wait().await;
        let err = err.unwrap_err();
        assert!(matches!(err, DownloadError::Unsafe(_)), "{repo}@{revision}: {err}");
        assert!(err.to_string().contains("refused"), "{err}");
    }
    // Values in the hub's answer: a commit, a file name, a hash, headers that would name paths.
    type Fault = fn(&mut hub::Faults);
    let hostile: [(Fault, &str); 6] = [
        (|f| f.commit = Some("../../../../escaped".into()), "commit"),
        (|f| f.commit = Some("g".repeat(40)), "commit"),
        (|f| f.first_name = Some("../../../escaped.json".into()), "file name"),
        (|f| f.sha256 = Some("../../escaped".into()), "hash"),
        // The download's own headers, which hf-hub names its blob and snapshot after.
        (|f| f.etag_header = Some("../../../../escaped-blob".into()), "ETag"),
        (|f| f.commit_header = Some("../../../../escaped-snapshot".into()), "commit"),
    ];
    for (fault, what) in hostile {
        *s.hub.hub.faults.lock().unwrap() = Default::default();
        fault(&mut s.hub.hub.faults.lock().unwrap());
        let err = d.pull(request("test/hybrid", true)).wait().await.unwrap_err();
        assert!(matches!(err, DownloadError::Unsafe(_)) && err.to_string().contains(what), "{what}: {err}");
    }
    // A hub that answers Ferrite's own header check truly and hf-hub's request for the same
    // file with paths: hf-hub (patched, third_party/hf-hub.patch) refuses them before writing.
    let second_answer: [(Fault, &str); 2] = [
        (|f| f.etag_header = Some("../../../escaped-blob".into()), "etag"),
        (|f| f.commit_header = Some("../../../escaped-snapshot".into()), "x-repo-commit"),
    ];
    for (fault, what) in second_answer {
        let mut faults = hub::Faults {
            headers_after: s.hub.hub.resolves.load(std::sync::atomic::Ordering::SeqCst) + 1,
            ..Default::default()
        };
        fault(&mut faults);
        *s.hub.hub.faults.lock().unwrap() = faults;
        let err = d.pull(request("test/hybrid", true)).wait().await.unwrap_err();
        assert!(err.to_string().contains(what), "{what}: {err}");
    }
    let after: Vec<_> = std::fs::read_dir(&outside).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(before, after, "nothing was created beside the models folder");
    assert!(s.store.list().installed.is_empty(), "nothing counts as installed");
    // The true answer still installs.
    *s.hub.hub.faults.lock().unwrap() = Default::default();
    d.pull(request("test/hybrid", true)).wait().await.unwrap();
}
