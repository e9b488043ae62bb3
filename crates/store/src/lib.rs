//! Ferrite's model store: the catalog (`models.toml`), the one models folder the CLI and the
//! app share (Hugging Face hub-cache layout, so other tools see the same files), downloads
//! with resume and verification, deletion, and watching the folder for changes.

pub mod catalog;
pub mod config;
pub mod download;
pub mod layout;
pub mod models;
pub mod tuning;
pub mod verify;
pub mod watch;

pub use catalog::{Catalog, Entry};
pub use config::Config;
pub use models::{Installed, Listing, Resolved, Store};

/// Where the models that ship with Ferrite live: `$FERRITE_ASSETS`, else `assets/` beside the
/// executable (an installed or bundled Ferrite), else the source checkout's `assets/` (a
/// `cargo build` in the repository).
pub fn assets_dir() -> std::path::PathBuf {
    if let Some(dir) = std::env::var_os("FERRITE_ASSETS").filter(|d| !d.is_empty()) {
        return dir.into();
    }
    let exe_dir = std::env::current_exe().ok().and_then(|e| e.parent().map(|p| p.to_path_buf()));
    let candidates = exe_dir
        .iter()
        // Beside the binary; the source tree (target/<profile>/); Ferrite.app's Resources; the
        // .deb's resources (/usr/bin → /usr/lib/Ferrite).
        .flat_map(|d| {
            [d.join("assets"), d.join("../../assets"), d.join("../Resources/assets"), d.join("../lib/Ferrite/assets")]
        })
        .chain([std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../assets")]);
    let mut fallback = None;
    for c in candidates {
        if c.join("models").is_dir() {
            return c.canonicalize().unwrap_or(c);
        }
        fallback.get_or_insert(c);
    }
    fallback.unwrap_or_else(|| "assets".into())
}

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Catalog(#[from] catalog::CatalogError),
    #[error(transparent)]
    Config(#[from] config::ConfigError),
    #[error(transparent)]
    Verify(#[from] verify::VerifyError),
    #[error("{}: {message}", dir.display())]
    Folder { dir: std::path::PathBuf, message: String },
    #[error(
        "`{0}` is neither a catalog model, an alias, a registered model, a repository (org/name) nor a model folder"
    )]
    UnknownModel(String),
    #[error("`{0}` is not installed: `ferrite pull {0}` downloads it")]
    NotInstalled(String),
    #[error("`{name}` is not usable: {reason}")]
    Unusable { name: String, reason: String },
    #[error("the name `{0}` is already taken")]
    NameTaken(String),
    #[error("`{0}` ships with Ferrite: there is nothing to download or delete")]
    Embedded(String),
}
