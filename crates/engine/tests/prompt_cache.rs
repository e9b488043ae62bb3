//! The prompt cache is exact: for every architecture, with and without MTP speculation, the
//! tokens generated with a cache hit are the tokens generated cold, for prompts that share
//! nothing, part of and all of a cached prompt. It also reuses what it should (the cached
//! token counts), and keeps within its byte budget, least recently used out first.

mod common;

use engine::checkpoint::{Architecture, Dtype};
use engine::{Engine, GenerateRequest, SamplingParams};

const CHUNK: usize = 16;

fn engine(arch: Architecture, budget: usize) -> (tempfile::TempDir, Engine) {
    let mut o = common::options(arch, "tiny", None, 64, Dtype::Float32);
    o.mtp = matches!(arch, Architecture::Qwen35 | Architecture::Qwen3Next);
    let d = common::make(&o);
    let mut e = Engine::load(d.path()).unwrap();
    e.set_prefill_chunk(CHUNK);
    e.set_prompt_cache_budget(budget);
    (d, e)
}

fn ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 31 + seed * 17 + 3) % 400 + 5).collect()
}

/// The generated ids and the cached-token count.
fn generate(e: &Engine, prompt: &[u32], depth: usize, temperature: f32) -> (Vec<u32>, usize) {
    let sampling = SamplingParams { temperature, seed: Some(7), ..Default::default() };
    let req = GenerateRequest {
        ignore_eos: true,
        draft_depth: depth,
        sampling,
        ..GenerateRequest::greedy(prompt.to_vec(), 12)
    };
    let mut generation = e.generate(req, Default::default()).unwrap();
    let mut tokens = Vec::new();
    let mut cached = 0;
    for event in generation.by_ref() {
        if let engine::Event::Finished(s) = event.unwrap() {
            cached = s.usage.cached_tokens;
        }
    }
    tokens.extend(generation.tokens());
    (tokens, cached)
}

#[test]
fn a_hit_generates_what_a_cold_run_does_for_every_architecture() {
    let first = ids(1, 100);
    let longer = [first.clone(), ids(2, 30)].concat(); // all of `first`, then more
    let diverging = [first[..57].to_vec(), ids(3, 40)].concat(); // part of it
    let unrelated = ids(4, 70); // none of it
    for arch in [Architecture::Qwen3, Architecture::Qwen3Moe, Architecture::Qwen3Next, Architecture::Qwen35] {
        let (_d, cold) = engine(arch, 0);
        let (_d2, warm) = engine(arch, 64 << 20);
        let hybrid = matches!(arch, Architecture::Qwen3Next | Architecture::Qwen35);
        let depths: &[usize] = if hybrid { &[0, 2] } else { &[0] };
        for &depth in depths {
            for temperature in [0.0, 0.8] {
                warm.clear_prompt_cache();
                // The reused prefix: attention-only models reuse any common prefix (here all of
                // `first`, kept with the answer after it); hybrids up to their last checkpoint (a
                // multiple of the chunk, or a cached prompt's or answer's end).
                let (part, whole) = if hybrid { (48, 99) } else { (57, 100) };
                for (prompt, expect_cached) in
                    [(&first, 0), (&longer, whole), (&diverging, part), (&unrelated, 0), (&first, 99)]
                {
                    let (want, none) = generate(&cold, prompt, depth, temperature);
                    let (got, cached) = generate(&warm, prompt, depth, temperature);
                    let case = format!("{arch:?} depth {depth} T {temperature} prompt of {}", prompt.len());
                    assert_eq!(none, 0, "{case}: the cold engine has no cache");
                    assert_eq!(got, want, "{case}: a hit changed the answer");
                    assert_eq!(cached, expect_cached, "{case}: cached tokens");
                }
            }
        }
        let stats = warm.prompt_cache_stats();
        assert!(stats.hits > 0 && stats.misses > 0 && stats.bytes <= stats.budget_bytes, "{stats:?}");
    }
}

#[test]
fn the_budget_holds_and_the_least_recently_used_goes_first() {
    let (_d, mut e) = engine(Architecture::Qwen35, 64 << 20);
    let (a, b, c) = (ids(1, 80), ids(2, 80), ids(3, 80));
    generate(&e, &a, 0, 0.0);
    let one = e.prompt_cache_stats().bytes;
    assert!(one > 0);
    // Room for two entries: a, b; a is used again; c pushes out b, the least recently used.
    e.set_prompt_cache_budget(one * 2 + one / 2);
    for p in [&a, &b, &a, &c] {
        generate(&e, p, 0, 0.0);
    }
    let stats = e.prompt_cache_stats();
    assert_eq!((stats.entries, stats.evictions), (2, 1), "{stats:?}");
    assert!(stats.bytes <= stats.budget_bytes);
    assert_eq!(generate(&e, &a, 0, 0.0).1, 79, "a stayed");
    assert_eq!(generate(&e, &b, 0, 0.0).1, 0, "b went");
    // An entry larger than the whole budget is not kept; 0 turns the cache off.
    e.set_prompt_cache_budget(one / 2);
    generate(&e, &a, 0, 0.0);
    assert_eq!(e.prompt_cache_stats().entries, 0);
    e.set_prompt_cache_budget(0);
    generate(&e, &a, 0, 0.0);
    assert_eq!(generate(&e, &a, 0, 0.0).1, 0);
}

#[test]
fn the_next_turn_reuses_the_answer_too() {
    // An agent's next turn: the prompt, the answer as generated, then more.
    let prompt = ids(6, 70);
    for arch in [Architecture::Qwen3, Architecture::Qwen35] {
        let (_d, cold) = engine(arch, 0);
        let (_d2, mut warm) = engine(arch, 64 << 20);
        // Speculating: at a fixed depth, and with the depth controller (a random head's drafts
        // fail: it decodes plainly, leaving the head behind until the answer ends).
        let settings: &[(usize, bool)] =
            if arch == Architecture::Qwen35 { &[(0, false), (2, false), (2, true)] } else { &[(0, false)] };
        for &(depth, control) in settings {
            warm.set_depth_control(control).unwrap();
            for temperature in [0.0, 0.8] {
                let case = format!("{arch:?} depth {depth} control {control} T {temperature}");
                warm.clear_prompt_cache();
                let (answer, _) = generate(&warm, &prompt, depth, temperature);
                let next = [prompt.clone(), answer.clone(), ids(7, 20)].concat();
                let (want, _) = generate(&cold, &next, depth, temperature);
                let (got, cached) = generate(&warm, &next, depth, temperature);
                // Greedy: the same tokens. Sampled with speculation, the same distribution but
                // not the same draws: the answer's MTP state was computed by verify passes, so
                // drafts (and the random numbers their checks take) differ from a cold prefill's.
                if depth == 0 || temperature == 0.0 {
                    assert_eq!(got, want, "{case}");
                } else {
                    assert_eq!(got.len(), want.len(), "{case}");
                }
                // Everything fed to the model: the prompt and the answer but its last token (a
                // speculating request's MTP head is caught up on its pending positions first;
                // one whose answer ended inside a cycle rolls back the positions after it).
                let whole = prompt.len() + answer.len() - 1;
                assert_eq!(cached, whole, "{case}");
            }
        }
    }
}

#[test]
fn entries_that_start_alike_hold_their_common_pieces_once() {
    use engine::prompt_cache::PIECE;
    for (arch, depth) in [(Architecture::Qwen3, 0), (Architecture::Qwen35, 2)] {
        let (_d, cold) = engine(arch, 0);
        let (_d2, warm) = engine(arch, 256 << 20);
        let first = ids(1, 2 * PIECE + 100);
        generate(&warm, &first, depth, 0.0);
        let one = warm.prompt_cache_stats();
        assert_eq!(one.entries, 1, "{arch:?}: the answer's entry replaces the prompt's");
        // Another conversation with the same start (an agent's system prompt and tools),
        // diverging two pieces and fifty tokens in.
        let second = [&first[..2 * PIECE + 50], &ids(2, 60)].concat();
        let (answer, cached) = generate(&warm, &second, depth, 0.0);
        assert_eq!(answer, generate(&cold, &second, depth, 0.0).0, "{arch:?}");
        assert!(cached > 2 * PIECE, "{arch:?}: {cached}");
        let two = warm.prompt_cache_stats();
        assert_eq!(two.entries, 2, "{arch:?}");
        // Its first two pieces (and the checkpoints in them) are the first entry's: what it
        // adds is its last stretch, not a second copy of the whole start.
        assert!(two.bytes - one.bytes < one.bytes / 4, "{arch:?}: {} -> {} bytes", one.bytes, two.bytes);
        // Its next turn restores from the shared pieces and generates what a cold run does.
        let third = [second.clone(), answer, ids(3, 20)].concat();
        let (got, cached) = generate(&warm, &third, depth, 0.0);
        assert_eq!(got, generate(&cold, &third, depth, 0.0).0, "{arch:?}");
        assert!(cached > second.len(), "{arch:?}: {cached}");
    }
}
