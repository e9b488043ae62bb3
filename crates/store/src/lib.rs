//! Ferrite's model store: the catalog (`models.toml`), the one models folder the CLI and the
//! app share (Hugging Face hub-cache layout, so other tools see the same files), downloads
//! with resume and verification, deletion, and watching the folder for changes.

pub mod catalog;
pub mod config;
pub mod download;
pub mod layout;
pub mod models;
pub mod verify;
pub mod watch;

pub use catalog::{Catalog, Entry};
pub use config::Config;
pub use models::{Installed, Listing, Resolved, Store};

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
    #[error("`{0}` is neither a catalog model, an alias, a registered model, a repository (org/name) nor a model folder")]
    UnknownModel(String),
    #[error("`{0}` is not installed: `ferrite pull {0}` downloads it")]
    NotInstalled(String),
    #[error("`{name}` is not usable: {reason}")]
    Unusable { name: String, reason: String },
    #[error("the name `{0}` is already taken")]
    NameTaken(String),
}
