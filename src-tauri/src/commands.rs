//! The commands the window's page may invoke (besides the HTTP API it uses like a browser),
//! and the tray's status lines, which are plain functions of the server's state.

use std::sync::atomic::Ordering;

use tauri::State;

use crate::Ferrite;

/// Where the in-process server listens (`http://127.0.0.1:PORT`).
#[tauri::command]
pub fn api_base(ferrite: State<'_, Ferrite>) -> String {
    ferrite.api_base.clone()
}

/// The tray's status lines, for a page that wants them too.
#[tauri::command]
pub fn status_lines(ferrite: State<'_, Ferrite>) -> Vec<String> {
    lines(&ferrite.state)
}

/// Uses `dir` as the models folder from now on (the same setting as `ferrite store set`).
#[tauri::command]
pub async fn set_models_folder(ferrite: State<'_, Ferrite>, dir: String) -> Result<String, String> {
    apply_models_folder(&ferrite.state, dir).await
}

/// Asks for the models folder with the system's folder picker, then uses it; `None` when
/// the person cancels.
#[tauri::command]
pub async fn choose_models_folder<R: tauri::Runtime>(
    app: tauri::AppHandle<R>,
    ferrite: State<'_, Ferrite>,
) -> Result<Option<String>, String> {
    use tauri_plugin_dialog::DialogExt;
    let (tx, rx) = tokio::sync::oneshot::channel();
    app.dialog().file().set_title("Where Ferrite keeps models").pick_folder(move |picked| {
        let _ = tx.send(picked);
    });
    let Some(picked) = rx.await.map_err(|_| "the folder picker closed without an answer".to_string())? else {
        return Ok(None);
    };
    let path =
        picked.into_path().map_err(|e| format!("the folder picker returned something that is not a folder: {e}"))?;
    apply_models_folder(&ferrite.state, path.to_string_lossy().into_owned()).await.map(Some)
}

async fn apply_models_folder(state: &server::AppState, dir: String) -> Result<String, String> {
    let config_dir = state.store.config_dir.clone().unwrap_or_else(store::config::config_dir);
    tokio::task::spawn_blocking(move || {
        let mut store = store::Store::open(&config_dir).map_err(|e| format!("the model store: {e}"))?;
        store.set_models_dir(std::path::Path::new(&dir)).map_err(|e| format!("{dir}: {e}"))?;
        Ok(store.models_dir.to_string_lossy().into_owned())
    })
    .await
    .map_err(|e| e.to_string())?
}

fn mib(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.1} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.0} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

/// A folder's last name, as the tray shows a drafter.
fn folder_name(dir: &std::path::Path) -> String {
    dir.file_name().map_or_else(|| dir.display().to_string(), |n| n.to_string_lossy().into_owned())
}

/// Four lines for the tray: what runs, how fast, how much memory, what drafting does.
pub fn lines(state: &server::AppState) -> Vec<String> {
    let loaded = state.loaded();
    let info = &loaded.worker.info;
    let metrics = &loaded.worker.metrics;
    let model = if let Some(other) = state.loading.lock().ok().and_then(|l| l.clone()) {
        format!("Loading {other}…")
    } else if loaded.worker.lifecycle.loaded.load(Ordering::SeqCst) {
        // The block drafter beside the model, if one is loaded, then how requests speculate.
        let drafter = match &info.drafter {
            Some(d) => format!("block drafter {} (blocks of {}), ", folder_name(&d.dir), d.block_size),
            None => String::new(),
        };
        format!("{} · {} · {drafter}{}", info.id, info.profile.name, loaded.depth.speculation)
    } else {
        format!("{} stopped (starts on the next request)", info.id)
    };
    let live = metrics.live();
    let streams = metrics.streams();
    let waiting = loaded.worker.queue_depth.load(Ordering::SeqCst);
    let speed = if waiting > 0 && streams.len() == 1 {
        format!("Generating: {:.1} tok/s, {waiting} waiting", streams[0].tokens_per_s)
    } else if streams.len() > 1 {
        let total: f64 = streams.iter().map(|s| s.tokens_per_s).sum();
        format!("Generating: {} requests together, {total:.1} tok/s in all", streams.len())
    } else if let Some(s) = streams.first().filter(|s| s.tokens_per_s > 0.0) {
        format!("Generating: {:.1} tok/s", s.tokens_per_s)
    } else if metrics.generating.load(Ordering::SeqCst) {
        "Generating…".to_string()
    } else if live.last_decode_tps > 0.0 {
        format!("Last request: {:.1} tok/s decode, {:.0} tok/s prompt", live.last_decode_tps, live.last_prompt_tps)
    } else if state.notice().is_some() {
        // The launch model could not start (the default runs instead): the window says why.
        "A model could not start: Open Ferrite says why".to_string()
    } else {
        "No request yet".to_string()
    };
    let snap = server::live::snapshot(state);
    let process = snap.memory.process_resident_bytes.map(mib).unwrap_or_else(|| "not available".into());
    let cache = metrics.prompt_cache();
    let cached = if cache.budget_bytes == 0 {
        "prompt cache off".to_string()
    } else {
        format!("prompt cache {}", mib(cache.bytes as u64))
    };
    let memory = format!("Memory: MLX {} · process {process} · {cached}", mib(snap.memory.mlx_active_bytes));
    vec![model, speed, memory, drafting_line(&live)]
}

/// What speculation does: the drafter and depth the last speculating request ran at (its
/// depth controller's), the tokens a cycle and the acceptance by draft position over every
/// request served — the window's figures, in one line.
pub fn drafting_line(live: &server::metrics::Live) -> String {
    if live.tokens_per_cycle <= 0.0 {
        return "Drafting: no speculative request yet".to_string();
    }
    let now = match &live.depth_control {
        Some(c) if c.depth_now == 0 => "plain now (drafts do not pay) · ".to_string(),
        Some(c) => format!("{} · ", engine::Speculation { drafter: c.drafter_now, depth: c.depth_now }),
        None => String::new(),
    };
    let accepted: Vec<String> = live.acceptance.iter().map(|a| format!("{:.0}%", a * 100.0)).collect();
    format!("Drafting: {now}{:.2} tokens a cycle · accepted by position {}", live.tokens_per_cycle, accepted.join(" "))
}
