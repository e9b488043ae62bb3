//! The tuning file (`tuning.json` in the config directory): the drafter and draft depth the
//! autotuner chose, per machine, model, profile and (optionally) workload class. A new run replaces the result for its key; a file
//! that does not parse is set aside (renamed) and reported, never fatal.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::Digest;

/// What a tuned depth is valid for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TuningKey {
    /// Chip / CPU model, memory size, OS, MLX backend and version, Ferrite version.
    pub machine: String,
    /// `org/name@commit` for a hub snapshot, else a content hash of the folder.
    pub model: String,
    pub profile: String,
    /// The workload class the depth is for (`code/greedy`, …); `None`: every request without a
    /// result of its own class.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<String>,
}

/// What drafts at a stored depth.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TunedDrafter {
    /// The model's MTP head (results stored before block drafters were measured say nothing,
    /// and mean this).
    #[default]
    Mtp,
    /// The DFlash block drafter the catalog pairs with the model.
    Block,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TunedResult {
    pub key: TuningKey,
    #[serde(default)]
    pub drafter: TunedDrafter,
    /// Drafts a cycle (0: plain decoding).
    pub depth: usize,
    pub speedup: f64,
    pub why: String,
    /// Seconds since the Unix epoch.
    pub measured_at: u64,
    /// First-position acceptance per temperature, for the next run's collapse check.
    pub first_acceptance: Vec<(f32, f64)>,
    /// The whole measurement, for `ferrite tune --show`.
    pub measurement: serde_json::Value,
    /// Plain decoding of n sequences together against one alone, as (n, total rate over one's)
    /// (the server's rule for a speculating request when others come).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub batch_gains: Vec<(usize, f64)>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct FileData {
    version: u32,
    results: Vec<TunedResult>,
}

#[derive(Debug)]
pub struct TuningFile {
    pub path: PathBuf,
    pub results: Vec<TunedResult>,
}

impl TuningFile {
    /// Reads the file. A corrupt one is renamed to `tuning.json.corrupt` and the returned
    /// warning says so; the store starts empty.
    pub fn load(config_dir: &Path) -> (TuningFile, Option<String>) {
        let path = config_dir.join("tuning.json");
        let empty = |warning| (TuningFile { path: path.clone(), results: vec![] }, warning);
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return empty(None),
            Err(e) => {
                return empty(Some(format!("{}: cannot read ({e}); tuning results start afresh", path.display())))
            }
        };
        match serde_json::from_str::<FileData>(&text) {
            Ok(data) => (TuningFile { path, results: data.results }, None),
            Err(e) => {
                let aside = path.with_extension("json.corrupt");
                let _ = std::fs::rename(&path, &aside);
                empty(Some(format!("{} was corrupt ({e}); moved to {} and rebuilt", path.display(), aside.display())))
            }
        }
    }

    pub fn find(&self, key: &TuningKey) -> Option<&TunedResult> {
        self.results.iter().find(|r| &r.key == key)
    }

    /// Puts `result` in place of any earlier one for its key, and saves (atomically).
    pub fn replace(&mut self, result: TunedResult) -> std::io::Result<()> {
        self.results.retain(|r| r.key != result.key);
        self.results.push(result);
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let data = FileData { version: 1, results: self.results.clone() };
        let tmp = self.path.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_string_pretty(&data)?)?;
        std::fs::rename(&tmp, &self.path)
    }
}

/// A model's identity for tuning: the hub snapshot it is (`org/name@commit`), else a hash of
/// its config and of each weight file's name, size and header.
pub fn model_identity(dir: &Path) -> String {
    let canonical = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    let parts: Vec<String> = canonical.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    if let Some(i) = parts.iter().position(|p| p == "snapshots") {
        if let (Some(repo), Some(commit)) =
            (i.checked_sub(1).and_then(|j| crate::layout::repo_from_folder(&parts[j])), parts.get(i + 1))
        {
            return format!("{repo}@{commit}");
        }
    }
    let mut h = sha2::Sha256::new();
    h.update(crate::verify::read_small(&dir.join("config.json")).unwrap_or_default());
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    for f in files {
        use std::io::Read;
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        h.update(format!("{}:{len}", f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()));
        let mut head = vec![0u8; 1 << 16];
        let n = std::fs::File::open(&f).and_then(|mut file| file.read(&mut head)).unwrap_or(0);
        h.update(&head[..n]);
    }
    let hex: String = h.finalize().iter().take(12).map(|b| format!("{b:02x}")).collect();
    let name = canonical.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{name}#{hex}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn result(depth: usize, profile: &str) -> TunedResult {
        TunedResult {
            key: TuningKey { machine: "m".into(), model: "x".into(), profile: profile.into(), class: None },
            drafter: TunedDrafter::Mtp,
            depth,
            speedup: 1.3,
            why: String::new(),
            measured_at: 0,
            first_acceptance: vec![(0.0, 0.9)],
            measurement: serde_json::json!({}),
            batch_gains: vec![],
        }
    }

    #[test]
    fn a_new_run_replaces_the_old_and_corrupt_files_are_rebuilt() {
        let dir = tempfile::tempdir().unwrap();
        let (mut f, warning) = TuningFile::load(dir.path());
        assert!(warning.is_none());
        f.replace(result(2, "sustained")).unwrap();
        f.replace(result(1, "turbo")).unwrap();
        f.replace(result(3, "sustained")).unwrap();
        let (f, _) = TuningFile::load(dir.path());
        assert_eq!(f.results.len(), 2);
        assert_eq!(f.find(&result(0, "sustained").key).unwrap().depth, 3);
        std::fs::write(dir.path().join("tuning.json"), "{ not json").unwrap();
        let (f, warning) = TuningFile::load(dir.path());
        assert!(f.results.is_empty());
        assert!(warning.unwrap().contains("corrupt"));
        assert!(dir.path().join("tuning.json.corrupt").exists());
    }

    #[test]
    fn results_stored_before_block_drafters_read_as_the_mtp_head() {
        let dir = tempfile::tempdir().unwrap();
        let old = r#"{"version": 1, "results": [{"key": {"machine": "m", "model": "x", "profile": "turbo"},
            "depth": 2, "speedup": 1.2, "why": "", "measured_at": 0, "first_acceptance": [], "measurement": {}}]}"#;
        std::fs::write(dir.path().join("tuning.json"), old).unwrap();
        let (mut f, warning) = TuningFile::load(dir.path());
        assert!(warning.is_none(), "{warning:?}");
        assert_eq!((f.results[0].drafter, f.results[0].depth), (TunedDrafter::Mtp, 2));
        f.replace(TunedResult { drafter: TunedDrafter::Block, depth: 4, ..result(0, "sustained") }).unwrap();
        let (f, _) = TuningFile::load(dir.path());
        assert_eq!(f.find(&result(0, "sustained").key).unwrap().drafter, TunedDrafter::Block);
    }

    #[test]
    fn identities_name_hub_snapshots_and_hash_other_folders() {
        let dir = tempfile::tempdir().unwrap();
        let snap = dir.path().join("models--org--m/snapshots/abc");
        std::fs::create_dir_all(&snap).unwrap();
        assert_eq!(model_identity(&snap), "org/m@abc");
        let plain = dir.path().join("mine");
        std::fs::create_dir_all(&plain).unwrap();
        std::fs::write(plain.join("config.json"), "{}").unwrap();
        let a = model_identity(&plain);
        std::fs::write(plain.join("config.json"), "{\"x\": 1}").unwrap();
        assert_ne!(a, model_identity(&plain));
        assert!(a.starts_with("mine#"));
    }
}
