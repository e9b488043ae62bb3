//! Ferrite's config file (`config.toml` in the platform config directory, or in
//! `$FERRITE_CONFIG_DIR`): the one place the models folder is chosen, read the same way by
//! the CLI and the app, and the local model folders registered in place.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The models folder (hub-cache layout); unset = the Hugging Face cache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub models_dir: Option<PathBuf>,
    /// MLX model folders used where they are, not copied.
    #[serde(default, rename = "local", skip_serializing_if = "Vec::is_empty")]
    pub local_models: Vec<LocalModel>,
    /// What the menu-bar app served last, so that its next launch starts it again.
    #[serde(default, skip_serializing_if = "AppChoice::is_empty")]
    pub app: AppChoice,
    /// The prompt cache's disk tier.
    #[serde(default, skip_serializing_if = "PromptCacheConfig::is_empty")]
    pub prompt_cache: PromptCacheConfig,
}

/// The `[prompt_cache]` table: where the disk tier keeps its blocks (default: a `.ferrite`
/// folder in the models folder, on the models volume) and its size in GB (default: a tenth of
/// the volume's free space, at most 50 GB; 0 turns the disk tier off).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PromptCacheConfig {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_gb: Option<f64>,
}

impl PromptCacheConfig {
    pub fn is_empty(&self) -> bool {
        self.dir.is_none() && self.disk_gb.is_none()
    }
}

/// The `[app]` table: the model and profile the person last started from the app (its tray
/// menu or its window), as they were named then.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AppChoice {
    /// A name the store resolves: catalog id or alias, registered id, repository or folder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// `sustained` or `turbo`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub profile: Option<String>,
}

impl AppChoice {
    pub fn is_empty(&self) -> bool {
        self.model.is_none() && self.profile.is_none()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalModel {
    pub id: String,
    pub path: PathBuf,
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}

/// Ferrite's config directory: `$FERRITE_CONFIG_DIR`, else the platform's (`~/.config/ferrite`
/// on Linux, `~/Library/Application Support/ferrite` on macOS).
pub fn config_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("FERRITE_CONFIG_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir);
    }
    dirs::config_dir().unwrap_or_else(|| PathBuf::from(".")).join("ferrite")
}

impl Config {
    pub fn path(config_dir: &Path) -> PathBuf {
        config_dir.join("config.toml")
    }

    /// Reads the config; a missing file is the default config, a broken one an error that
    /// names the file and the line.
    pub fn load(config_dir: &Path) -> Result<Config, ConfigError> {
        let path = Self::path(config_dir);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Config::default()),
            Err(source) => return Err(ConfigError::Io { path, source }),
        };
        toml::from_str(&text).map_err(|e| {
            let line = e.span().map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1).unwrap_or(0);
            ConfigError::Invalid { path, message: format!("line {line}: {}", e.message().trim()) }
        })
    }

    /// Reads the config, changes it and writes it back (read fresh, so that what another
    /// process saved meanwhile is kept).
    pub fn update(config_dir: &Path, change: impl FnOnce(&mut Config)) -> Result<Config, ConfigError> {
        let mut config = Config::load(config_dir)?;
        change(&mut config);
        config.save(config_dir)?;
        Ok(config)
    }

    /// Writes the config atomically (a crash never leaves half a file).
    pub fn save(&self, config_dir: &Path) -> Result<(), ConfigError> {
        let path = Self::path(config_dir);
        let io = |source| ConfigError::Io { path: path.clone(), source };
        std::fs::create_dir_all(config_dir).map_err(io)?;
        let text = toml::to_string_pretty(self)
            .map_err(|e| ConfigError::Invalid { path: path.clone(), message: e.to_string() })?;
        let tmp = path.with_extension("toml.tmp");
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, &path).map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_reports_bad_files() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(Config::load(dir.path()).unwrap(), Config::default());
        let c = Config {
            models_dir: Some("/Volumes/External/models".into()),
            local_models: vec![LocalModel { id: "mine".into(), path: "/m".into() }],
            app: AppChoice { model: Some("qwen3-8b".into()), profile: Some("turbo".into()) },
            prompt_cache: PromptCacheConfig { dir: Some("/Volumes/External/cache".into()), disk_gb: Some(20.0) },
        };
        c.save(dir.path()).unwrap();
        assert_eq!(Config::load(dir.path()).unwrap(), c);
        // An update keeps what it does not touch.
        let updated = Config::update(dir.path(), |c| c.app.model = Some("default".into())).unwrap();
        assert_eq!(updated.local_models, c.local_models);
        assert_eq!(
            Config::load(dir.path()).unwrap().app,
            AppChoice { model: Some("default".into()), profile: Some("turbo".into()) }
        );
        // A config without an [app] table (every file before it existed) reads as before.
        std::fs::write(Config::path(dir.path()), "models_dir = \"/m\"\n").unwrap();
        assert!(Config::load(dir.path()).unwrap().app.is_empty());
        std::fs::write(Config::path(dir.path()), "[app]\nmodle = \"x\"\n").unwrap();
        let e = Config::load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("line 2") && e.contains("modle"), "{e}");
        std::fs::write(Config::path(dir.path()), "models_dir = 3\n").unwrap();
        let e = Config::load(dir.path()).unwrap_err().to_string();
        assert!(e.contains("config.toml") && e.contains("line 1"), "{e}");
    }
}
