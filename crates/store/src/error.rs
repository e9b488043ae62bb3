//! What the store refuses or cannot do, one variant a cause.

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error(transparent)]
    Catalog(#[from] crate::catalog::CatalogError),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Verify(#[from] crate::verify::VerifyError),
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
