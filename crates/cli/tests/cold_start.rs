//! Several `ferrite` processes started together on an empty MLX kernel cache all start: each
//! compiles into a folder of its own and shares only finished kernels (`engine::kernel_cache`).
//! Before, they compiled into one shared folder and one could load a kernel another was still
//! writing ("Could not load C++ shared library …: file too short").
#![cfg(target_os = "linux")]

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Output};

use engine::checkpoint::{self, Architecture, MakeOptions};

/// `count` processes generating from `model` at once, all with `tmp` as their temporary folder.
fn generate_together(model: &Path, tmp: &Path, count: usize) -> Vec<Output> {
    let children: Vec<_> = (0..count)
        .map(|_| {
            Command::new(env!("CARGO_BIN_EXE_ferrite"))
                .env("TMPDIR", tmp)
                .env("RUST_LOG", "warn")
                .args(["generate", "--model", model.to_str().unwrap(), "--prompt", "hello", "--max-tokens", "3"])
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    children.into_iter().map(|c| c.wait_with_output().unwrap()).collect()
}

fn assert_all_started(outputs: &[Output], round: &str) {
    for (i, out) in outputs.iter().enumerate() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && !stderr.contains("Could not load"), "{round}, process {i}: {stderr}");
    }
}

fn user_folder(tmp: &Path) -> std::path::PathBuf {
    // SAFETY: getuid cannot fail.
    tmp.join(format!("ferrite-mlx-{}", unsafe { libc::getuid() }))
}

fn kernels_in(folder: &Path) -> usize {
    let Ok(versions) = std::fs::read_dir(folder) else { return 0 };
    versions
        .flatten()
        .filter_map(|v| std::fs::read_dir(v.path()).ok())
        .flat_map(|k| k.flatten())
        .filter(|k| k.file_name().to_string_lossy().ends_with(".so"))
        .count()
}

/// A project-made checkpoint of `arch` and an empty temporary folder, both in the returned one.
fn model_and_empty_tmp(arch: Architecture) -> (tempfile::TempDir, std::path::PathBuf, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let (model, tmp) = (dir.path().join("model"), dir.path().join("tmp"));
    checkpoint::make(&MakeOptions::new(arch, "tiny"), &model).unwrap();
    std::fs::create_dir(&tmp).unwrap();
    (dir, model, tmp)
}

#[test]
fn processes_started_together_on_an_empty_kernel_cache_all_start() {
    // A hybrid: its gated-delta layers compile the most kernels.
    let (_dir, model, tmp) = model_and_empty_tmp(Architecture::Qwen35);
    assert_all_started(&generate_together(&model, &tmp, 4), "cold");
    let user = user_folder(&tmp);
    let mode = std::fs::metadata(&user).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "the user's kernel folder is private");
    let shared = kernels_in(&user.join("kernels"));
    assert!(shared > 0, "the finished kernels are shared");
    let left: Vec<_> = std::fs::read_dir(&user).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left, vec![std::ffi::OsString::from("kernels")], "each process removed its own folder");
    // Nothing in MLX's own shared folder, which every user can write to.
    assert!(!tmp.join("mlx").exists());

    // Warm: the shared kernels are used (and still all start).
    assert_all_started(&generate_together(&model, &tmp, 4), "warm");
    assert_eq!(kernels_in(&user.join("kernels")), shared, "no kernel compiled twice");
}

/// A kernel folder someone else could write to is not used: the process compiles privately and
/// shares nothing (a library put there would run in every process that loaded it).
#[test]
fn a_kernel_folder_others_can_write_to_is_not_trusted() {
    let (_dir, model, tmp) = model_and_empty_tmp(Architecture::Qwen3);
    let user = user_folder(&tmp);
    std::fs::DirBuilder::new().mode(0o777).create(&user).unwrap();
    std::fs::set_permissions(&user, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert_all_started(&generate_together(&model, &tmp, 1), "untrusted folder");
    assert_eq!(std::fs::read_dir(&user).unwrap().count(), 0, "nothing was put in the untrusted folder");
    let left: Vec<_> = std::fs::read_dir(&tmp).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(left.len(), 1, "the private folder was removed at exit: {left:?}");
}
