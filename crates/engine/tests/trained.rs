//! The embedded model against the code that trained it: Ferrite's logits (trunk, and the MTP
//! head's for the token after next) on held-out code equal the training code's own forward
//! pass within the quantization tolerance, and its greedy choices agree.

mod common;

use std::path::{Path, PathBuf};

use engine::Engine;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

pub struct Parity {
    pub trunk_max_abs: f32,
    pub mtp_max_abs: f32,
    pub trunk_argmax_agree: f32,
    pub mtp_argmax_agree: f32,
}

fn max_abs(a: &Array, b: &Array) -> f32 {
    a.subtract(b).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>()
}

fn agree(a: &Array, b: &Array) -> f32 {
    let same = mlx_rs::ops::indexing::argmax_axis(a, -1, None)
        .unwrap()
        .eq(mlx_rs::ops::indexing::argmax_axis(b, -1, None).unwrap())
        .unwrap();
    same.as_dtype(mlx_rs::Dtype::Float32).unwrap().mean(None).unwrap().item_cast::<f32>()
}

/// Ferrite's logits on the reference ids against the reference's.
pub fn parity(model_dir: &Path, reference: &Path) -> Parity {
    let engine = Engine::load(model_dir).unwrap();
    let r = Array::load_safetensors(reference).unwrap();
    let ids = r["ids"].as_dtype(mlx_rs::Dtype::Uint32).unwrap();
    let t = ids.dim(0);
    let ids = ids.reshape(&[1, t]).unwrap();
    let model = engine.model();
    let mut cache = model.new_cache();
    let hidden = model.hidden(&ids, &mut cache).unwrap();
    let logits = model.logits(&hidden).unwrap().index(0).as_dtype(mlx_rs::Dtype::Float32).unwrap();
    let mtp = model.mtp().expect("the model has an MTP head");
    let mut mtp_cache = mtp.new_cache();
    let x = mtp.forward(model, &hidden.index((.., ..t - 1, ..)), &ids.index((.., 1..)), &mut mtp_cache).unwrap();
    let mtp_logits = mtp.logits(model, &x).unwrap().index(0).as_dtype(mlx_rs::Dtype::Float32).unwrap();
    let want_mtp = r["mtp_logits"].index((..t - 1, ..));
    Parity {
        trunk_max_abs: max_abs(&logits, &r["logits"]),
        mtp_max_abs: max_abs(&mtp_logits, &want_mtp),
        trunk_argmax_agree: agree(&logits, &r["logits"]),
        mtp_argmax_agree: agree(&mtp_logits, &want_mtp),
    }
}

/// The shipped model, if this checkout has it.
fn embedded() -> Option<(PathBuf, PathBuf)> {
    let assets = common::repo_root().join("assets/models");
    let dir = assets.join("ferrite-code-20m");
    let reference = assets.join("ferrite-code-20m.reference.safetensors");
    (dir.join("config.json").exists() && reference.exists()).then_some((dir, reference))
}

#[test]
fn embedded_model_matches_its_training_code() {
    let (dir, reference) = embedded().expect("assets/models/ferrite-code-20m ships with the repository");
    let p = parity(&dir, &reference);
    eprintln!(
        "trunk: max |Δlogit| {:.4}, argmax agreement {:.3}; MTP: max |Δlogit| {:.4}, argmax agreement {:.3}",
        p.trunk_max_abs, p.trunk_argmax_agree, p.mtp_max_abs, p.mtp_argmax_agree
    );
    // 8-bit affine weights against the f32 training model.
    assert!(p.trunk_max_abs < 0.5 && p.mtp_max_abs < 0.5, "quantized logits drift too far");
    assert!(p.trunk_argmax_agree >= 0.9 && p.mtp_argmax_agree >= 0.9);
}

/// `FERRITE_PARITY_DIR=DIR FERRITE_PARITY_REF=FILE`: an unquantized export, exact up to f32.
#[test]
fn unquantized_export_matches_exactly() {
    let (Ok(dir), Ok(reference)) = (std::env::var("FERRITE_PARITY_DIR"), std::env::var("FERRITE_PARITY_REF")) else {
        return;
    };
    let p = parity(Path::new(&dir), Path::new(&reference));
    eprintln!("trunk max |Δ| {:e}, MTP max |Δ| {:e}", p.trunk_max_abs, p.mtp_max_abs);
    assert!(p.trunk_max_abs < 1e-3 && p.mtp_max_abs < 1e-3);
}

/// Long prompts take the chunked delta rule, short chunks the step-by-step one: on the trained
/// model (real decays, some close to 0) both give the same tokens and nearly the same logits.
#[test]
fn embedded_model_chunked_prefill_equals_step_by_step() {
    let (dir, _) = embedded().expect("assets/models/ferrite-code-20m ships with the repository");
    let mut engine = Engine::load(&dir).unwrap();
    let prompts: Vec<Vec<u32>> = serde_json::from_str(
        &std::fs::read_to_string(common::repo_root().join("bench/prompts/heldout-code.json")).unwrap(),
    )
    .unwrap();
    let prompt: Vec<u32> = prompts.concat().into_iter().take(300).collect();
    let model = engine.model();
    let ids = Array::from_slice(&prompt, &[1, prompt.len() as i32]);
    let whole = model.hidden(&ids, &mut model.new_cache()).unwrap();
    let mut cache = model.new_cache();
    let parts: Vec<Array> = prompt
        .chunks(50)
        .map(|c| model.hidden(&Array::from_slice(c, &[1, c.len() as i32]), &mut cache).unwrap())
        .collect();
    let stepped = mlx_rs::ops::concatenate(&parts, 1).unwrap();
    assert!(!whole.max(None).unwrap().item_cast::<f32>().is_nan(), "NaN in the chunked prefill");
    let d = max_abs(&whole, &stepped);
    assert!(d < 1e-3, "hidden states differ by {d}");
    let req = engine::GenerateRequest { ignore_eos: true, ..engine::GenerateRequest::greedy(prompt.clone(), 24) };
    let (a, _) = engine.generate_text(req.clone()).unwrap();
    engine.set_prefill_chunk(50);
    let (b, _) = engine.generate_text(req).unwrap();
    assert_eq!(a, b);
}
