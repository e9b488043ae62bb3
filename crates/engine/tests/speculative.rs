//! Speculative decoding with the MTP head is exact: greedy output is token for token the
//! plain output at every depth, rollback restores every kind of state, and sampled output
//! has the plain output's distribution.

mod common;

use engine::cache::Cache;
use engine::checkpoint::{Architecture, Dtype, MakeOptions};
use engine::{Engine, GenerateRequest, SamplingParams};
use mlx_rs::{ops, Array};

fn with_mtp(arch: Architecture, dtype: Dtype) -> (tempfile::TempDir, Engine) {
    let mut o: MakeOptions = common::options(arch, "tiny", None, 32, dtype);
    o.mtp = true;
    let d = common::make(&o);
    let e = Engine::load(d.path()).unwrap();
    assert!(e.model().mtp().is_some());
    (d, e)
}

/// `ids` through the model into `cache`: their logits.
fn forward(e: &Engine, cache: &mut Cache, ids: &[u32]) -> Array {
    e.model().forward(&Array::from_slice(ids, &[1, ids.len() as i32]), cache).unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![7, 300, 41],
        (0..40u32).map(|i| (i * 37 + 11) % 490).collect(),
        (0..75u32).map(|i| (i * 13 + 5) % 490).collect(),
    ]
}

#[test]
fn greedy_speculation_equals_plain_decoding_at_every_depth() {
    for (arch, dtype) in [
        (Architecture::Qwen3Next, Dtype::Float32),
        (Architecture::Qwen35, Dtype::Bfloat16),
        (Architecture::Qwen35Moe, Dtype::Float32),
    ] {
        let (_d, mut e) = with_mtp(arch, dtype);
        e.set_prefill_chunk(16); // the longer prompts span several chunks
        for prompt in prompts() {
            let plain = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompt.clone(), 33) };
            let (expected, s0) = e.generate_text(plain.clone()).unwrap();
            assert!(s0.speculative.is_none());
            for depth in 1..=4 {
                let (text, s) = e.generate_text(GenerateRequest { draft_depth: depth, ..plain.clone() }).unwrap();
                assert_eq!(text, expected, "{arch:?} depth {depth} prompt of {}", prompt.len());
                assert_eq!(s.usage.completion_tokens, 33);
                let spec = s.speculative.unwrap();
                assert_eq!(spec.depth, depth);
                assert!(spec.cycles > 0 && spec.drafted.iter().all(|&n| n == spec.cycles));
            }
        }
        // The engine keeps totals across requests: 3 prompts x depths 1..4 here.
        let totals = e.spec_totals().clone();
        assert_eq!(totals.committed, 3 * 4 * 32, "{arch:?}: every token after the first comes from a cycle");
        assert_eq!(totals.depth, 4);
    }
}

#[test]
fn penalised_speculation_equals_penalised_plain_decoding() {
    // Each position's penalties look at the tokens before it, drafted ones included: greedy
    // output stays token for token the plain output, with the head's drafts or scripted ones.
    // These random models seldom repeat a token, so the penalties here are negative (they
    // favour recent tokens): then a draft's own tokens decide the next position's winner,
    // and a window that missed them would show.
    let penalties = engine::Penalties { repetition: 1.0, presence: -2.0, frequency: -1.0 };
    for (arch, dtype) in [(Architecture::Qwen3Next, Dtype::Float32), (Architecture::Qwen35, Dtype::Bfloat16)] {
        let (_d, e) = with_mtp(arch, dtype);
        let mut changed = 0;
        for prompt in prompts() {
            let sampling = SamplingParams { penalties, ..Default::default() };
            let plain = GenerateRequest { sampling, ignore_eos: true, ..GenerateRequest::greedy(prompt.clone(), 33) };
            let expected = e.generate(plain.clone(), Default::default()).unwrap().token_ids().unwrap();
            let unpenalised = GenerateRequest { sampling: SamplingParams::greedy(), ..plain.clone() };
            changed +=
                usize::from(expected != e.generate(unpenalised, Default::default()).unwrap().token_ids().unwrap());
            // Scripted drafts: the true continuation with every third token wrong.
            let script: Vec<u32> =
                expected.iter().enumerate().map(|(i, &t)| if i % 3 == 2 { (t + 1) % 490 } else { t }).collect();
            for depth in 1..=4 {
                for draft_script in [None, Some(script.clone())] {
                    let scripted = draft_script.is_some();
                    let req = GenerateRequest { draft_depth: depth, draft_script, ..plain.clone() };
                    let before = e.spec_totals().committed;
                    let ids = e.generate(req, Default::default()).unwrap().token_ids().unwrap();
                    assert_eq!(ids, expected, "{arch:?} depth {depth} scripted {scripted} prompt of {}", prompt.len());
                    assert!(e.spec_totals().committed - before >= 32, "speculation ran");
                }
            }
        }
        assert!(changed > 0, "{arch:?}: the penalties changed no output, so this checks nothing");
    }
}

#[test]
fn biased_speculation_equals_biased_plain_decoding() {
    // A request's `logit_bias` heads every position's logits chain, the drafts' and the
    // verify pass's too: greedy output stays token for token the plain biased output. The
    // bias bans the plain answer's second token and favours two others a little, so it
    // changes the answer without deciding every token.
    for (arch, dtype) in [(Architecture::Qwen3Next, Dtype::Float32), (Architecture::Qwen35, Dtype::Bfloat16)] {
        let (_d, e) = with_mtp(arch, dtype);
        let mut changed = 0;
        for prompt in prompts() {
            let unbiased = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompt.clone(), 33) };
            let before = e.generate(unbiased.clone(), Default::default()).unwrap().token_ids().unwrap();
            let banned = before[1];
            let logit_bias = vec![(banned, -100.0), ((banned + 7) % 490, 0.5), ((banned + 101) % 490, 1.0)];
            let sampling = SamplingParams { logit_bias, ..Default::default() };
            let plain = GenerateRequest { sampling, ..unbiased };
            let expected = e.generate(plain.clone(), Default::default()).unwrap().token_ids().unwrap();
            assert!(!expected.contains(&banned), "{arch:?}: a token biased by -100 was chosen");
            changed += usize::from(expected != before);
            let script: Vec<u32> =
                expected.iter().enumerate().map(|(i, &t)| if i % 3 == 2 { (t + 1) % 490 } else { t }).collect();
            for depth in 1..=3 {
                for draft_script in [None, Some(script.clone())] {
                    let scripted = draft_script.is_some();
                    let req = GenerateRequest { draft_depth: depth, draft_script, ..plain.clone() };
                    let ids = e.generate(req, Default::default()).unwrap().token_ids().unwrap();
                    assert_eq!(ids, expected, "{arch:?} depth {depth} scripted {scripted} prompt of {}", prompt.len());
                }
            }
        }
        assert!(changed > 0, "{arch:?}: the bias changed no output, so this checks nothing");
    }
}

#[test]
fn a_bias_outside_the_vocabulary_or_its_range_is_refused_by_name() {
    let (_d, e) = with_mtp(Architecture::Qwen3Next, Dtype::Float32);
    let vocab = e.model().config().vocab_size as u32;
    for (bias, word) in [((vocab, 1.0), "outside the vocabulary"), ((3, 100.5), "[-100, 100]"), ((3, f32::NAN), "NaN")]
    {
        let sampling = SamplingParams { logit_bias: vec![bias], ..Default::default() };
        let req = GenerateRequest { sampling, ..GenerateRequest::greedy(prompts()[0].clone(), 4) };
        let err = e.generate(req, Default::default()).err().expect("refused");
        assert!(matches!(err, engine::Error::Field { field: "logit_bias", .. }), "{err}");
        assert!(err.to_string().contains(word), "{err}");
    }
}

#[test]
fn accepted_and_rejected_drafts_keep_the_output_exact() {
    // Drafts from a script: the true continuation with every third token wrong, so cycles
    // accept all, some or none of their drafts, and each rolls back a different amount.
    for arch in [Architecture::Qwen3Next, Architecture::Qwen35] {
        let (_d, e) = with_mtp(arch, Dtype::Float32);
        let prompt = prompts()[1].clone();
        let truth = common::greedy_tokens(&e, &prompt, 40);
        let script: Vec<u32> =
            truth.iter().enumerate().map(|(i, &t)| if i % 3 == 2 { (t + 1) % 490 } else { t }).collect();
        let plain = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompt, 40) };
        let (expected, _) = e.generate_text(plain.clone()).unwrap();
        for depth in 1..=4 {
            let req = GenerateRequest { draft_depth: depth, draft_script: Some(script.clone()), ..plain.clone() };
            let (text, s) = e.generate_text(req).unwrap();
            assert_eq!(text, expected, "{arch:?} depth {depth}");
            let spec = s.speculative.unwrap();
            assert!(
                spec.tokens_per_cycle() > 1.3,
                "{arch:?} depth {depth}: {:.2} tokens/cycle",
                spec.tokens_per_cycle()
            );
            let (accepted, drafted): (usize, usize) = (spec.accepted.iter().sum(), spec.drafted.iter().sum());
            assert!(accepted > 0 && accepted < drafted, "{arch:?} depth {depth}: {accepted} of {drafted}");
            // Every third scripted token is wrong, so no cycle accepts three in a row.
            if depth >= 3 {
                assert_eq!(spec.accepted[2], 0, "{arch:?} depth {depth}: {:?}", spec.accepted);
            }
        }
        // Perfect drafts: every draft is accepted.
        let req = GenerateRequest { draft_depth: 4, draft_script: Some(truth.clone()), ..plain.clone() };
        let (text, s) = e.generate_text(req).unwrap();
        assert_eq!(text, expected);
        let spec = s.speculative.unwrap();
        assert!(spec.acceptance().iter().all(|&a| a > 0.99), "{:?}", spec.acceptance());
        assert!(spec.tokens_per_cycle() > 4.0);
    }
}

#[test]
fn rollback_restores_linear_attention_and_kv_state_exactly() {
    let (_d, e) = with_mtp(Architecture::Qwen3Next, Dtype::Float32);
    let m = e.model();
    let run = |cache: &mut Cache, ids: &[u32]| forward(&e, cache, ids);
    let prefix = [5u32, 17, 230, 99, 4, 61];
    // Verify-style: 5 more positions recorded, then all but 2 rolled back.
    let mut a = m.new_cache();
    run(&mut a, &prefix);
    a.set_record(true);
    run(&mut a, &[8, 9, 10, 11, 12]);
    a.rollback(3).unwrap();
    let la = run(&mut a, &[300, 301]);
    // Reference: only the 2 kept positions were ever seen.
    let mut b = m.new_cache();
    run(&mut b, &prefix);
    run(&mut b, &[8, 9]);
    let lb = run(&mut b, &[300, 301]);
    assert_eq!(a.offset(), b.offset());
    let diff = la.subtract(&lb).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>();
    // Equal to f32 rounding: an optimised BLAS may tile the 5-position pass's products
    // differently from the 2-position one, so their last bits can differ (a rollback that kept
    // or lost a position would move the logits by tenths).
    assert!(diff <= 1e-5, "logits after rollback differ by {diff}");
}

/// The state before a recorded pass's first position is not kept: rolling all of them back
/// is refused by name, and the refusal leaves every layer (attention too) as it was.
#[test]
fn a_rollback_past_the_recorded_positions_is_refused_and_changes_nothing() {
    let (_d, e) = with_mtp(Architecture::Qwen3Next, Dtype::Float32);
    let m = e.model();
    let run = |cache: &mut Cache, ids: &[u32]| forward(&e, cache, ids);
    let mut a = m.new_cache();
    run(&mut a, &[5, 17, 230]);
    a.set_record(true);
    run(&mut a, &[8, 9]);
    let offset = a.offset();
    for n in [2, 3] {
        let err = a.rollback(n).unwrap_err().to_string();
        assert!(err.contains(&format!("cannot roll back {n} of 2 recorded positions")), "{err}");
        assert_eq!(a.offset(), offset, "a refused rollback of {n} moved the cache");
    }
    a.rollback(1).unwrap();
    assert_eq!(a.offset(), offset - 1);
}

#[test]
fn depth_limits_and_checkpoints_without_a_head() {
    let (_d, e) = with_mtp(Architecture::Qwen3Next, Dtype::Float32);
    let req = GenerateRequest { draft_depth: 5, ..GenerateRequest::greedy(vec![1, 2], 4) };
    let err = e.generate(req, Default::default()).err().unwrap().to_string();
    assert!(err.contains("draft depth must be in 0..=4"), "{err}");
    // No mtp.* tensors: plain decoding, and the summary says so by having no MTP stats.
    let d = common::make(&common::options(Architecture::Qwen3Next, "tiny", None, 32, Dtype::Float32));
    let plain = Engine::load(d.path()).unwrap();
    assert!(plain.model().mtp().is_none());
    let (_, s) =
        plain.generate_text(GenerateRequest { draft_depth: 2, ..GenerateRequest::greedy(vec![1, 2], 4) }).unwrap();
    assert!(s.speculative.is_none());
}

#[test]
fn mtp_head_that_does_not_fit_is_refused() {
    let mut o = common::options(Architecture::Qwen3Next, "tiny", None, 32, Dtype::Float32);
    o.mtp = true;
    let d = common::make(&o);
    // Rewrite the head's fc with the wrong input width.
    common::rewrite_tensors(&d.path().join("model.safetensors"), |t| {
        t.insert("mtp.fc.weight".into(), ops::zeros::<f32>(&[64, 100]).unwrap());
    });
    let err = Engine::load(d.path()).err().unwrap().to_string();
    assert!(err.contains("MTP head does not fit") && err.contains("mtp.fc.weight"), "{err}");
}

#[test]
fn sampled_speculation_has_the_plain_distribution() {
    let (_d, e) = with_mtp(Architecture::Qwen3Next, Dtype::Float32);
    let prompt = prompts()[0].clone();
    let vocab = e.model().config().vocab_size as usize;
    // Histograms of the 2nd and 3rd generated tokens (the ones speculation produces).
    let histogram = |depth: usize, penalties: engine::Penalties| {
        let mut h = vec![vec![0usize; vocab]; 2];
        for seed in 0..400u64 {
            let sampling =
                SamplingParams { temperature: 1.0, top_k: 6, seed: Some(seed), penalties, ..Default::default() };
            let req = GenerateRequest {
                sampling,
                ignore_eos: true,
                draft_depth: depth,
                ..GenerateRequest::greedy(prompt.clone(), 3)
            };
            let ids = e.generate(req, Default::default()).unwrap().token_ids().unwrap();
            for (pos, &t) in ids[1..3].iter().enumerate() {
                h[pos][t as usize] += 1;
            }
        }
        h
    };
    let (plain, spec) = (histogram(0, Default::default()), histogram(2, Default::default()));
    check(&plain, &spec);
    // With penalties the drafts and the verification are penalised alike (the window holds
    // the drafted tokens), so the distribution is still the plain one. Negative presence and
    // frequency favour recent tokens, so the drafted token matters to the next one's odds.
    let penalties = engine::Penalties { repetition: 1.3, presence: -2.0, frequency: -1.0 };
    let (plain, spec) = (histogram(0, penalties), histogram(2, penalties));
    check(&plain, &spec);
}

fn check(plain: &[Vec<usize>], spec: &[Vec<usize>]) {
    for pos in 0..2 {
        let (stat, dof) = common::chi_square(&plain[pos], &spec[pos]);
        // 99.9% quantile of chi-square: below ~ dof + 3.1 * sqrt(2 dof) + 10 for these sizes.
        let limit = dof as f64 + 3.1 * (2.0 * dof as f64).sqrt() + 10.0;
        println!("token {}: chi2 {stat:.1} with {dof} dof (limit {limit:.1})", pos + 2);
        assert!(dof > 3, "too few categories to test");
        assert!(stat < limit, "token {}: chi2 {stat:.1} >= {limit:.1}", pos + 2);
    }
}

/// With the depth controller on, a head whose drafts are never accepted (random weights) is
/// dropped to plain decoding within a few cycles and probed now and then; greedy output stays
/// plain decoding's throughout, for a hybrid of each kind.
#[test]
fn the_depth_controller_goes_plain_when_drafts_fail_and_the_output_stays_exact() {
    for (arch, dtype) in [(Architecture::Qwen3Next, Dtype::Float32), (Architecture::Qwen35, Dtype::Bfloat16)] {
        let (_d, mut e) = with_mtp(arch, dtype);
        e.set_depth_control(true).unwrap();
        let costs = e.depth_costs().cloned();
        assert!(costs.is_some());
        let (mut went_plain, mut last_ended_at) = (0, None);
        for prompt in prompts() {
            // Each request from the tuned depth, not where the last one ended (below).
            e.set_depth_costs(costs.clone());
            let plain = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompt.clone(), 60) };
            let (expected, _) = e.generate_text(plain.clone()).unwrap();
            let (text, s) = e.generate_text(GenerateRequest { draft_depth: 2, ..plain.clone() }).unwrap();
            assert_eq!(text, expected, "{arch:?} prompt of {}", prompt.len());
            assert_eq!(s.usage.completion_tokens, 60);
            let spec = s.speculative.unwrap();
            assert_eq!(spec.drafted.len(), 3, "positions up to the requested depth + 1");
            let accepted: usize = spec.accepted.iter().sum();
            last_ended_at = spec.control.as_ref().map(|c| c.depth_now);
            if accepted * 10 < spec.drafted.iter().sum::<usize>() {
                let control = spec.control.as_ref().unwrap();
                assert_eq!(control.depth_now, 0, "{arch:?}: {spec:?}");
                assert!(control.changes.to_plain >= 1, "{arch:?}: {spec:?}");
                // Plain cycles commit one token each; probes drafted at the first position.
                assert!(spec.cycles > 40 && spec.drafted[0] >= 3, "{arch:?}: {spec:?}");
                assert!(spec.drafted[1] < 10, "{arch:?}: depth 2 only until the first decisions: {spec:?}");
                went_plain += 1;
            }
        }
        assert!(went_plain >= 2, "{arch:?}: a random head's drafts are rarely accepted");
        // The next request starts where the last one ended: plain, or drafting.
        let plain = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompts()[0].clone(), 60) };
        let (expected, _) = e.generate_text(plain.clone()).unwrap();
        let (text, s) = e.generate_text(GenerateRequest { draft_depth: 2, ..plain }).unwrap();
        assert_eq!(text, expected, "{arch:?}: after the last request");
        let spec = s.speculative.unwrap();
        let control = spec.control.as_ref().unwrap();
        match last_ended_at {
            Some(0) => {
                // No cycle at the tuned depth, no fall to plain: plain from its first token.
                assert_eq!((control.changes.to_plain, spec.drafted[1]), (0, 0), "{arch:?} started plain: {spec:?}");
            }
            depth => assert!(depth.is_some() && spec.drafted[1] > 0, "{arch:?} started drafting: {spec:?}"),
        }
        e.set_depth_control(false).unwrap();
        let (_, s) =
            e.generate_text(GenerateRequest { draft_depth: 2, ..GenerateRequest::greedy(vec![1, 2], 20) }).unwrap();
        assert!(s.speculative.unwrap().control.is_none(), "off: the requested depth throughout");
    }
}

/// A request the controller sends back to plain decoding decodes on the plain pipelined path
/// (the trunk fed a token ahead, its hidden states kept for the head, which catches up when a
/// probe drafts again): greedy output stays plain decoding's with penalties, a grammar, or
/// both.
#[test]
fn plain_stretches_keep_penalties_and_grammars_exact() {
    let (_d, mut e) = with_mtp(Architecture::Qwen3Next, Dtype::Float32);
    let costs = engine::depth_control::CostModel {
        draft: Some(0.5),
        block: Vec::new(),
        verify: vec![2.0; 4],
        plain_step_s: 0.001,
    };
    let penalties = engine::Penalties { repetition: 1.0, presence: -2.0, frequency: -1.0 };
    let grammar = engine::Grammar::Regex("[a-z ]{0,2000}".into());
    for (penalised, constrained) in [(true, false), (false, true), (true, true)] {
        for prompt in prompts() {
            let sampling = SamplingParams {
                penalties: if penalised { penalties } else { Default::default() },
                ..Default::default()
            };
            let plain = GenerateRequest {
                sampling,
                grammar: constrained.then(|| grammar.clone()),
                ignore_eos: true,
                ..GenerateRequest::greedy(prompt.clone(), 70)
            };
            let (expected, _) = e.generate_text(plain.clone()).unwrap();
            // Each request from the tuned depth, not where the last one ended.
            e.set_depth_costs(Some(costs.clone()));
            let (text, s) = e.generate_text(GenerateRequest { draft_depth: 2, ..plain }).unwrap();
            let case = format!("penalties {penalised} grammar {constrained} prompt of {}", prompt.len());
            assert_eq!(text, expected, "{case}");
            let spec = s.speculative.unwrap();
            let control = spec.control.as_ref().unwrap();
            assert!(control.changes.to_plain >= 1, "{case}: {spec:?}");
            // Drafting resumed at the probes after the switch (one in 16 plain steps).
            assert!(spec.drafted[0] >= 5, "{case}: {spec:?}");
        }
    }
}

/// A forced answer (a benchmark's fixed text) decodes with speculation too: the verify pass
/// takes the answer's tokens, the drafts are the head's own, and the answer is exactly the
/// script whatever the head drafts.
#[test]
fn a_forced_answer_speculates_and_stays_the_script() {
    let (_d, mut e) = with_mtp(Architecture::Qwen3Next, Dtype::Float32);
    let script: Vec<u32> = (0..30u32).map(|i| (i * 53 + 17) % 480).collect();
    for control in [false, true] {
        e.set_depth_control(control).unwrap();
        let req = GenerateRequest {
            forced_tokens: Some(script.clone()),
            draft_depth: 3,
            ..GenerateRequest::greedy(vec![5, 6, 7], 64)
        };
        let mut ids = e.generate(req, Default::default()).unwrap().token_ids().unwrap();
        assert_eq!(ids.pop(), e.tokenizer().eos_ids.first().copied(), "the script, then its end");
        assert_eq!(ids, script, "control {control}");
    }
}

/// Sampled output keeps the plain distribution while the depth controller changes the depth:
/// with costs that a random head's acceptance does not pay for, its first decision (after 4
/// cycles, at most 12 tokens) is plain decoding; the tokens after that switch have the plain
/// tokens' distribution.
#[test]
fn sampled_output_keeps_its_distribution_through_the_controllers_changes() {
    let (_d, mut e) = with_mtp(Architecture::Qwen3Next, Dtype::Float32);
    let costs = engine::depth_control::CostModel {
        draft: Some(0.5),
        block: Vec::new(),
        verify: vec![2.0; 4],
        plain_step_s: 0.001,
    };
    let prompt = prompts()[0].clone();
    let vocab = e.model().config().vocab_size as usize;
    let mut histogram = |depth: usize| {
        let mut h = vec![vec![0usize; vocab]; 2];
        let mut went_plain = 0;
        for seed in 0..200u64 {
            let sampling = SamplingParams { temperature: 1.0, top_k: 6, seed: Some(seed), ..Default::default() };
            let req = GenerateRequest {
                sampling,
                ignore_eos: true,
                draft_depth: depth,
                ..GenerateRequest::greedy(prompt.clone(), 15)
            };
            // Each request from the tuned depth, not where the last one ended.
            e.set_depth_costs(Some(costs.clone()));
            let mut g = e.generate(req, Default::default()).unwrap();
            let mut spec = None;
            for event in g.by_ref() {
                if let Ok(engine::Event::Finished(s)) = event {
                    spec = s.speculative;
                }
            }
            for (pos, &t) in g.tokens()[13..15].iter().enumerate() {
                h[pos][t as usize] += 1;
            }
            went_plain += spec.and_then(|s| s.control).map_or(0, |c| c.changes.to_plain);
        }
        (h, went_plain)
    };
    let ((plain, _), (spec, went_plain)) = (histogram(0), histogram(2));
    assert_eq!(went_plain, 200, "every run went plain after its first decision");
    check(&plain, &spec);
}
