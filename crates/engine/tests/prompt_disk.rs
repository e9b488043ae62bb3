//! The prompt cache's disk tier: a later process (a restarted server) restores what an earlier
//! one wrote and generates exactly what a cold run does, dense and hybrid with MTP speculation;
//! corrupt, truncated and foreign blocks are removed and never loaded; the folder keeps under its
//! byte budget, least recently used out first, also with two engines writing at once; a block
//! that cannot be written is dropped and the request still answers.

mod common;

use std::collections::HashMap;
use std::path::Path;

use engine::checkpoint::{Architecture, Dtype};
use engine::prompt_cache::disk::BLOCK;
use engine::prompt_cache::DiskSettings;
use engine::{DraftWith, Engine, EngineOptions, GenerateRequest};

const CHUNK: usize = 1024;

fn checkpoint(arch: Architecture) -> tempfile::TempDir {
    let mut o = common::options(arch, "tiny", None, 64, Dtype::Float32);
    o.mtp = arch == Architecture::Qwen35;
    common::make(&o)
}

/// An engine on `model` with a disk tier in `root` (budget 0: no disk tier).
fn engine(model: &Path, root: &Path, budget: u64) -> Engine {
    let mut e = Engine::load(model).unwrap();
    e.set_prefill_chunk(CHUNK);
    e.set_prompt_cache_budget(256 << 20);
    e.set_prompt_disk(&settings(root, budget)).unwrap();
    e
}

/// This test installation's key.
const KEY: [u8; 32] = [7; 32];

/// The disk tier in `root` under this test installation's key.
fn settings(root: &Path, budget: u64) -> DiskSettings {
    DiskSettings { dir: root.to_path_buf(), budget, key: KEY }
}

/// An array of a block as safetensors stores it: name, type, shape, bytes.
type Stored = (String, safetensors::Dtype, Vec<usize>, Vec<u8>);

/// Rewrites `block` after `edit` changed its metadata or arrays, named after its new bytes'
/// HMAC under `key`, or their bare sha256 without one.
fn rewrite(block: &Path, key: Option<[u8; 32]>, edit: impl Fn(&mut HashMap<String, String>, &mut Vec<Stored>)) {
    let bytes = std::fs::read(block).unwrap();
    let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let mut meta = header.metadata().clone().unwrap_or_default();
    let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut arrays: Vec<Stored> =
        tensors.tensors().into_iter().map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec())).collect();
    arrays.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut meta, &mut arrays);
    let views: Vec<(String, safetensors::tensor::TensorView)> = arrays
        .iter()
        .map(|(n, d, s, b)| (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let out = safetensors::serialize(views, Some(meta)).unwrap();
    let sum: Vec<u8> = match key {
        Some(key) => {
            use hmac::{KeyInit, Mac};
            let mut m = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(&key).unwrap();
            m.update(&out);
            m.finalize().into_bytes().to_vec()
        }
        None => <sha2::Sha256 as sha2::Digest>::digest(&out).to_vec(),
    };
    let sum: String = sum.iter().map(|b| format!("{b:02x}")).collect();
    let chain = block.file_name().unwrap().to_string_lossy().split('.').next().unwrap().to_string();
    std::fs::remove_file(block).unwrap();
    std::fs::write(block.with_file_name(format!("{chain}.{}.safetensors", &sum[..16])), out).unwrap();
}

fn ids(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 31 + seed * 17 + 3) % 400 + 5).collect()
}

/// Greedy tokens and the cached-token count; the request then ends as the server ends it.
fn generate(e: &Engine, prompt: &[u32], depth: usize) -> (Vec<u32>, usize) {
    generate_with(e, prompt, depth, DraftWith::Mtp)
}

fn generate_with(e: &Engine, prompt: &[u32], depth: usize, draft_with: DraftWith) -> (Vec<u32>, usize) {
    let req = GenerateRequest {
        ignore_eos: true,
        draft_depth: depth,
        draft_with,
        ..GenerateRequest::greedy(prompt.to_vec(), 8)
    };
    let mut generation = e.generate(req, Default::default()).unwrap();
    let mut cached = 0;
    for event in generation.by_ref() {
        if let engine::Event::Finished(s) = event.unwrap() {
            cached = s.usage.cached_tokens;
        }
    }
    let tokens = generation.tokens().to_vec();
    drop(generation);
    e.after_request(prompt.len());
    e.wait_for_prompt_disk(); // the blocks are written on a thread of their own
    (tokens, cached)
}

fn blocks(root: &Path) -> Vec<std::path::PathBuf> {
    let mut out: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .filter(|m| m.path().is_dir())
        .flat_map(|m| std::fs::read_dir(m.path()).unwrap().flatten())
        .map(|e| e.path())
        .filter(|p| {
            p.extension().is_some_and(|x| x == "safetensors")
                && !p.file_name().unwrap().to_string_lossy().starts_with('.')
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_restarted_engine_restores_from_disk_exactly() {
    let first = ids(1, BLOCK + 1500); // one whole block and a last, shorter one
    let next_turn = [first.clone(), ids(2, 40)].concat();
    for arch in [Architecture::Qwen3, Architecture::Qwen35] {
        let model = checkpoint(arch);
        let root = tempfile::tempdir().unwrap();
        let depths: &[usize] = if arch == Architecture::Qwen35 { &[0, 2] } else { &[0] };
        let cold = engine(model.path(), root.path(), 0);
        for &depth in depths {
            let case = format!("{arch:?} depth {depth}");
            std::fs::remove_dir_all(root.path()).unwrap();
            std::fs::create_dir_all(root.path()).unwrap();
            {
                let before = engine(model.path(), root.path(), 1 << 30);
                let (_, cached) = generate(&before, &first, depth);
                assert_eq!(cached, 0, "{case}");
            }
            assert_eq!(
                blocks(root.path()).len(),
                3,
                "{case}: a whole block, then one to the prompt's end and one to the answer's"
            );
            // A new process: nothing in memory, the blocks on disk.
            let after = engine(model.path(), root.path(), 1 << 30);
            let (want, _) = generate(&cold, &next_turn, depth);
            let (got, cached) = generate(&after, &next_turn, depth);
            assert_eq!(got, want, "{case}: restored from disk, the answer changed");
            assert_eq!(cached, first.len() - 1, "{case}: the whole earlier prompt restored");
            let disk = after.prompt_cache_stats().disk.unwrap();
            assert_eq!((disk.loaded, disk.rejected), (2, 0), "{case}: {disk:?}");
        }
    }
}

#[test]
fn corrupt_truncated_and_foreign_blocks_are_removed_never_loaded() {
    let prompt = ids(5, BLOCK + 300);
    let model = checkpoint(Architecture::Qwen3);
    let other = checkpoint(Architecture::Qwen35);
    let cold_root = tempfile::tempdir().unwrap();
    let (want, _) = generate(&engine(model.path(), cold_root.path(), 0), &prompt, 0);
    type Damage = fn(&Path, &Path);
    let damages: [(&str, Damage); 8] = [
        ("corrupt", |block, _| {
            let mut bytes = std::fs::read(block).unwrap();
            let at = bytes.len() - 10;
            bytes[at] ^= 0x55;
            std::fs::write(block, bytes).unwrap();
        }),
        ("truncated", |block, _| {
            let bytes = std::fs::read(block).unwrap();
            std::fs::write(block, &bytes[..bytes.len() / 2]).unwrap();
        }),
        ("foreign", |block, foreign| {
            // Another model's block, renamed to this chain and with a matching checksum.
            let chain = block.file_name().unwrap().to_string_lossy().split('.').next().unwrap().to_string();
            let bytes = std::fs::read(foreign).unwrap();
            let sum: String =
                <sha2::Sha256 as sha2::Digest>::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
            std::fs::remove_file(block).unwrap();
            std::fs::write(block.with_file_name(format!("{chain}.{}.safetensors", &sum[..16])), bytes).unwrap();
        }),
        // Edited and named after its new bytes' bare sha256: what a folder without a key
        // could not tell from a good block.
        ("edited, rehashed", |block, _| rewrite(block, None, |_, arrays| arrays[0].3[0] ^= 0x40)),
        ("another installation's", |block, _| rewrite(block, Some([8; 32]), |_, _| {})),
        // Written with this installation's key (as a bug of its own could): still range-checked.
        ("4e9 layers, keyed", |block, _| {
            rewrite(block, Some(KEY), |meta, _| drop(meta.insert("layers".into(), "4000000000".into())))
        }),
        ("usize::MAX layers, keyed", |block, _| {
            rewrite(block, Some(KEY), |meta, _| drop(meta.insert("layers".into(), usize::MAX.to_string())))
        }),
        ("reshaped, keyed", |block, _| {
            rewrite(block, Some(KEY), |_, arrays| {
                let keys = arrays.iter_mut().find(|a| a.0 == "k.0").unwrap();
                keys.2 = vec![keys.2[0], keys.2[1] * keys.2[2], 1, keys.2[3]];
            })
        }),
    ];
    for (what, damage) in damages {
        let root = tempfile::tempdir().unwrap();
        generate(&engine(model.path(), root.path(), 1 << 30), &prompt, 0);
        let ours = blocks(root.path());
        generate(&engine(other.path(), root.path(), 1 << 30), &ids(9, BLOCK + 10), 0);
        let foreign = blocks(root.path()).into_iter().find(|p| !ours.contains(p)).unwrap();
        // The prompt's first block (the larger of its two): the chain starts there.
        let first_block = ours.iter().max_by_key(|p| std::fs::metadata(p).unwrap().len()).unwrap().clone();
        damage(&first_block, &foreign);
        let mine = engine(model.path(), root.path(), 1 << 30);
        let (got, cached) = generate(&mine, &prompt, 0);
        assert_eq!(got, want, "{what}: the answer is the cold one");
        assert_eq!(cached, 0, "{what}: nothing was restored from a bad block");
        let disk = mine.prompt_cache_stats().disk.unwrap();
        assert_eq!(disk.rejected, 1, "{what}: {disk:?}");
        // The bad block was removed and the request wrote it again: a restart restores it all.
        let ours_now = blocks(root.path()).into_iter().filter(|p| p.parent() == first_block.parent()).count();
        assert_eq!(ours_now, ours.len(), "{what}");
        let (got, cached) = generate(&engine(model.path(), root.path(), 1 << 30), &prompt, 0);
        assert_eq!((got, cached), (want.clone(), prompt.len() - 1), "{what}: written again, whole");
    }
}

#[test]
fn the_folder_keeps_its_budget_with_two_engines_writing_at_once() {
    let model = checkpoint(Architecture::Qwen3);
    let root = tempfile::tempdir().unwrap();
    // Measure one block of this model, then give the folder room for about three.
    let probe = tempfile::tempdir().unwrap();
    generate(&engine(model.path(), probe.path(), 1 << 30), &ids(1, BLOCK), 0);
    let block = std::fs::metadata(&blocks(probe.path())[0]).unwrap().len();
    let budget = block * 3 + block / 2;
    std::thread::scope(|s| {
        for seed in [10, 20] {
            let (model, root) = (model.path(), root.path());
            s.spawn(move || {
                let e = engine(model, root, budget);
                for turn in 0..3 {
                    generate(&e, &ids(seed + turn, BLOCK + 5), 0);
                    let total: u64 =
                        blocks(root).iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
                    assert!(total <= budget, "{total} bytes on disk, budget {budget}");
                }
            });
        }
    });
    let left = blocks(root.path());
    let total: u64 = left.iter().map(|p| std::fs::metadata(p).unwrap().len()).sum();
    assert!(total <= budget && !left.is_empty(), "{} blocks, {total} bytes, budget {budget}", left.len());
    // Every block left is whole: a restart restores the newest prompt of one of the engines.
    let e = engine(model.path(), root.path(), budget);
    let (_, cached) = generate(&e, &[ids(12, BLOCK + 5), ids(3, 4)].concat(), 0);
    let (_, cached_other) = generate(&e, &[ids(22, BLOCK + 5), ids(3, 4)].concat(), 0);
    assert!(cached.max(cached_other) > 0, "the newest prompts are the ones kept");
    assert_eq!(e.prompt_cache_stats().disk.unwrap().rejected, 0);
}

#[test]
fn a_block_that_cannot_be_written_is_dropped_and_the_request_answers() {
    let model = checkpoint(Architecture::Qwen3);
    let root = tempfile::tempdir().unwrap();
    let e = engine(model.path(), root.path(), 1 << 30);
    // The model's folder in the cache becomes a file: every write fails.
    for dir in std::fs::read_dir(root.path()).unwrap().flatten().filter(|d| d.path().is_dir()) {
        std::fs::remove_dir_all(dir.path()).unwrap();
        std::fs::write(dir.path(), b"not a folder").unwrap();
    }
    let (tokens, _) = generate(&e, &ids(4, 600), 0);
    assert_eq!(tokens.len(), 8);
    assert_eq!(e.prompt_cache_stats().disk.unwrap().written, 0);
    // A budget smaller than one block: nothing is written either, and nothing fails.
    let small = tempfile::tempdir().unwrap();
    let e = engine(model.path(), small.path(), 1000);
    let (tokens, _) = generate(&e, &ids(4, 600), 0);
    assert_eq!(tokens.len(), 8);
    assert!(blocks(small.path()).is_empty());
}

/// A block names the drafter whose state it keeps: a restarted engine restores it for requests
/// that draft with that drafter, and only the trunk's state for the others (the MTP head's
/// cache and a block drafter's differ in layers and shapes).
#[test]
fn a_drafters_state_on_disk_serves_that_drafter_only() {
    let assets = common::repo_root().join("assets/models");
    let options = EngineOptions { drafter: Some(assets.join("ferrite-code-20m-dflash")), ..Default::default() };
    let root = tempfile::tempdir().unwrap();
    let fresh = || {
        let mut e = Engine::load_with(&assets.join("ferrite-code-20m"), &options).unwrap();
        e.set_prefill_chunk(CHUNK);
        e.set_prompt_cache_budget(256 << 20);
        e.set_prompt_disk(&settings(root.path(), 1 << 30)).unwrap();
        e
    };
    let prompt = ids(4, BLOCK + 10);
    let (cold, _) = generate_with(&fresh(), &prompt, 3, DraftWith::Block);
    for block in blocks(root.path()) {
        let bytes = std::fs::read(&block).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let drafter = header.metadata().as_ref().and_then(|m| m.get("drafter").cloned());
        assert_eq!(drafter.as_deref(), Some("block"), "{}", block.display());
    }
    for (with, depth) in [(DraftWith::Mtp, 2), (DraftWith::Block, 3)] {
        let (tokens, cached) = generate_with(&fresh(), &prompt, depth, with);
        assert_eq!(tokens, cold, "{with:?} from the disk tier");
        assert!(cached >= BLOCK, "{with:?}: {cached} tokens from the disk tier");
    }
}
