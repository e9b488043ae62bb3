//! `--matmul-path`: which implementation multiplies a few rows by quantized weights. Off a
//! CUDA machine the engine's kernel cannot run: asked for, it fails its self-check at load,
//! the log and `ferrite inspect` say so, MLX's matmul runs and the answer is MLX's, token for
//! token (the kernel itself is checked on a GPU: `bench/gpu/checks.sh qmm verify-8b`).

use std::path::{Path, PathBuf};
use std::process::Command;

use engine::checkpoint::{self, Architecture, MakeOptions};

fn quantized_model() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let mut options = MakeOptions::new(Architecture::Qwen35, "tiny");
    options.bits = Some(4);
    options.mtp = true;
    checkpoint::make(&options, &model).unwrap();
    (dir, model)
}

/// The answer's text and the log of `ferrite generate --matmul-path path`.
fn generate(model: &Path, path: &str) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .env("RUST_LOG", "info")
        .args(["generate", "--model", model.to_str().unwrap(), "--prompt", "fn main() {", "--max-tokens", "16"])
        .args(["--draft-depth", "2", "--matmul-path", path])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "generate --matmul-path {path}: {stderr}");
    let answer = stdout.lines().take_while(|l| !l.starts_with("[")).collect::<Vec<_>>().join("\n");
    (answer, stderr.into_owned())
}

#[test]
fn the_kernel_asked_for_off_a_gpu_fails_its_check_and_mlx_answers() {
    let (_dir, model) = quantized_model();
    let (expected, log) = generate(&model, "mlx");
    assert!(log.contains("quantized matmuls of a few rows: mlx (asked for)"), "{log}");
    let (got, log) = generate(&model, "cuda-rows");
    assert!(log.contains("quantized matmuls of a few rows: mlx (cuda-rows failed its self-check:"), "{log}");
    assert_eq!(got, expected);
}

#[test]
fn inspect_says_which_path_multiplies_a_few_rows() {
    let (_dir, model) = quantized_model();
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite")).args(["inspect", model.to_str().unwrap()]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("few-row qmm    mlx (no kernel path on cpu)"), "{text}");
}

#[test]
fn an_unknown_matmul_path_is_refused_by_name() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite")).args(["profiles", "--matmul-path", "cuda"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("`cuda` is not one of auto, mlx, cuda-rows, cuda-mma, mlx-pad8"), "{err}");
}
