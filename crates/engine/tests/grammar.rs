//! Output held to a grammar: the embedded model, whose free answers are code, not JSON, writes
//! documents that parse and validate under each request's JSON schema, greedy and sampled,
//! with and without MTP speculation (greedy: the same tokens either way); a regular expression
//! and a Lark grammar hold too; a schema the grammar engine cannot take is refused before
//! generating.

use std::path::PathBuf;

use engine::{Engine, FinishReason, GenerateRequest, Grammar, SamplingParams};
use serde_json::{json, Value};

fn embedded() -> Engine {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../assets/models/ferrite-code-20m");
    Engine::load(&dir).unwrap()
}

fn request(e: &Engine, grammar: Grammar, temperature: f32, seed: u64, depth: usize) -> GenerateRequest {
    let prompt = e.tokenizer().encode("def parse_config(path):\n    \"\"\"Read the settings file.").unwrap();
    let sampling = SamplingParams { temperature, seed: Some(seed), ..Default::default() };
    GenerateRequest { sampling, grammar: Some(grammar), draft_depth: depth, ..GenerateRequest::greedy(prompt, 160) }
}

fn answer_at(e: &Engine, grammar: Grammar, temperature: f32, seed: u64, depth: usize) -> (String, FinishReason) {
    let (text, summary) = e.generate_text(request(e, grammar, temperature, seed, depth)).unwrap();
    (text, summary.finish_reason)
}

fn answer(e: &Engine, grammar: Grammar, temperature: f32, seed: u64) -> (String, FinishReason) {
    answer_at(e, grammar, temperature, seed, 0)
}

fn schemas() -> Vec<Value> {
    vec![
        json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}),
        json!({
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "port": {"type": "integer", "minimum": 1, "maximum": 65535}},
            "required": ["name", "port"],
            "additionalProperties": false
        }),
        json!({
            "type": "object",
            "properties": {
                "level": {"enum": ["debug", "info", "warn"]},
                "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "minItems": 1, "maxItems": 3},
                "limits": {
                    "type": "object",
                    "properties": {"cpu": {"type": "number", "minimum": 0, "maximum": 64}, "on": {"type": "boolean"}},
                    "required": ["cpu", "on"],
                    "additionalProperties": false
                }
            },
            "required": ["level", "tags", "limits"],
            "additionalProperties": false
        }),
        json!({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}),
    ]
}

#[test]
fn answers_parse_and_validate_under_their_schema() {
    let e = embedded();
    for (i, schema) in schemas().into_iter().enumerate() {
        let validator = jsonschema::validator_for(&schema).unwrap();
        for (temperature, seed) in [(0.0, 0), (0.7, 1), (0.7, 2)] {
            let (text, finish) = answer(&e, Grammar::JsonSchema(schema.clone()), temperature, seed);
            let case = format!("schema {i} at T {temperature} seed {seed}: {text:?} ({finish:?})");
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|err| panic!("{case}: {err}"));
            assert!(validator.is_valid(&value), "{case}");
            assert_eq!(finish, FinishReason::Stop, "{case}");
        }
    }
}

#[test]
fn speculation_stays_on_and_exact_under_the_grammar() {
    let e = embedded();
    let before = e.spec_totals();
    for (i, schema) in schemas().into_iter().enumerate() {
        let validator = jsonschema::validator_for(&schema).unwrap();
        let grammar = Grammar::JsonSchema(schema);
        // Greedy: the drafts and the verified positions masked alike give plain constrained
        // decoding's tokens.
        let plain = e.generate(request(&e, grammar.clone(), 0.0, 0, 0), Default::default()).unwrap().token_ids();
        for depth in [1, 2, 3] {
            let spec = e.generate(request(&e, grammar.clone(), 0.0, 0, depth), Default::default()).unwrap().token_ids();
            assert_eq!(spec.unwrap(), *plain.as_ref().unwrap(), "schema {i} depth {depth}");
        }
        // Sampled: valid documents.
        for seed in [1, 2] {
            let (text, finish) = answer_at(&e, grammar.clone(), 0.7, seed, 2);
            let case = format!("schema {i} sampled at depth 2, seed {seed}: {text:?} ({finish:?})");
            let value: Value = serde_json::from_str(&text).unwrap_or_else(|err| panic!("{case}: {err}"));
            assert!(validator.is_valid(&value), "{case}");
        }
    }
    let spec = e.spec_totals();
    assert!(spec.cycles > before.cycles, "the speculative path ran");
    eprintln!("MTP acceptance under the grammar, by position: {:?}", spec.acceptance());
}

#[test]
fn a_regex_and_a_lark_grammar_hold() {
    let e = embedded();
    let (text, _) = answer(&e, Grammar::Regex("(yes|no), [0-9]{3}".into()), 0.7, 3);
    let ok = text.strip_prefix("yes, ").or_else(|| text.strip_prefix("no, "));
    assert!(ok.is_some_and(|n| n.len() == 3 && n.bytes().all(|b| b.is_ascii_digit())), "{text:?}");
    let lark = r#"start: "let " NAME " = " NUMBER ";"
NAME: /[a-z]{1,6}/
NUMBER: /[0-9]{1,4}/"#;
    let (text, _) = answer(&e, Grammar::Lark(lark.into()), 0.0, 0);
    assert!(text.starts_with("let ") && text.ends_with(';') && text.contains(" = "), "{text:?}");
}

#[test]
fn a_grammar_that_cannot_be_built_is_refused_up_front() {
    let e = embedded();
    let prompt = e.tokenizer().encode("x").unwrap();
    for bad in [Grammar::Lark("start: undefined_rule".into()), Grammar::Regex("(unclosed".into())] {
        let req = GenerateRequest { grammar: Some(bad.clone()), ..GenerateRequest::greedy(prompt.clone(), 8) };
        let err = e.generate(req, Default::default()).err().unwrap_or_else(|| panic!("{bad:?} was accepted"));
        assert!(err.to_string().contains("cannot be enforced"), "{err}");
    }
}

/// The think block stays free text and the grammar holds what follows it: where the template
/// opens the block, where the model opens it itself, and none where thinking is turned off.
#[test]
fn the_think_block_stays_free_and_the_grammar_holds_after_it() {
    use engine::tokenizer::ChatMessage;
    let e = embedded();
    let schema = &schemas()[1];
    let validator = jsonschema::validator_for(schema).unwrap();
    let messages = [ChatMessage::new("user", "Describe the server's settings as JSON.")];
    let chat = |thinking: Option<bool>| {
        let mut vars = serde_json::Map::new();
        if let Some(on) = thinking {
            vars.insert("enable_thinking".into(), on.into());
        }
        e.tokenizer().apply_chat_template(&messages, true, &vars).unwrap()
    };
    let opened = format!("{}<think>\n\n", chat(None));
    for (case, prompt) in
        [("the model opens it", chat(None)), ("the template opened it", opened), ("off", chat(Some(false)))]
    {
        let ids = e.tokenizer().encode(&prompt).unwrap();
        let request =
            GenerateRequest { grammar: Some(Grammar::JsonSchema(schema.clone())), ..GenerateRequest::greedy(ids, 200) };
        let (text, summary) = e.generate_text(request).unwrap();
        let document = match text.rsplit_once("</think>") {
            Some((thought, rest)) => {
                assert_ne!(case, "off", "{text:?}");
                assert!(!thought.contains('{'), "{case}: the block is the model's own text: {text:?}");
                rest.trim_start()
            }
            None => {
                assert_eq!(case, "off", "{case}: {text:?}");
                text.as_str()
            }
        };
        let value: Value = serde_json::from_str(document).unwrap_or_else(|err| panic!("{case}: {text:?}: {err}"));
        assert!(validator.is_valid(&value), "{case}: {text:?}");
        assert_eq!(summary.finish_reason, FinishReason::Stop, "{case}: {text:?}");
    }
}

/// A schema llguidance cannot take is refused naming where in the schema the problem is.
#[test]
fn a_refused_schema_names_the_path_of_what_was_refused() {
    let e = embedded();
    let cases = [
        (
            json!({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"if": {"type": "string"}, "then": {"minLength": 2}}}}}}),
            "/properties/a/properties/b",
        ),
        (json!({"type": "array", "items": {"type": "string", "format": "no-such-format"}}), "/items"),
        (json!({"anyOf": [{"type": "integer"}, {"$ref": "#/$defs/missing"}]}), "/anyOf/1"),
    ];
    for (schema, path) in cases {
        let request = GenerateRequest {
            grammar: Some(Grammar::JsonSchema(schema.clone())),
            ..GenerateRequest::greedy(vec![1, 2, 3], 4)
        };
        let err = e.generate_text(request).unwrap_err().to_string();
        assert!(err.contains(&format!("`{path}`")), "{schema}: {err}");
    }
}

#[test]
fn text_held_back_for_a_stop_string_is_kept_when_the_grammar_ends_the_answer() {
    let e = embedded();
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
    for depth in [0, 2] {
        let mut req = request(&e, Grammar::JsonSchema(schema.clone()), 0.0, 1, depth);
        // The answer's last `}` could begin this stop string: it is held back until the end.
        req.stop = vec!["}\n".into(), "}}".into()];
        let (text, summary) = e.generate_text(req).unwrap();
        let doc: Value = serde_json::from_str(&text).unwrap_or_else(|err| panic!("depth {depth}: {text:?}: {err}"));
        assert!(doc["ok"].is_boolean(), "{text}");
        assert_eq!(summary.finish_reason, FinishReason::Stop);
    }
}

#[test]
fn a_grammar_past_the_limits_is_refused_by_name_not_compiled() {
    let e = embedded();
    let mut defs = serde_json::Map::new();
    for i in 0..700 {
        defs.insert(format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)}));
    }
    defs.insert("d700".into(), json!({"type": "string"}));
    let chain = json!({"$ref": "#/$defs/d0", "$defs": defs});
    let deep_lark = format!("start: {}\"a\"{}", "(".repeat(5000), ")".repeat(5000));
    for grammar in
        [Grammar::JsonSchema(chain), Grammar::Lark(deep_lark), Grammar::Regex("(".repeat(300) + &")".repeat(300))]
    {
        let err = e.generate_text(request(&e, grammar, 0.0, 1, 0)).unwrap_err().to_string();
        assert!(err.contains("too large to enforce"), "{err}");
    }
    // The engine goes on.
    let (text, _) = answer(&e, Grammar::Regex("[a-z]{3}".into()), 0.0, 1);
    assert_eq!(text.len(), 3, "{text}");
}
