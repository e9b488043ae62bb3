//! `ferrite inspect` reports what the checkpoint maker wrote.

mod common;

use engine::checkpoint::{self, Architecture, Dtype};
use engine::inspect::inspect;

#[test]
fn reports_parameters_quantization_and_mtp() {
    for (arch, bits, mtp) in [
        (Architecture::Qwen3, Some(4), false),
        (Architecture::Qwen3Moe, None, false),
        (Architecture::Qwen3Next, Some(8), true),
    ] {
        let mut o = common::options(arch, "tiny", bits, 32, Dtype::Bfloat16);
        o.mtp = mtp;
        let d = tempfile::tempdir().unwrap();
        let made = checkpoint::make(&o, d.path()).unwrap();
        let r = inspect(d.path(), &Default::default()).unwrap();
        assert_eq!(r.parameters + r.mtp_parameters, made.parameters, "{arch:?}");
        assert_eq!(r.mtp.is_some(), mtp);
        assert_eq!(r.mtp.as_ref().map(|m| m.is_ok()), mtp.then_some(true));
        if let Some(b) = bits {
            assert!(r.quantization.contains(&format!("{b}-bit")), "{}", r.quantization);
        }
        if arch == Architecture::Qwen3 {
            assert_eq!(r.active_parameters, r.parameters);
        } else {
            assert!(r.active_parameters < r.parameters);
            assert!(r.to_string().contains("8, 2 per token"));
        }
    }
}

#[test]
fn reports_an_incomplete_mtp_head() {
    let mut o = common::options(Architecture::Qwen35, "tiny", None, 32, Dtype::Float32);
    o.mtp = true;
    let d = common::make(&o);
    common::rewrite_tensors(&d.path().join("model.safetensors"), |t| {
        t.remove("mtp.norm.weight");
    });
    let r = inspect(d.path(), &Default::default()).unwrap();
    let text = r.to_string();
    assert!(text.contains("present but unusable") && text.contains("mtp.norm.weight"), "{text}");
}

#[test]
fn the_layer_count_asked_is_the_checkpoints_on_every_architecture() {
    use Architecture::*;
    for arch in [Qwen3, Qwen3Moe, Qwen3Next, Qwen35, Qwen35Moe] {
        let mut o = common::options(arch, "tiny", None, 32, Dtype::Float32);
        o.layers = Some(5);
        let d = tempfile::tempdir().unwrap();
        checkpoint::make(&o, d.path()).unwrap();
        let r = inspect(d.path(), &Default::default()).unwrap();
        assert!(r.to_string().contains("layers         5"), "{arch:?}:\n{r}");
    }
}
