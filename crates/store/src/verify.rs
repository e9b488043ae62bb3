//! Is a model folder usable? Cheap checks (run on every listing: config, tokenizer,
//! safetensors headers against file sizes, the index against the shards present, the MTP
//! head when one is promised) and the hash check of downloaded files against the hub's ETag.

use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{}: {message}", file.display())]
pub struct VerifyError {
    pub file: PathBuf,
    pub message: String,
}

fn fail(file: &Path, message: impl Into<String>) -> VerifyError {
    VerifyError { file: file.to_path_buf(), message: message.into() }
}

/// What a usable model folder holds.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelFacts {
    pub model_type: String,
    pub weight_files: Vec<PathBuf>,
    pub tensors: usize,
    pub has_mtp: bool,
    /// Whether it sees: a `vision_config` in its config.json and the tower's tensors
    /// (`model.visual.*` or `vision_tower.*`) in its weights.
    pub sees: bool,
    /// Bytes of every file in the folder (links followed).
    pub bytes: u64,
}

/// The cheap checks. `expect_mtp`: the catalog promises `mtp.*` tensors.
pub fn check_model_dir(dir: &Path, expect_mtp: bool) -> Result<ModelFacts, VerifyError> {
    let config_path = dir.join("config.json");
    let config: serde_json::Value = read_small(&config_path)
        .map_err(|e| fail(&config_path, format!("missing or unreadable: {e}")))
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| fail(&config_path, format!("not valid JSON: {e}"))))?;
    let model_type = config
        .get("model_type")
        .or_else(|| config.get("text_config").and_then(|t| t.get("model_type")))
        .and_then(|t| t.as_str())
        .ok_or_else(|| fail(&config_path, "no `model_type`"))?
        .to_string();
    let tokenizer = dir.join("tokenizer.json");
    if !tokenizer.is_file() {
        return Err(fail(&tokenizer, "missing"));
    }
    let weight_files = weight_files(dir)?;
    let mut names = BTreeSet::new();
    for file in &weight_files {
        names.extend(safetensors_names(file)?);
    }
    let has_mtp = names.iter().any(|n| n.starts_with("mtp.") || n.contains(".mtp."));
    if expect_mtp && !has_mtp {
        return Err(fail(dir, "the catalog promises an MTP head but no `mtp.*` tensor is present"));
    }
    let sees = config.get("vision_config").is_some_and(|v| v.is_object())
        && names.iter().any(|n| n.starts_with("model.visual.") || n.starts_with("vision_tower."));
    let bytes = folder_bytes(dir)?;
    Ok(ModelFacts { model_type, weight_files, tensors: names.len(), has_mtp, sees, bytes })
}

/// What a usable block-drafter folder holds.
#[derive(Debug, Clone, PartialEq)]
pub struct DrafterFacts {
    /// Tokens a block holds, as its config says.
    pub block_size: usize,
    pub tensors: usize,
    pub bytes: u64,
}

/// Whether `dir`'s config.json describes a DFlash block drafter (its `architectures`).
pub fn is_drafter_dir(dir: &Path) -> bool {
    drafter_config(dir).is_ok_and(|c| drafter_architecture(&c))
}

fn drafter_config(dir: &Path) -> Result<serde_json::Value, VerifyError> {
    let path = dir.join("config.json");
    read_small(&path)
        .map_err(|e| fail(&path, format!("missing or unreadable: {e}")))
        .and_then(|b| serde_json::from_slice(&b).map_err(|e| fail(&path, format!("not valid JSON: {e}"))))
}

fn drafter_architecture(config: &serde_json::Value) -> bool {
    config["architectures"]
        .as_array()
        .is_some_and(|a| a.iter().filter_map(|v| v.as_str()).any(|a| a.starts_with("DFlash")))
}

/// The cheap checks of a block drafter's folder (no tokenizer: it uses its target's). The
/// engine checks the rest against the target when it loads the pair.
pub fn check_drafter_dir(dir: &Path) -> Result<DrafterFacts, VerifyError> {
    let config = drafter_config(dir)?;
    let path = dir.join("config.json");
    if !drafter_architecture(&config) {
        return Err(fail(&path, "not a DFlash block drafter (`architectures` names no DFlash model)"));
    }
    let block_size = config
        .get("dflash_config")
        .and_then(|d| d.get("block_size"))
        .or_else(|| config.get("block_size"))
        .and_then(|b| b.as_u64())
        .ok_or_else(|| fail(&path, "no `block_size`"))? as usize;
    let mut tensors = 0;
    for file in weight_files(dir)? {
        tensors += safetensors_names(&file)?.len();
    }
    let bytes = folder_bytes(dir)?;
    Ok(DrafterFacts { block_size, tensors, bytes })
}

/// Bytes of the files directly in `dir` (links followed).
fn folder_bytes(dir: &Path) -> Result<u64, VerifyError> {
    Ok(std::fs::read_dir(dir)
        .map_err(|e| fail(dir, e.to_string()))?
        .flatten()
        .filter_map(|e| std::fs::metadata(e.path()).ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum())
}

/// The shards the index names (all present), else every `*.safetensors` (at least one).
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, VerifyError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v: serde_json::Value = read_small(&index)
            .map_err(|e| fail(&index, e.to_string()))
            .and_then(|b| serde_json::from_slice(&b).map_err(|e| fail(&index, format!("not valid JSON: {e}"))))?;
        let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| fail(&index, "no `weight_map`"))?;
        let shards: BTreeSet<&str> = map.values().filter_map(|s| s.as_str()).collect();
        let mut files = Vec::new();
        for shard in shards {
            // The index comes with the model: a shard is a file of this folder, by plain name.
            if !crate::layout::plain_name(shard) {
                return Err(fail(&index, format!("names shard `{shard}`, which is not a plain file name")));
            }
            let path = dir.join(shard);
            if !path.is_file() {
                return Err(fail(&index, format!("lists shard `{shard}`, which is missing")));
            }
            files.push(path);
        }
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| fail(dir, e.to_string()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(fail(dir, "no *.safetensors weights"));
    }
    Ok(files)
}

/// Tensor names of one safetensors file, after checking that the data the header
/// announces is all there.
pub fn safetensors_names(file: &Path) -> Result<Vec<String>, VerifyError> {
    let mut f = std::fs::File::open(file).map_err(|e| fail(file, e.to_string()))?;
    let size = f.metadata().map_err(|e| fail(file, e.to_string()))?.len();
    let mut prefix = [0u8; 8];
    f.read_exact(&mut prefix).map_err(|_| fail(file, "shorter than a safetensors header"))?;
    let header_len = u64::from_le_bytes(prefix);
    if header_len > (100 << 20) || 8 + header_len > size {
        return Err(fail(
            file,
            format!("not safetensors, or truncated: a {header_len}-byte header in a {size}-byte file"),
        ));
    }
    let mut header = vec![0u8; header_len as usize];
    f.read_exact(&mut header).map_err(|e| fail(file, e.to_string()))?;
    let meta: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).map_err(|e| fail(file, format!("bad safetensors header: {e}")))?;
    let expected = 8 + header_len + meta.data_len() as u64;
    if size != expected {
        return Err(fail(file, format!("{size} bytes, but its header describes {expected}: truncated or padded")));
    }
    Ok(meta.tensors().into_keys().collect())
}

/// Checks a downloaded file against the hub's ETag: the sha256 of LFS files (64 hex
/// digits), or git's blob sha1 of small files (40). Other ETags cannot be checked.
pub fn check_hash(file: &Path, etag: &str) -> Result<(), VerifyError> {
    let etag = etag.trim_matches('"').to_ascii_lowercase();
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let size = std::fs::metadata(file).map_err(|e| fail(file, e.to_string()))?.len();
    let got = match etag.len() {
        64 => hex(&digest_file::<sha2::Sha256>(file, None)?),
        40 => hex(&digest_file::<sha1::Sha1>(file, Some(format!("blob {size}\0")))?),
        _ => return Ok(()),
    };
    if got != etag {
        return Err(fail(file, format!("corrupt: its hash is {got}, the hub says {etag}")));
    }
    Ok(())
}

fn digest_file<D: sha1::Digest>(file: &Path, prefix: Option<String>) -> Result<Vec<u8>, VerifyError> {
    let mut f = std::fs::File::open(file).map_err(|e| fail(file, e.to_string()))?;
    let mut hasher = D::new();
    if let Some(p) = prefix {
        hasher.update(p.as_bytes());
    }
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| fail(file, e.to_string()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher.finalize().to_vec())
}

/// The most bytes of a model's JSON files (`config.json`, the shard index) read.
const JSON_CAP: u64 = 16 << 20;

/// A model folder's small JSON file, refused when it is not a regular file or larger than
/// [`JSON_CAP`] (a model folder may come from anywhere: a link to `/dev/zero` never ends).
pub fn read_small(path: &Path) -> std::io::Result<Vec<u8>> {
    let file = std::fs::File::open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut bytes = Vec::new();
    file.take(JSON_CAP + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > JSON_CAP {
        return Err(std::io::Error::other(format!("larger than {} MiB", JSON_CAP >> 20)));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a");
        std::fs::write(&f, b"hello\n").unwrap();
        // `git hash-object` and `sha256sum` of "hello\n".
        check_hash(&f, "ce013625030ba8dba906f756967f9e9ca394464a").unwrap();
        check_hash(&f, "\"5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03\"").unwrap();
        let e = check_hash(&f, &"0".repeat(64)).unwrap_err();
        assert!(e.message.contains("corrupt"), "{e}");
        check_hash(&f, "W/\"weak-etag\"").unwrap();
    }

    #[test]
    fn a_drafter_folder_is_told_from_a_model() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let config = r#"{"architectures": ["DFlashDraftModel"], "dflash_config": {"block_size": 16}}"#;
        std::fs::write(d.join("config.json"), config).unwrap();
        assert!(is_drafter_dir(d));
        let e = check_drafter_dir(d).unwrap_err();
        assert!(e.message.contains("safetensors"), "{e}");
        // An empty safetensors file: an 2-byte header `{}`.
        let mut st = 2u64.to_le_bytes().to_vec();
        st.extend_from_slice(b"{}");
        std::fs::write(d.join("model.safetensors"), &st).unwrap();
        let facts = check_drafter_dir(d).unwrap();
        assert_eq!((facts.block_size, facts.tensors), (16, 0));
        std::fs::write(d.join("config.json"), r#"{"architectures": ["Qwen3ForCausalLM"]}"#).unwrap();
        assert!(!is_drafter_dir(d));
        assert!(check_drafter_dir(d).unwrap_err().message.contains("not a DFlash"));
        std::fs::write(d.join("config.json"), r#"{"architectures": ["DFlashDraftModel"]}"#).unwrap();
        assert!(check_drafter_dir(d).unwrap_err().message.contains("block_size"));
    }
}
