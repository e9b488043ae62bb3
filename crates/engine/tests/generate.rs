//! The generation API on a tiny checkpoint: finish reasons, stop strings, cancel, chunked
//! prefill, streaming UTF-8 and reproducible sampling.

mod common;

use engine::checkpoint::{Architecture, Dtype};
use engine::tokenizer::{ChatMessage, StreamDecoder};
use engine::{CancelToken, Engine, Event, FinishReason, GenerateRequest, SamplingParams};

fn engine(arch: Architecture, dtype: Dtype) -> (tempfile::TempDir, Engine) {
    let d = common::make(&common::options(arch, "tiny", None, 64, dtype));
    let e = Engine::load(d.path()).unwrap();
    (d, e)
}

fn prompt(e: &Engine) -> Vec<u32> {
    e.tokenizer().encode("fn main() { let total = numbers.iter().sum(); }").unwrap()
}

#[test]
fn length_and_usage() {
    let (_d, e) = engine(Architecture::Qwen3, Dtype::Float32);
    let p = prompt(&e);
    let req = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(p.clone(), 12) };
    let (_, s) = e.generate_text(req).unwrap();
    assert_eq!(s.finish_reason, FinishReason::Length);
    assert_eq!(s.usage.completion_tokens, 12);
    assert_eq!(s.usage.prompt_tokens, p.len());
    assert!(s.timings.decode_tps > 0.0 && s.timings.prompt_tps > 0.0);
    assert!(s.timings.peak_memory_bytes > 0);
}

#[test]
fn chunked_prefill_matches_one_pass() {
    // The hybrid carries conv and recurrent state across chunks, the others KV caches.
    for arch in [Architecture::Qwen3Moe, Architecture::Qwen3Next, Architecture::Qwen35] {
        let (_d, mut e) = engine(arch, Dtype::Float32);
        let p: Vec<u32> = (0..300u32).map(|i| (i * 13 + 5) % 490).collect();
        let req = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(p, 24) };
        let (whole, _) = e.generate_text(req.clone()).unwrap();
        e.set_prefill_chunk(7);
        let (chunked, _) = e.generate_text(req).unwrap();
        assert!(!whole.is_empty());
        assert_eq!(whole, chunked, "{arch:?}");
    }
}

#[test]
fn stop_strings_end_the_text_before_them() {
    let (_d, e) = engine(Architecture::Qwen3, Dtype::Bfloat16);
    let req = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompt(&e), 40) };
    let (full, _) = e.generate_text(req.clone()).unwrap();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() > 12, "{full:?}");
    let stop: String = chars[8..11].iter().collect();
    let expected = &full[..full.find(&stop).unwrap()];
    let (text, s) = e.generate_text(GenerateRequest { stop: vec![stop.clone()], ..req }).unwrap();
    assert_eq!(text, expected, "stop {stop:?}");
    assert_eq!(s.finish_reason, FinishReason::Stop);
}

#[test]
fn eos_ends_generation() {
    let (_d, mut e) = engine(Architecture::Qwen3, Dtype::Float32);
    let p = prompt(&e);
    let (first, _) = e.generate_text(GenerateRequest::greedy(p.clone(), 1)).unwrap();
    let first_id = e.tokenizer().encode(&first).unwrap()[0];
    e.tokenizer_mut().eos_ids = vec![first_id];
    let (text, s) = e.generate_text(GenerateRequest::greedy(p.clone(), 20)).unwrap();
    assert_eq!((text.as_str(), s.finish_reason, s.usage.completion_tokens), ("", FinishReason::Stop, 1));
    let req = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(p, 5) };
    assert_eq!(e.generate_text(req).unwrap().1.usage.completion_tokens, 5);
}

#[test]
fn a_forced_answer_is_decoded_through_the_sampler_and_ends() {
    // The test device behind `--scripted-replies`: the text comes out token for token, then
    // end-of-sequence ends it, also when the request asked for speculation or sampling.
    let d = hybrid_with_mtp();
    let e = Engine::load(d.path()).unwrap();
    let answer = "<tool_call>\n{\"name\": \"write\", \"arguments\": {\"path\": \"a.rs\"}}\n</tool_call>";
    let forced = e.tokenizer().encode(answer).unwrap();
    for (depth, temperature) in [(0, 0.0), (2, 0.0), (0, 0.9)] {
        let sampling = SamplingParams { temperature, seed: Some(3), ..Default::default() };
        let req = GenerateRequest {
            forced_tokens: Some(forced.clone()),
            draft_depth: depth,
            sampling,
            ..GenerateRequest::greedy(prompt(&e), 200)
        };
        let (text, s) = e.generate_text(req).unwrap();
        assert_eq!(text, answer, "depth {depth}, temperature {temperature}");
        assert_eq!((s.finish_reason, s.usage.completion_tokens), (FinishReason::Stop, forced.len() + 1));
    }
    let bad = GenerateRequest { forced_tokens: Some(vec![u32::MAX]), ..GenerateRequest::greedy(prompt(&e), 4) };
    assert!(e.generate(bad, CancelToken::default()).is_err());
}

#[test]
fn cancel_stops_at_the_next_token() {
    let (_d, e) = engine(Architecture::Qwen3, Dtype::Float32);
    let cancel = CancelToken::default();
    let req = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(prompt(&e), 1000) };
    let mut events = e.generate(req, cancel.clone()).unwrap();
    let mut texts = 0;
    let summary = loop {
        match events.next().unwrap().unwrap() {
            Event::Text(_) => {
                texts += 1;
                if texts == 3 {
                    cancel.cancel();
                }
            }
            Event::Finished(s) => break s,
        }
    };
    assert!(events.next().is_none());
    assert_eq!(summary.finish_reason, FinishReason::Cancelled);
    assert!(summary.usage.completion_tokens < 20, "{}", summary.usage.completion_tokens);
}

#[test]
fn bad_requests_are_refused() {
    let (_d, e) = engine(Architecture::Qwen3, Dtype::Float32);
    let err = |r: GenerateRequest| e.generate(r, CancelToken::default()).err().unwrap().to_string();
    assert!(err(GenerateRequest::greedy(vec![], 4)).contains("prompt is empty"));
    assert!(err(GenerateRequest::greedy(vec![1, 99999], 4)).contains("token id 99999"));
    let hot = SamplingParams { temperature: -1.0, ..Default::default() };
    assert!(err(GenerateRequest { sampling: hot, ..GenerateRequest::greedy(vec![1], 4) }).contains("temperature"));
}

#[test]
fn seeded_sampling_reproduces() {
    let (_d, e) = engine(Architecture::Qwen3Moe, Dtype::Bfloat16);
    let sampling =
        SamplingParams { temperature: 1.0, top_p: 0.9, top_k: 50, min_p: 0.02, seed: Some(42), ..Default::default() };
    let req = GenerateRequest { sampling, ignore_eos: true, ..GenerateRequest::greedy(prompt(&e), 30) };
    let (a, _) = e.generate_text(req.clone()).unwrap();
    let (b, _) = e.generate_text(req.clone()).unwrap();
    assert_eq!(a, b);
    let other = GenerateRequest { sampling: SamplingParams { seed: Some(43), ..req.sampling.clone() }, ..req };
    assert_ne!(a, e.generate_text(other).unwrap().0);
}

#[test]
fn streaming_never_splits_a_character() {
    let (_d, e) = engine(Architecture::Qwen3, Dtype::Float32);
    let text = "héllo wörld — 你好 🙂 fn main() {}";
    let ids = e.tokenizer().encode(text).unwrap();
    assert!(ids.len() > text.chars().count() / 2);
    let mut dec = StreamDecoder::new();
    let mut out = String::new();
    for id in ids {
        let delta = dec.push(e.tokenizer(), id).unwrap();
        assert!(!delta.contains('\u{FFFD}'), "{delta:?}");
        out.push_str(&delta);
    }
    out.push_str(&dec.flush(e.tokenizer()).unwrap());
    assert_eq!(out, text);
}

#[test]
fn chat_template_renders() {
    let (_d, e) = engine(Architecture::Qwen3, Dtype::Float32);
    let mut extra = serde_json::Map::new();
    let msgs = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")];
    let on = e.tokenizer().apply_chat_template(&msgs, true, &extra).unwrap();
    assert_eq!(on, "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    extra.insert("enable_thinking".into(), false.into());
    let off = e.tokenizer().apply_chat_template(&msgs, true, &extra).unwrap();
    assert!(off.ends_with("<think>\n\n</think>\n\n"));
    let ids = e.tokenizer().encode(&on).unwrap();
    assert_eq!(ids[0], e.tokenizer().token_to_id("<|im_start|>").unwrap());
    assert!(e.tokenizer().eos_ids.contains(&e.tokenizer().token_to_id("<|im_end|>").unwrap()));
}

#[test]
fn chat_template_renders_tools_calls_and_results() {
    use engine::tokenizer::ToolCall;
    let (_d, e) = engine(Architecture::Qwen3, Dtype::Float32);
    let tool = serde_json::json!({"type": "function", "function": {"name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}});
    let mut extra = serde_json::Map::new();
    extra.insert("tools".into(), serde_json::json!([tool]));
    let mut call = ChatMessage::new("assistant", "");
    call.tool_calls = vec![ToolCall::new("read_file", serde_json::json!({"path": "a.rs"}))];
    let mut result = ChatMessage::new("tool", "fn main() {}");
    result.tool_call_id = Some("call_1".into());
    let msgs = [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Show a.rs"), call, result];
    let text = e.tokenizer().apply_chat_template(&msgs, true, &extra).unwrap();
    assert!(text.starts_with("<|im_start|>system\nBe brief.\n\n# Tools"), "{text}");
    // Tools and arguments as transformers' `tojson` writes them (Python's separators).
    assert!(text.contains("\"name\": \"read_file\""), "{text}");
    assert!(text.contains("<|im_start|>assistant\n<tool_call>\n{\"name\": \"read_file\", \"arguments\": {\"path\": \"a.rs\"}}\n</tool_call><|im_end|>"), "{text}");
    assert!(
        text.contains(
            "<|im_start|>user\n<tool_response>\nfn main() {}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
        ),
        "{text}"
    );
}

/// A tiny Qwen3.5-style hybrid with an MTP head, in f32.
fn hybrid_with_mtp() -> tempfile::TempDir {
    let mut o = common::options(Architecture::Qwen35, "tiny", None, 64, Dtype::Float32);
    o.mtp = true;
    common::make(&o)
}

#[test]
fn profiles_change_knobs_not_answers() {
    // Turbo warms up at load (plain and speculative) and prefills in bigger chunks; the
    // tokens it produces are the Sustained profile's.
    let d = hybrid_with_mtp();
    let sustained = Engine::load(d.path()).unwrap();
    let turbo =
        engine::EngineOptions { profile: engine::Profile::named(engine::ProfileName::Turbo), ..Default::default() };
    let turbo = Engine::load_with(d.path(), &turbo).unwrap();
    assert_eq!(sustained.prefill_chunk(), 2048);
    assert_eq!(turbo.prefill_chunk(), 8192);
    assert_eq!(turbo.spec_totals().cycles, 0, "the warm-up leaves no figures behind");
    let p = prompt(&sustained);
    let req = GenerateRequest { ignore_eos: true, ..GenerateRequest::greedy(p, 16) };
    let (a, _) = sustained.generate_text(req.clone()).unwrap();
    let (b, _) = turbo.generate_text(req).unwrap();
    assert_eq!(a, b);
    let before = mlx_rs::memory::cache_memory().unwrap();
    // MLX's buffer cache is the whole process's: a test on another thread may free a buffer
    // into it right after the clear (580 bytes once in CI), so the best of three clears must
    // come under a small bound.
    let after = (0..3)
        .map(|_| {
            sustained.after_request(100_000);
            mlx_rs::memory::cache_memory().unwrap()
        })
        .min()
        .unwrap();
    println!("buffer cache {before} -> {after} bytes");
    assert!(before > 64 << 10, "the requests left a cache to give back ({before} bytes)");
    assert!(after < 64 << 10, "a long request's cache goes back: {before} -> {after} bytes");
}

#[test]
fn tuning_reports_progress_and_stops_when_asked() {
    let d = hybrid_with_mtp();
    let e = Engine::load(d.path()).unwrap();
    let options = engine::tune::TuneOptions {
        gen_tokens: 4,
        min_rounds: 2,
        budget: std::time::Duration::from_secs(2),
        prompts: 1,
        temperatures: vec![0.0],
        ..Default::default()
    };
    let mut seen = Vec::new();
    let m = engine::tune::measure(
        &e,
        &options,
        || None,
        |p| {
            seen.push(p.clone());
            true
        },
    )
    .unwrap();
    // 5 candidates (depth 0..4) warmed up, then paired rounds (at least 2) until a verdict or
    // the 2 s budget.
    // Then batching's gains (the profile decodes up to 4 together).
    let batching = seen.last().unwrap();
    assert_eq!((batching.step, batching.steps, batching.phase), (5, 5, "batching"));
    assert_eq!(m.batch_gains.iter().map(|g| g.sequences).collect::<Vec<_>>(), [2, 4]);
    assert!(m.batch_gains.iter().all(|g| g.gain > 0.0), "{:?}", m.batch_gains);
    let last = &seen[seen.len() - 2];
    assert_eq!((last.step, last.steps, last.phase), (5, 5, "measuring"));
    assert!(
        seen.windows(2).all(|w| w[0].step <= w[1].step && w[0].elapsed_s <= w[1].elapsed_s),
        "progress only goes forward"
    );
    assert!(
        seen.iter().any(|p| p.phase == "warm-up")
            && seen.iter().any(|p| p.repetition == 2 && p.choice == engine::Speculation::mtp(4))
    );
    assert!(last.last_tps.unwrap() > 0.0);
    assert_eq!(last.budget_s, 2.0);
    assert_eq!(m.candidates.len(), 5);
    assert!(m.rounds >= 2, "{}", m.rounds);
    assert_eq!(m.speedups.len(), 4);
    assert!(m.speedups.iter().all(|s| s.interval[0] <= s.speedup && s.speedup <= s.interval[1]), "{:?}", m.speedups);
    // Stopped mid-way: an error, no half-made measurement.
    let mut calls = 0;
    let stopped = engine::tune::measure(
        &e,
        &options,
        || None,
        |_| {
            calls += 1;
            calls < 7
        },
    );
    assert!(matches!(stopped, Err(engine::Error::Cancelled(_))), "{stopped:?}");
    assert_eq!(calls, 7);
}
