//! A CUDA gated delta path checks its kernels at a model's load on exactly what the model's
//! layers launch (`delta_check::check_model`), once per use in a process, and a layer launches
//! a kernel only on a use that passed. Here, on the CPU, no CUDA kernel can run: every check
//! fails, each is recorded, and the model runs on the operations.

mod common;

use engine::checkpoint::{Architecture, Dtype};
use engine::delta_path::{DeltaPath, KernelUse};
use engine::{Engine, GenerateRequest};

#[test]
fn a_cuda_path_checks_each_kernel_use_of_the_model_once_and_runs_failed_ones_as_operations() {
    // Its own test binary: the path is chosen once per process.
    let chosen = engine::delta_path::choose(Some(DeltaPath::CudaFused));
    assert_eq!(chosen.path, DeltaPath::CudaFused);
    assert!(chosen.why.contains("at its load"), "{}", chosen.why);
    assert!(engine::delta_path::verdicts().is_empty(), "nothing checked before a model loads");

    // Qwen3-Next "small": Gated DeltaNet layers of 4 x 32 key and 8 x 32 value heads (the fused
    // step takes them), MoE feed-forwards.
    let dir = common::make(&common::options(Architecture::Qwen3Next, "small", Some(4), 32, Dtype::Float32));
    let engine = Engine::load(dir.path()).unwrap();
    let mut verdicts = engine::delta_path::verdicts();
    verdicts.sort_by_key(|(u, _)| format!("{u:?}"));
    let delta_uses: Vec<_> = verdicts
        .iter()
        .filter_map(|(u, ok)| match u {
            KernelUse::Delta { kernel, heads, dtype, record, .. } => Some((*kernel, *heads, *dtype, *record, *ok)),
            KernelUse::Moe { .. } => None,
        })
        .collect();
    // The fused step failed, so the recurrence kernel was checked too, for decoding and for a
    // verify pass's recording step: four uses for the one layer shape, none passed.
    assert_eq!(delta_uses.len(), 4, "{verdicts:?}");
    for kernel in [DeltaPath::CudaFused, DeltaPath::Cuda] {
        for record in [false, true] {
            assert!(
                delta_uses.contains(&(kernel, [4, 8, 32, 32, 4], mlx_rs::Dtype::Float32, record, false)),
                "{kernel} recording {record}: {verdicts:?}"
            );
        }
    }
    assert!(
        verdicts.iter().any(|(u, ok)| *u == KernelUse::Moe { dtype: mlx_rs::Dtype::Float32 } && !ok),
        "{verdicts:?}"
    );
    // What `/v1/status` and `ferrite inspect` say of it.
    let said = engine::delta_path::describe(chosen);
    assert!(said.ends_with("0 of 5 kernel uses checked in this process passed"), "{said}");

    // The layers keep to the operations: a request runs (and speculates) as on the CPU.
    let req = GenerateRequest::greedy(vec![1, 5, 9, 14, 3], 8);
    let (_, summary) = engine.generate_text(req).unwrap();
    assert!(summary.usage.completion_tokens > 0);

    // A second model of the same shapes checks nothing again.
    let again = Engine::load(dir.path()).unwrap();
    drop(again);
    assert_eq!(engine::delta_path::verdicts().len(), verdicts.len());
}
