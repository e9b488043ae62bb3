//! The UI's store actions over HTTP, against the local hub of the store's own tests: choose
//! the folder, pull with progress, list, delete; bad requests get clear errors.

mod common;
#[path = "../../store/tests/hub/mod.rs"]
mod hub;

use std::sync::Arc;
use std::time::Duration;

use common::post;
use serde_json::{json, Value};
use server::models::StoreAccess;

/// Downloads from the local hub at `endpoint`: no token, retries or space margin, small chunks,
/// whatever the environment says.
fn hub_options(endpoint: &str) -> store::download::Options {
    store::download::Options {
        endpoint: endpoint.to_string(),
        token: None,
        space: Arc::new(|p: &std::path::Path| store::download::free_space(p)),
        margin_bytes: 0,
        retries: 0,
        chunk_bytes: 64 << 10,
        offline: false,
        model_check: None,
    }
}

/// The store listing once the first download has ended (done or failed).
async fn download_ended(s: &common::Server) -> Value {
    let ended = async {
        loop {
            let v: Value = reqwest::get(format!("{}/v1/store", s.base)).await.unwrap().json().await.unwrap();
            let state = v["downloads"][0]["state"]["state"].clone();
            if state == "done" || state == "failed" {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(60), ended).await.expect("the download ended")
}

#[tokio::test(flavor = "multi_thread")]
async fn choose_pull_list_and_delete_from_the_ui() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = hub::start().await;
    hub::checkpoint(&tmp.path().join("src"), true, 3);
    hub.hub.publish("test/hybrid", &tmp.path().join("src"));
    let options = hub_options(&hub.endpoint);
    let access = StoreAccess::new(Some(tmp.path().join("config")), Some(options));
    let s = common::start_configured(None, Default::default(), move |state| state.store = access).await;

    let models = tmp.path().join("models");
    let (code, v) = post(&s, "/v1/store/folder", &json!({"dir": models})).await;
    assert_eq!(code, 200, "{v}");
    let (code, v) = post(&s, "/v1/store/folder", &json!({"dir": "/proc/version/not-a-folder"})).await;
    assert_eq!(code, 400, "{v}");

    let (code, v) = post(&s, "/v1/store/pull", &json!({"model": "test/hybrid"})).await;
    assert_eq!(code, 202, "{v}");
    assert_eq!(v["repo"], "test/hybrid");
    let v = download_ended(&s).await;
    assert_eq!(v["downloads"][0]["state"]["state"], "done", "{v}");
    assert_eq!(v["downloads"][0]["done_bytes"], v["downloads"][0]["total_bytes"]);
    let installed = v["installed"].as_array().unwrap();
    let hybrid = installed.iter().find(|m| m["id"] == "test/hybrid").expect("installed");
    assert_eq!(hybrid["has_mtp"], true);

    let (code, v) = post(&s, "/v1/store/delete", &json!({"model": "test/hybrid"})).await;
    assert_eq!(code, 200, "{v}");
    assert!(v["freed_bytes"].as_u64().unwrap() > 100_000, "{v}");
    let v: Value = reqwest::get(format!("{}/v1/store", s.base)).await.unwrap().json().await.unwrap();
    assert!(!v["installed"].as_array().unwrap().iter().any(|m| m["id"] == "test/hybrid"));

    let (code, v) = post(&s, "/v1/store/pull", &json!({"model": "no-such-model"})).await;
    assert_eq!(code, 404, "{v}");
    let (code, v) = post(&s, "/v1/store/delete", &json!({"model": "default"})).await;
    assert_eq!(code, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("ships with Ferrite"));
    let (code, _) = post(&s, "/v1/store/cancel", &json!({"model": "test/hybrid"})).await;
    assert_eq!(code, 404);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_model_the_engine_would_refuse_never_counts_as_installed() {
    // A hub model whose config asks for a hundred million layers: every file's hash is right,
    // the store's own checks pass, but the engine refuses it, so the pull fails and leaves
    // nothing installed.
    let tmp = tempfile::tempdir().unwrap();
    let hub = hub::start().await;
    let src = tmp.path().join("src");
    hub::checkpoint(&src, true, 4);
    let config = src.join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    c["text_config"]["num_hidden_layers"] = json!(100_000_000);
    c["num_hidden_layers"] = json!(100_000_000);
    std::fs::write(&config, c.to_string()).unwrap();
    hub.hub.publish("test/hostile", &src);
    let options = hub_options(&hub.endpoint);
    let access = StoreAccess::new(Some(tmp.path().join("config")), Some(options));
    let s = common::start_configured(None, Default::default(), move |state| state.store = access).await;
    let (code, v) = post(&s, "/v1/store/folder", &json!({"dir": tmp.path().join("models")})).await;
    assert_eq!(code, 200, "{v}");
    let (code, v) = post(&s, "/v1/store/pull", &json!({"model": "test/hostile"})).await;
    assert_eq!(code, 202, "{v}");
    let v = download_ended(&s).await;
    assert_eq!(v["downloads"][0]["state"]["state"], "failed", "{v}");
    let why = v["downloads"][0]["state"]["detail"].as_str().unwrap();
    assert!(why.contains("does not load") && why.contains("num_hidden_layers"), "{why}");
    assert!(!v["installed"].as_array().unwrap().iter().any(|m| m["id"] == "test/hostile"), "{v}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_model_being_served_or_downloaded_is_not_deleted() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = hub::start().await;
    for (repo, seed) in [("test/served", 5), ("test/coming", 6)] {
        let src = tmp.path().join(repo);
        hub::checkpoint(&src, false, seed);
        hub.hub.publish(repo, &src);
    }
    let options = hub_options(&hub.endpoint);
    let access = StoreAccess::new(Some(tmp.path().join("config")), Some(options));
    let first = access.clone();
    let s = common::start_configured(None, Default::default(), move |state| state.store = first).await;
    let models = tmp.path().join("models");
    assert_eq!(post(&s, "/v1/store/folder", &json!({"dir": models})).await.0, 200);
    assert_eq!(post(&s, "/v1/store/pull", &json!({"model": "test/served"})).await.0, 202);
    assert_eq!(download_ended(&s).await["downloads"][0]["state"]["state"], "done");

    // Deleting during a download would leave a partial folder: refused until it is cancelled.
    hub.hub.faults.lock().unwrap().slow = Some(Duration::from_millis(300));
    assert_eq!(post(&s, "/v1/store/pull", &json!({"model": "test/coming"})).await.0, 202);
    let (code, v) = post(&s, "/v1/store/delete", &json!({"model": "test/coming"})).await;
    assert_eq!(code, 409, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("being downloaded"), "{v}");
    assert_eq!(post(&s, "/v1/store/cancel", &json!({"model": "test/coming"})).await.0, 200);
    hub.hub.faults.lock().unwrap().slow = None;

    // The downloaded model served by a relative path (as `ferrite serve --model ../x` gives
    // it) is still the model being served.
    let snapshots = models.join("models--test--served/snapshots");
    let snapshot = std::fs::read_dir(&snapshots).unwrap().flatten().next().unwrap().path();
    let cwd = std::env::current_dir().unwrap();
    let relative =
        std::path::PathBuf::from("../".repeat(cwd.components().count() - 1)).join(snapshot.strip_prefix("/").unwrap());
    assert!(relative.is_relative() && relative.join("config.json").is_file(), "{}", relative.display());
    let served = common::serve_dir(relative, move |state| state.store = access).await;
    let (code, v) = post(&served, "/v1/store/delete", &json!({"model": "test/served"})).await;
    assert_eq!(code, 409, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("being served"), "{v}");
    assert!(snapshot.join("config.json").is_file());
    assert_eq!(post(&served, "/v1/chat/completions", &common::chat(json!({}))).await.0, 200);
}

/// A catalog model paired with a block drafter: one pull fetches both from the hub, the
/// listing shows the drafter apart (naming the model it drafts for), the model resolves with
/// its drafter, and the engine loads the pair.
#[tokio::test(flavor = "multi_thread")]
async fn a_model_and_its_drafter_are_pulled_listed_and_loaded_together() {
    use engine::checkpoint::drafter::{make_drafter, DrafterOptions};
    let tmp = tempfile::tempdir().unwrap();
    let hub = hub::start().await;
    let (target, drafter) = (tmp.path().join("target"), tmp.path().join("drafter"));
    hub::checkpoint(&target, true, 5);
    let config = engine::ModelConfig::load(&target).unwrap();
    let tensors = engine::checkpoint::MakeOptions::new(engine::checkpoint::Architecture::Qwen35, "tiny");
    make_drafter(&config, &DrafterOptions::new(&config, tensors), &drafter).unwrap();
    hub.hub.publish("test/paired", &target);
    hub.hub.publish("test/paired-dflash", &drafter);
    let config_dir = tmp.path().join("config");
    std::fs::create_dir_all(&config_dir).unwrap();
    let entry = r#"
[[model]]
id = "paired"
repo = "test/paired"
architecture = "qwen3_5"
quantization = "8-bit affine g64"
size_bytes = "unknown"
params_b = 0.001
active_params_b = "unknown"
mtp = true
memory_bytes = "unknown"
description = "a tiny hybrid with a block drafter"
drafter = { repo = "test/paired-dflash", size_bytes = "unknown", block_size = 8 }
"#;
    std::fs::write(store::catalog::user_file(&config_dir), entry).unwrap();
    let options = hub_options(&hub.endpoint);
    let access = StoreAccess::new(Some(config_dir.clone()), Some(options));
    let s = common::start_configured(None, Default::default(), move |state| state.store = access).await;
    let models = tmp.path().join("models");
    assert_eq!(post(&s, "/v1/store/folder", &json!({"dir": models})).await.0, 200);

    let (code, v) = post(&s, "/v1/store/pull", &json!({"model": "paired"})).await;
    assert_eq!(code, 202, "{v}");
    assert_eq!((v["repo"].as_str(), v["drafter"]["repo"].as_str()), (Some("test/paired"), Some("test/paired-dflash")));
    let both_ended = async {
        loop {
            let v: Value = reqwest::get(format!("{}/v1/store", s.base)).await.unwrap().json().await.unwrap();
            let states: Vec<Value> =
                v["downloads"].as_array().unwrap().iter().map(|d| d["state"]["state"].clone()).collect();
            if states.len() == 2 && states.iter().all(|s| s == "done" || s == "failed") {
                return v;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let v = tokio::time::timeout(Duration::from_secs(60), both_ended).await.expect("both downloads ended");
    for d in v["downloads"].as_array().unwrap() {
        assert_eq!(d["state"]["state"], "done", "{v}");
    }
    assert!(v["installed"].as_array().unwrap().iter().any(|m| m["id"] == "paired"), "{v}");
    assert!(!v["installed"].as_array().unwrap().iter().any(|m| m["id"] == "test/paired-dflash"), "listed apart: {v}");
    let drafters = v["drafters"].as_array().unwrap();
    assert_eq!(drafters.len(), 1, "{v}");
    assert_eq!(
        (drafters[0]["repo"].as_str(), drafters[0]["block_size"].as_u64()),
        (Some("test/paired-dflash"), Some(8))
    );
    assert_eq!(drafters[0]["drafts_for"], json!(["paired"]), "{v}");

    let store = store::Store::open(&config_dir).unwrap();
    let resolved = store.resolve("paired").unwrap();
    let drafter_dir = resolved.drafter.clone().expect("the paired drafter resolves");
    assert!(drafter_dir.starts_with(&models), "{}", drafter_dir.display());
    let options = engine::EngineOptions { drafter: Some(drafter_dir), ..Default::default() };
    let drafts_in_blocks_of_8 = tokio::task::spawn_blocking(move || {
        let e = engine::Engine::load_with(&resolved.dir, &options).unwrap();
        e.drafter().is_some_and(|d| d.spec.block_size == 8) && e.can_draft()
    })
    .await
    .unwrap();
    assert!(drafts_in_blocks_of_8);
}
