//! The small text files of a model folder (`config.json`, the safetensors index, the tokenizer
//! and its template) read under a size cap: a model folder comes from elsewhere, and a file
//! there may be a link to a device that never ends or a multi-gigabyte decoy.

use std::io::Read;
use std::path::Path;

use crate::error::{Error, Result};

/// The cap for JSON files that describe a model (configs, the shard index): the largest real
/// index is a few hundred kilobytes.
pub const JSON_CAP: u64 = 16 << 20;
/// The cap for `tokenizer.json` (a 250K-entry vocabulary with its merges is ~30 MB).
pub const TOKENIZER_CAP: u64 = 256 << 20;

/// `path`'s text, refused by name when it is not a regular file or holds more than `cap` bytes.
pub fn read_text(path: &Path, cap: u64) -> Result<String> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::malformed(path, "not a regular file"));
    }
    let mut text = String::new();
    file.take(cap + 1).read_to_string(&mut text).map_err(|e| Error::io(path, e))?;
    if text.len() as u64 > cap {
        return Err(Error::malformed(path, format!("larger than {} MiB: refused", cap >> 20)));
    }
    Ok(text)
}

/// Checks that `path` is a regular file of at most `cap` bytes, for files a library reads
/// itself (the tokenizers crate reads `tokenizer.json`).
pub fn check_size(path: &Path, cap: u64) -> Result<()> {
    let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(Error::malformed(path, "not a regular file"));
    }
    if meta.len() > cap {
        return Err(Error::malformed(path, format!("larger than {} MiB: refused", cap >> 20)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_and_oversized_files_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let small = dir.path().join("config.json");
        std::fs::write(&small, "{}").unwrap();
        assert_eq!(read_text(&small, 16).unwrap(), "{}");
        std::fs::write(&small, "x".repeat(17)).unwrap();
        let e = read_text(&small, 16).unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains("refused"), "{e}");
        assert!(check_size(&small, 16).is_err() && check_size(&small, 17).is_ok());
        #[cfg(unix)]
        {
            let zero = dir.path().join("model.safetensors.index.json");
            std::os::unix::fs::symlink("/dev/zero", &zero).unwrap();
            assert!(read_text(&zero, JSON_CAP).unwrap_err().to_string().contains("not a regular file"));
            assert!(check_size(&zero, JSON_CAP).is_err());
        }
    }
}
