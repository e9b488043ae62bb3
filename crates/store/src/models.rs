//! The models folder as the CLI and the app see it: which models are installed (complete and
//! verified), which downloads are unfinished, how a name resolves to a folder, and deletion.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::catalog::{Catalog, DrafterEntry, Entry};
use crate::config::{Config, LocalModel};
use crate::error::StoreError;
use crate::layout;
use crate::verify::{self, ModelFacts};

/// Where the model came from.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// A snapshot in the models folder (downloaded by Ferrite or any other hub tool).
    Hub { repo: String, commit: String },
    /// A folder registered in place.
    Local,
    /// A model that ships with Ferrite (in its assets).
    Embedded,
}

#[derive(Debug, Clone, Serialize)]
pub struct Installed {
    /// The catalog id, the local registration's id, or the repository.
    pub id: String,
    pub catalog_id: Option<String>,
    pub dir: PathBuf,
    pub source: Source,
    pub model_type: String,
    pub bytes: u64,
    pub has_mtp: bool,
    /// A vision tower is in the folder (`verify::ModelFacts::sees`).
    pub sees: bool,
}

/// A snapshot that is not usable (yet): an unfinished or corrupt download.
#[derive(Debug, Clone, Serialize)]
pub struct Incomplete {
    pub repo: String,
    pub dir: PathBuf,
    pub reason: String,
    /// Bytes already on disk that a new pull resumes from.
    pub partial_bytes: u64,
}

/// A block drafter in the models folder (listed apart: it is loaded beside a model, never
/// served alone).
#[derive(Debug, Clone, Serialize)]
pub struct InstalledDrafter {
    pub repo: String,
    pub dir: PathBuf,
    pub block_size: usize,
    pub bytes: u64,
    /// The catalog models it drafts for.
    pub drafts_for: Vec<String>,
}

#[derive(Debug, Default, Serialize)]
pub struct Listing {
    pub installed: Vec<Installed>,
    pub incomplete: Vec<Incomplete>,
    pub drafters: Vec<InstalledDrafter>,
}

/// The store: the config's choices, the catalog, and the folder they point at.
#[derive(Debug, Clone)]
pub struct Store {
    pub config_dir: PathBuf,
    pub config: Config,
    pub catalog: Catalog,
    pub models_dir: PathBuf,
    /// Where embedded models are looked for ([`crate::assets_dir`]).
    pub assets_dir: PathBuf,
}

/// A name made concrete: the folder to load and the names to serve it under.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub dir: PathBuf,
    pub id: String,
    pub aliases: Vec<String>,
    pub entry: Option<Entry>,
    /// The catalog's block drafter for it, when that is installed (or ships with Ferrite).
    pub drafter: Option<PathBuf>,
}

impl Store {
    /// Opens the store the config in `config_dir` describes (the user catalog included).
    pub fn open(config_dir: &Path) -> Result<Store, StoreError> {
        let config = Config::load(config_dir)?;
        let catalog = Catalog::load(Some(&crate::catalog::user_file(config_dir)))?;
        let models_dir = config.models_dir.clone().unwrap_or_else(layout::default_models_dir);
        Ok(Store {
            config_dir: config_dir.to_path_buf(),
            config,
            catalog,
            models_dir,
            assets_dir: crate::assets::assets_dir(),
        })
    }

    /// Opens the store of the platform config directory (or `$FERRITE_CONFIG_DIR`).
    /// The prompt cache's disk tier: its folder and byte budget (`None`: turned off).
    pub fn prompt_disk(&self) -> Option<(PathBuf, u64)> {
        const CAP: u64 = 50_000_000_000;
        let c = &self.config.prompt_cache;
        let dir = c.dir.clone().unwrap_or_else(|| self.models_dir.join(".ferrite").join("prompt-cache"));
        let budget = match c.disk_gb {
            Some(gb) => (gb.max(0.0) * 1e9) as u64,
            None => {
                let volume = dir.ancestors().find(|d| d.exists())?;
                (crate::download::free_space(volume).ok()? / 10).min(CAP)
            }
        };
        (budget > 0).then_some((dir, budget))
    }

    /// The key that binds the prompt cache's blocks to this installation (a keyed MAC names
    /// each block): 32 random bytes kept in the config directory, made on first use. The
    /// cache's folder sits on the models volume, which other tools, copies and syncs share;
    /// the key does not, so a block this installation did not write is never loaded.
    pub fn prompt_cache_key(&self) -> std::io::Result<[u8; 32]> {
        let path = self.config_dir.join("prompt-cache.key");
        let mut key = [0u8; 32];
        if let Ok(bytes) = crate::verify::read_small(&path) {
            if bytes.len() == key.len() {
                key.copy_from_slice(&bytes);
                return Ok(key);
            }
        }
        getrandom::fill(&mut key).map_err(|e| std::io::Error::other(format!("no random source: {e}")))?;
        std::fs::create_dir_all(&self.config_dir)?;
        let tmp = self.config_dir.join(format!(".prompt-cache.key.{}", std::process::id()));
        let mut options = std::fs::OpenOptions::new();
        options.write(true).create(true).truncate(true);
        #[cfg(unix)]
        std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
        std::io::Write::write_all(&mut options.open(&tmp)?, &key)?;
        // Two processes starting at once: the first key placed wins, both use it.
        if std::fs::hard_link(&tmp, &path).is_err() {
            let _ = std::fs::remove_file(&tmp);
            let bytes = crate::verify::read_small(&path)?;
            if bytes.len() != key.len() {
                // A key file of the wrong size is replaced: its blocks cannot be verified anyway.
                std::fs::write(&path, key)?;
                return Ok(key);
            }
            key.copy_from_slice(&bytes);
            return Ok(key);
        }
        let _ = std::fs::remove_file(&tmp);
        Ok(key)
    }

    pub fn open_default() -> Result<Store, StoreError> {
        Self::open(&crate::config::config_dir())
    }

    /// Chooses the models folder (created if needed, checked writable) and saves the choice.
    pub fn set_models_dir(&mut self, dir: &Path) -> Result<(), StoreError> {
        let io = |e: std::io::Error| StoreError::Folder { dir: dir.to_path_buf(), message: e.to_string() };
        std::fs::create_dir_all(dir).map_err(io)?;
        let dir = dir.canonicalize().map_err(io)?;
        let probe = dir.join(".ferrite-write-test");
        std::fs::write(&probe, b"")
            .map_err(|e| StoreError::Folder { dir: dir.clone(), message: format!("not writable: {e}") })?;
        let _ = std::fs::remove_file(probe);
        self.config.models_dir = Some(dir.clone());
        self.config.save(&self.config_dir)?;
        self.models_dir = dir;
        Ok(())
    }

    /// Registers an MLX model folder where it is (after checking it loads).
    pub fn register_local(&mut self, id: &str, path: &Path) -> Result<ModelFacts, StoreError> {
        let path =
            path.canonicalize().map_err(|e| StoreError::Folder { dir: path.to_path_buf(), message: e.to_string() })?;
        let facts = verify::check_model_dir(&path, false)?;
        if self.catalog.find(id).is_some() || self.config.local_models.iter().any(|m| m.id == id) {
            return Err(StoreError::NameTaken(id.to_string()));
        }
        self.config.local_models.push(LocalModel { id: id.to_string(), path });
        self.config.save(&self.config_dir)?;
        Ok(facts)
    }

    /// Every snapshot in the models folder and every registered folder, sorted into usable
    /// and not.
    pub fn list(&self) -> Listing {
        let mut listing = Listing::default();
        for (repo, repo_dir) in self.repo_dirs() {
            let entry = self.catalog.entries.iter().find(|e| e.repo == repo);
            let partial = layout::partial_bytes(&repo_dir);
            let snapshots = std::fs::read_dir(repo_dir.join("snapshots")).into_iter().flatten().flatten();
            let mut seen_snapshot = false;
            let drafts_for: Vec<String> = self.catalog.drafted_by(&repo).map(|e| e.id.clone()).collect();
            for snap in snapshots.filter(|s| s.path().is_dir()) {
                seen_snapshot = true;
                let dir = snap.path();
                let commit = snap.file_name().to_string_lossy().into_owned();
                if !drafts_for.is_empty() || verify::is_drafter_dir(&dir) {
                    match verify::check_drafter_dir(&dir) {
                        Ok(facts) => listing.drafters.push(InstalledDrafter {
                            repo: repo.clone(),
                            dir,
                            block_size: facts.block_size,
                            bytes: facts.bytes,
                            drafts_for: drafts_for.clone(),
                        }),
                        Err(e) => listing.incomplete.push(Incomplete {
                            repo: repo.clone(),
                            dir,
                            reason: e.to_string(),
                            partial_bytes: partial,
                        }),
                    }
                    continue;
                }
                match verify::check_model_dir(&dir, entry.is_some_and(|e| e.mtp)) {
                    Ok(facts) => listing.installed.push(Installed {
                        id: entry.map(|e| e.id.clone()).unwrap_or_else(|| repo.clone()),
                        catalog_id: entry.map(|e| e.id.clone()),
                        dir,
                        source: Source::Hub { repo: repo.clone(), commit },
                        model_type: facts.model_type,
                        bytes: facts.bytes,
                        has_mtp: facts.has_mtp,
                        sees: facts.sees,
                    }),
                    Err(e) => listing.incomplete.push(Incomplete {
                        repo: repo.clone(),
                        dir,
                        reason: e.to_string(),
                        partial_bytes: partial,
                    }),
                }
            }
            if !seen_snapshot && partial > 0 {
                listing.incomplete.push(Incomplete {
                    repo,
                    dir: repo_dir,
                    reason: "download not finished".into(),
                    partial_bytes: partial,
                });
            }
        }
        for entry in &self.catalog.entries {
            let Some(rel) = &entry.embedded else { continue };
            let dir = self.assets_dir.join(rel);
            if let Ok(facts) = verify::check_model_dir(&dir, entry.mtp) {
                listing.installed.push(Installed {
                    id: entry.id.clone(),
                    catalog_id: Some(entry.id.clone()),
                    dir,
                    source: Source::Embedded,
                    model_type: facts.model_type,
                    bytes: facts.bytes,
                    has_mtp: facts.has_mtp,
                    sees: facts.sees,
                });
            }
        }
        for local in &self.config.local_models {
            match verify::check_model_dir(&local.path, false) {
                Ok(facts) => listing.installed.push(Installed {
                    id: local.id.clone(),
                    catalog_id: None,
                    dir: local.path.clone(),
                    source: Source::Local,
                    model_type: facts.model_type,
                    bytes: facts.bytes,
                    has_mtp: facts.has_mtp,
                    sees: facts.sees,
                }),
                Err(e) => listing.incomplete.push(Incomplete {
                    repo: local.id.clone(),
                    dir: local.path.clone(),
                    reason: e.to_string(),
                    partial_bytes: 0,
                }),
            }
        }
        listing
    }

    /// `(repo, folder)` of every hub repository in the models folder.
    fn repo_dirs(&self) -> Vec<(String, PathBuf)> {
        let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(&self.models_dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| layout::repo_from_folder(&e.file_name().to_string_lossy()).map(|r| (r, e.path())))
            .collect();
        out.sort();
        out
    }

    /// A catalog id or alias, a repository, a registered id, or a model folder → what to load.
    pub fn resolve(&self, name: &str) -> Result<Resolved, StoreError> {
        let path = Path::new(name);
        if let Some(resolved) = folder_model(path, &self.catalog) {
            return Ok(resolved);
        }
        if let Some(local) = self.config.local_models.iter().find(|m| m.id == name) {
            return Ok(Resolved {
                dir: local.path.clone(),
                id: local.id.clone(),
                aliases: vec![],
                entry: None,
                drafter: None,
            });
        }
        let entry = self.catalog.find(name).cloned();
        if let Some((e, rel)) = entry.as_ref().and_then(|e| e.embedded.as_ref().map(|rel| (e, rel))) {
            let dir = self.assets_dir.join(rel);
            verify::check_model_dir(&dir, e.mtp)
                .map_err(|err| StoreError::Unusable { name: name.to_string(), reason: err.to_string() })?;
            let drafter = e.drafter.as_ref().and_then(|d| self.drafter_dir(d));
            return Ok(Resolved { dir, id: e.id.clone(), aliases: e.aliases.clone(), entry: entry.clone(), drafter });
        }
        let (repo, revision) = match &entry {
            Some(e) => (e.repo.clone(), e.revision.clone()),
            None if name.contains('/') && !path.exists() => (name.to_string(), "main".to_string()),
            None => return Err(StoreError::UnknownModel(name.to_string())),
        };
        let repo_dir = self.models_dir.join(layout::repo_folder(&repo));
        let commit =
            layout::resolve_ref(&repo_dir, &revision).ok_or_else(|| StoreError::NotInstalled(name.to_string()))?;
        let dir = repo_dir.join("snapshots").join(commit);
        verify::check_model_dir(&dir, entry.as_ref().is_some_and(|e| e.mtp))
            .map_err(|e| StoreError::Unusable { name: name.to_string(), reason: e.to_string() })?;
        let id = entry.as_ref().map(|e| e.id.clone()).unwrap_or_else(|| repo.clone());
        let aliases = entry.as_ref().map(|e| e.aliases.clone()).unwrap_or_default();
        let drafter = entry.as_ref().and_then(|e| e.drafter.as_ref()).and_then(|d| self.drafter_dir(d));
        Ok(Resolved { dir, id, aliases, entry, drafter })
    }

    /// The folder of a catalog drafter when it is installed and passes the cheap checks.
    pub fn drafter_dir(&self, drafter: &DrafterEntry) -> Option<PathBuf> {
        let dir = match &drafter.embedded {
            Some(rel) => self.assets_dir.join(rel),
            None => {
                let repo_dir = self.models_dir.join(layout::repo_folder(&drafter.repo));
                repo_dir.join("snapshots").join(layout::resolve_ref(&repo_dir, &drafter.revision)?)
            }
        };
        match verify::check_drafter_dir(&dir) {
            Ok(_) => Some(dir),
            Err(e) => {
                tracing::debug!("the drafter {} is not usable: {e}", dir.display());
                None
            }
        }
    }

    /// The repository and hub folder `delete(name)` would remove from (`None` for a registered
    /// folder, which is only forgotten, and for the embedded model).
    pub fn deleted_folder(&self, name: &str) -> Option<(String, PathBuf)> {
        if self.config.local_models.iter().any(|m| m.id == name) {
            return None;
        }
        let repo = match self.catalog.find(name) {
            Some(e) if e.embedded.is_some() => return None,
            Some(e) => e.repo.clone(),
            None if name.contains('/') => name.to_string(),
            None => return None,
        };
        let dir = self.models_dir.join(layout::repo_folder(&repo));
        Some((repo, dir))
    }

    /// Deletes a model: its snapshots, and the blobs no remaining snapshot uses (a registered
    /// folder is only forgotten, never deleted). Returns the bytes freed.
    pub fn delete(&mut self, name: &str) -> Result<u64, StoreError> {
        if let Some(i) = self.config.local_models.iter().position(|m| m.id == name) {
            self.config.local_models.remove(i);
            self.config.save(&self.config_dir)?;
            return Ok(0);
        }
        let (repo, revision) = match self.catalog.find(name) {
            Some(e) if e.embedded.is_some() => return Err(StoreError::Embedded(e.id.clone())),
            Some(e) => (e.repo.clone(), e.revision.clone()),
            None if name.contains('/') => (name.to_string(), "main".to_string()),
            None => return Err(StoreError::UnknownModel(name.to_string())),
        };
        let repo_dir = self.models_dir.join(layout::repo_folder(&repo));
        if !repo_dir.exists() {
            return Err(StoreError::NotInstalled(name.to_string()));
        }
        let folder_error =
            |dir: &Path, e: std::io::Error| StoreError::Folder { dir: dir.to_path_buf(), message: e.to_string() };
        let mut freed = 0;
        if let Some(commit) = layout::resolve_ref(&repo_dir, &revision) {
            let snapshot = repo_dir.join("snapshots").join(&commit);
            let before = used_blobs(&repo_dir);
            std::fs::remove_dir_all(&snapshot).map_err(|e| folder_error(&snapshot, e))?;
            let after = used_blobs(&repo_dir);
            for blob in before.keys().filter(|b| !after.contains_key(*b)) {
                let path = repo_dir.join("blobs").join(blob);
                freed += path.metadata().map(|m| m.len()).unwrap_or(0);
                std::fs::remove_file(&path).map_err(|e| folder_error(&path, e))?;
            }
            for r in std::fs::read_dir(repo_dir.join("refs")).into_iter().flatten().flatten() {
                if layout::read_ref(&r.path()).is_some_and(|c| c == commit) {
                    let _ = std::fs::remove_file(r.path());
                }
            }
        }
        // No snapshot left: the folder goes, unfinished downloads with it.
        let left = std::fs::read_dir(repo_dir.join("snapshots")).map(|d| d.count()).unwrap_or(0);
        if left == 0 {
            freed += dir_bytes(&repo_dir);
            std::fs::remove_dir_all(&repo_dir).map_err(|e| folder_error(&repo_dir, e))?;
        }
        Ok(freed)
    }
}

/// Bytes of the real files under `dir` (links not followed: blobs are counted once).
fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let Ok(meta) = entry.path().symlink_metadata() else { continue };
        if meta.is_dir() {
            total += dir_bytes(&entry.path());
        } else if meta.is_file() {
            total += meta.len();
        }
    }
    total
}

/// A model folder given by its path (it has a config.json), named after the folder, with
/// the aliases of the catalog entry of that name if there is one.
pub fn folder_model(path: &Path, catalog: &Catalog) -> Option<Resolved> {
    if !path.join("config.json").is_file() {
        return None;
    }
    let name = path.canonicalize().ok().and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()));
    let id = name.unwrap_or_else(|| path.display().to_string());
    let entry = catalog.find(&id).cloned();
    Some(Resolved {
        dir: path.to_path_buf(),
        aliases: entry.as_ref().map(|e| e.aliases.clone()).unwrap_or_default(),
        id,
        entry,
        // A folder given by path runs as given (`--drafter` adds one).
        drafter: None,
    })
}

/// Blobs the snapshots of a repository folder use, by file name.
pub fn used_blobs(repo_dir: &Path) -> BTreeMap<String, BTreeSet<PathBuf>> {
    let mut used: BTreeMap<String, BTreeSet<PathBuf>> = BTreeMap::new();
    for snap in std::fs::read_dir(repo_dir.join("snapshots")).into_iter().flatten().flatten() {
        for file in std::fs::read_dir(snap.path()).into_iter().flatten().flatten() {
            if let Ok(target) = std::fs::read_link(file.path()) {
                if let Some(blob) = target.file_name() {
                    used.entry(blob.to_string_lossy().into_owned()).or_default().insert(file.path());
                }
            }
        }
    }
    used
}
