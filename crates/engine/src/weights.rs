//! Reading a checkpoint's tensors: `model.safetensors`, or shards listed in
//! `model.safetensors.index.json`. Headers are checked with the `safetensors` crate before
//! MLX maps the data, so a missing shard or a truncated file is reported by name instead of
//! surfacing later as an MLX exception.

use std::collections::{BTreeSet, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

use mlx_rs::Array;

use crate::error::{Error, Result};

/// All tensors of a checkpoint, taken one by one as the model is built; what is left over at
/// the end is an error (a misnamed tensor must not be silently ignored).
pub struct Weights {
    dir: PathBuf,
    tensors: HashMap<String, (Array, PathBuf)>,
}

impl Weights {
    pub fn load(dir: &Path) -> Result<Self> {
        let mut tensors = HashMap::new();
        for file in weight_files(dir)? {
            let names = check_header(&file)?;
            let arrays = Array::load_safetensors(&file)
                .map_err(|e| Error::malformed(&file, format!("MLX could not load it: {e}")))?;
            for (name, array) in arrays {
                debug_assert!(names.contains(&name));
                tensors.insert(name, (array, file.clone()));
            }
        }
        Ok(Weights { dir: dir.to_path_buf(), tensors })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every tensor not taken yet, by name.
    pub fn arrays(&self) -> impl Iterator<Item = (&str, &Array)> {
        self.tensors.iter().map(|(name, (array, _))| (name.as_str(), array))
    }

    /// The tensor `name`, if present and not taken yet.
    pub fn array(&self, name: &str) -> Option<&Array> {
        self.tensors.get(name).map(|(array, _)| array)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    /// Removes and returns `name`, checking its shape when `shape` is given.
    pub fn take(&mut self, name: &str, shape: Option<&[i32]>) -> Result<Array> {
        let (array, file) = self
            .tensors
            .remove(name)
            .ok_or_else(|| Error::MissingTensor { dir: self.dir.clone(), name: name.to_string() })?;
        if let Some(expected) = shape {
            if array.shape() != expected {
                return Err(Error::Shape {
                    file,
                    name: name.to_string(),
                    expected: expected.to_vec(),
                    found: array.shape().to_vec(),
                });
            }
        }
        Ok(array)
    }

    pub fn take_optional(&mut self, name: &str, shape: Option<&[i32]>) -> Result<Option<Array>> {
        if self.contains(name) {
            self.take(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Drops every tensor whose name starts with `prefix`; returns how many there were.
    pub fn drop_prefix(&mut self, prefix: &str) -> usize {
        let before = self.tensors.len();
        self.tensors.retain(|name, _| !name.starts_with(prefix));
        before - self.tensors.len()
    }

    /// Adds a tensor derived from others (e.g. stacked experts); it counts as from the folder.
    pub fn insert(&mut self, name: String, array: Array) {
        let origin = self.dir.clone();
        self.tensors.insert(name, (array, origin));
    }

    /// Names of the tensors not taken yet.
    pub fn names(&self) -> Vec<String> {
        self.tensors.keys().cloned().collect()
    }

    /// Renames every tensor starting with `from` to start with `to` instead.
    pub fn rename_prefix(&mut self, from: &str, to: &str) {
        let names: Vec<String> = self.tensors.keys().filter(|n| n.starts_with(from)).cloned().collect();
        for name in names {
            if let Some(entry) = self.tensors.remove(&name) {
                self.tensors.insert(format!("{to}{}", &name[from.len()..]), entry);
            }
        }
    }

    /// Replaces tensor `name` by `f(tensor)` (e.g. a layout or offset fix-up on load).
    pub fn update(&mut self, name: &str, f: impl FnOnce(&Array) -> Result<Array>) -> Result<()> {
        if let Some((array, file)) = self.tensors.remove(name) {
            let new = f(&array)?;
            self.tensors.insert(name.to_string(), (new, file));
        }
        Ok(())
    }

    /// Fails if any tensor was not used by the model.
    pub fn finish(self) -> Result<()> {
        let unused: BTreeSet<&String> = self.tensors.keys().collect();
        match unused.iter().next() {
            None => Ok(()),
            Some(example) => {
                Err(Error::UnusedTensors { dir: self.dir.clone(), count: unused.len(), example: example.to_string() })
            }
        }
    }
}

/// The safetensors files of a checkpoint: the shards the index names, else every
/// `*.safetensors` in the folder.
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = crate::small_file::read_text(&index, crate::small_file::JSON_CAP)?;
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| Error::malformed(&index, format!("not valid JSON: {e}")))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| Error::config(&index, "weight_map", "missing or not an object"))?;
        let mut files = BTreeSet::new();
        for (tensor, file) in map {
            let file = file
                .as_str()
                .ok_or_else(|| Error::config(&index, format!("weight_map.{tensor}"), "not a file name"))?;
            files.insert(file.to_string());
        }
        return files
            .into_iter()
            .map(|f| {
                // A name from the index: a plain file name in this folder, nothing else.
                let plain = Path::new(&f).components().count() == 1
                    && matches!(Path::new(&f).components().next(), Some(std::path::Component::Normal(_)));
                if !plain {
                    return Err(Error::malformed(
                        &index,
                        format!("shard `{f}` is not a file name in the model folder"),
                    ));
                }
                let path = dir.join(&f);
                if path.is_file() {
                    inside_model(dir, &path)
                } else {
                    Err(Error::malformed(&index, format!("shard `{f}` is listed but missing")))
                }
            })
            .collect();
    }
    let entries = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut files: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(Error::malformed(dir, "no model.safetensors (or *.safetensors shards) here"));
    }
    files.iter().map(|f| inside_model(dir, f)).collect()
}

/// The bytes of a checkpoint's weight files ([`weight_files`]), links followed: in the hub
/// layout every snapshot file is a link to a blob, and a link's own size is a few bytes.
pub fn weight_bytes(dir: &Path) -> Result<u64> {
    weight_files(dir)?.iter().map(|f| std::fs::metadata(f).map(|m| m.len()).map_err(|e| Error::io(f, e))).sum()
}

/// `path` if it resolves inside the model folder `dir` (links followed) — or, for a folder in
/// the Hugging Face hub layout (`models--ORG--NAME/snapshots/REV/`), inside its repository's
/// `blobs/`, where the hub's links point. A file that leads elsewhere is refused, and its
/// content is never read (nor quoted in an error).
pub fn inside_model(dir: &Path, path: &Path) -> Result<PathBuf> {
    let resolved = path.canonicalize().map_err(|e| Error::io(path, e))?;
    let root = dir.canonicalize().map_err(|e| Error::io(dir, e))?;
    let blobs = (root.parent().and_then(Path::file_name) == Some(std::ffi::OsStr::new("snapshots")))
        .then(|| root.parent().and_then(Path::parent).map(|repo| repo.join("blobs")))
        .flatten();
    if resolved.starts_with(&root) || blobs.is_some_and(|b| resolved.starts_with(b)) {
        Ok(path.to_path_buf())
    } else {
        Err(Error::malformed(path, "leads outside the model folder (a link elsewhere): refused"))
    }
}

/// Name, dtype and shape of each tensor in a safetensors file (header only).
pub fn tensor_infos(file: &Path) -> Result<Vec<(String, String, Vec<usize>)>> {
    let metadata = read_header(file)?;
    Ok(metadata.tensors().into_iter().map(|(n, t)| (n, format!("{:?}", t.dtype), t.shape.clone())).collect())
}

/// Parses a safetensors header and checks that the file holds all the bytes it announces.
/// Returns the tensor names.
pub fn check_header(file: &Path) -> Result<BTreeSet<String>> {
    Ok(read_header(file)?.tensors().keys().cloned().collect())
}

fn read_header(file: &Path) -> Result<safetensors::tensor::Metadata> {
    let bad = |m: String| Error::malformed(file, m);
    let mut handle = std::fs::File::open(file).map_err(|e| Error::io(file, e))?;
    let file_len = handle.metadata().map_err(|e| Error::io(file, e))?.len();
    let mut len_bytes = [0u8; 8];
    handle.read_exact(&mut len_bytes).map_err(|_| bad("truncated: shorter than a safetensors header".into()))?;
    let header_len = u64::from_le_bytes(len_bytes);
    if header_len > 100_000_000 || 8 + header_len > file_len {
        return Err(bad(format!(
            "truncated or not safetensors: header of {header_len} bytes in a {file_len}-byte file"
        )));
    }
    let mut header = vec![0u8; header_len as usize];
    handle.read_exact(&mut header).map_err(|e| bad(format!("reading the header: {e}")))?;
    let metadata: safetensors::tensor::Metadata =
        serde_json::from_slice(&header).map_err(|e| bad(format!("invalid safetensors header: {e}")))?;
    let tensors = metadata.tensors();
    let data_end = tensors.values().map(|t| t.data_offsets.1).max().unwrap_or(0) as u64;
    let have = file_len - 8 - header_len;
    if have < data_end {
        return Err(bad(format!(
            "truncated: the header announces {data_end} bytes of tensor data, the file holds {have}"
        )));
    }
    Ok(metadata)
}

#[cfg(test)]
mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// A safetensors header with any dtype, shape and offsets (or something else entirely).
    fn header() -> impl Strategy<Value = String> {
        let dtype = prop_oneof![Just("F32"), Just("BF16"), Just("U32"), Just("I8"), Just("F8_E4M3"), Just("X")];
        let dims = prop::collection::vec(prop_oneof![0u64..8, Just(u64::MAX), Just(1 << 40)], 0..4);
        let offsets = (any::<u64>(), any::<u64>());
        let tensor =
            (dtype, dims, offsets, prop_oneof![Just(0u64..64), Just(0u64..64)]).prop_map(|(d, s, (a, b), _)| {
                format!(r#""t":{{"dtype":"{d}","shape":{s:?},"data_offsets":[{},{}]}}"#, a % 80, b % 80)
            });
        prop_oneof![
            tensor.prop_map(|t| format!("{{{t}}}")),
            "\\PC{0,40}",
            Just(r#"{"__metadata__":{"format":"mlx"}}"#.to_string()),
        ]
    }

    proptest! {
        /// Any header and any length prefix: a list of tensors or an error naming the file;
        /// never a panic, never an allocation the file does not back.
        #[test]
        fn any_header_is_read_or_refused(h in header(), prefix in prop_oneof![Just(None), any::<u64>().prop_map(Some)], data in prop::collection::vec(any::<u8>(), 0..80)) {
            let dir = tempfile::tempdir().unwrap();
            let file = dir.path().join("model.safetensors");
            let mut bytes = prefix.unwrap_or(h.len() as u64).to_le_bytes().to_vec();
            bytes.extend_from_slice(h.as_bytes());
            bytes.extend_from_slice(&data);
            std::fs::write(&file, &bytes).unwrap();
            if let Err(e) = check_header(&file) {
                prop_assert!(e.to_string().contains("model.safetensors"), "{e}");
            }
            let _ = tensor_infos(&file);
        }
    }
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;

    /// A checkpoint in the hub layout: `snapshots/REV/` holds links into `blobs/`.
    #[test]
    fn a_hub_snapshot_of_links_weighs_its_blobs() {
        let repo = tempfile::tempdir().unwrap();
        let (blobs, snapshot) = (repo.path().join("blobs"), repo.path().join("snapshots/abc123"));
        std::fs::create_dir_all(&blobs).unwrap();
        std::fs::create_dir_all(&snapshot).unwrap();
        for (name, blob, bytes) in [("model-00001.safetensors", "1f2e", 3000), ("model-00002.safetensors", "9a8b", 500)]
        {
            std::fs::write(blobs.join(blob), vec![0u8; bytes]).unwrap();
            std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snapshot.join(name)).unwrap();
        }
        assert_eq!(weight_bytes(&snapshot).unwrap(), 3500);
        assert_eq!(weight_files(&snapshot).unwrap().len(), 2);
    }
}
