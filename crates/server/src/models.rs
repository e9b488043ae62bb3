//! The models the UI offers: `GET /v1/store` lists what is installed (and what is not usable
//! yet) and the catalog; `POST /v1/models/load {"model": NAME}` starts another model, through
//! the resolver the embedding program gave, and serves it from then on.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{parse, ApiError};
use crate::worker::Worker;
use crate::{AppState, Loaded};

pub async fn store_listing() -> Result<Json<Value>, ApiError> {
    let store = tokio::task::spawn_blocking(store::Store::open_default)
        .await
        .map_err(|e| ApiError::internal(e.to_string()))?
        .map_err(|e| ApiError::internal(format!("the model store: {e}")))?;
    let listing = tokio::task::spawn_blocking({
        let store = store.clone();
        move || store.list()
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(Json(json!({
        "models_dir": store.models_dir,
        "free_bytes": store::download::free_space(&store.models_dir).ok(),
        "installed": listing.installed,
        "incomplete": listing.incomplete,
        "catalog": store.catalog.entries,
    })))
}

#[derive(Deserialize)]
struct LoadRequest {
    model: String,
}

/// Clears the "loading" mark however the load ends.
struct Loading(AppState);

impl Drop for Loading {
    fn drop(&mut self) {
        if let Ok(mut l) = self.0.loading.lock() {
            *l = None;
        }
    }
}

pub async fn load(State(s): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let LoadRequest { model } = parse(&body)?;
    let resolver = s.resolver.clone().ok_or_else(|| ApiError {
        status: StatusCode::CONFLICT,
        message: "this server was started to serve one model; restart it with another --model".into(),
        param: None,
    })?;
    {
        let mut loading = s.loading.lock().map_err(|_| ApiError::internal("loading state poisoned"))?;
        if let Some(other) = loading.as_ref() {
            return Err(ApiError { status: StatusCode::CONFLICT, message: format!("`{other}` is loading; try again when it is ready"), param: None });
        }
        *loading = Some(model.clone());
    }
    let _mark = Loading(s.clone());
    let options = s.worker_options.clone();
    let name = model.clone();
    let started = tokio::task::spawn_blocking(move || -> anyhow::Result<(crate::ModelSpec, Worker)> {
        let spec = resolver(&name)?;
        let worker = Worker::start(spec.dir.clone(), spec.id.clone(), options)?;
        Ok((spec, worker))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?;
    let (spec, worker) = started.map_err(|e| ApiError::bad_request(format!("cannot start `{model}`: {e:#}")).with_param("model"))?;
    tracing::info!("now serving `{}` from {}", spec.id, spec.dir.display());
    s.replace(Loaded { worker, aliases: spec.aliases.clone(), draft_depth: spec.draft_depth, draft_depth_source: spec.draft_depth_source.clone() });
    Ok(Json(json!({"model": spec.id, "aliases": spec.aliases, "dir": spec.dir, "draft_depth": spec.draft_depth})))
}
