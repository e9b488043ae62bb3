//! The Hugging Face hub-cache layout, shared with every tool that reads it:
//! `models--ORG--NAME/{blobs/SHA, refs/REVISION, snapshots/COMMIT/FILE -> ../../blobs/SHA}`.

use std::path::{Path, PathBuf};

/// The hub cache other tools use: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `~/.cache/huggingface/hub` (huggingface_hub's default on every platform).
pub fn default_models_dir() -> PathBuf {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = env("HF_HUB_CACHE") {
        return dir;
    }
    if let Some(home) = env("HF_HOME") {
        return home.join("hub");
    }
    dirs::home_dir().unwrap_or_else(|| PathBuf::from(".")).join(".cache").join("huggingface").join("hub")
}

/// `org/name` → `models--org--name`.
pub fn repo_folder(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// `models--org--name` → `org/name` (`None` for other folders).
pub fn repo_from_folder(folder: &str) -> Option<String> {
    let rest = folder.strip_prefix("models--")?;
    let (org, name) = rest.split_once("--")?;
    Some(format!("{org}/{name}"))
}

/// The commit a revision points at, from `refs/REVISION` (or the revision itself when it is
/// a commit hash with a snapshot).
pub fn resolve_ref(repo_dir: &Path, revision: &str) -> Option<String> {
    if let Ok(commit) = std::fs::read_to_string(repo_dir.join("refs").join(revision)) {
        return Some(commit.trim().to_string());
    }
    repo_dir.join("snapshots").join(revision).is_dir().then(|| revision.to_string())
}

/// Bytes of unfinished downloads (hf-hub's `*.sync.part` files) in a repository folder.
pub fn partial_bytes(repo_dir: &Path) -> u64 {
    std::fs::read_dir(repo_dir.join("blobs"))
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".sync.part"))
        .filter_map(|e| e.metadata().ok())
        .map(|m| m.len())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn folder_names_round_trip() {
        assert_eq!(repo_folder("mlx-community/Qwen3-8B-4bit"), "models--mlx-community--Qwen3-8B-4bit");
        assert_eq!(repo_from_folder("models--mlx-community--Qwen3-8B-4bit").unwrap(), "mlx-community/Qwen3-8B-4bit");
        assert!(repo_from_folder("datasets--a--b").is_none());
    }
}
