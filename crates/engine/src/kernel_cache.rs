//! A folder of its own for MLX's CPU kernel compiler in every process.
//!
//! MLX's CPU backend compiles fused kernels with g++ into `$TMPDIR/mlx/<version>/cpu/` and
//! loads them by file name, with no lock between processes: a process that finds a kernel
//! another one is still writing loads a half-written file ("Could not load C++ shared library
//! …: file too short"), and two that compile the same kernel together write one source file at
//! once. The folder is also shared by every user of the machine, so one user could put a
//! library there that another user's process then loads.
//!
//! So a constructor run before `main` (while the program has one thread) points `TMPDIR` at a
//! folder of this process's own, `<tmp>/ferrite-mlx-<uid>/run-<pid>/`, and fills it with hard
//! links to the kernels earlier processes finished, kept in `<tmp>/ferrite-mlx-<uid>/kernels/
//! <version>/`. A kernel reaches that shared folder only once this process has loaded it (it
//! is then in `/proc/self/maps`, so g++ is done with it), under a temporary name first and then
//! renamed: another process sees a whole file or none. The user's folder is made private
//! (mode 700) and checked to be theirs; if it is not, the process keeps a private folder and
//! shares nothing. Folders of processes that no longer run are removed at the next start.
//!
//! MLX's CUDA backend keeps what NVRTC compiled in the same temporary folder
//! (`mlx/<version>/ptx/`): its finished entries are shared too (`ptx.rs`), or every fresh
//! process on a GPU machine would compile every kernel again.
//!
//! Linux only: there the engine runs on MLX's CPU or CUDA backend. On macOS MLX runs on Metal
//! and keeps its own compiled kernels.

#[cfg(target_os = "linux")]
mod ptx;

#[cfg(target_os = "linux")]
mod linux {
    use std::collections::HashSet;
    use std::ffi::{CString, OsString};
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    use std::path::{Path, PathBuf};
    use std::sync::{Mutex, OnceLock};

    /// What the constructor set up.
    pub struct Folders {
        /// This process's `TMPDIR`: MLX compiles into `run/mlx/<version>/cpu/`.
        pub run: PathBuf,
        /// `<user folder>/kernels`, when the user's folder could be trusted.
        pub shared: Option<PathBuf>,
        /// Kernel files already in the shared folder (seeded from it, or published).
        known: Mutex<HashSet<PathBuf>>,
    }

    pub static FOLDERS: OnceLock<Folders> = OnceLock::new();

    /// The temporary folder as libstdc++'s `temp_directory_path` (which MLX asks) finds it.
    fn temp_base() -> PathBuf {
        ["TMPDIR", "TMP", "TEMP", "TEMPDIR"]
            .iter()
            .filter_map(std::env::var_os)
            .find(|v| !v.is_empty())
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/tmp"))
    }

    fn user_folder_name(uid: u32) -> String {
        format!("ferrite-mlx-{uid}")
    }

    /// A Ferrite process started by another inherits its `run-<pid>` folder as `TMPDIR`: its
    /// own folders belong beside its parent's, not inside them.
    fn outside_parents_folder(base: PathBuf, uid: u32) -> PathBuf {
        let is_run = base.file_name().is_some_and(|n| n.as_bytes().starts_with(b"run-"));
        let parent = base.parent();
        match parent {
            Some(p) if is_run && p.file_name().is_some_and(|n| n.as_bytes() == user_folder_name(uid).as_bytes()) => {
                p.parent().map(Path::to_path_buf).unwrap_or(base)
            }
            _ => base,
        }
    }

    /// The user's folder, made if missing, when it is a real folder of this user's that no one
    /// else may write to.
    fn trusted_user_folder(base: &Path, uid: u32) -> Option<PathBuf> {
        let folder = base.join(user_folder_name(uid));
        let _ = std::fs::DirBuilder::new().mode(0o700).create(&folder);
        let meta = std::fs::symlink_metadata(&folder).ok()?;
        (meta.file_type().is_dir() && meta.uid() == uid && meta.mode() & 0o077 == 0).then_some(folder)
    }

    fn process_alive(pid: i32) -> bool {
        // SAFETY: signal 0 sends nothing; kill only checks that the process exists.
        let rc = unsafe { libc::kill(pid, 0) };
        rc == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
    }

    /// Removes the `run-<pid>` folders of processes that are gone (killed before they could),
    /// first sharing the CUDA modules they finished: a process stopped mid-compile (a time
    /// limit on a fresh GPU machine, where the first one compiles for minutes) leaves that work
    /// to the next instead of every one starting over. (Its CPU kernels stay unshared: only a
    /// live process can tell that g++ finished one, by having loaded it.)
    pub(super) fn sweep(user: &Path, shared: &Path) {
        let Ok(entries) = std::fs::read_dir(user) else { return };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let pid = name.to_str().and_then(|n| n.strip_prefix("run-")).and_then(|p| p.parse::<i32>().ok());
            if pid.is_some_and(|p| p > 0 && !process_alive(p)) {
                crate::kernel_cache::ptx::publish(&entry.path(), shared, &mut HashSet::new());
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }

    /// Hard links to every finished kernel of every MLX version, in this process's folder.
    fn seed(shared: &Path, run: &Path) -> HashSet<PathBuf> {
        let mut seeded = HashSet::new();
        let Ok(versions) = std::fs::read_dir(shared) else { return seeded };
        for version in versions.flatten() {
            let Ok(kernels) = std::fs::read_dir(version.path()) else { continue };
            let target = run.join("mlx").join(version.file_name()).join("cpu");
            if std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&target).is_err() {
                continue;
            }
            for kernel in kernels.flatten() {
                let name = kernel.file_name();
                if is_kernel_name(&name) && std::fs::hard_link(kernel.path(), target.join(&name)).is_ok() {
                    seeded.insert(target.join(&name));
                }
            }
        }
        seeded
    }

    fn is_kernel_name(name: &std::ffi::OsStr) -> bool {
        let name = name.as_bytes();
        name.starts_with(b"lib") && name.ends_with(b".so")
    }

    /// Sets the folders up and points `TMPDIR` at this process's own. Runs before `main`.
    pub fn set_up() {
        // SAFETY: getuid and getpid cannot fail.
        let (uid, pid) = unsafe { (libc::getuid(), libc::getpid()) };
        let base = outside_parents_folder(temp_base(), uid);
        let user = trusted_user_folder(&base, uid);
        let (run, shared) = match &user {
            Some(user) => {
                let shared = user.join("kernels");
                sweep(user, &shared);
                let run = user.join(format!("run-{pid}"));
                let _ = std::fs::remove_dir_all(&run); // a gone process's with this pid
                (run, Some(shared))
            }
            // Not the user's own: a folder no other process knows, and nothing shared.
            None => (base.join(format!("ferrite-mlx-{uid}-{pid}-{}", nanos())), None),
        };
        if std::fs::DirBuilder::new().mode(0o700).create(&run).is_err() {
            return; // MLX keeps the temporary folder it would have used
        }
        let mut known = shared.as_deref().map(|s| seed(s, &run)).unwrap_or_default();
        if let Some(shared) = &shared {
            known.extend(crate::kernel_cache::ptx::seed(shared, &run));
        }
        let Ok(value) = CString::new(OsString::from(run.clone()).as_bytes()) else { return };
        // SAFETY: this runs before main, while the program has one thread, so nothing reads the
        // environment meanwhile; both strings are NUL-terminated and outlive the call.
        if unsafe { libc::setenv(c"TMPDIR".as_ptr(), value.as_ptr(), 1) } != 0 {
            let _ = std::fs::remove_dir_all(&run);
            return;
        }
        let _ = FOLDERS.set(Folders { run, shared, known: Mutex::new(known) });
        // SAFETY: registers a plain function with no arguments to run at exit.
        unsafe { libc::atexit(at_exit) };
    }

    fn nanos() -> u32 {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos())
    }

    extern "C" fn at_exit() {
        // Nothing may unwind out of an exit handler.
        let _ = std::panic::catch_unwind(|| {
            publish();
            if let Some(f) = FOLDERS.get() {
                let _ = std::fs::remove_dir_all(&f.run);
            }
        });
    }

    /// The kernel files this process has loaded from its own folder (each one whole: MLX loads
    /// a kernel only after g++ has finished writing it).
    fn loaded_kernels(run: &Path) -> Vec<PathBuf> {
        let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else { return Vec::new() };
        let prefix = run.join("mlx");
        let mut found: Vec<PathBuf> = maps
            .lines()
            // The path is the sixth field; it may contain spaces, so take the rest of the line.
            .filter_map(|line| line.find('/').map(|at| PathBuf::from(&line[at..])))
            .filter(|p| p.starts_with(&prefix) && p.file_name().is_some_and(is_kernel_name))
            .collect();
        found.sort();
        found.dedup();
        found
    }

    /// Puts the kernels this process compiled and loaded, and its finished CUDA modules, into
    /// the shared folder.
    pub fn publish() {
        let Some(Folders { run, shared: Some(shared), known }) = FOLDERS.get() else { return };
        let Ok(mut known) = known.lock() else { return };
        for kernel in loaded_kernels(run) {
            if known.contains(&kernel) {
                continue;
            }
            // run/mlx/<version>/cpu/<name>
            let (Some(name), Some(version)) =
                (kernel.file_name(), kernel.parent().and_then(Path::parent).and_then(Path::file_name))
            else {
                continue;
            };
            let folder = shared.join(version);
            if std::fs::DirBuilder::new().recursive(true).mode(0o700).create(&folder).is_err() {
                continue;
            }
            let staged = folder.join(format!(".{}.{}.part", name.to_string_lossy(), std::process::id()));
            let _ = std::fs::remove_file(&staged);
            let done =
                std::fs::hard_link(&kernel, &staged).is_ok() && std::fs::rename(&staged, folder.join(name)).is_ok();
            if !done {
                let _ = std::fs::remove_file(&staged);
            }
            known.insert(kernel);
        }
        crate::kernel_cache::ptx::publish(run, shared, &mut known);
    }

    extern "C" fn constructor(_: libc::c_int, _: *const *const libc::c_char, _: *const *const libc::c_char) {
        // A panic must not unwind into the C runtime's start-up code.
        let _ = std::panic::catch_unwind(set_up);
    }

    #[used]
    #[link_section = ".init_array"]
    pub static SET_UP: extern "C" fn(libc::c_int, *const *const libc::c_char, *const *const libc::c_char) = constructor;
}

/// Keeps the constructor in every program that uses the engine (a linker takes an object from
/// a library only when something refers to it).
pub(crate) fn keep_constructor() {
    #[cfg(target_os = "linux")]
    std::hint::black_box(&linux::SET_UP);
}

/// Shares the kernels this process has compiled so far with the processes that start after it
/// (also done at exit). Cheap: it reads this process's memory map.
pub fn publish() {
    #[cfg(target_os = "linux")]
    linux::publish();
}

/// Where MLX compiles this process's CPU kernels, and the shared folder of finished ones (for
/// `ferrite inspect` and the logs); None where the constructor did not run or changed nothing.
pub fn folders() -> Option<(std::path::PathBuf, Option<std::path::PathBuf>)> {
    #[cfg(target_os = "linux")]
    return linux::FOLDERS.get().map(|f| (f.run.clone(), f.shared.clone()));
    #[cfg(not(target_os = "linux"))]
    None
}
