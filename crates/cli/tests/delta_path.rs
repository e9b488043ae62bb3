//! The hybrids' gated delta rule on MLX's own op (`--delta-path mlx-native`: Metal kernels on
//! a Mac, its operations fallback here) against the operations path: it passes its self-check
//! at load, and greedy answers are the same token for token — a short prompt (the compiled
//! short step), a long one (the whole-sequence prefill), plainly and with MTP speculation
//! (verify passes a position at a time, rollback of rejected drafts). `ferrite inspect` and the
//! log say which path runs.

use std::path::Path;
use std::process::Command;

use engine::checkpoint::{self, Architecture, MakeOptions};

/// The answer's text and the log of `ferrite generate` on `path`.
fn generate(model: &Path, path: &str, prompt: &str, depth: u32) -> (String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .env("RUST_LOG", "info")
        .args(["generate", "--model", model.to_str().unwrap(), "--prompt", prompt, "--max-tokens", "24"])
        .args(["--draft-depth", &depth.to_string(), "--delta-path", path])
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "generate --delta-path {path}: {stderr}");
    // The answer comes before the figures in brackets.
    let answer = stdout.lines().take_while(|l| !l.starts_with("[")).collect::<Vec<_>>().join("\n");
    (answer, stderr.into_owned())
}

fn model(arch: Architecture) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let mut options = MakeOptions::new(arch, "tiny");
    options.mtp = true;
    // In float32 MLX's op and the operations agree exactly (the self-check's figures); in
    // bfloat16 MLX's op rounds within the stated tolerance, which a random model's near-tied
    // logits can turn into another token.
    options.dtype = checkpoint::Dtype::Float32;
    checkpoint::make(&options, &model).unwrap();
    (dir, model)
}

#[test]
fn mlx_native_answers_as_the_operations_do() {
    for arch in [Architecture::Qwen3Next, Architecture::Qwen35] {
        let (_dir, model) = model(arch);
        let long = "fn main() { let x = 1; println!(\"{x}\"); } ".repeat(12);
        for prompt in ["hello world, this is", long.as_str()] {
            for depth in [0, 2] {
                let (expected, _) = generate(&model, "ops", prompt, depth);
                let (got, log) = generate(&model, "mlx-native", prompt, depth);
                assert!(
                    log.contains("gated delta rule: mlx-native (checked against ops"),
                    "{arch:?}: the native path did not pass its self-check: {log}"
                );
                assert!(!expected.is_empty());
                assert_eq!(got, expected, "{arch:?}, depth {depth}, prompt of {} chars", prompt.len());
            }
        }
    }
}

#[test]
fn inspect_names_the_delta_path_and_mlx_version() {
    let (_dir, model) = model(Architecture::Qwen3Next);
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite"))
        .args(["inspect", model.to_str().unwrap(), "--delta-path", "ops"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("delta rule     ops (asked for)"), "{text}");
    assert!(text.contains(&format!("on MLX {}", engine::device::mlx_version())), "{text}");
    assert!(text.contains("on MLX 0.32.4"), "the engine runs MLX 0.32.4: {text}");
}

#[test]
fn an_unknown_delta_path_is_refused_by_name() {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrite")).args(["profiles", "--delta-path", "metal"]).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("`metal` is not one of auto, ops, mlx-native, cuda-kernel"), "{err}");
}
