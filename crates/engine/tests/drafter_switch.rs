//! One request, two drafters: where the model has its MTP head and a block drafter beside it,
//! the depth controller keeps the one the request did not ask for standing by, tries it now
//! and then, and drafts with it when it promises more — and the answer stays plain decoding's
//! token for token. Shown on the embedded model and its shipped drafter, one of the two
//! drafters made useless (its output norm zeroed: it drafts the same token every time).

mod common;

use std::path::{Path, PathBuf};

use engine::depth_control::CostModel;
use engine::{DraftWith, Engine, EngineOptions, GenerateRequest, SamplingParams};
use mlx_rs::ops;

/// A copy of the folder `from` in `into`, the tensor `zeroed` of its weights all zeros.
fn copy_with_zeroed(from: &Path, into: &Path, zeroed: &str) -> PathBuf {
    std::fs::create_dir_all(into).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let path = entry.unwrap().path();
        std::fs::copy(&path, into.join(path.file_name().unwrap())).unwrap();
    }
    common::rewrite_tensors(&into.join("model.safetensors"), |t| {
        let like = &t[zeroed];
        let zeros = ops::zeros_like(like).unwrap();
        t.insert(zeroed.to_string(), zeros);
    });
    into.to_path_buf()
}

/// The embedded model and its drafter, `useless` of the two drafting the same token always.
fn engine_with_useless(useless: DraftWith, scratch: &Path) -> Engine {
    let assets = common::repo_root().join("assets/models");
    let (mut model, mut drafter) = (assets.join("ferrite-code-20m"), assets.join("ferrite-code-20m-dflash"));
    match useless {
        DraftWith::Mtp => model = copy_with_zeroed(&model, &scratch.join("model"), "mtp.norm.weight"),
        DraftWith::Block => drafter = copy_with_zeroed(&drafter, &scratch.join("drafter"), "norm.weight"),
    }
    let options = EngineOptions { drafter: Some(drafter), ..Default::default() };
    let mut e = Engine::load_with(&model, &options).unwrap();
    // Costs where both drafters pay when their drafts are accepted (a machine's measured ones
    // would make the test depend on how busy it is).
    e.set_depth_costs(Some(CostModel {
        draft: Some(0.2),
        block: vec![0.3; 7],
        verify: vec![1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7],
        plain_step_s: 0.001,
    }));
    e
}

/// A request's tokens, and how many prompt tokens came from the prompt cache.
fn tokens_of(e: &Engine, request: GenerateRequest) -> (Vec<u32>, usize) {
    let mut generation = e.generate(request, Default::default()).unwrap();
    let mut cached = None;
    for event in generation.by_ref() {
        if let engine::Event::Finished(s) = event.unwrap() {
            cached = Some(s.usage.cached_tokens);
        }
    }
    let tokens = generation.tokens().to_vec();
    drop(generation);
    (tokens, cached.unwrap())
}

fn heldout_prompt() -> Vec<u32> {
    let windows: Vec<Vec<u32>> = serde_json::from_str(
        &std::fs::read_to_string(common::repo_root().join("bench/prompts/heldout-code.json")).unwrap(),
    )
    .unwrap();
    windows[1].clone()
}

#[test]
fn a_request_leaves_a_useless_drafter_for_the_one_standing_by() {
    let scratch = tempfile::tempdir().unwrap();
    for (asked, useless, useful) in
        [(DraftWith::Mtp, DraftWith::Mtp, DraftWith::Block), (DraftWith::Block, DraftWith::Block, DraftWith::Mtp)]
    {
        let e = engine_with_useless(useless, &scratch.path().join(useless.name()));
        let plain =
            GenerateRequest { ignore_eos: true, draft_with: asked, ..GenerateRequest::greedy(heldout_prompt(), 160) };
        let (expected, _) = e.generate_text(plain.clone()).unwrap();
        let (text, s) = e.generate_text(GenerateRequest { draft_depth: 2, ..plain.clone() }).unwrap();
        assert_eq!(text, expected, "asked {asked:?}: the answer changed");
        let spec = s.speculative.unwrap();
        let control = spec.control.as_ref().unwrap();
        assert!(control.switches >= 1 && control.drafter_now == useful, "asked {asked:?}: {spec:?}");
        assert!(control.depth_now > 0, "the useful drafter drafts: {spec:?}");
        assert!(spec.tokens_per_cycle() > 1.5, "{:.2} tokens a cycle: {spec:?}", spec.tokens_per_cycle());

        // Penalties look at drafted and verified positions alike, whichever drafter drafts.
        let penalties = engine::Penalties { repetition: 1.1, presence: 0.5, frequency: 0.2 };
        let penalised =
            GenerateRequest { sampling: SamplingParams { penalties, ..Default::default() }, ..plain.clone() };
        let (expected, _) = e.generate_text(penalised.clone()).unwrap();
        let (text, s) = e.generate_text(GenerateRequest { draft_depth: 2, ..penalised }).unwrap();
        assert_eq!(text, expected, "asked {asked:?}, penalised: the answer changed");
        let control = s.speculative.unwrap().control.unwrap();
        assert!(control.switches >= 1, "penalised, asked {asked:?}: {control:?}");

        // The next turn (the answer and more) restores the state the switching request kept:
        // its first drafter's, caught up to the answer's end, and stays exact.
        let (answer, _) = tokens_of(&e, GenerateRequest { draft_depth: 2, ..plain.clone() });
        let next: Vec<u32> = [plain.prompt.clone(), answer, vec![11, 12, 13]].concat();
        let next_plain = GenerateRequest { prompt: next.clone(), max_tokens: 40, ..plain.clone() };
        let (expected_next, _) = tokens_of(&e, next_plain.clone());
        e.clear_prompt_cache();
        let _ = tokens_of(&e, GenerateRequest { draft_depth: 2, ..plain.clone() });
        let (tokens, cached) = tokens_of(&e, GenerateRequest { draft_depth: 2, ..next_plain });
        assert_eq!(tokens, expected_next, "asked {asked:?}: the next turn changed");
        assert!(cached > plain.prompt.len(), "asked {asked:?}: {cached} cached");

        // Sampled, the switch happens too, and the answer is one plain sampling could give
        // (each cycle is exact whichever drafter wrote its drafts: the distribution tests of
        // both drafters hold it).
        let sampled = GenerateRequest {
            sampling: SamplingParams { temperature: 0.7, seed: Some(3), ..Default::default() },
            draft_depth: 2,
            ..plain.clone()
        };
        let (_, s) = e.generate_text(sampled).unwrap();
        let control = s.speculative.unwrap().control.unwrap();
        assert!(control.switches >= 1, "sampled, asked {asked:?}: {control:?}");
    }
}

/// With the drafter it asked for drafting well, a request stays with it: tries of the other
/// grow rarer while they do not promise more.
#[test]
fn a_request_keeps_a_drafter_that_pays() {
    let scratch = tempfile::tempdir().unwrap();
    let e = engine_with_useless(DraftWith::Block, scratch.path());
    let plain = GenerateRequest {
        ignore_eos: true,
        draft_with: DraftWith::Mtp,
        ..GenerateRequest::greedy(heldout_prompt(), 160)
    };
    let (expected, _) = e.generate_text(plain.clone()).unwrap();
    let (text, s) = e.generate_text(GenerateRequest { draft_depth: 2, ..plain }).unwrap();
    assert_eq!(text, expected);
    let spec = s.speculative.unwrap();
    let control = spec.control.as_ref().unwrap();
    assert_eq!((control.switches, control.drafter_now), (0, DraftWith::Mtp), "{spec:?}");
}
