//! The tray (menu-bar) icon and its menu: installed models (click starts one; the running
//! one is checked), Stop, three live status lines, Open Ferrite, Quit. A task rebuilds the
//! menu when the set of models or the running one changes and refreshes the status lines
//! every two seconds.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tauri::image::Image;
use tauri::menu::{CheckMenuItem, Menu, MenuEvent, MenuItem, PredefinedMenuItem};
use tauri::tray::TrayIconBuilder;
use tauri::{AppHandle, Manager, Runtime};

use crate::Ferrite;

const TRAY_ID: &str = "ferrite";
const MODEL_PREFIX: &str = "model:";

/// What the menu shows, to rebuild it only when this changes.
#[derive(Debug, Clone, PartialEq)]
struct MenuFacts {
    models: Vec<String>,
    running: String,
    loaded: bool,
}

fn facts(ferrite: &Ferrite) -> MenuFacts {
    let mut f = running(ferrite);
    let mut models = installed_models(&ferrite.state);
    if !models.contains(&f.running) {
        models.insert(0, f.running.clone());
    }
    f.models = models;
    f
}

/// Installed models by id (the models folder, folders registered in place, the embedded one).
pub fn installed_models(state: &server::AppState) -> Vec<String> {
    let dir = state.store.config_dir.clone().unwrap_or_else(store::config::config_dir);
    match store::Store::open(&dir) {
        Ok(store) => store.list().installed.into_iter().map(|m| m.id).collect(),
        Err(e) => {
            tracing::warn!("the tray cannot list models: {e}");
            vec![]
        }
    }
}

/// The menu, and its status lines (updated in place, so an open menu stays open).
fn build_menu<R: Runtime>(
    app: &AppHandle<R>,
    f: &MenuFacts,
    status: &[String],
) -> tauri::Result<(Menu<R>, Vec<MenuItem<R>>)> {
    let menu = Menu::new(app)?;
    let mut lines = Vec::new();
    for (i, line) in status.iter().enumerate() {
        let item = MenuItem::with_id(app, format!("status:{i}"), line, false, None::<&str>)?;
        menu.append(&item)?;
        lines.push(item);
    }
    menu.append(&PredefinedMenuItem::separator(app)?)?;
    for id in &f.models {
        let running = *id == f.running && f.loaded;
        menu.append(&CheckMenuItem::with_id(app, format!("{MODEL_PREFIX}{id}"), id, true, running, None::<&str>)?)?;
    }
    menu.append(&MenuItem::with_id(app, "stop", "Stop", f.loaded, None::<&str>)?)?;
    menu.append(&PredefinedMenuItem::separator(app)?)?;
    menu.append(&MenuItem::with_id(app, "open", "Open Ferrite", true, None::<&str>)?)?;
    menu.append(&MenuItem::with_id(app, "quit", "Quit Ferrite", true, None::<&str>)?)?;
    Ok((menu, lines))
}

pub fn install<R: Runtime>(app: &AppHandle<R>) -> tauri::Result<()> {
    let ferrite = app.state::<Ferrite>();
    let f = facts(&ferrite);
    let (menu, lines) = build_menu(app, &f, &crate::commands::lines(&ferrite.state))?;
    let icon = Image::from_bytes(include_bytes!("../../assets/icons/tray.png"))?;
    TrayIconBuilder::with_id(TRAY_ID)
        .icon(icon)
        // Drawn by macOS in the menu bar's own colour.
        .icon_as_template(true)
        .tooltip("Ferrite")
        .menu(&menu)
        .on_menu_event(on_menu)
        .build(app)?;
    let handle = app.clone();
    tauri::async_runtime::spawn(async move { refresh(handle, f, lines).await });
    Ok(())
}

fn on_menu<R: Runtime>(app: &AppHandle<R>, event: MenuEvent) {
    let id = event.id().as_ref().to_string();
    match id.as_str() {
        "open" => {
            if let Err(e) = crate::open_window(app) {
                tracing::warn!("opening the window: {e}");
            }
        }
        "quit" => crate::quit(app),
        "stop" => app.state::<Ferrite>().state.loaded().worker.unload(),
        other => {
            if let Some(model) = other.strip_prefix(MODEL_PREFIX) {
                let state = app.state::<Ferrite>().state.clone();
                let model = model.to_string();
                tauri::async_runtime::spawn(async move {
                    if let Err(e) = server::models::load_model(&state, Some(model.clone()), None).await {
                        tracing::warn!("starting {model} from the tray: {}", e.message);
                    }
                });
            }
        }
    }
}

/// Keeps the menu true: status lines every 2 s; the whole menu when the running model or
/// its state changes, or (looked at every 10 s) the installed models do.
async fn refresh<R: Runtime>(app: AppHandle<R>, mut shown: MenuFacts, mut lines: Vec<MenuItem<R>>) {
    for tick in 1u64.. {
        tokio::time::sleep(Duration::from_secs(2)).await;
        let ferrite = app.state::<Ferrite>();
        if ferrite.quitting.load(Ordering::SeqCst) {
            return;
        }
        let Some(tray) = app.tray_by_id(TRAY_ID) else { return };
        let status = crate::commands::lines(&ferrite.state);
        let now = if tick % 5 == 0 {
            facts(&ferrite)
        } else {
            MenuFacts { models: shown.models.clone(), ..running(&ferrite) }
        };
        if now != shown {
            match build_menu(&app, &now, &status) {
                Ok((menu, items)) => {
                    let _ = tray.set_menu(Some(menu));
                    lines = items;
                    shown = now;
                }
                Err(e) => tracing::warn!("updating the tray menu: {e}"),
            }
            continue;
        }
        for (item, text) in lines.iter().zip(&status) {
            let _ = item.set_text(text);
        }
    }
}

/// The running model and whether it is in memory, without listing the models folder.
fn running(ferrite: &Ferrite) -> MenuFacts {
    let loaded = ferrite.state.loaded();
    MenuFacts {
        models: vec![],
        running: loaded.worker.info.id.clone(),
        loaded: loaded.worker.lifecycle.loaded.load(Ordering::SeqCst),
    }
}
