//! The models: `GET /v1/models` lists the one served (OpenAI's form, with its context);
//! the models the UI offers: `GET /v1/store` lists what is installed (and what is not usable
//! yet), the catalog and the downloads; `POST /v1/store/pull|cancel|delete {"model": NAME}`
//! and `POST /v1/store/folder {"dir": DIR}` act on the store (the same config file and folder
//! as the CLI); `POST /v1/models/load {"model": NAME}` starts another model, through the
//! resolver the embedding program gave, and serves it from then on.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use std::sync::{Arc, Mutex};

use store::download::{Download, Downloader};

use crate::error::{parse, ApiError};
use crate::worker::{Worker, WorkerOptions};
use crate::{AppState, Loaded};

/// Where the store's settings live and how downloads reach the hub: the defaults (the config
/// directory, `$HF_ENDPOINT`) unless the embedding program (or a test) says otherwise.
#[derive(Clone, Default)]
pub struct StoreAccess {
    pub config_dir: Option<std::path::PathBuf>,
    pub download: Option<store::download::Options>,
    /// One downloader per models folder (a pull of a model already coming joins it).
    downloader: Arc<Mutex<Option<(std::path::PathBuf, Downloader)>>>,
    /// Downloads started here, newest last, for the listing and the live stream.
    pub downloads: Arc<Mutex<Vec<Arc<Download>>>>,
}

impl StoreAccess {
    pub fn new(config_dir: Option<std::path::PathBuf>, download: Option<store::download::Options>) -> Self {
        StoreAccess { config_dir, download, ..Default::default() }
    }

    fn open(&self) -> Result<store::Store, ApiError> {
        let dir = self.config_dir.clone().unwrap_or_else(store::config::config_dir);
        store::Store::open(&dir).map_err(|e| ApiError::internal(format!("the model store: {e}")))
    }

    fn downloader(&self, models_dir: &std::path::Path) -> Downloader {
        let mut slot = self.downloader.lock().unwrap_or_else(|e| e.into_inner());
        match slot.as_ref() {
            Some((dir, d)) if dir == models_dir => d.clone(),
            _ => {
                let mut options = self.download.clone().unwrap_or_default();
                // A download counts as installed only if the engine would load it.
                options.model_check.get_or_insert_with(|| {
                    Arc::new(|dir: &std::path::Path| engine::inspect::check_folder(dir).map_err(|e| e.to_string()))
                });
                let d = Downloader::new(models_dir.to_path_buf(), options);
                *slot = Some((models_dir.to_path_buf(), d.clone()));
                d
            }
        }
    }

    /// Progress of every download started here that is running or ended in the last minutes.
    pub fn progress(&self) -> Vec<store::download::Progress> {
        self.downloads.lock().map(|d| d.iter().map(|x| x.progress().borrow().clone()).collect()).unwrap_or_default()
    }
}

async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await.map_err(|e| ApiError::internal(e.to_string()))?
}

fn store_error(e: store::StoreError) -> ApiError {
    use store::StoreError as E;
    match e {
        E::UnknownModel(_) | E::NotInstalled(_) => ApiError::not_found(e.to_string()).with_param("model"),
        E::Embedded(_) | E::NameTaken(_) | E::Folder { .. } | E::Unusable { .. } => {
            ApiError::bad_request(e.to_string())
        }
        other => ApiError::internal(other.to_string()),
    }
}

#[derive(Deserialize)]
struct ModelRequest {
    model: String,
}

#[derive(Deserialize)]
struct FolderRequest {
    dir: std::path::PathBuf,
}

/// Starts (or joins) a download: 202 with its progress so far.
pub async fn pull(State(s): State<AppState>, body: Bytes) -> Result<(StatusCode, Json<Value>), ApiError> {
    let ModelRequest { model } = parse(&body)?;
    let access = s.store.clone();
    let st = blocking(move || access.open()).await?;
    let entry = st.catalog.find(&model);
    let (repo, revision, expect_mtp) = match entry {
        Some(e) if e.embedded.is_some() => {
            return Err(ApiError::bad_request(format!("`{}` ships with Ferrite: nothing to download", e.id)))
        }
        Some(e) => (e.repo.clone(), e.revision.clone(), e.mtp),
        None if model.split('/').count() == 2 => (model.clone(), "main".to_string(), false),
        None => {
            return Err(ApiError::not_found(format!(
                "`{model}` is neither a catalog model nor a repository (org/name)"
            ))
            .with_param("model"))
        }
    };
    let downloader = s.store.downloader(&st.models_dir);
    let download = downloader.pull(store::download::Request::model(repo, revision, expect_mtp));
    // The block drafter the catalog pairs with the model comes along, as its own download.
    let drafter = entry.and_then(store::download::Request::drafter_of).map(|r| downloader.pull(r));
    if let Ok(mut list) = s.store.downloads.lock() {
        for d in std::iter::once(&download).chain(drafter.as_ref()) {
            if !list.iter().any(|known| Arc::ptr_eq(known, d)) {
                list.push(d.clone());
            }
        }
        // Keep the last few finished ones for the UI, not all of history.
        while list.len() > 16 {
            list.remove(0);
        }
    }
    let mut progress = json!(download.progress().borrow().clone());
    if let Some(d) = &drafter {
        progress["drafter"] = json!(d.progress().borrow().clone());
    }
    Ok((StatusCode::ACCEPTED, Json(progress)))
}

pub async fn cancel(State(s): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let ModelRequest { model } = parse(&body)?;
    let access = s.store.clone();
    let st = blocking(move || access.open()).await?;
    let repo = st.catalog.find(&model).map(|e| e.repo.clone()).unwrap_or(model.clone());
    let list = s.store.downloads.lock().map(|l| l.clone()).unwrap_or_default();
    let running: Vec<_> = list
        .iter()
        .filter(|d| {
            let p = d.progress().borrow().clone();
            p.repo == repo && !p.state.is_final()
        })
        .collect();
    if running.is_empty() {
        return Err(ApiError::not_found(format!("no download of `{model}` is running")).with_param("model"));
    }
    running.iter().for_each(|d| d.cancel());
    Ok(Json(json!({"cancelled": repo})))
}

pub async fn delete(State(s): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let ModelRequest { model } = parse(&body)?;
    let loaded = s.loaded();
    let access = s.store.clone();
    let dir_in_use = loaded.worker.info.dir.clone();
    let downloading: Vec<String> = s
        .store
        .downloads
        .lock()
        .map(|l| {
            l.iter().map(|d| d.progress().borrow().clone()).filter(|p| !p.state.is_final()).map(|p| p.repo).collect()
        })
        .unwrap_or_default();
    let name = model.clone();
    let freed = blocking(move || {
        let mut st = access.open()?;
        // Compared as real paths: a model started by a relative path, or through a link, is
        // still the one being served.
        let real = |p: &std::path::Path| p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
        let served = real(&dir_in_use);
        let serves = |dir: &std::path::Path| served == real(dir) || served.starts_with(real(dir));
        let folder = st.deleted_folder(&name);
        if st.resolve(&name).is_ok_and(|r| serves(&r.dir)) || folder.as_ref().is_some_and(|(_, d)| serves(d)) {
            return Err(
                ApiError::conflict(format!("`{name}` is being served: start another model first")).with_param("model")
            );
        }
        if let Some((repo, _)) = folder.filter(|(repo, _)| downloading.contains(repo)) {
            return Err(ApiError::conflict(format!(
                "`{repo}` is being downloaded: cancel the download first (deleting now would leave a partial folder)"
            ))
            .with_param("model"));
        }
        st.delete(&name).map_err(store_error)
    })
    .await?;
    Ok(Json(json!({"deleted": model, "freed_bytes": freed})))
}

pub async fn folder(State(s): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let FolderRequest { dir } = parse(&body)?;
    let access = s.store.clone();
    let models_dir = blocking(move || {
        let mut st = access.open()?;
        st.set_models_dir(&dir).map_err(store_error)?;
        Ok(st.models_dir)
    })
    .await?;
    Ok(Json(json!({"models_dir": models_dir})))
}

pub async fn store_listing(State(s): State<AppState>) -> Result<Json<Value>, ApiError> {
    let access = s.store.clone();
    // Downloads first, then the folder: a pull seen ended has already removed what it refused,
    // so the listing cannot show a model its download says failed.
    let downloads = s.store.progress();
    let store = blocking(move || access.open()).await?;
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
        "drafters": listing.drafters,
        "catalog": store.catalog.entries,
        "downloads": downloads,
    })))
}

/// Either field may be left out: the model served now, or the profile it runs with now.
#[derive(Deserialize)]
struct LoadRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    profile: Option<String>,
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

/// `POST /v1/models/load {"model"?, "profile"?}`: another model, or the same one with another
/// runtime profile.
pub async fn load(State(s): State<AppState>, body: Bytes) -> Result<Json<Value>, ApiError> {
    let request: LoadRequest = parse(&body)?;
    let profile = match request.profile.as_deref() {
        Some(p) => Some(p.parse::<engine::ProfileName>().map_err(|e| ApiError::bad_request(e).with_param("profile"))?),
        None => None,
    };
    Ok(Json(load_model(&s, request.model, profile).await?))
}

/// Starts `model` (default: the one served) with `profile` (default: the one in use) and
/// serves it from then on; the UI's Start buttons and the app's tray menu both come here.
pub async fn load_model(
    s: &AppState,
    model: Option<String>,
    profile: Option<engine::ProfileName>,
) -> Result<Value, ApiError> {
    let current = s.loaded().worker.info.clone();
    let model = model.unwrap_or_else(|| current.id.clone());
    let profile = profile.unwrap_or(current.profile.name);
    let resolver = s.resolver.clone().ok_or_else(|| {
        ApiError::conflict("this server was started to serve one model; restart it with another --model")
    })?;
    if s.worker_options.split.is_some() {
        return Err(ApiError::conflict(
            "this server's model is split across ranks (--hosts): start it again with another model to serve that one",
        )
        .with_param("model"));
    }
    {
        let mut loading = s.loading.lock().map_err(|_| ApiError::internal("loading state poisoned"))?;
        if let Some(other) = loading.as_ref() {
            return Err(ApiError::conflict(format!("`{other}` is loading; try again when it is ready")));
        }
        *loading = Some(model.clone());
    }
    let _mark = Loading(s.clone());
    let options = WorkerOptions { profile: engine::Profile::named(profile), ..s.worker_options.clone() };
    let name = model.clone();
    let started = tokio::task::spawn_blocking(move || -> anyhow::Result<(crate::ModelSpec, Worker)> {
        let spec = resolver(&name, profile)?;
        let options = WorkerOptions { batch_rule: spec.batch_rule.clone(), drafter: spec.drafter.clone(), ..options };
        let worker = Worker::start(spec.dir.clone(), spec.id.clone(), options)?;
        Ok((spec, worker))
    })
    .await
    .map_err(|e| ApiError::internal(e.to_string()))?;
    let (spec, worker) =
        started.map_err(|e| ApiError::bad_request(format!("cannot start `{model}`: {e:#}")).with_param("model"))?;
    tracing::info!("now serving `{}` from {} ({profile} profile)", spec.id, spec.dir.display());
    s.replace(Loaded { worker: Arc::new(worker), aliases: spec.aliases.clone(), depth: spec.depth.clone() });
    s.set_notice(None);
    if let Some(on_load) = s.on_load.clone() {
        let spec = spec.clone();
        let told = tokio::task::spawn_blocking(move || on_load(&model, &spec, profile)).await;
        if let Err(e) = told {
            tracing::warn!("telling the embedding program about the new model failed: {e}");
        }
    }
    Ok(
        json!({"model": spec.id, "aliases": spec.aliases, "dir": spec.dir, "draft_depth": spec.depth.depth(), "drafter": spec.depth.speculation.drafter, "profile": profile}),
    )
}

/// `GET /v1/models`: the model served and its aliases, each with its context.
pub async fn list(State(state): State<AppState>) -> Json<ModelList> {
    let loaded = state.loaded();
    let (context, sees) = (loaded.worker.info.context, loaded.worker.info.sees);
    let card = |id: &str| ModelCard {
        id: id.to_string(),
        object: "model",
        created: state.started_unix,
        owned_by: "ferrite",
        context_length: context,
        max_model_len: context,
        input_modalities: if sees { vec!["text", "image"] } else { vec!["text"] },
    };
    let mut data = vec![card(&loaded.worker.info.id)];
    data.extend(loaded.aliases.iter().map(|a| card(a)));
    Json(ModelList { object: "list", data })
}

#[derive(Serialize)]
pub struct ModelList {
    object: &'static str,
    data: Vec<ModelCard>,
}

#[derive(Serialize)]
struct ModelCard {
    id: String,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
    /// The model's context in tokens, under the two names clients read it by (OpenRouter's
    /// and vLLM's), so a client can compact a conversation before it overflows.
    context_length: usize,
    max_model_len: usize,
    /// What the model reads (OpenRouter's name for it): `image` too when it sees.
    input_modalities: Vec<&'static str>,
}
