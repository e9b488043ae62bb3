//! The disk tier's folder as files: block names (`<chain>.<checksum>.safetensors`), their
//! keyed checksums, the folder's lock file, and listing the blocks of one model or all.

use std::path::{Path, PathBuf};
use std::time::SystemTime;

use hmac::{KeyInit, Mac};
use sha2::Sha256;

pub(super) const LOCK: &str = ".lock";

/// `<chain: 64 hex>.<checksum: 16 hex>.safetensors`.
pub(super) fn parse_name(name: &str) -> Option<(&str, &str)> {
    let stem = name.strip_suffix(".safetensors")?;
    let (chain, checksum) = stem.split_once('.')?;
    let is_hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
    (is_hex(chain, 64) && is_hex(checksum, 16)).then_some((chain, checksum))
}

pub(super) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// HMAC-SHA256 of a file's bytes under the installation's key, hex.
pub(super) fn mac(key: &[u8; 32], bytes: &[u8]) -> String {
    let mut m = <hmac::Hmac<Sha256> as KeyInit>::new_from_slice(key).expect("HMAC takes a key of any length");
    m.update(bytes);
    hex(&m.finalize().into_bytes())
}

/// The blocks of one model's folder: path, size, last use.
pub(super) fn blocks_in(dir: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
    let Ok(entries) = std::fs::read_dir(dir) else { return vec![] };
    entries
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| parse_name(n).is_some()))
        .filter_map(|e| {
            let m = e.metadata().ok()?;
            Some((e.path(), m.len(), m.modified().unwrap_or(SystemTime::UNIX_EPOCH)))
        })
        .collect()
}

/// Every block of every model in `root`.
pub(super) fn all_blocks(root: &Path) -> Vec<(PathBuf, u64, SystemTime)> {
    let Ok(models) = std::fs::read_dir(root) else { return vec![] };
    models.flatten().flat_map(|m| blocks_in(&m.path())).collect()
}
