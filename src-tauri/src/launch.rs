//! What the app serves at launch, resolved as `ferrite serve` does (same config file, same
//! model store, same tuned draft depth): the model named in the environment, else the one the
//! person last started from the app, else the embedded default. A model that cannot start
//! does not stop the app: it starts the default model and the window says why.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use store::config::{config_dir, Config};

/// The embedded default model's alias: always installed, so the launch's fallback.
pub const DEFAULT_MODEL: &str = "default";

pub struct Settings {
    pub model: String,
    pub port: u16,
    pub profile: engine::ProfileName,
    pub hidden: bool,
    /// Something about these settings the window should say (a remembered profile that no
    /// longer reads, say).
    pub notice: Option<String>,
}

impl Settings {
    /// From the environment (`FERRITE_MODEL`, `FERRITE_PORT`, `FERRITE_PROFILE`,
    /// `FERRITE_APP_HIDDEN`), then the `[app]` table of the config file.
    pub fn from_env() -> anyhow::Result<Settings> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        // A config file that does not read is reported when the store opens; here it only
        // means nothing is remembered.
        let config = config_dir();
        let remembered = Config::load(&config).map(|c| c.app).unwrap_or_default();
        let mut notice = None;
        let profile = match (var("FERRITE_PROFILE"), remembered.profile) {
            (Some(p), _) => p.parse().map_err(|e| anyhow::anyhow!("FERRITE_PROFILE: {e}"))?,
            (None, Some(p)) => p.parse().unwrap_or_else(|e| {
                let message = format!(
                    "The profile remembered in {} does not read ({e}); using the default.",
                    Config::path(&config).display()
                );
                tracing::warn!("{message}");
                notice = Some(message);
                engine::ProfileName::default()
            }),
            (None, None) => engine::ProfileName::default(),
        };
        Ok(Settings {
            model: var("FERRITE_MODEL").or(remembered.model).unwrap_or_else(|| DEFAULT_MODEL.into()),
            port: match var("FERRITE_PORT") {
                Some(p) => p.parse().with_context(|| format!("FERRITE_PORT: `{p}` is not a port number"))?,
                None => 8080,
            },
            profile,
            hidden: var("FERRITE_APP_HIDDEN").is_some_and(|v| v != "0"),
            notice,
        })
    }
}

/// Loads the launch model (or, if it cannot start, the default one) and binds loopback: the
/// port asked for, or any free one if it is taken (a `ferrite serve` may be running already;
/// the window shows the address in use). Each model started later from the tray or the window
/// is remembered for the next launch.
pub async fn start(settings: &Settings) -> anyhow::Result<(server::AppState, tokio::net::TcpListener)> {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, settings.port));
    let (mut state, notice) = match serve(&settings.model, settings.profile, addr).await {
        Ok(state) => (state, settings.notice.clone()),
        Err(e) if settings.model != DEFAULT_MODEL => {
            tracing::warn!("could not start `{}`: {e:#}; starting the default model instead", settings.model);
            let state = serve(DEFAULT_MODEL, settings.profile, addr).await.with_context(|| {
                format!("starting the default model, after `{}` could not start ({e:#})", settings.model)
            })?;
            (state, Some(format!("Ferrite could not start `{}`: {e:#}. It started the default model instead; start another from the models list.", settings.model)))
        }
        Err(e) => return Err(e),
    };
    state.set_notice(notice);
    state.on_load = Some(remember(state.store.config_dir.clone().unwrap_or_else(config_dir)));
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!("{addr} is taken ({e}): using another port");
            tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.context("binding a loopback port")?
        }
    };
    Ok((state, listener))
}

/// Starts the server's engine on the model `name` resolves to.
async fn serve(name: &str, profile: engine::ProfileName, addr: SocketAddr) -> anyhow::Result<server::AppState> {
    let model = server::launch::spec(name, "auto", profile)?;
    let config = server::ServerConfig {
        model_dir: model.dir,
        model_id: Some(model.id),
        aliases: model.aliases,
        addr,
        api_key: None,
        depth: model.depth,
        worker: server::worker::WorkerOptions {
            idle: Some(std::time::Duration::from_secs(600)),
            profile: engine::Profile::named(profile),
            prompt_disk: server::launch::prompt_disk(),
            batch_rule: model.batch_rule,
            drafter: model.drafter,
            ..Default::default()
        },
        cors_origins: server::APP_ORIGINS.iter().map(|o| o.to_string()).collect(),
        allowed_hosts: vec![],
        resolver: Some(server::launch::resolver()),
        strict_model_names: false,
    };
    server::start(&config).await
}

/// Writes each model the person starts (and its profile) to the config file's `[app]` table.
fn remember(config_dir: PathBuf) -> server::OnLoad {
    Arc::new(move |name: &str, _spec: &server::ModelSpec, profile: engine::ProfileName| {
        let saved = Config::update(&config_dir, |c| {
            c.app.model = Some(name.to_string());
            c.app.profile = Some(profile.to_string());
        });
        match saved {
            Ok(_) => tracing::info!("the next launch starts `{name}` ({profile} profile)"),
            Err(e) => tracing::warn!("could not remember `{name}` for the next launch: {e}"),
        }
    })
}
