//! Broken checkpoints are refused with an error that names the file and what is wrong.

mod common;

use std::path::Path;

use engine::checkpoint::{Architecture, Dtype};
use engine::Engine;

fn load_err(dir: &Path) -> String {
    match Engine::load(dir) {
        Ok(_) => panic!("{} loaded but should not have", dir.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    f(&mut c);
    std::fs::write(path, c.to_string()).unwrap();
}

fn tiny(bits: Option<i32>) -> tempfile::TempDir {
    common::make(&common::options(Architecture::Qwen3, "tiny", bits, 32, Dtype::Bfloat16))
}

#[test]
fn malformed_config() {
    let d = tiny(None);
    std::fs::write(d.path().join("config.json"), "{\"model_type\": \"qwen3\",").unwrap();
    let e = load_err(d.path());
    assert!(e.contains("config.json") && e.contains("not valid JSON"), "{e}");
}

#[test]
fn wrong_field_type() {
    let d = tiny(None);
    edit_config(d.path(), |c| c["num_attention_heads"] = "many".into());
    let e = load_err(d.path());
    assert!(e.contains("config.json") && e.contains("num_attention_heads"), "{e}");
}

#[test]
fn unknown_architecture() {
    let d = tiny(None);
    edit_config(d.path(), |c| c["model_type"] = "mamba".into());
    let e = load_err(d.path());
    assert!(e.contains("unknown architecture `mamba`") && e.contains("qwen3"), "{e}");
}

#[test]
fn unsupported_quantization() {
    let d = tiny(Some(4));
    edit_config(d.path(), |c| c["quantization"]["bits"] = 7.into());
    let e = load_err(d.path());
    assert!(e.contains("unsupported quantization") && e.contains("7 bits"), "{e}");
    edit_config(d.path(), |c| {
        c["quantization"]["bits"] = 4.into();
        c["quantization"]["mode"] = "mxfp4".into();
    });
    let e = load_err(d.path());
    assert!(e.contains("mode `mxfp4`"), "{e}");
}

#[test]
fn quantized_weights_without_quantization_block() {
    let d = tiny(Some(4));
    edit_config(d.path(), |c| {
        let o = c.as_object_mut().unwrap();
        o.remove("quantization");
        o.remove("quantization_config");
    });
    let e = load_err(d.path());
    assert!(e.contains("is quantized but the config gives no bits"), "{e}");
}

#[test]
fn shape_mismatch() {
    let d = tiny(None);
    edit_config(d.path(), |c| c["intermediate_size"] = 96.into());
    let e = load_err(d.path());
    assert!(e.contains("model.safetensors") && e.contains("mlp.gate_proj.weight") && e.contains("[96, 64]"), "{e}");
}

#[test]
fn truncated_safetensors() {
    let d = tiny(None);
    let file = d.path().join("model.safetensors");
    let len = std::fs::metadata(&file).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
    f.set_len(len - 1000).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model.safetensors") && e.contains("truncated"), "{e}");
    f.set_len(5).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn missing_shard_and_missing_tensor() {
    let mut o = common::options(Architecture::Qwen3, "tiny", None, 64, Dtype::Float32);
    o.shard_bytes = 100_000;
    let d = common::make(&o);
    let mut shards: Vec<_> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("model-"))
        .collect();
    shards.sort();
    assert!(shards.len() >= 3 && shards[1].starts_with("model-00002-of-"), "{shards:?}");
    let shard = d.path().join(&shards[1]);
    let moved = d.path().join("elsewhere.bin");
    std::fs::rename(&shard, &moved).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("model.safetensors.index.json") && e.contains(&shards[1]) && e.contains("missing"), "{e}");
    std::fs::rename(&moved, &shard).unwrap();
    Engine::load(d.path()).unwrap();

    // Drop a tensor: the error names it.
    let d = tiny(None);
    edit_config(d.path(), |c| c["num_hidden_layers"] = 3.into());
    let e = load_err(d.path());
    assert!(e.contains("model.layers.2.") && e.contains("missing"), "{e}");
}

#[test]
fn extra_tensors_are_not_ignored() {
    let d = tiny(None);
    edit_config(d.path(), |c| c["num_hidden_layers"] = 1.into());
    let e = load_err(d.path());
    assert!(e.contains("not used by the model") && e.contains("model.layers.1."), "{e}");
}

#[test]
fn missing_tokenizer_and_files() {
    let d = tiny(None);
    std::fs::remove_file(d.path().join("tokenizer.json")).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("tokenizer.json") && e.contains("missing"), "{e}");
    let e = load_err(Path::new("/nonexistent/model"));
    assert!(e.contains("/nonexistent/model/config.json"), "{e}");
}

#[test]
fn hybrid_config_without_linear_attention_fields() {
    let d = common::make(&common::options(Architecture::Qwen3Next, "tiny", None, 32, Dtype::Float32));
    edit_config(d.path(), |c| {
        c.as_object_mut().unwrap().remove("linear_key_head_dim");
    });
    let e = load_err(d.path());
    assert!(e.contains("config.json") && e.contains("linear_key_head_dim"), "{e}");
    let d = common::make(&common::options(Architecture::Qwen35, "tiny", None, 32, Dtype::Float32));
    edit_config(d.path(), |c| c["text_config"]["layer_types"] = serde_json::json!(["full_attention"]));
    let e = load_err(d.path());
    assert!(e.contains("layer_types") && e.contains("1 entries for 4 layers"), "{e}");
    edit_config(d.path(), |c| c["text_config"]["hidden_size"] = "wide".into());
    let e = load_err(d.path());
    assert!(e.contains("text_config.hidden_size"), "{e}");
}

#[test]
fn broken_chat_template_fails_chat_requests_only() {
    let d = tiny(None);
    let path = d.path().join("tokenizer_config.json");
    let mut c: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    c["chat_template"] = "{% for m in messages %}{{ m.content }".into();
    std::fs::write(&path, c.to_string()).unwrap();
    let e = Engine::load(d.path()).unwrap();
    assert!(!e.tokenizer().has_chat_template());
    let err = e
        .tokenizer()
        .apply_chat_template(&[engine::tokenizer::ChatMessage::new("user", "hi")], true, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("chat template"), "{err}");
    assert!(!e.tokenizer().encode("plain text still works").unwrap().is_empty());
}

#[test]
fn a_hostile_chat_template_is_stopped_and_named() {
    // Templates ship with models: one that loops, grows its output without end or builds
    // more text or lists than memory holds is stopped (minijinja's fuel, an output cap, the
    // patched minijinja's build budget) with an error naming the template; the process lives.
    let d = tiny(None);
    let path = d.path().join("tokenizer_config.json");
    let original = std::fs::read_to_string(&path).unwrap();
    let messages = [engine::tokenizer::ChatMessage::new("user", "hi")];
    for (template, expect) in [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
        ("{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}", "MiB"),
        // Each `~` doubles: 100 MB to 25 GB in eight steps.
        (
            "{% set s = 'x' * 100000000 %}{% for i in range(8) %}{% set s = s ~ s %}{% endfor %}{{ s | length }}",
            "MiB of text",
        ),
        ("{% set s = 'x' * 100000000 %}{% set s = s + s + s + s %}{{ s | length }}", "MiB of text"),
        ("{{ (['x' * 10000000] * 1000) | join('') | length }}", "MiB of text"),
        ("{{ ''.join(['x' * 10000000] * 1000) | length }}", "MiB of text"),
        ("{{ ('x' * 1000000).replace('x', 'y' * 10000) | length }}", "MiB of text"),
        ("{{ ('x' * 1000000) | replace('x', 'y' * 10000) | length }}", "MiB of text"),
        ("{{ ([0] * 100000000) | list | length }}", "MiB of text"),
        ("{{ ('a ' * 50000000).split() | length }}", "MiB of text"),
        ("{{ '%999999999999s' | format('a') }}", "MiB of text"),
        ("{{ '{:>999999999999}'.format('a') }}", "MiB of text"),
        ("{{ messages | tojson(indent=100000000000) }}", "MiB of text"),
        ("{{ ('x\n' * 1000000) | indent(100000) | length }}", "MiB of text"),
        (
            "{% set x %}{% for i in range(100000) %}{{ 'x' * 10000 }}{% endfor %}{% endset %}{{ x | length }}",
            "MiB of text",
        ),
    ] {
        let mut c: serde_json::Value = serde_json::from_str(&original).unwrap();
        c["chat_template"] = template.into();
        std::fs::write(&path, c.to_string()).unwrap();
        let tokenizer = engine::tokenizer::Tokenizer::load(d.path()).unwrap();
        let started = std::time::Instant::now();
        let err = tokenizer.apply_chat_template(&messages, true, &Default::default()).unwrap_err().to_string();
        assert!(err.contains("chat template") && err.contains(expect), "{err}");
        assert!(err.contains(&d.path().display().to_string()), "the error names the template's model: {err}");
        eprintln!("{template}: stopped after {:?}", started.elapsed());
    }
    // An ordinary template on a long conversation stays within the budget.
    let mut c: serde_json::Value = serde_json::from_str(&original).unwrap();
    c["chat_template"] =
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content.split('</think>')[-1].strip() ~ '\n' }}{% endfor %}"
            .into();
    std::fs::write(&path, c.to_string()).unwrap();
    let tokenizer = engine::tokenizer::Tokenizer::load(d.path()).unwrap();
    let long: Vec<_> =
        (0..40).map(|i| engine::tokenizer::ChatMessage::new("user", &format!("{i}{}", "y".repeat(100_000)))).collect();
    let text = tokenizer.apply_chat_template(&long, true, &Default::default()).unwrap();
    assert!(text.len() > 4_000_000, "{}", text.len());
}

#[test]
fn absurd_sizes_are_refused_by_name_before_anything_is_allocated() {
    for (field, value) in [
        ("num_hidden_layers", serde_json::json!(100_000_000)),
        ("hidden_size", serde_json::json!(2_147_483_647)),
        ("vocab_size", serde_json::json!(1_000_000_000)),
        ("intermediate_size", serde_json::json!(2_000_000_000)),
        ("max_position_embeddings", serde_json::json!(2_000_000_000)),
        ("head_dim", serde_json::json!(1_000_000)),
    ] {
        let d = tiny(None);
        edit_config(d.path(), |c| c[field] = value.clone());
        let e = load_err(d.path());
        assert!(e.contains(field) && e.contains("config.json"), "{field}: {e}");
    }
}

/// A model folder whose `name` is a link to a file outside it, holding a secret.
fn link_outside(d: &Path, name: &str) -> tempfile::TempDir {
    let outside = tempfile::tempdir().unwrap();
    let secret = outside.path().join("secret");
    std::fs::write(&secret, "{\"hidden_size\": \"TOPSECRET\"}").unwrap();
    std::fs::remove_file(d.join(name)).unwrap();
    std::os::unix::fs::symlink(&secret, d.join(name)).unwrap();
    outside
}

#[test]
fn files_that_lead_outside_the_model_folder_are_refused_unread() {
    // Shard names from the index: only plain names in the folder.
    let mut o = common::options(Architecture::Qwen3, "tiny", None, 64, Dtype::Float32);
    o.shard_bytes = 100_000;
    let d = common::make(&o);
    let index = d.path().join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).unwrap();
    let first = text.split("\"model-").nth(1).unwrap().split('"').next().unwrap().to_string();
    for bad in ["../elsewhere.safetensors", "/etc/passwd", "sub/../../x.safetensors"] {
        std::fs::write(&index, text.replace(&format!("model-{first}"), bad)).unwrap();
        let e = load_err(d.path());
        assert!(e.contains(bad) && e.contains("not a file name"), "{e}");
    }
    std::fs::write(&index, &text).unwrap();
    Engine::load(d.path()).unwrap();

    // Links to files elsewhere: config, tokenizer files, weights. The error never quotes them.
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"] {
        let d = tiny(None);
        let _outside = link_outside(d.path(), name);
        let e = load_err(d.path());
        assert!(e.contains("outside the model folder") && e.contains(name), "{name}: {e}");
        assert!(!e.contains("TOPSECRET"), "{name}: {e}");
    }
}

#[test]
fn the_hub_layout_links_into_blobs_are_followed() {
    // models--ORG--NAME/snapshots/REV/FILE -> ../../blobs/HASH, as the hub and its tools lay them out.
    let d = tiny(None);
    let repo = tempfile::tempdir().unwrap();
    let (blobs, snapshot) = (repo.path().join("blobs"), repo.path().join("snapshots").join("0123abcd"));
    std::fs::create_dir_all(&blobs).unwrap();
    std::fs::create_dir_all(&snapshot).unwrap();
    for (i, entry) in std::fs::read_dir(d.path()).unwrap().enumerate() {
        let entry = entry.unwrap();
        let blob = blobs.join(format!("blob{i}"));
        std::fs::copy(entry.path(), &blob).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/blob{i}"), snapshot.join(entry.file_name())).unwrap();
    }
    Engine::load(&snapshot).unwrap();
    // The weights' size is the blobs', not the links' (the Turbo profile wires that much on a
    // Mac): every way Ferrite sizes the weights follows the links.
    let real = std::fs::metadata(d.path().join("model.safetensors")).unwrap().len();
    assert!(real > 1000);
    let link = std::fs::symlink_metadata(snapshot.join("model.safetensors")).unwrap().len();
    assert!(link < 100, "{link}");
    assert_eq!(engine::inspect::inspect(&snapshot, &Default::default()).unwrap().bytes_on_disk, real);
}

#[test]
fn weights_larger_than_memory_are_refused_before_loading() {
    // A (sparse) weight file larger than the machine's memory: refused by its size, unread.
    let d = tiny(None);
    let file = std::fs::OpenOptions::new().write(true).open(d.path().join("model.safetensors")).unwrap();
    file.set_len(engine::device::total_memory() + (1 << 30)).unwrap();
    let e = load_err(d.path());
    assert!(e.contains("more than this machine's") && e.contains("GB of memory"), "{e}");
}
