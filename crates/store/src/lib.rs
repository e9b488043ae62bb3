//! Ferrite's model store: the catalog (`models.toml`), the one models folder the CLI and the
//! app share (Hugging Face hub-cache layout, so other tools see the same files), downloads
//! with resume and verification, deletion, and watching the folder for changes.

mod assets;
pub mod catalog;
pub mod config;
pub mod download;
mod error;
pub mod layout;
pub mod models;
pub mod tuning;
pub mod verify;
pub mod watch;

pub use assets::assets_dir;
pub use catalog::{Catalog, Entry};
pub use config::Config;
pub use error::StoreError;
pub use models::{Installed, Listing, Resolved, Store};
