//! Several sequences decoded in one pass (`LanguageModel::hidden_batch`): each sequence of a
//! batch gives the tokens it gives alone (greedy), for every architecture, with caches of
//! different lengths and with sequences joining and leaving the batch between steps.

mod common;

use engine::batch_cache::BatchCache;
use engine::cache::Cache;
use engine::checkpoint::{Architecture, Dtype};
use engine::models::LanguageModel;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, Array};

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![7, 300, 41],
        (0..40u32).map(|i| (i * 37 + 11) % 490).collect(),
        (0..75u32).map(|i| (i * 13 + 5) % 490).collect(),
        (0..9u32).map(|i| (i * 101 + 3) % 490).collect(),
    ]
}

fn argmax(logits: &Array) -> Vec<u32> {
    let t = ops::indexing::argmax_axis(logits, -1, None).unwrap();
    t.as_dtype(mlx_rs::Dtype::Uint32).unwrap().as_slice::<u32>().to_vec()
}

/// The prompt's cache and the first greedy token.
fn prefill(model: &dyn LanguageModel, prompt: &[u32]) -> (Cache, u32) {
    let mut cache = model.new_cache();
    let logits = model.forward(&Array::from_slice(prompt, &[1, prompt.len() as i32]), &mut cache).unwrap();
    (cache, argmax(&logits.index((0, -1..))).remove(0))
}

/// Greedy tokens of one sequence decoded alone.
fn alone(model: &dyn LanguageModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let (mut cache, mut t) = prefill(model, prompt);
    let mut out = vec![t];
    while out.len() < n {
        let logits = model.forward(&Array::from_slice(&[t], &[1, 1]), &mut cache).unwrap();
        t = argmax(&logits.index((0, -1..)))[0];
        out.push(t);
    }
    out
}

/// A running sequence: which prompt, its tokens so far (its cache is a row of the batch's).
struct Running {
    index: usize,
    tokens: Vec<u32>,
}

#[test]
fn each_sequence_of_a_batch_gives_its_tokens_alone() {
    const N: usize = 14;
    for arch in [Architecture::Qwen3, Architecture::Qwen3Moe, Architecture::Qwen3Next, Architecture::Qwen35] {
        let dir = common::make(&common::options(arch, "tiny", None, 32, Dtype::Float32));
        let model = engine::models::load(dir.path()).unwrap();
        let model = model.as_ref();
        let prompts = prompts();
        let expected: Vec<Vec<u32>> = prompts.iter().map(|p| alone(model, p, N)).collect();
        // Sequences 0, 1 and 3 start together (rows padded to the 40-token one); 2, longer than
        // every row, joins at step 2 (the others are padded further); 0 leaves after 8 tokens
        // and goes on alone from the cache the batch gives back.
        let mut batch = BatchCache::default();
        let start = |i: usize, batch: &mut BatchCache| {
            let (cache, t) = prefill(model, &prompts[i]);
            batch.push(cache).unwrap();
            Running { index: i, tokens: vec![t] }
        };
        let mut running: Vec<Running> = [0, 1, 3].into_iter().map(|i| start(i, &mut batch)).collect();
        let mut done: Vec<Running> = vec![];
        for step in 0.. {
            if step == 2 {
                running.push(start(2, &mut batch));
            }
            for row in (0..running.len()).rev() {
                let r = &running[row];
                if r.tokens.len() < if r.index == 0 { 8 } else { N } {
                    continue;
                }
                let mut cache = batch.remove(row).unwrap();
                let mut r = running.remove(row);
                assert_eq!(cache.offset() as usize, prompts[r.index].len() + r.tokens.len() - 1, "{arch:?}");
                while r.tokens.len() < N {
                    let t = *r.tokens.last().unwrap();
                    let logits = model.forward(&Array::from_slice(&[t], &[1, 1]), &mut cache).unwrap();
                    r.tokens.push(argmax(&logits.index((0, -1..)))[0]);
                }
                done.push(r);
            }
            if running.is_empty() {
                break;
            }
            assert_eq!(batch.rows(), running.len());
            let last: Vec<u32> = running.iter().map(|r| *r.tokens.last().unwrap()).collect();
            let tokens = Array::from_slice(&last, &[last.len() as i32, 1]);
            let hidden = model.hidden_batch(&tokens, &mut batch).unwrap();
            let next = argmax(&model.logits(&hidden).unwrap().index((.., -1, ..)));
            for (r, t) in running.iter_mut().zip(next) {
                r.tokens.push(t);
            }
        }
        assert_eq!(done.len(), 4, "{arch:?}");
        for r in &done {
            assert_eq!(r.tokens, expected[r.index], "{arch:?}: sequence {} in a batch", r.index);
        }
        assert_eq!(batch.rows(), 0);
    }
}

/// Requests decoded together through `engine::batch::Batch` answer as they do alone: greedy,
/// with penalties, with a grammar, with a stop string; one joins late, one is cancelled
/// mid-way and leaves the others untouched.
#[test]
fn requests_in_a_batch_answer_as_they_do_alone() {
    use engine::batch::Batch;
    use engine::{CancelToken, Engine, Event, FinishReason, GenerateRequest, Grammar, Penalties, SamplingParams};
    use std::collections::HashMap;

    let dir = common::repo_root().join("assets/models/ferrite-code-20m");
    let e = Engine::load(&dir).unwrap();
    e.clear_prompt_cache();
    let ids = |text: &str| e.tokenizer().encode(text).unwrap();
    let greedy = |text: &str, n| GenerateRequest::greedy(ids(text), n);
    let mut requests = vec![
        greedy("def read_config(path):\n", 40),
        greedy("fn main() {\n    let args", 32),
        GenerateRequest {
            sampling: SamplingParams {
                penalties: Penalties { repetition: 1.3, presence: 0.2, frequency: 0.1 },
                ..SamplingParams::greedy()
            },
            ..greedy("import os\nimport sys\n\n", 36)
        },
        GenerateRequest {
            grammar: Some(Grammar::JsonSchema(serde_json::json!({"type": "object",
                "properties": {"port": {"type": "integer", "minimum": 1, "maximum": 9999}}, "required": ["port"]}))),
            ..greedy("The settings as JSON:", 30)
        },
        GenerateRequest { stop: vec!["\n\n".into()], ..greedy("class Stack:\n    def push(self, x):", 48) },
    ];
    requests.push(greedy("SELECT name FROM", 40)); // cancelled after 5 steps
    let alone: Vec<(String, FinishReason)> = requests[..5]
        .iter()
        .map(|r| {
            let (text, summary) = e.generate_text(r.clone()).unwrap();
            (text, summary.finish_reason)
        })
        .collect();

    e.clear_prompt_cache();
    let mut batch = Batch::default();
    let cancel_last = CancelToken::default();
    let mut texts: HashMap<usize, String> = HashMap::new();
    let mut finished: HashMap<usize, FinishReason> = HashMap::new();
    for (i, r) in requests.iter().enumerate().take(4) {
        batch.join(i, e.generate(r.clone(), CancelToken::default()).unwrap()).unwrap();
    }
    batch.join(5, e.generate(requests[5].clone(), cancel_last.clone()).unwrap()).unwrap();
    let mut step = 0;
    while !batch.is_empty() {
        if step == 3 {
            batch.join(4, e.generate(requests[4].clone(), CancelToken::default()).unwrap()).unwrap();
            assert_eq!(batch.len(), 6);
        }
        if step == 5 {
            cancel_last.cancel();
        }
        for (key, event) in batch.step() {
            match event.unwrap() {
                Event::Text(t) => texts.entry(key).or_default().push_str(&t),
                Event::Finished(summary) => {
                    assert!(finished.insert(key, summary.finish_reason).is_none(), "{key} finished twice");
                }
            }
        }
        step += 1;
    }
    for (i, (text, reason)) in alone.iter().enumerate() {
        assert_eq!(texts.get(&i).map(String::as_str).unwrap_or(""), text, "request {i}");
        assert_eq!(finished[&i], *reason, "request {i}");
    }
    assert_eq!(finished[&5], FinishReason::Cancelled);
    assert!(texts.get(&5).map_or(0, String::len) < alone[0].0.len() + 200);
}

/// The constructor that raises MLX's CUDA graph cache ran in this program too (a value the
/// environment already had would be kept).
#[test]
fn the_cuda_graph_cache_is_raised_before_main() {
    let _ = engine::device::backend();
    let size = std::env::var("MLX_CUDA_GRAPH_CACHE_SIZE").unwrap_or_default();
    assert!(size.parse::<u32>().is_ok(), "MLX_CUDA_GRAPH_CACHE_SIZE is {size:?}");
}

/// The text of a generation run alone, and its finish reason.
fn alone_text(e: &engine::Engine, request: &engine::GenerateRequest) -> String {
    e.generate_text(request.clone()).unwrap().0
}

/// Steps `batch` to its end; each key's text, and its summary.
fn run_out<K: Clone + Eq + std::hash::Hash>(
    batch: &mut engine::batch::Batch<'_, K>,
    texts: &mut std::collections::HashMap<K, String>,
) -> std::collections::HashMap<K, engine::Summary> {
    let mut summaries = std::collections::HashMap::new();
    while !batch.is_empty() {
        for (key, event) in batch.step() {
            match event.unwrap() {
                engine::Event::Text(t) => texts.entry(key).or_default().push_str(&t),
                engine::Event::Finished(s) => assert!(summaries.insert(key, s).is_none()),
            }
        }
    }
    summaries
}

/// A request running alone with speculation goes on in a batch when others come (the server
/// hands it over between its cycles): greedy, its answer is the one it gives alone, and so is
/// the newcomer's; its summary keeps the speculative figures of its cycles. The embedded model
/// and a hybrid with an MTP head.
#[test]
fn a_speculating_generation_joins_a_batch_and_answers_as_alone() {
    use engine::batch::Batch;
    use engine::{CancelToken, Engine, Event, GenerateRequest, Penalties, SamplingParams};

    let hybrid = {
        let mut o = common::options(Architecture::Qwen3Next, "tiny", None, 32, Dtype::Float32);
        o.mtp = true;
        common::make(&o)
    };
    for dir in [common::repo_root().join("assets/models/ferrite-code-20m"), hybrid.path().to_path_buf()] {
        let mut e = Engine::load(&dir).unwrap();
        e.set_prompt_cache_budget(0);
        let ids = |text: &str| e.tokenizer().encode(text).unwrap();
        let speculating = GenerateRequest {
            draft_depth: 2,
            sampling: SamplingParams {
                penalties: Penalties { repetition: 1.2, presence: 0.0, frequency: 0.0 },
                ..SamplingParams::greedy()
            },
            ..GenerateRequest::greedy(ids("def read_config(path):\n"), 40)
        };
        let newcomer = GenerateRequest::greedy(ids("fn main() {\n    let args"), 24);
        let plain = GenerateRequest { draft_depth: 0, ..speculating.clone() };
        let (want_a, want_b) = (alone_text(&e, &plain), alone_text(&e, &newcomer));

        let mut a = e.generate(speculating, CancelToken::default()).unwrap();
        let mut before = String::new();
        while a.tokens().len() < 7 || !a.can_join_batch() {
            match a.next().unwrap().unwrap() {
                Event::Text(t) => before.push_str(&t),
                Event::Finished(_) => panic!("{}: ended before joining", dir.display()),
            }
        }
        let mut batch = Batch::default();
        batch.join(0, a).unwrap();
        batch.queue(1, e.generate(newcomer, CancelToken::default()).unwrap()).unwrap();
        let mut texts = std::collections::HashMap::from([(0, before)]);
        let summaries = run_out(&mut batch, &mut texts);
        assert_eq!(texts[&0], want_a, "{}: the speculating request", dir.display());
        assert_eq!(texts.get(&1).map(String::as_str).unwrap_or(""), want_b, "{}: the newcomer", dir.display());
        let spec = summaries[&0].speculative.as_ref().expect("the speculative figures of its cycles");
        assert!(spec.cycles > 0, "{spec:?}");
    }
}

/// A newcomer's prompt is prefilled a chunk per decode step while another request decodes
/// (that one gets a token every step meanwhile), and both answer as they do alone; a hybrid's
/// too, whose state is checkpointed at the engine's prefill chunks whatever the step's size.
/// A request's own smaller chunk (the tuner's) is kept, batched and alone, and changes no token
/// (speculating alone either).
#[test]
fn a_newcomers_prompt_is_prefilled_a_chunk_per_step_while_others_decode() {
    use engine::batch::Batch;
    use engine::{CancelToken, Engine, GenerateRequest};

    let hybrid = common::make(&common::options(Architecture::Qwen35, "tiny", None, 32, Dtype::Float32));
    for dir in [common::repo_root().join("assets/models/ferrite-code-20m"), hybrid.path().to_path_buf()] {
        let mut e = Engine::load(&dir).unwrap();
        e.set_prefill_chunk(64);
        e.set_prefill_interleave(16);
        let ids = |text: &str| e.tokenizer().encode(text).unwrap();
        let long: String = (0..30).map(|i| format!("x{i} = compute({i})\n")).collect();
        let plain_newcomer = GenerateRequest::greedy(ids(&long), 12);
        assert!(plain_newcomer.prompt.len() > 100, "{}", plain_newcomer.prompt.len());
        // It decodes on through the newcomer's prefill in chunks of 8.
        let decodes = plain_newcomer.prompt.len() / 8 + 8;
        let running =
            GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(ids("import os\nimport sys\n\n"), decodes) };
        e.set_prompt_cache_budget(0);
        let (want_a, want_b) = (alone_text(&e, &running), alone_text(&e, &plain_newcomer));
        for own in [None, Some(8)] {
            let newcomer = GenerateRequest { prefill_chunk: own, ..plain_newcomer.clone() };
            let per_step = own.unwrap_or(16);
            if own.is_some() {
                assert_eq!(alone_text(&e, &newcomer), want_b, "{}: alone in chunks of 8", dir.display());
                if e.model().mtp().is_some() {
                    let speculating = GenerateRequest { draft_depth: 2, fixed_depth: true, ..newcomer.clone() };
                    assert_eq!(alone_text(&e, &speculating), want_b, "{}: speculating", dir.display());
                }
            }

            let mut batch = Batch::default();
            batch.queue("running", e.generate(running.clone(), CancelToken::default()).unwrap()).unwrap();
            let mut texts = std::collections::HashMap::new();
            for (key, event) in batch.step() {
                if let engine::Event::Text(t) = event.unwrap() {
                    texts.entry(key).or_insert_with(String::new).push_str(&t);
                }
            }
            // Alone, the first one was prefilled at once and decodes from the first step.
            assert_eq!(batch.prefilling(), (0, 0));
            batch.queue("newcomer", e.generate(newcomer.clone(), CancelToken::default()).unwrap()).unwrap();
            let mut left = newcomer.prompt.len() - 1;
            assert_eq!(batch.prefilling(), (1, left));
            let mut steps = 0;
            while batch.prefilling().0 == 1 {
                let decoded = batch.generated(&"running").unwrap();
                for (key, event) in batch.step() {
                    if let engine::Event::Text(t) = event.unwrap() {
                        texts.entry(key).or_default().push_str(&t);
                    }
                }
                steps += 1;
                assert_eq!(batch.generated(&"running").unwrap(), decoded + 1, "a token every step");
                let now = batch.prefilling().1;
                assert!(left - now <= per_step && (now == 0 || left - now >= 1), "{left} -> {now}");
                left = now;
            }
            assert!(steps >= newcomer.prompt.len() / per_step, "prefilled in {steps} steps");
            run_out(&mut batch, &mut texts);
            assert_eq!(texts["running"], want_a, "{}", dir.display());
            assert_eq!(texts.get("newcomer").map(String::as_str).unwrap_or(""), want_b, "{}", dir.display());
        }
    }
}
