//! Block drafting (DFlash) is exact: a drafter in z-lab's format, loaded beside a target of
//! each architecture, gives token for token the plain greedy output at every depth — with its
//! drafts accepted, partly accepted or rejected, across prefill chunks, from the prompt cache,
//! with penalties and a bias — and sampled output keeps the plain distribution. A drafter that
//! does not fit its target is refused by name.

mod common;

use engine::checkpoint::drafter::{make_drafter, DrafterOptions};
use engine::checkpoint::{Architecture, Dtype, MakeOptions};
use engine::{DraftWith, Engine, EngineOptions, Event, GenerateRequest, ModelConfig, SamplingParams};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, Array};
use serde_json::json;

/// A target of `arch` (no MTP head) and a drafter for it made by `edit`ed options.
fn target_and_drafter(
    arch: Architecture,
    dtype: Dtype,
    edit: impl FnOnce(&mut DrafterOptions),
) -> (tempfile::TempDir, tempfile::TempDir, Engine) {
    let target = common::make(&common::options(arch, "tiny", None, 32, dtype));
    let config = ModelConfig::load(target.path()).unwrap();
    let mut o = DrafterOptions::new(&config, MakeOptions { seed: 7, ..common::options(arch, "tiny", None, 32, dtype) });
    edit(&mut o);
    let drafter = tempfile::tempdir().unwrap();
    make_drafter(&config, &o, drafter.path()).unwrap();
    let options = EngineOptions { drafter: Some(drafter.path().to_path_buf()), ..Default::default() };
    let e = Engine::load_with(target.path(), &options).unwrap();
    assert!(e.drafter().is_some() && e.can_draft());
    (target, drafter, e)
}

/// The Turbo profile's warm-up drafts with a block drafter too, here beside a target with no
/// MTP head: the load succeeds, leaves no figures behind, and block drafting still answers as
/// plain decoding does.
#[test]
fn a_turbo_warm_up_drafts_with_the_block_drafter() {
    let (target, drafter, sustained) = target_and_drafter(Architecture::Qwen35, Dtype::Float32, |_| {});
    let turbo = EngineOptions {
        drafter: Some(drafter.path().to_path_buf()),
        profile: engine::Profile::named(engine::ProfileName::Turbo),
        ..Default::default()
    };
    let turbo = Engine::load_with(target.path(), &turbo).unwrap();
    assert_eq!(turbo.spec_totals().cycles, 0, "the warm-up leaves no figures behind");
    let drafting = GenerateRequest {
        ignore_eos: true,
        draft_depth: 3,
        draft_with: DraftWith::Block,
        ..GenerateRequest::greedy(vec![7, 300, 41], 12)
    };
    let plain = GenerateRequest { draft_depth: 0, ..drafting.clone() };
    assert_eq!(turbo.generate_text(drafting).unwrap().0, sustained.generate_text(plain).unwrap().0);
}

fn prompts() -> Vec<Vec<u32>> {
    vec![vec![7, 300, 41], (0..40u32).map(|i| (i * 37 + 11) % 490).collect()]
}

#[test]
fn greedy_block_drafting_equals_plain_decoding() {
    for (arch, dtype) in [
        (Architecture::Qwen3, Dtype::Float32),
        (Architecture::Qwen3Moe, Dtype::Float32),
        (Architecture::Qwen3Next, Dtype::Float32),
        (Architecture::Qwen35, Dtype::Bfloat16),
    ] {
        let (_t, _d, mut e) = target_and_drafter(arch, dtype, |_| {});
        e.set_prefill_chunk(16); // the longer prompt spans several chunks
        for prompt in prompts() {
            let plain = GenerateRequest {
                ignore_eos: true,
                draft_with: DraftWith::Block,
                ..GenerateRequest::greedy(prompt.clone(), 30)
            };
            let (expected, s0) = e.generate_text(plain.clone()).unwrap();
            assert!(s0.speculative.is_none());
            // Past the answer's end: the last cycles draft whole blocks too.
            let truth = common::greedy_tokens(&e, &prompt, 40);
            // The true continuation with every third token wrong: cycles accept all, some or
            // none of their drafts and roll back different amounts.
            let wrong: Vec<u32> =
                truth.iter().enumerate().map(|(i, &t)| if i % 3 == 2 { (t + 1) % 490 } else { t }).collect();
            for depth in [1, 3, 7] {
                let (text, s) = e.generate_text(GenerateRequest { draft_depth: depth, ..plain.clone() }).unwrap();
                assert_eq!(text, expected, "{arch:?} depth {depth}, the drafter's own drafts");
                let spec = s.speculative.unwrap();
                assert_eq!((spec.depth, s.usage.completion_tokens), (depth, 30));
                let req = GenerateRequest { draft_depth: depth, draft_script: Some(wrong.clone()), ..plain.clone() };
                let (text, s) = e.generate_text(req).unwrap();
                assert_eq!(text, expected, "{arch:?} depth {depth}, partly wrong drafts");
                let spec = s.speculative.unwrap();
                let (accepted, drafted): (usize, usize) = (spec.accepted.iter().sum(), spec.drafted.iter().sum());
                assert!(
                    accepted > 0 && (depth == 1 || accepted < drafted),
                    "{arch:?} depth {depth}: {accepted} of {drafted}"
                );
            }
            // Perfect drafts: whole blocks accepted.
            let req = GenerateRequest { draft_depth: 7, draft_script: Some(truth.clone()), ..plain.clone() };
            let (text, s) = e.generate_text(req).unwrap();
            assert_eq!(text, expected, "{arch:?}: perfect drafts");
            let spec = s.speculative.unwrap();
            assert!(spec.acceptance().iter().all(|&a| a > 0.99), "{arch:?}: {:?}", spec.acceptance());
            assert!(spec.tokens_per_cycle() > 5.0, "{arch:?}: {:.2} tokens/cycle", spec.tokens_per_cycle());
        }
        // The same prompt again starts from the prompt cache (the drafter's context with it).
        let prompt = prompts()[1].clone();
        let plain =
            GenerateRequest { ignore_eos: true, draft_with: DraftWith::Block, ..GenerateRequest::greedy(prompt, 30) };
        let (expected, _) = e.generate_text(plain.clone()).unwrap();
        let (text, s) = e.generate_text(GenerateRequest { draft_depth: 3, ..plain }).unwrap();
        assert_eq!(text, expected, "{arch:?}: after a prompt-cache hit");
        assert!(s.usage.cached_tokens > 0, "{arch:?}: the prompt cache was not used");
    }
}

#[test]
fn block_drafting_with_penalties_a_bias_and_a_windowed_causal_drafter_stays_exact() {
    // Sliding-window layers narrower than the prompt (the window mask is used) and causal
    // blocks: another drafter, the same exactness.
    let (_t, _d, e) = target_and_drafter(Architecture::Qwen3Next, Dtype::Float32, |o| {
        o.sliding_window = Some(8);
        o.causal = true;
        o.layers = 2;
        o.block_size = 5;
        o.tensors.bits = Some(4); // quantized, as a target may be
    });
    let prompt = prompts()[1].clone();
    let sampling = SamplingParams {
        penalties: engine::Penalties { repetition: 1.3, presence: 0.5, frequency: 0.2 },
        logit_bias: vec![(17, 8.0), (300, -100.0)],
        ..SamplingParams::greedy()
    };
    let plain = GenerateRequest {
        sampling,
        ignore_eos: true,
        draft_with: DraftWith::Block,
        ..GenerateRequest::greedy(prompt.clone(), 30)
    };
    let (expected, _) = e.generate_text(plain.clone()).unwrap();
    let ids = e.generate(plain.clone(), Default::default()).unwrap().token_ids().unwrap();
    for depth in 1..=4 {
        let script = Some(ids.iter().enumerate().map(|(i, &t)| if i % 4 == 3 { (t + 2) % 490 } else { t }).collect());
        let req = GenerateRequest { draft_depth: depth, draft_script: script, ..plain.clone() };
        let (text, s) = e.generate_text(req).unwrap();
        assert_eq!(text, expected, "depth {depth}");
        assert!(s.speculative.unwrap().accepted.iter().sum::<usize>() > 0, "depth {depth}");
    }
    // Under a grammar each draft row is masked with the grammar's state after the drafts
    // before it; a draft after which nothing may follow ends the block there.
    let grammar = engine::Grammar::Regex("[a-z ]{0,2000}".into());
    let constrained = GenerateRequest { grammar: Some(grammar), ..plain.clone() };
    let (expected, _) = e.generate_text(constrained.clone()).unwrap();
    let (text, s) = e.generate_text(GenerateRequest { draft_depth: 4, ..constrained }).unwrap();
    assert_eq!(text, expected, "under a grammar");
    assert!(s.speculative.unwrap().cycles > 0);
    let err = e.generate_text(GenerateRequest { draft_depth: 5, ..plain }).unwrap_err().to_string();
    assert!(err.contains("0..=4"), "a block of 5 drafts 4 at most: {err}");
}

#[test]
fn sampled_block_drafting_has_the_plain_distribution() {
    // A block's drafts are point masses, accepted with the target's probability of them: drafts
    // scripted as the greedy continuation are often likely, so cycles accept and reject.
    let (_t, _d, e) = target_and_drafter(Architecture::Qwen3, Dtype::Float32, |_| {});
    let prompt = prompts()[0].clone();
    let vocab = e.model().config().vocab_size as usize;
    let script = common::greedy_tokens(&e, &prompt, 4);
    let mut accepted = 0;
    let mut histogram = |depth: usize| {
        let mut h = vec![vec![0usize; vocab]; 2];
        for seed in 0..400u64 {
            let sampling = SamplingParams { temperature: 1.0, top_k: 6, seed: Some(seed), ..Default::default() };
            let req = GenerateRequest {
                sampling,
                ignore_eos: true,
                draft_depth: depth,
                draft_with: DraftWith::Block,
                draft_script: (depth > 0).then(|| script.clone()),
                ..GenerateRequest::greedy(prompt.clone(), 3)
            };
            let mut generation = e.generate(req, Default::default()).unwrap();
            for event in generation.by_ref() {
                if let Event::Finished(summary) = event.unwrap() {
                    accepted += summary.speculative.map_or(0, |s| s.accepted.iter().sum::<usize>());
                }
            }
            let ids = generation.tokens().to_vec();
            for (pos, &t) in ids[1..3].iter().enumerate() {
                h[pos][t as usize] += 1;
            }
        }
        h
    };
    let (plain, spec) = (histogram(0), histogram(2));
    assert!(accepted > 40, "too few drafts accepted to test acceptance: {accepted}");
    for pos in 0..2 {
        let (stat, dof) = common::chi_square(&plain[pos], &spec[pos]);
        // 99.9% quantile of chi-square: below ~ dof + 3.1 * sqrt(2 dof) + 10 for these sizes.
        let limit = dof as f64 + 3.1 * (2.0 * dof as f64).sqrt() + 10.0;
        assert!(dof > 3, "too few categories to test");
        assert!(stat < limit, "token {}: chi2 {stat:.1} >= {limit:.1}", pos + 2);
    }
}

#[test]
fn a_drafter_that_does_not_fit_is_refused_by_name() {
    let target = common::make(&common::options(Architecture::Qwen3, "tiny", None, 32, Dtype::Float32));
    let config = ModelConfig::load(target.path()).unwrap();
    // Each case sets one field (a JSON pointer into config.json) and names what the error names.
    let load = |pointer: &str, new: serde_json::Value| {
        let drafter = tempfile::tempdir().unwrap();
        let o = DrafterOptions::new(&config, common::options(Architecture::Qwen3, "tiny", None, 32, Dtype::Float32));
        make_drafter(&config, &o, drafter.path()).unwrap();
        let path = drafter.path().join("config.json");
        let mut value: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        *value.pointer_mut(pointer).unwrap() = new;
        std::fs::write(&path, value.to_string()).unwrap();
        let options = EngineOptions { drafter: Some(drafter.path().to_path_buf()), ..Default::default() };
        Engine::load_with(target.path(), &options).err().map(|e| e.to_string()).unwrap_or_default()
    };
    let layers = config.num_hidden_layers;
    let cases = [
        ("/dflash_config/target_layer_ids", json!([0, 99]), "target_layer_ids"),
        ("/dflash_config/mask_token_id", json!(1 << 30), "mask_token_id"),
        ("/block_size", json!(1), "block_size"),
        ("/architectures", json!(["DFlash2DraftModel"]), "DFlash2"),
        ("/architectures", json!(["Qwen3ForCausalLM"]), "DFlashDraftModel"),
        ("/hidden_size", json!(96), "hidden_size"),
        ("/layer_types", json!(["chunked_attention"]), "layer_types"),
    ];
    for (pointer, new, named) in cases {
        let err = load(pointer, new);
        assert!(err.contains(named), "expected an error naming {named}, got: {err:?} ({layers} layers)");
    }
}

/// The training code (train/drafter.py) drafts what the engine drafts: a drafter for the
/// embedded model, its block logits from Ferrite's trunk taps and `BlockDrafter::draft` against
/// the training code's forward over mlx-lm's taps, on the same weights.
#[test]
fn the_training_code_drafts_what_the_engine_drafts() {
    let target = common::repo_root().join("assets/models/ferrite-code-20m");
    let config = ModelConfig::load(&target).unwrap();
    let drafter = tempfile::tempdir().unwrap();
    let tensors = MakeOptions { seed: 3, ..common::options(Architecture::Qwen35, "tiny", None, 64, Dtype::Float32) };
    let mut o = DrafterOptions::new(&config, tensors);
    o.target_layers = vec![1, 3, 5, 7];
    o.layers = 2;
    make_drafter(&config, &o, drafter.path()).unwrap();
    let options = EngineOptions { drafter: Some(drafter.path().to_path_buf()), ..Default::default() };
    let e = Engine::load_with(&target, &options).unwrap();
    let ids: Vec<u32> = (0..24u32).map(|i| (i * 101 + 7) % 8000).collect();
    let anchor = 17;

    let block = e.drafter().unwrap();
    let mut cache = e.model().new_cache();
    let context = Array::from_slice(&ids[..anchor], &[1, anchor as i32]);
    let (_, taps) = e.model().hidden_tapped(&context, &mut cache, &block.spec.target_layers).unwrap();
    let mut draft_cache = block.new_cache();
    let logits =
        block.draft(e.model(), Some(&taps), ids[anchor], block.max_drafts(), &mut draft_cache).unwrap().index(0);

    let out = tempfile::tempdir().unwrap();
    let file = out.path().join("logits.safetensors");
    let ids_arg = ids.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(",");
    let status = common::reference_command("dflash_drafter.py")
        .args(["--target", target.to_str().unwrap(), "--drafter", drafter.path().to_str().unwrap()])
        .args(["--prompt-ids", &ids_arg, "--anchor", &anchor.to_string(), "--out", file.to_str().unwrap()])
        .status()
        .unwrap();
    assert!(status.success(), "the training code's drafter did not run");
    let reference = &Array::load_safetensors(&file).unwrap()["logits"];
    assert_eq!(reference.shape(), logits.shape());
    let diff = ops::abs(ops::subtract(logits.as_dtype(mlx_rs::Dtype::Float32).unwrap(), reference).unwrap())
        .unwrap()
        .max(None)
        .unwrap()
        .item_cast::<f32>();
    let argmax = |a: &Array| ops::indexing::argmax_axis(a, -1, None).unwrap().as_slice::<u32>().to_vec();
    println!("block logits: max |Δ| {diff:.2e}");
    // Ferrite's trunk and mlx-lm's on the same 8-bit weights (dequantized here on the CPU).
    assert!(diff < 2e-2, "the engine's block logits differ from the training code's by {diff}");
    assert_eq!(argmax(&logits), argmax(reference), "drafts differ");
}

/// The tuner measures a loaded block drafter's depths beside the MTP head's in the same rounds,
/// and a request asking for block drafts where no drafter is loaded is refused by name.
#[test]
fn the_tuner_measures_block_depths_beside_mtp_depths() {
    use engine::tune::{candidates, measure, TuneOptions};
    use engine::Speculation;
    let assets = common::repo_root().join("assets/models");
    let options = EngineOptions { drafter: Some(assets.join("ferrite-code-20m-dflash")), ..Default::default() };
    let e = Engine::load_with(&assets.join("ferrite-code-20m"), &options).unwrap();
    let expected: Vec<Speculation> = (1..=4).map(Speculation::mtp).chain([2, 4, 7].map(Speculation::block)).collect();
    assert_eq!(candidates(&e), expected);
    let tune = TuneOptions {
        gen_tokens: 6,
        min_rounds: 2,
        budget: std::time::Duration::from_secs(1),
        prompts: 1,
        temperatures: vec![0.0],
        ..Default::default()
    };
    let m = measure(&e, &tune, || None, |_| true).unwrap();
    assert_eq!(m.speedups.iter().map(|s| s.choice).collect::<Vec<_>>(), expected);
    let block = m.get(Speculation::block(7), 0.0).unwrap();
    assert_eq!(block.acceptance.len(), 7, "{block:?}");
    assert!(block.runs.len() >= 2 && block.tokens_per_cycle >= 1.0, "{block:?}");
    // The same model without its drafter: block drafts are refused, the MTP head still drafts.
    let alone = Engine::load(&assets.join("ferrite-code-20m")).unwrap();
    let mut req = GenerateRequest::greedy(vec![1, 2, 3], 4);
    req.speculate(Speculation::block(2));
    let err = alone.generate_text(req.clone()).unwrap_err().to_string();
    assert!(err.contains("no block drafter is loaded"), "{err}");
    req.speculate(Speculation::mtp(2));
    assert!(alone.generate_text(req).unwrap().1.speculative.is_some());
}

/// The depth controller runs block drafting too: with the block pass and the verify passes
/// measured on this machine it follows the request's acceptance; with costs the request's
/// acceptance does not pay for it sends the request to plain decoding, probes now and then, and
/// the answer stays plain decoding's token for token (penalties included); with costs no
/// acceptance could pay for it does not probe once plain.
#[test]
fn the_depth_controller_runs_block_drafting_and_sends_it_plain_when_it_does_not_pay() {
    let (_t, _d, mut e) = target_and_drafter(Architecture::Qwen3Next, Dtype::Float32, |_| {});
    e.set_depth_control(true).unwrap();
    let costs = e.depth_costs().unwrap().clone();
    assert!(costs.draft.is_none(), "the target has no MTP head: {costs:?}");
    assert_eq!((costs.block.len(), costs.verify.len()), (7, 7), "{costs:?}");
    let req =
        GenerateRequest { draft_depth: 3, draft_with: DraftWith::Block, ..GenerateRequest::greedy(vec![5, 6], 12) };
    let (_, s) = e.generate_text(req).unwrap();
    let spec = s.speculative.unwrap();
    assert!(spec.control.is_some(), "measured costs: the controller runs: {spec:?}");
    assert!(spec.drafted.len() <= 7, "never past the block's drafts: {spec:?}");

    // Costs a drafter accepted every time would pay for (8 tokens for 4 steps), but random
    // weights' drafts are not.
    let paying_if_accepted = engine::depth_control::CostModel {
        draft: None,
        block: vec![1.0; 7],
        verify: vec![3.0; 7],
        plain_step_s: 0.001,
    };
    let penalties = engine::Penalties { repetition: 1.0, presence: -2.0, frequency: -1.0 };
    for (prompt, penalised) in prompts().into_iter().zip([false, true]) {
        // Each request from the tuned depth, not where the last one ended.
        e.set_depth_costs(Some(paying_if_accepted.clone()));
        let sampling =
            SamplingParams { penalties: if penalised { penalties } else { Default::default() }, ..Default::default() };
        let plain = GenerateRequest {
            sampling,
            ignore_eos: true,
            draft_with: DraftWith::Block,
            ..GenerateRequest::greedy(prompt.clone(), 70)
        };
        let (expected, _) = e.generate_text(plain.clone()).unwrap();
        let (text, s) = e.generate_text(GenerateRequest { draft_depth: 4, ..plain }).unwrap();
        assert_eq!(text, expected, "penalties {penalised}");
        let spec = s.speculative.unwrap();
        let control = spec.control.as_ref().unwrap();
        assert!(control.changes.to_plain >= 1 && control.depth_now == 0, "{spec:?}");
        // Drafting resumed at the probes after the switch (one in 16 plain steps at first).
        assert!(spec.drafted[0] >= 4 && spec.drafted[3] <= 4, "{spec:?}");
    }

    // Costs no drafter could pay for (every draft accepted, 8 tokens for 9 steps): plain after
    // the first decision, and not a probe after it; the answer plain decoding's.
    e.set_depth_costs(Some(engine::depth_control::CostModel { verify: vec![8.0; 7], ..paying_if_accepted }));
    let plain =
        GenerateRequest { ignore_eos: true, draft_with: DraftWith::Block, ..GenerateRequest::greedy(vec![5, 6], 80) };
    let (expected, _) = e.generate_text(plain.clone()).unwrap();
    let (text, s) = e.generate_text(GenerateRequest { draft_depth: 4, ..plain }).unwrap();
    assert_eq!(text, expected);
    let spec = s.speculative.unwrap();
    assert_eq!(spec.control.as_ref().unwrap().changes.to_plain, 1, "{spec:?}");
    assert!(spec.drafted[0] <= 4, "the cycles before the first decision only, no probe: {spec:?}");
}

/// The drafter trained for the embedded model (assets/models/ferrite-code-20m-dflash, by
/// train/drafter.py) drafts it exactly and well: on held-out code its greedy output equals
/// plain decoding token for token, and its blocks are mostly accepted.
#[test]
fn the_shipped_drafter_drafts_the_embedded_model_exactly() {
    let assets = common::repo_root().join("assets/models");
    let options = EngineOptions { drafter: Some(assets.join("ferrite-code-20m-dflash")), ..Default::default() };
    let e = Engine::load_with(&assets.join("ferrite-code-20m"), &options).unwrap();
    assert_eq!(e.drafter().unwrap().spec.block_size, 8);
    let windows: Vec<Vec<u32>> = serde_json::from_str(
        &std::fs::read_to_string(common::repo_root().join("bench/prompts/heldout-code.json")).unwrap(),
    )
    .unwrap();
    let (mut accepted, mut cycles) = (0usize, 0usize);
    for prompt in windows.into_iter().take(2) {
        let plain =
            GenerateRequest { ignore_eos: true, draft_with: DraftWith::Block, ..GenerateRequest::greedy(prompt, 48) };
        let (expected, _) = e.generate_text(plain.clone()).unwrap();
        let (text, s) = e.generate_text(GenerateRequest { draft_depth: 7, ..plain }).unwrap();
        assert_eq!(text, expected, "block drafting changed the greedy answer");
        let spec = s.speculative.unwrap();
        accepted += spec.accepted.iter().sum::<usize>();
        cycles += spec.cycles;
    }
    // Random weights accept next to nothing; the trained drafter's first positions mostly hit.
    let per_cycle = 1.0 + accepted as f64 / cycles.max(1) as f64;
    assert!(per_cycle > 1.8, "{per_cycle:.2} tokens a cycle");
}

/// The prompt cache keeps the drafter's state of the request that stored it: a request that
/// drafts with the other drafter (the MTP head after a block drafter, and back) still finds
/// the trunk's state there and drafts from its own.
#[test]
fn a_prompt_cached_by_one_drafter_serves_the_other() {
    let assets = common::repo_root().join("assets/models");
    let options = EngineOptions { drafter: Some(assets.join("ferrite-code-20m-dflash")), ..Default::default() };
    let e = Engine::load_with(&assets.join("ferrite-code-20m"), &options).unwrap();
    let windows: Vec<Vec<u32>> = serde_json::from_str(
        &std::fs::read_to_string(common::repo_root().join("bench/prompts/heldout-code.json")).unwrap(),
    )
    .unwrap();
    let prompt = windows[0].clone();
    let plain = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompt.clone(), 24) };
    let (expected, _) = e.generate_text(plain.clone()).unwrap();
    e.clear_prompt_cache();
    for (i, (with, depth)) in
        [(DraftWith::Mtp, 2), (DraftWith::Block, 3), (DraftWith::Mtp, 2), (DraftWith::Block, 5)].into_iter().enumerate()
    {
        let (text, s) =
            e.generate_text(GenerateRequest { draft_depth: depth, draft_with: with, ..plain.clone() }).unwrap();
        assert_eq!(text, expected, "{with:?} after the other drafter cached the prompt");
        assert_eq!(s.usage.cached_tokens > 0, i > 0, "{with:?}: the trunk's state is shared");
        let spec = s.speculative.unwrap();
        assert!(spec.accepted.iter().sum::<usize>() > 0, "{with:?}: nothing accepted");
    }
}
