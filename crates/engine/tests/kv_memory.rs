//! What one token of context costs in KV cache, as the engine states it before a request
//! (`Engine::kv_bytes_per_token`, which the server compares with the machine's memory), equals
//! what the caches really grow by.

mod common;

use engine::checkpoint::{Architecture, Dtype};
use engine::Engine;

/// Bytes the trunk's caches grow by over `tokens` more positions (a multiple of the KV
/// caches' growth step), past the first step.
fn measured_bytes_per_token(engine: &Engine, tokens: i32) -> u64 {
    let model = engine.model();
    let mut cache = model.new_cache();
    let prompt =
        |n: i32| mlx_rs::Array::from_slice(&(0..n).map(|i| (i * 7 + 3) as u32 % 200).collect::<Vec<_>>(), &[1, n]);
    let step = engine::cache::KvCache::STEP;
    model.forward(&prompt(step), &mut cache).unwrap().eval().unwrap();
    let before = cache.nbytes();
    model.forward(&prompt(tokens), &mut cache).unwrap().eval().unwrap();
    ((cache.nbytes() - before) / tokens as usize) as u64
}

#[test]
fn the_stated_kv_bytes_per_token_are_what_the_caches_grow_by() {
    for (arch, dtype) in [(Architecture::Qwen3, Dtype::Bfloat16), (Architecture::Qwen35, Dtype::Float32)] {
        let mut options = common::options(arch, "tiny", None, 64, dtype);
        let dir = common::make(&options);
        let engine = Engine::load(dir.path()).unwrap();
        let stated = engine.kv_bytes_per_token();
        let measured = measured_bytes_per_token(&engine, engine::cache::KvCache::STEP);
        assert!(stated > 0, "{arch:?}");
        assert_eq!(stated, measured, "{arch:?} {dtype:?}: stated vs measured bytes a token");

        if arch == Architecture::Qwen35 {
            // An MTP head's attention layer holds its own keys and values too.
            options.mtp = true;
            let with_head = common::make(&options);
            let with_head = Engine::load(with_head.path()).unwrap();
            let config = with_head.model().config();
            let attention = (0..config.num_hidden_layers).filter(|&i| !config.is_linear_layer(i)).count() as u64;
            assert_eq!(with_head.kv_bytes_per_token(), stated / attention * (attention + 1));
        }
    }
}
