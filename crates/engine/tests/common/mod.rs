//! Helpers shared by the engine's integration tests.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use engine::checkpoint::{self, Architecture, Dtype, MakeOptions};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// The venv with mlx-lm that scripts/setup.sh creates.
pub fn reference_python() -> PathBuf {
    let python = repo_root().join("third_party/venv/bin/python");
    assert!(python.exists(), "{} is missing: run scripts/setup.sh (make setup)", python.display());
    python
}

/// A run of `script` in the reference venv, multiplying with the BLAS this process loaded and
/// its kernels (OPENBLAS_CORETYPE, when the engine chose them, is inherited): then mlx-lm and
/// Ferrite sum f32 products in the same order, as on a Mac where both use Accelerate.
pub fn reference_command(script: &str) -> std::process::Command {
    let mut command = std::process::Command::new(reference_python());
    command.arg(repo_root().join("tests/reference").join(script));
    // Any MLX work maps libmlx and its BLAS before the path is read.
    mlx_rs::Array::from_int(1).eval().unwrap();
    if let Some(blas) = engine::blas::library().filter(|_| cfg!(target_os = "linux")) {
        command.env("LD_PRELOAD", blas);
    }
    command
}

pub fn options(arch: Architecture, preset: &str, bits: Option<i32>, group_size: i32, dtype: Dtype) -> MakeOptions {
    let mut o = MakeOptions::new(arch, preset);
    o.bits = bits;
    o.group_size = group_size;
    o.dtype = dtype;
    o
}

/// Makes a checkpoint in a fresh temporary folder (kept alive by the returned guard).
pub fn make(opts: &MakeOptions) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    checkpoint::make(opts, dir.path()).unwrap();
    dir
}

/// Rewrites a checkpoint's safetensors file after `edit` changes its tensors.
pub fn rewrite_tensors(file: &Path, edit: impl FnOnce(&mut std::collections::HashMap<String, mlx_rs::Array>)) {
    let mut tensors = mlx_rs::Array::load_safetensors(file).unwrap();
    edit(&mut tensors);
    mlx_rs::transforms::eval(tensors.values()).unwrap(); // read everything before overwriting
    mlx_rs::Array::save_safetensors(tensors.iter(), None, file).unwrap();
}
