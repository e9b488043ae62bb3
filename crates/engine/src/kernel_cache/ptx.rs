//! MLX's CUDA backend keeps what NVRTC compiled in `$TMPDIR/mlx/<version>/ptx/`, one entry a
//! module: `<module>.ptx` (a cubin, or PTX text where NVRTC cannot target the card),
//! `<module>.txt` (its kernels' mangled names), `<module>.cu` (the source); a later process reads
//! the first two back instead of compiling. With `TMPDIR` a folder of each process's own, that
//! cache would end with its process and every fresh process would compile everything again, so
//! finished entries are shared the way the CPU kernels are: seeded as hard links at start,
//! published under a temporary name and renamed.
//!
//! MLX writes an entry with no lock and reads it with none: a reader that finds a half-written
//! `.ptx` fails to load it, one that finds a `.ptx` without its `.txt` has no kernels. So an
//! entry is published only when it is whole — its source written (MLX writes it last) and its
//! module complete by its own format — its `.txt` before its `.ptx`, and seeded only when both
//! are there, the `.txt` first.

use std::collections::HashSet;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// Every `.ptx` file under `folder` (MLX splits module names longer than a file name into
/// folders).
fn modules(folder: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let mut pending = vec![folder.to_path_buf()];
    while let Some(dir) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else { continue };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else { continue };
            let path = entry.path();
            if kind.is_dir() {
                pending.push(path);
            } else if kind.is_file() && path.extension().is_some_and(|e| e == "ptx") {
                found.push(path);
            }
        }
    }
    found.sort();
    found
}

fn u16_at(bytes: &[u8], at: usize) -> u64 {
    u64::from(u16::from_le_bytes([bytes[at], bytes[at + 1]]))
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

/// Whether a module's bytes are all there: a cubin (64-bit little-endian ELF) reaches the end
/// of its section and program header tables; PTX text ends with the NUL NVRTC counts in it.
pub(super) fn whole_module(bytes: &[u8]) -> bool {
    if !bytes.starts_with(b"\x7fELF") {
        return bytes.len() > 1 && bytes.last() == Some(&0);
    }
    if bytes.len() < 64 || bytes[4] != 2 || bytes[5] != 1 {
        return false;
    }
    let len = bytes.len() as u64;
    let (phoff, shoff) = (u64_at(bytes, 0x20), u64_at(bytes, 0x28));
    let (phentsize, phnum) = (u16_at(bytes, 0x36), u16_at(bytes, 0x38));
    let (shentsize, shnum) = (u16_at(bytes, 0x3a), u16_at(bytes, 0x3c));
    let reaches = |off: u64, size: u64, count: u64| off.checked_add(size * count).is_some_and(|end| end <= len);
    shnum > 0 && reaches(shoff, shentsize, shnum) && reaches(phoff, phentsize, phnum)
}

/// Whether the entry of `ptx` (in this process's own folder) is finished: MLX writes the
/// `.txt` line by line, flushing each, then the source; the module's tail may wait in a
/// buffer until MLX is done with the entry, so its own format says when it is complete.
fn finished(ptx: &Path) -> bool {
    let names = std::fs::read(ptx.with_extension("txt")).unwrap_or_default();
    ptx.with_extension("cu").is_file()
        && names.ends_with(b"\n")
        && names.contains(&b'\t')
        && std::fs::read(ptx).is_ok_and(|bytes| whole_module(&bytes))
}

/// Puts `file` at `target` whole or not at all (a hard link under a temporary name, renamed).
fn place(file: &Path, target: &Path) -> bool {
    let (Some(folder), Some(name)) = (target.parent(), target.file_name()) else { return false };
    if std::fs::DirBuilder::new().recursive(true).mode(0o700).create(folder).is_err() {
        return false;
    }
    let staged = folder.join(format!(".{}.{}.part", name.to_string_lossy(), std::process::id()));
    let _ = std::fs::remove_file(&staged);
    let done = std::fs::hard_link(file, &staged).is_ok() && std::fs::rename(&staged, target).is_ok();
    if !done {
        let _ = std::fs::remove_file(&staged);
    }
    done
}

/// Publishes the finished entries under `run` (`<run>/mlx/<version>/ptx`) into `shared`
/// (`<shared>/<version>/ptx`); `known` holds the entries already there (seeded or published).
pub(super) fn publish(run: &Path, shared: &Path, known: &mut HashSet<PathBuf>) {
    let Ok(versions) = std::fs::read_dir(run.join("mlx")) else { return };
    for version in versions.flatten() {
        let own = version.path().join("ptx");
        let theirs = shared.join(version.file_name()).join("ptx");
        for ptx in modules(&own) {
            if known.contains(&ptx) || !finished(&ptx) {
                continue;
            }
            let Ok(relative) = ptx.strip_prefix(&own) else { continue };
            let target = theirs.join(relative);
            // The names first: a reader that finds the module finds its names.
            if place(&ptx.with_extension("txt"), &target.with_extension("txt")) {
                place(&ptx, &target);
            }
            known.insert(ptx);
        }
    }
}

/// Hard links in `run` to every shared entry that has both its files; returns the linked
/// modules (already shared: not published again).
pub(super) fn seed(shared: &Path, run: &Path) -> HashSet<PathBuf> {
    let mut seeded = HashSet::new();
    let Ok(versions) = std::fs::read_dir(shared) else { return seeded };
    for version in versions.flatten() {
        let theirs = version.path().join("ptx");
        let own = run.join("mlx").join(version.file_name()).join("ptx");
        for ptx in modules(&theirs) {
            let Ok(relative) = ptx.strip_prefix(&theirs) else { continue };
            let target = own.join(relative);
            let Some(folder) = target.parent() else { continue };
            if std::fs::DirBuilder::new().recursive(true).mode(0o700).create(folder).is_err() {
                continue;
            }
            let names = target.with_extension("txt");
            if std::fs::hard_link(ptx.with_extension("txt"), &names).is_err() {
                continue;
            }
            if std::fs::hard_link(&ptx, &target).is_ok() {
                seeded.insert(target);
            } else {
                let _ = std::fs::remove_file(names);
            }
        }
    }
    seeded
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 64-bit little-endian ELF of `len` bytes whose section headers end at `tables_end`.
    fn cubin(len: usize, tables_end: u64) -> Vec<u8> {
        let mut bytes = vec![0u8; len];
        bytes[..4].copy_from_slice(b"\x7fELF");
        bytes[4] = 2;
        bytes[5] = 1;
        bytes[0x20..0x28].copy_from_slice(&64u64.to_le_bytes()); // program headers right after
        bytes[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        bytes[0x38..0x3a].copy_from_slice(&1u16.to_le_bytes());
        bytes[0x28..0x30].copy_from_slice(&(tables_end - 4 * 64).to_le_bytes());
        bytes[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        bytes[0x3c..0x3e].copy_from_slice(&4u16.to_le_bytes());
        bytes
    }

    fn entry(folder: &Path, name: &str, module: &[u8], names: &str, source: bool) -> PathBuf {
        std::fs::create_dir_all(folder).unwrap();
        let ptx = folder.join(format!("{name}.ptx"));
        std::fs::write(&ptx, module).unwrap();
        std::fs::write(ptx.with_extension("txt"), names).unwrap();
        if source {
            std::fs::write(ptx.with_extension("cu"), "__global__ void k() {}").unwrap();
        }
        ptx
    }

    #[test]
    fn modules_are_whole_by_their_own_format() {
        assert!(whole_module(&cubin(1024, 1024)));
        assert!(whole_module(&cubin(1100, 1024)));
        assert!(!whole_module(&cubin(1024, 1024)[..1000]), "a cubin cut before its section headers' end");
        assert!(!whole_module(&cubin(1024, 1024)[..40]), "shorter than its header");
        let mut no_sections = cubin(1024, 1024);
        no_sections[0x3c..0x3e].copy_from_slice(&0u16.to_le_bytes());
        assert!(!whole_module(&no_sections));
        let mut huge = cubin(1024, 1024);
        huge[0x28..0x30].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(!whole_module(&huge), "an offset past any file is not whole (and does not overflow)");
        assert!(whole_module(b".version 8.0\n.target sm_90\n\0"));
        assert!(!whole_module(b".version 8.0\n.target sm_9"), "PTX text cut before its NUL");
        assert!(!whole_module(b""));
    }

    /// A process killed mid-compile leaves its finished entries to the next one: the sweep of
    /// its folder shares them before removing it; an entry it was still writing stays out.
    #[test]
    fn a_killed_processs_finished_modules_are_shared() {
        let tmp = tempfile::tempdir().unwrap();
        let user = tmp.path();
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        let pid = gone.id();
        gone.wait().unwrap();
        let ptx = user.join(format!("run-{pid}/mlx/0.32.4/ptx"));
        entry(&ptx, "binary_add", &cubin(2048, 2048), "add\t_Z3addv\n", true);
        entry(&ptx, "cut", &cubin(2048, 2048)[..1500], "cut\t_Z3cutv\n", true);
        let shared = user.join("kernels");
        crate::kernel_cache::linux::sweep(user, &shared);
        assert!(!user.join(format!("run-{pid}")).exists());
        let shared_ptx = shared.join("0.32.4/ptx");
        assert_eq!(std::fs::read(shared_ptx.join("binary_add.txt")).unwrap(), b"add\t_Z3addv\n");
        assert!(shared_ptx.join("binary_add.ptx").is_file() && !shared_ptx.join("cut.ptx").exists());
    }

    #[test]
    fn only_whole_entries_are_shared_and_seeded_names_first() {
        let tmp = tempfile::tempdir().unwrap();
        let (run, shared, next) = (tmp.path().join("run"), tmp.path().join("shared"), tmp.path().join("next"));
        let ptx = run.join("mlx/0.32.4/ptx");
        let whole = entry(&ptx, "binary_add", &cubin(2048, 2048), "add\t_Z3addv\n", true);
        // MLX splits a long module name into folders.
        let long = entry(&ptx.join("a".repeat(245)), "rest", &cubin(512, 512), "k\t_Z1kv\n", true);
        entry(&ptx, "cut", &cubin(2048, 2048)[..1500], "cut\t_Z3cutv\n", true);
        entry(&ptx, "no_source_yet", &cubin(512, 512), "k\t_Z1kv\n", false);
        entry(&ptx, "names_cut", &cubin(512, 512), "k\t_Z1", true);

        let mut known = HashSet::new();
        publish(&run, &shared, &mut known);
        let shared_ptx = shared.join("0.32.4/ptx");
        let mut published: Vec<PathBuf> =
            modules(&shared_ptx).iter().map(|p| p.strip_prefix(&shared_ptx).unwrap().to_path_buf()).collect();
        published.sort();
        let mut expected = vec![PathBuf::from("binary_add.ptx"), PathBuf::from("a".repeat(245)).join("rest.ptx")];
        expected.sort();
        assert_eq!(published, expected);
        assert_eq!(std::fs::read(shared_ptx.join("binary_add.txt")).unwrap(), b"add\t_Z3addv\n");
        assert!(known.contains(&whole) && known.contains(&long) && known.len() == 2);
        let leftovers = std::fs::read_dir(&shared_ptx)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".part"));
        assert_eq!(leftovers.count(), 0, "no staged file is left behind");

        // The unfinished entry finishes: the next publication takes it, and only it.
        std::fs::write(ptx.join("no_source_yet.cu"), "src").unwrap();
        publish(&run, &shared, &mut known);
        assert!(shared_ptx.join("no_source_yet.ptx").is_file());
        assert!(!shared_ptx.join("cut.ptx").exists() && !shared_ptx.join("names_cut.ptx").exists());

        // A module whose names never arrived is not seeded (MLX would find no kernels in it).
        std::fs::write(shared_ptx.join("orphan.ptx"), cubin(512, 512)).unwrap();
        let seeded = seed(&shared, &next);
        let next_ptx = next.join("mlx/0.32.4/ptx");
        assert_eq!(seeded.len(), 3);
        assert!(seeded.contains(&next_ptx.join("binary_add.ptx")));
        assert_eq!(std::fs::read(next_ptx.join("binary_add.txt")).unwrap(), b"add\t_Z3addv\n");
        assert!(next_ptx.join("a".repeat(245)).join("rest.ptx").is_file());
        assert!(!next_ptx.join("orphan.ptx").exists() && !next_ptx.join("orphan.txt").exists());
    }
}
