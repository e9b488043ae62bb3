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
/// a commit hash with a snapshot). The folder may be shared with other hub clients or copied
/// from elsewhere, so what a ref holds is untrusted: only a plain snapshot name is taken (an
/// absolute path or `..` would make loading and deleting reach outside the store), and only
/// its first bytes are read (a ref may be a link to a device that never ends).
pub fn resolve_ref(repo_dir: &Path, revision: &str) -> Option<String> {
    if !plain_name(revision) && !revision.split('/').all(plain_name) {
        return None;
    }
    let file = repo_dir.join("refs").join(revision);
    if file.exists() {
        return read_ref(&file);
    }
    (plain_name(revision) && repo_dir.join("snapshots").join(revision).is_dir()).then(|| revision.to_string())
}

/// The snapshot name a ref file holds, if it holds a plain one.
pub fn read_ref(file: &Path) -> Option<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(file).ok()?.take(MAX_REF_BYTES).read_to_string(&mut text).ok()?;
    let commit = text.trim();
    plain_name(commit).then(|| commit.to_string())
}

/// A ref file's most bytes read: a commit hash is 40.
const MAX_REF_BYTES: u64 = 256;

/// Whether `name` can name a snapshot (or one part of a revision such as `refs/pr/1`): a
/// single path component of letters, digits, `-`, `_` and `.`, neither `.` nor `..`.
pub fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 128
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
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

    #[test]
    fn refs_that_leave_the_snapshots_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("models--a--b");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::create_dir_all(repo.join("snapshots").join("abc123")).unwrap();
        let write = |r: &str| std::fs::write(repo.join("refs").join("main"), r).unwrap();
        write("abc123\n");
        assert_eq!(resolve_ref(&repo, "main").as_deref(), Some("abc123"));
        for hostile in ["/", "/etc", "../../..", "..", ".", "a/../../b", "abc\\..", "", "x\0y"] {
            write(hostile);
            assert_eq!(resolve_ref(&repo, "main"), None, "{hostile:?}");
        }
        write(&"a".repeat(10_000));
        assert_eq!(resolve_ref(&repo, "main"), None);
        // The revision asked for is checked too.
        assert_eq!(resolve_ref(&repo, "../../refs/main"), None);
        assert_eq!(resolve_ref(&repo, "abc123").as_deref(), Some("abc123"));
        #[cfg(unix)]
        {
            std::fs::remove_file(repo.join("refs").join("main")).unwrap();
            std::os::unix::fs::symlink("/dev/zero", repo.join("refs").join("main")).unwrap();
            assert_eq!(resolve_ref(&repo, "main"), None);
        }
    }
}
