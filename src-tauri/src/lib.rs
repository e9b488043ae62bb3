//! Ferrite's menu-bar app: the same server the CLI runs (`ferrite serve`), in this process,
//! with a tray menu and a window showing the web UI from `ui/` (embedded in the binary). The
//! window's page talks to the server over loopback like any browser, so the app adds no
//! second way of doing things: the tray's actions call the same functions as the HTTP API.
//!
//! Settings (environment): `FERRITE_MODEL` (the model started at launch; else the one last
//! started from the app, else `default`: see [`launch`]), `FERRITE_PORT` (default 8080;
//! another free port if taken), `FERRITE_PROFILE`, `FERRITE_APP_HIDDEN=1` (start in the tray
//! only).

pub mod commands;
pub mod launch;
pub mod tray;

use std::sync::Arc;

use anyhow::Context;
use tauri::{Manager, RunEvent, WebviewUrl, WebviewWindowBuilder, WindowEvent};

/// What the app keeps while it runs: the server's state, where it listens, and how to stop it.
pub struct Ferrite {
    pub state: server::AppState,
    /// `http://127.0.0.1:PORT`, what the page and agents use.
    pub api_base: String,
    /// Notified to stop the server (Quit); the server then stops the engine.
    pub stop: Arc<tokio::sync::Notify>,
    /// Set by Quit, so background tasks stop touching the engine's state.
    pub quitting: std::sync::atomic::AtomicBool,
    /// The serving task, which Quit waits for: it ends after the engine thread has.
    pub stopped: std::sync::Mutex<Option<tauri::async_runtime::JoinHandle<anyhow::Result<()>>>>,
}

pub fn run() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let settings = launch::Settings::from_env()?;
    let hidden = settings.hidden;
    // The single-instance plugin comes first: a second launch ends in it, before it loads a
    // model, and the running app shows its window instead of a second server and tray icon.
    let base = tauri::Builder::default().plugin(tauri_plugin_single_instance::init(|app, _argv, _cwd| {
        tracing::info!("launched again: showing the window");
        if let Err(e) = open_window(app) {
            tracing::warn!("could not show the window: {e}");
        }
    }));
    let app = commands_on(base)
        .setup(move |app| {
            // SIGTERM or Ctrl-C (a logout, `kill`, a terminal) quits as the menu's Quit does:
            // listened for before the server starts, so a signal that comes as soon as it
            // answers is not one the process dies of (the quit runs once setup is done).
            let handle = app.handle().clone();
            tauri::async_runtime::spawn(async move {
                server::interrupted().await;
                let _ = handle.clone().run_on_main_thread(move || quit(&handle));
            });
            match serve(&settings) {
                Ok(ferrite) => app.manage(ferrite),
                Err(e) => {
                    cannot_start(app.handle(), e);
                    return Ok(());
                }
            };
            // A menu-bar app: no Dock icon, no app menu; the tray is its face.
            #[cfg(target_os = "macos")]
            app.set_activation_policy(tauri::ActivationPolicy::Accessory);
            tray::install(app.handle())?;
            if !hidden {
                open_window(app.handle())?;
            }
            Ok(())
        })
        .build(tauri::generate_context!())
        .context("starting the app")?;
    app.run(|app, event| match event {
        // Closing the window keeps Ferrite in the tray; only Quit ends it.
        RunEvent::ExitRequested { api, code: None, .. } => api.prevent_exit(),
        RunEvent::WindowEvent { label, event: WindowEvent::CloseRequested { api, .. }, .. } if label == "main" => {
            api.prevent_close();
            if let Some(w) = app.get_webview_window("main") {
                let _ = w.hide();
            }
        }
        // Opened again from Finder, Spotlight or `open -a` while it runs: show the window.
        #[cfg(target_os = "macos")]
        RunEvent::Reopen { .. } => {
            if let Err(e) = open_window(app) {
                tracing::warn!("could not show the window: {e}");
            }
        }
        _ => {}
    });
    Ok(())
}

/// Loads the launch model and serves it on loopback in this process until Quit.
fn serve(settings: &launch::Settings) -> anyhow::Result<Ferrite> {
    let (state, listener) = tauri::async_runtime::block_on(launch::start(settings)).context("starting the server")?;
    let api_base = format!("http://{}", listener.local_addr()?);
    let stop = Arc::new(tokio::sync::Notify::new());
    let served = {
        let (state, stop) = (state.clone(), stop.clone());
        let origins: Vec<String> = server::APP_ORIGINS.iter().map(|o| o.to_string()).collect();
        tauri::async_runtime::spawn(async move {
            server::serve_until(listener, state, &origins, async move { stop.notified().await }).await
        })
    };
    Ok(Ferrite { state, api_base, stop, quitting: Default::default(), stopped: std::sync::Mutex::new(Some(served)) })
}

/// Not even the default model would start: say why — on stderr, and in a dialog, as an app
/// opened from Finder has no terminal — and exit once the dialog is closed.
fn cannot_start<R: tauri::Runtime>(app: &tauri::AppHandle<R>, e: anyhow::Error) {
    use tauri_plugin_dialog::{DialogExt, MessageDialogKind};
    let message = format!("{e:#}");
    eprintln!("ferrite-app: {message}");
    let handle = app.clone();
    app.dialog()
        .message(message)
        .title("Ferrite could not start")
        .kind(MessageDialogKind::Error)
        .show(move |_| handle.exit(1));
}

/// The app's commands and state on `base`, without a window or tray (tests pass tauri's
/// mock builder).
pub fn builder<R: tauri::Runtime>(base: tauri::Builder<R>, ferrite: Ferrite) -> tauri::Builder<R> {
    commands_on(base).manage(ferrite)
}

/// The plugins and commands the window's page uses.
fn commands_on<R: tauri::Runtime>(base: tauri::Builder<R>) -> tauri::Builder<R> {
    base.plugin(tauri_plugin_dialog::init()).invoke_handler(tauri::generate_handler![
        commands::api_base,
        commands::status_lines,
        commands::set_models_folder,
        commands::choose_models_folder,
    ])
}

/// Shows the window (creating it the first time): the web UI, told where the API is.
pub fn open_window<R: tauri::Runtime>(app: &tauri::AppHandle<R>) -> tauri::Result<()> {
    if let Some(w) = app.get_webview_window("main") {
        w.show()?;
        return w.set_focus();
    }
    // Nothing to show when the launch failed (the dialog saying why is open).
    let Some(ferrite) = app.try_state::<Ferrite>() else { return Ok(()) };
    let api = ferrite.api_base.clone();
    let token = ferrite.state.guard.control_token().to_string();
    let window = WebviewWindowBuilder::new(app, "main", WebviewUrl::App("index.html".into()))
        .title("Ferrite")
        .inner_size(1000.0, 780.0)
        .min_inner_size(560.0, 480.0)
        // The page's fetches go to the in-process server: its address, and the control token
        // its model, store and tuning endpoints need.
        .initialization_script(format!(
            "window.__FERRITE_API__ = {}; window.__FERRITE_TOKEN__ = {};",
            serde_json::to_string(&api).unwrap_or_default(),
            serde_json::to_string(&token).unwrap_or_default()
        ))
        .build()?;
    window.set_focus()
}

/// Quit: stop the server, let the engine finish or cancel its step, then exit.
pub fn quit<R: tauri::Runtime>(app: &tauri::AppHandle<R>) {
    // No server (it could not start): nothing to stop.
    let Some(ferrite) = app.try_state::<Ferrite>() else {
        app.exit(0);
        return;
    };
    ferrite.quitting.store(true, std::sync::atomic::Ordering::SeqCst);
    ferrite.stop.notify_one();
    if let Some(w) = app.get_webview_window("main") {
        let _ = w.hide();
    }
    let handle = ferrite.stopped.lock().ok().and_then(|mut h| h.take());
    if let Some(handle) = handle {
        match tauri::async_runtime::block_on(handle) {
            Ok(Err(e)) => tracing::warn!("the server stopped with an error: {e:#}"),
            Err(e) => tracing::warn!("the server task failed: {e}"),
            Ok(Ok(())) => tracing::info!("server and engine stopped"),
        }
    }
    app.exit(0);
}
