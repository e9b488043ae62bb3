//! What the app serves at launch, from the environment, resolved as `ferrite serve` does
//! (same config file, same model store, same tuned draft depth).

use std::net::{Ipv4Addr, SocketAddr};

use anyhow::Context;

pub struct Settings {
    pub model: String,
    pub port: u16,
    pub profile: engine::ProfileName,
    pub hidden: bool,
}

impl Settings {
    pub fn from_env() -> anyhow::Result<Settings> {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Ok(Settings {
            model: var("FERRITE_MODEL").unwrap_or_else(|| "default".into()),
            port: match var("FERRITE_PORT") {
                Some(p) => p.parse().with_context(|| format!("FERRITE_PORT: `{p}` is not a port number"))?,
                None => 8080,
            },
            profile: match var("FERRITE_PROFILE") {
                Some(p) => p.parse().map_err(|e| anyhow::anyhow!("FERRITE_PROFILE: {e}"))?,
                None => engine::ProfileName::default(),
            },
            hidden: var("FERRITE_APP_HIDDEN").is_some_and(|v| v != "0"),
        })
    }
}

/// Loads the launch model and binds loopback: the port asked for, or any free one if it is
/// taken (a `ferrite serve` may be running already; the window shows the address in use).
pub async fn start(settings: &Settings) -> anyhow::Result<(server::AppState, tokio::net::TcpListener)> {
    let model = server::launch::spec(&settings.model, "auto", settings.profile)?;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, settings.port));
    let config = server::ServerConfig {
        model_dir: model.dir,
        model_id: Some(model.id),
        aliases: model.aliases,
        addr,
        api_key: None,
        draft_depth: model.draft_depth,
        draft_depth_source: model.draft_depth_source,
        worker: server::worker::WorkerOptions {
            idle: Some(std::time::Duration::from_secs(600)),
            profile: engine::Profile::named(settings.profile),
            ..Default::default()
        },
        cors_origins: server::APP_ORIGINS.iter().map(|o| o.to_string()).collect(),
        resolver: Some(server::launch::resolver()),
    };
    let state = server::start(&config).await?;
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::warn!("{addr} is taken ({e}): using another port");
            tokio::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.context("binding a loopback port")?
        }
    };
    Ok((state, listener))
}
