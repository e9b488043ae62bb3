//! The models folder without the network: what other tools put there shows up (and the
//! watcher says so), deletion frees what no other snapshot uses, folders register in place.

mod hub;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use store::Store;

/// Lays `src` out as another hub tool would: blobs by hash, snapshot links, a ref.
fn place_like_another_tool(models: &Path, repo: &str, commit: &str, src: &Path) {
    let repo_dir = models.join(store::layout::repo_folder(repo));
    let blobs = repo_dir.join("blobs");
    let snap = repo_dir.join("snapshots").join(commit);
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snap).unwrap();
    for f in std::fs::read_dir(src).unwrap().flatten() {
        let bytes = std::fs::read(f.path()).unwrap();
        let blob = format!("{:x}", bytes.len() as u64 * 1_000_003 + bytes.iter().map(|b| *b as u64).sum::<u64>());
        std::fs::write(blobs.join(&blob), &bytes).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(f.file_name())).unwrap();
    }
    std::fs::create_dir_all(repo_dir.join("refs")).unwrap();
    std::fs::write(repo_dir.join("refs").join("main"), commit).unwrap();
}

fn open(tmp: &Path) -> Store {
    let mut store = Store::open(&tmp.join("config")).unwrap();
    store.set_models_dir(&tmp.join("models")).unwrap();
    store.assets_dir = tmp.join("no-assets");
    store
}

#[test]
fn a_model_another_tool_adds_is_listed_and_the_watcher_notices() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path());
    let changes = Arc::new(AtomicUsize::new(0));
    let seen = changes.clone();
    let _watcher = store::watch::watch(&store.models_dir, Duration::from_millis(100), move || {
        seen.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    assert!(store.list().installed.is_empty());
    let src = tmp.path().join("src");
    hub::checkpoint(&src, false, 1);
    place_like_another_tool(&store.models_dir, "other/tool-model", "abc123", &src);
    let listing = store.list();
    assert_eq!(listing.installed.len(), 1, "{listing:?}");
    assert_eq!(listing.installed[0].id, "other/tool-model");
    assert_eq!(
        store.resolve("other/tool-model").unwrap().dir,
        store.models_dir.join("models--other--tool-model/snapshots/abc123")
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while changes.load(Ordering::SeqCst) == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(changes.load(Ordering::SeqCst) >= 1);
    // A snapshot missing a shard is listed as incomplete, never as installed.
    let snap = store.models_dir.join("models--other--tool-model/snapshots/abc123");
    let shard = std::fs::read_dir(&snap)
        .unwrap()
        .flatten()
        .find(|f| f.file_name().to_string_lossy().starts_with("model-"))
        .unwrap();
    std::fs::remove_file(shard.path()).unwrap();
    let listing = store.list();
    assert!(listing.installed.is_empty());
    assert!(listing.incomplete[0].reason.contains("missing"), "{:?}", listing.incomplete);
}

#[test]
fn delete_frees_what_no_other_snapshot_uses() {
    let tmp = tempfile::tempdir().unwrap();
    let mut store = open(tmp.path());
    let src = tmp.path().join("src");
    hub::checkpoint(&src, false, 1);
    place_like_another_tool(&store.models_dir, "org/m", "old", &src);
    place_like_another_tool(&store.models_dir, "org/m", "new", &src);
    // `main` now points at `new`; both snapshots share every blob.
    assert_eq!(store.list().installed.len(), 2);
    assert_eq!(store.delete("org/m").unwrap(), 0, "blobs still used by `old` stay");
    let repo_dir = store.models_dir.join("models--org--m");
    assert!(repo_dir.join("snapshots/old").is_dir() && !repo_dir.join("snapshots/new").exists());
    std::fs::write(repo_dir.join("refs/main"), "old").unwrap();
    let blob_bytes: u64 =
        std::fs::read_dir(repo_dir.join("blobs")).unwrap().flatten().map(|b| b.metadata().unwrap().len()).sum();
    assert_eq!(store.delete("org/m").unwrap(), blob_bytes);
    assert!(!repo_dir.exists());
    assert!(matches!(store.delete("org/m"), Err(store::StoreError::NotInstalled(_))));
    assert!(matches!(store.delete("nothing-like-this"), Err(store::StoreError::UnknownModel(_))));
}

#[test]
fn refs_another_tool_wrote_never_lead_outside_the_store() {
    let tmp = tempfile::tempdir().unwrap();
    let mut store = open(tmp.path());
    let src = tmp.path().join("src");
    hub::checkpoint(&src, false, 1);
    // A folder outside the store that a hostile ref names, holding a model of its own.
    let victim = tmp.path().join("victim");
    hub::checkpoint(&victim.join("snapshots").join("x"), false, 1);
    let repo_dir = store.models_dir.join("models--org--m");
    for hostile in [
        victim.display().to_string(),
        "../../../victim".to_string(),
        "../../victim/snapshots/x".to_string(),
        "/".to_string(),
        "..".to_string(),
    ] {
        place_like_another_tool(&store.models_dir, "org/m", "abc", &src);
        std::fs::write(repo_dir.join("refs/main"), &hostile).unwrap();
        assert!(store.resolve("org/m").is_err(), "{hostile}: loading follows no such ref");
        let _ = store.delete("org/m");
        assert!(victim.join("snapshots/x/config.json").is_file(), "{hostile}: nothing outside the store is touched");
        let _ = std::fs::remove_dir_all(&repo_dir);
    }
}

#[test]
fn model_files_that_never_end_are_not_read() {
    let tmp = tempfile::tempdir().unwrap();
    let store = open(tmp.path());
    let src = tmp.path().join("src");
    hub::checkpoint(&src, false, 1);
    place_like_another_tool(&store.models_dir, "org/zero", "abc", &src);
    let snap = store.models_dir.join("models--org--zero/snapshots/abc");
    for file in ["config.json", "model.safetensors.index.json"] {
        let _ = std::fs::remove_file(snap.join(file));
        std::os::unix::fs::symlink("/dev/zero", snap.join(file)).unwrap();
        let started = std::time::Instant::now();
        let listing = store.list();
        assert!(listing.installed.is_empty(), "{file}: {listing:?}");
        assert!(started.elapsed() < Duration::from_secs(20), "{file}: read for {:?}", started.elapsed());
        std::fs::remove_file(snap.join(file)).unwrap();
        std::fs::copy(src.join("config.json"), snap.join("config.json")).unwrap();
    }
}

#[test]
fn folders_register_in_place_and_the_choice_is_shared() {
    let tmp = tempfile::tempdir().unwrap();
    let mut store = open(tmp.path());
    let src = tmp.path().join("mine");
    hub::checkpoint(&src, true, 2);
    let facts = store.register_local("my-model", &src).unwrap();
    assert!(facts.has_mtp && !facts.sees);
    assert!(matches!(store.register_local("my-model", &src), Err(store::StoreError::NameTaken(_))));
    // Another process (the app, the CLI) opening the same config sees the same store.
    let again = Store::open(&tmp.path().join("config")).unwrap();
    assert_eq!(again.models_dir, store.models_dir);
    assert_eq!(again.resolve("my-model").unwrap().dir, src.canonicalize().unwrap());
    assert_eq!(again.list().installed.iter().filter(|m| m.id == "my-model").count(), 1);
    // A catalog id that is not downloaded says how to get it; a folder resolves as itself.
    let e = again.resolve("qwen3-8b").unwrap_err().to_string();
    assert!(e.contains("ferrite pull qwen3-8b"), "{e}");
    assert_eq!(again.resolve(src.to_str().unwrap()).unwrap().dir, src);
    // Forgetting a registered folder leaves its files alone.
    store.delete("my-model").unwrap();
    assert!(src.join("config.json").exists());
    // A folder that is not a model is refused with the reason.
    let e = store.register_local("empty", tmp.path()).unwrap_err().to_string();
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn the_embedded_model_is_installed_and_cannot_be_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let mut store = Store::open(&tmp.path().join("config")).unwrap();
    let resolved = store.resolve("default").unwrap();
    assert_eq!(resolved.id, "ferrite-code-20m");
    assert!(resolved.aliases.contains(&"ferrite-default".to_string()));
    assert!(resolved.dir.ends_with("assets/models/ferrite-code-20m"), "{}", resolved.dir.display());
    // Its block drafter ships beside it.
    let drafter = resolved.drafter.expect("the embedded drafter resolves");
    assert!(drafter.ends_with("assets/models/ferrite-code-20m-dflash"), "{}", drafter.display());
    let listing = store.list();
    let embedded = listing.installed.iter().find(|m| m.id == "ferrite-code-20m").expect("listed");
    assert_eq!(embedded.source, store::models::Source::Embedded);
    assert!(embedded.has_mtp);
    assert!(matches!(store.delete("default"), Err(store::StoreError::Embedded(_))));
}

/// A folder with a vision tower (its `vision_config` and `model.visual.*` tensors) is listed as
/// one that sees; a `vision_config` without the tower's tensors is not.
#[test]
fn a_folder_with_a_vision_tower_is_listed_as_seeing() {
    let tmp = tempfile::tempdir().unwrap();
    let mut store = open(tmp.path());
    let src = tmp.path().join("seeing");
    hub::checkpoint(&src, false, 3);
    let config_path = src.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["vision_config"] = serde_json::json!({"depth": 1, "hidden_size": 8});
    std::fs::write(&config_path, config.to_string()).unwrap();
    assert!(!store.register_local("half", &src).unwrap().sees, "a config alone does not make a tower");
    store.delete("half").unwrap();
    let tensor = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2], &[0u8; 8]).unwrap();
    let bytes = safetensors::serialize([("model.visual.patch_embed.proj.weight", tensor)], None).unwrap();
    std::fs::write(src.join("visual.safetensors"), bytes).unwrap();
    let index_path = src.join("model.safetensors.index.json");
    if index_path.exists() {
        let mut index: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&index_path).unwrap()).unwrap();
        index["weight_map"]["model.visual.patch_embed.proj.weight"] = "visual.safetensors".into();
        std::fs::write(&index_path, index.to_string()).unwrap();
    }
    assert!(store.register_local("seeing", &src).unwrap().sees);
    let listing = store.list();
    assert!(listing.installed.iter().find(|m| m.id == "seeing").is_some_and(|m| m.sees));
}
