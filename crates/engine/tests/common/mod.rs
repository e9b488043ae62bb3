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

/// Greedy token ids straight from the model, one position at a time.
pub fn greedy_tokens(e: &engine::Engine, prompt: &[u32], n: usize) -> Vec<u32> {
    use mlx_rs::ops::indexing::IndexOp;
    let mut cache = e.model().new_cache();
    let ids = mlx_rs::Array::from_slice(prompt, &[1, prompt.len() as i32]);
    let mut logits = e.model().forward(&ids, &mut cache).unwrap();
    let mut out = vec![];
    for _ in 0..n {
        let t = mlx_rs::ops::indexing::argmax_axis(logits.index((.., -1, ..)), -1, None).unwrap().item_cast::<u32>();
        out.push(t);
        logits = e.model().forward(&mlx_rs::Array::from_slice(&[t], &[1, 1]), &mut cache).unwrap();
    }
    out
}

/// Pearson's chi-square of two histograms over the same categories, and its degrees of freedom.
pub fn chi_square(a: &[usize], b: &[usize]) -> (f64, usize) {
    let (na, nb) = (a.iter().sum::<usize>() as f64, b.iter().sum::<usize>() as f64);
    let mut stat = 0.0;
    let mut dof = 0usize;
    for (&x, &y) in a.iter().zip(b) {
        let total = (x + y) as f64;
        if total == 0.0 {
            continue;
        }
        let (ea, eb) = (total * na / (na + nb), total * nb / (na + nb));
        stat += (x as f64 - ea).powi(2) / ea + (y as f64 - eb).powi(2) / eb;
        dof += 1;
    }
    (stat, dof.saturating_sub(1))
}
