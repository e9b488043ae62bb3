//! What the app and the web UI watch: `/v1/telemetry` (one snapshot of memory, fans and
//! thermal state) and `/v1/events`, a server-sent-events stream that first replays the
//! history the server keeps (`history.rs`: the charts' last 15 minutes), then pushes the
//! engine's state, the tokens per second of the generation running now, the last request's
//! figures, acceptance by draft position, the telemetry and the latest sample — every second
//! while generating, every three seconds otherwise (one connection, no polling).

use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::Json;
use futures_util::{Stream, StreamExt};
use serde_json::json;

use crate::AppState;

pub async fn telemetry(State(s): State<AppState>) -> Json<telemetry::Snapshot> {
    Json(snapshot(&s))
}

/// The sampler's latest figures, with MLX's allocator counters read now.
pub fn snapshot(s: &AppState) -> telemetry::Snapshot {
    let mut snap = s.telemetry.latest();
    let mlx = engine::memory::mlx_memory();
    snap.memory = snap.memory.with_mlx(mlx.active, mlx.peak, mlx.cache);
    snap
}

/// One update of the live view: the status, plus what moves.
fn update(s: &AppState, tokens_per_s: f64, downloads: Vec<store::download::Progress>) -> serde_json::Value {
    let metrics = &s.loaded().worker.metrics;
    let mut u = crate::status_json(s);
    u["generating"] = json!(metrics.generating.load(Ordering::SeqCst));
    u["tokens_per_s_now"] = json!(tokens_per_s);
    u["last"] = json!(metrics.live());
    u["telemetry"] = json!(snapshot(s));
    u["downloads"] = json!(downloads);
    u["tuning"] = json!(crate::tuning::snapshot(s));
    u["sample"] = json!(s.history.latest());
    u
}

pub async fn events(State(s): State<AppState>) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    // First the history (at most 15 minutes of samples), then the updates.
    let history = Event::default()
        .event("history")
        .data(json!({"keep": crate::history::KEEP, "samples": s.history.all()}).to_string());
    let replay = futures_util::stream::once(async move { Ok(history) });
    let stream = futures_util::stream::unfold((s, true), |(s, first)| async move {
        if !first {
            let downloading = s.store.progress().iter().any(|p| !p.state.is_final());
            let tuning = s.tuning.lock().map(|t| t.running).unwrap_or(false);
            let busy = downloading || tuning || s.loaded().worker.metrics.generating.load(Ordering::SeqCst);
            tokio::time::sleep(if busy { Duration::from_secs(1) } else { Duration::from_secs(3) }).await;
        }
        // The rate the history's sampler measured over its last second.
        let rate = s.history.latest().map_or(0.0, |sample| sample.tokens_per_s);
        let event = Event::default().event("status").data(update(&s, rate, s.store.progress()).to_string());
        Some((Ok(event), (s, false)))
    });
    Sse::new(replay.chain(stream)).keep_alive(KeepAlive::default())
}
