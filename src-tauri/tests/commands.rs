//! The app's commands through tauri's mock runtime (no display needed): the same launch path
//! as the real app (a model resolved by name, the server started in-process on loopback),
//! then each command invoked the way the window's page invokes it.

use std::io::{Read, Write};
use std::sync::Arc;

use engine::checkpoint::{self, Architecture, MakeOptions};
use serde_json::{json, Value};
use tauri::ipc::{CallbackFn, InvokeBody};
use tauri::test::{get_ipc_response, mock_builder, mock_context, noop_assets, MockRuntime, INVOKE_KEY};
use tauri::webview::InvokeRequest;
use tauri::WebviewWindowBuilder;

fn invoke(window: &tauri::WebviewWindow<MockRuntime>, cmd: &str, args: Value) -> Result<Value, Value> {
    let request = InvokeRequest {
        cmd: cmd.into(),
        callback: CallbackFn(0),
        error: CallbackFn(1),
        // Linux and macOS serve the app's pages from tauri://localhost.
        url: "tauri://localhost".parse().unwrap(),
        body: InvokeBody::Json(args),
        headers: Default::default(),
        invoke_key: INVOKE_KEY.to_string(),
    };
    get_ipc_response(window, request).map(|body| body.deserialize::<Value>().unwrap())
}

fn http_get(base: &str, path: &str) -> String {
    let addr = base.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    write!(stream, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// Both tests set `FERRITE_CONFIG_DIR`, which the app reads: one at a time.
static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn the_apps_commands_answer_through_the_ipc() {
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let config = tempfile::tempdir().unwrap();
    std::env::set_var("FERRITE_CONFIG_DIR", config.path());
    let model = tempfile::tempdir().unwrap();
    let mut o = MakeOptions::new(Architecture::Qwen3, "tiny");
    o.bits = Some(4);
    o.group_size = 32;
    checkpoint::make(&o, model.path()).unwrap();

    let settings = app::launch::Settings {
        model: model.path().to_string_lossy().into_owned(),
        port: 0,
        profile: Default::default(),
        hidden: true,
        notice: None,
    };
    let (state, listener) = tauri::async_runtime::block_on(app::launch::start(&settings)).unwrap();
    let api_base = format!("http://{}", listener.local_addr().unwrap());
    let stop = Arc::new(tokio::sync::Notify::new());
    let served = {
        let (state, stop) = (state.clone(), stop.clone());
        tauri::async_runtime::spawn(async move {
            server::serve_until(listener, state, &[], async move { stop.notified().await }).await
        })
    };
    let ferrite = app::Ferrite {
        state: state.clone(),
        api_base: api_base.clone(),
        stop: stop.clone(),
        quitting: Default::default(),
        stopped: Default::default(),
    };
    let app = app::builder(mock_builder(), ferrite).build(mock_context(noop_assets())).unwrap();
    let window = WebviewWindowBuilder::new(&app, "main", Default::default()).build().unwrap();

    // Where the page's fetches go, and the server really answers there.
    assert_eq!(invoke(&window, "api_base", json!({})).unwrap(), json!(api_base));
    assert!(
        http_get(&api_base, "/health").starts_with("HTTP/1.0 200")
            || http_get(&api_base, "/health").starts_with("HTTP/1.1 200")
    );

    // The tray's status lines: the model, no request yet, memory with MLX's figure, no
    // drafting yet.
    let lines = invoke(&window, "status_lines", json!({})).unwrap();
    let lines: Vec<String> = serde_json::from_value(lines).unwrap();
    assert_eq!(lines.len(), 4, "{lines:?}");
    assert_eq!(lines[3], "Drafting: no speculative request yet");
    assert!(lines[0].contains("sustained") && lines[0].contains("plain decoding"), "{lines:?}");
    assert_eq!(lines[1], "No request yet");
    assert!(lines[2].starts_with("Memory: MLX ") && !lines[2].contains("not available"), "{lines:?}");
    assert!(lines[2].contains("prompt cache"), "{lines:?}");

    // The models folder: kept in the shared config file, as `ferrite store set` does.
    let folder = tempfile::tempdir().unwrap();
    let chosen = invoke(&window, "set_models_folder", json!({"dir": folder.path()})).unwrap();
    let store = store::Store::open(config.path()).unwrap();
    assert_eq!(store.models_dir, std::path::PathBuf::from(chosen.as_str().unwrap()));
    assert_eq!(store.models_dir.canonicalize().unwrap(), folder.path().canonicalize().unwrap());
    // Bad input names what was wrong and changes nothing.
    let not_a_folder = model.path().join("config.json");
    let err = invoke(&window, "set_models_folder", json!({"dir": not_a_folder})).unwrap_err();
    assert!(err.as_str().unwrap().contains("config.json"), "{err}");
    assert_eq!(store::Store::open(config.path()).unwrap().models_dir, store.models_dir);
    assert!(invoke(&window, "set_models_folder", json!({})).is_err(), "a missing argument is an error");

    // The tray lists installed models: the embedded default ships with Ferrite.
    assert!(app::tray::installed_models(&state).iter().any(|m| m == "ferrite-code-20m"));

    // Stop from the tray unloads; the status line says so.
    state.loaded().worker.unload();
    std::thread::sleep(std::time::Duration::from_millis(300));
    let lines: Vec<String> = serde_json::from_value(invoke(&window, "status_lines", json!({})).unwrap()).unwrap();
    assert!(lines[0].contains("stopped"), "{lines:?}");

    // Quit's path: the server stops and the engine thread ends before the process does.
    stop.notify_one();
    tauri::async_runtime::block_on(served).unwrap().unwrap();
}

#[test]
fn a_model_that_cannot_start_leaves_the_default_running_and_says_why() {
    let _env = ENV.lock().unwrap_or_else(|e| e.into_inner());
    let config = tempfile::tempdir().unwrap();
    std::env::set_var("FERRITE_CONFIG_DIR", config.path());
    std::env::remove_var("FERRITE_MODEL");
    std::env::remove_var("FERRITE_PROFILE");
    let model = tempfile::tempdir().unwrap();
    let mut o = MakeOptions::new(Architecture::Qwen3, "tiny");
    o.bits = Some(4);
    o.group_size = 32;
    checkpoint::make(&o, model.path()).unwrap();
    let tiny = model.path().to_string_lossy().into_owned();

    // What the app started last is what its next launch starts; here it has gone since.
    store::config::Config::update(config.path(), |c| {
        c.app.model = Some("/no/such/model".into());
        c.app.profile = Some("turbo".into());
    })
    .unwrap();
    let settings = app::launch::Settings::from_env().unwrap();
    assert_eq!((settings.model.as_str(), settings.profile), ("/no/such/model", engine::ProfileName::Turbo));
    assert_eq!(settings.notice, None);
    let (state, _listener) = tauri::async_runtime::block_on(app::launch::start(&settings)).unwrap();
    assert_eq!(state.loaded().worker.info.id, "ferrite-code-20m", "the default model runs");
    assert_eq!(state.loaded().worker.info.profile.name, engine::ProfileName::Turbo, "with the remembered profile");
    let notice = state.notice().expect("a notice says what happened");
    assert!(notice.contains("/no/such/model") && notice.contains("default model"), "{notice}");
    assert_eq!(server::status_json(&state)["notice"], json!(notice));
    assert_eq!(
        app::commands::lines(&state)[1],
        "A model could not start: Open Ferrite says why",
        "the tray says so too"
    );
    // The choice is kept (an unplugged volume comes back), not replaced by the fallback.
    assert_eq!(store::config::Config::load(config.path()).unwrap().app.model.as_deref(), Some("/no/such/model"));

    // A model started from the tray or the window clears the notice and is remembered.
    let started = tauri::async_runtime::block_on(server::models::load_model(
        &state,
        Some(tiny.clone()),
        Some(engine::ProfileName::Sustained),
    ));
    started.unwrap();
    assert_eq!(state.notice(), None);
    let remembered = store::config::Config::load(config.path()).unwrap().app;
    assert_eq!((remembered.model.as_deref(), remembered.profile.as_deref()), (Some(tiny.as_str()), Some("sustained")));
    let next = app::launch::Settings::from_env().unwrap();
    assert_eq!((next.model.as_str(), next.profile), (tiny.as_str(), engine::ProfileName::Sustained));

    // The environment still wins over what was remembered; a remembered profile that no longer
    // reads is said, and the default profile used.
    std::env::set_var("FERRITE_MODEL", "default");
    store::config::Config::update(config.path(), |c| c.app.profile = Some("fastest".into())).unwrap();
    let next = app::launch::Settings::from_env().unwrap();
    std::env::remove_var("FERRITE_MODEL");
    assert_eq!((next.model.as_str(), next.profile), ("default", engine::ProfileName::Sustained));
    let notice = next.notice.unwrap();
    assert!(notice.contains("config.toml") && notice.contains("fastest"), "{notice}");

    // The default model itself failing is an error naming both failures.
    std::env::set_var("FERRITE_ASSETS", config.path().join("no-assets"));
    let broken = app::launch::Settings {
        model: "/no/such/model".into(),
        port: 0,
        profile: Default::default(),
        hidden: true,
        notice: None,
    };
    let e = tauri::async_runtime::block_on(app::launch::start(&broken)).err().expect("nothing can start");
    std::env::remove_var("FERRITE_ASSETS");
    let e = format!("{e:#}");
    assert!(e.contains("default model") && e.contains("/no/such/model"), "{e}");
}

/// The tray's drafting line: which drafter and depth the controller runs, or plain; the tokens
/// a cycle and the acceptance by position.
#[test]
fn the_tray_says_what_drafting_does() {
    use engine::speculative::ControlStats;
    use engine::DraftWith;

    let mut live = server::metrics::Live::default();
    assert_eq!(app::commands::drafting_line(&live), "Drafting: no speculative request yet");
    live.tokens_per_cycle = 3.094;
    live.acceptance = vec![0.8, 0.53, 0.4];
    assert_eq!(app::commands::drafting_line(&live), "Drafting: 3.09 tokens a cycle · accepted by position 80% 53% 40%");
    live.depth_control = Some(ControlStats { drafter_now: DraftWith::Block, depth_now: 4, ..Default::default() });
    assert_eq!(
        app::commands::drafting_line(&live),
        "Drafting: block depth 4 · 3.09 tokens a cycle · accepted by position 80% 53% 40%"
    );
    live.depth_control = Some(ControlStats { drafter_now: DraftWith::Mtp, depth_now: 0, ..Default::default() });
    assert!(app::commands::drafting_line(&live).starts_with("Drafting: plain now (drafts do not pay) · 3.09"));
}
