//! Finds tool calls in streamed answer text, in both forms Qwen models write: Qwen3's JSON
//! (`<tool_call>{"name": …, "arguments": {…}}</tool_call>`) and the XML form of Qwen3.5/3.6
//! and Qwen3-Coder (`<tool_call><function=NAME><parameter=KEY>value</parameter>…</function>
//! </tool_call>`), whose values are typed by the tool's JSON schema. Text outside calls passes
//! through; a block that is neither form is passed through as text (with a warning), so
//! nothing the model wrote is lost.

use serde_json::{Map, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: Value,
}

#[derive(Debug, Default)]
pub struct ToolCallParser {
    held: String,
    in_call: bool,
    /// Each offered tool's parameter schemas by name (`properties`), to type XML values.
    schemas: Map<String, Value>,
}

impl ToolCallParser {
    /// A parser for answers to a prompt that offered `tools` (chat-template form:
    /// `{"type": "function", "function": {"name", "parameters"}}`).
    pub fn for_tools(tools: &[Value]) -> Self {
        let schemas = tools
            .iter()
            .filter_map(|t| {
                let f = &t["function"];
                Some((f["name"].as_str()?.to_string(), f["parameters"]["properties"].clone()))
            })
            .collect();
        ToolCallParser { schemas, ..Default::default() }
    }

    /// Returns the text that is certainly not part of a call, and the calls completed.
    pub fn push(&mut self, text: &str) -> (String, Vec<ParsedCall>) {
        self.held.push_str(text);
        let (mut out, mut calls) = (String::new(), Vec::new());
        loop {
            if self.in_call {
                let Some(end) = self.held.find(CLOSE) else { return (out, calls) };
                let body = self.held[..end].to_string();
                match parse_call(&body, &self.schemas) {
                    Some(call) => calls.push(call),
                    None => {
                        tracing::warn!("a <tool_call> block that is not a call was passed on as text: {body:?}");
                        out.push_str(&format!("{OPEN}{body}{CLOSE}"))
                    }
                }
                self.held.drain(..end + CLOSE.len());
                self.in_call = false;
            } else if let Some(start) = self.held.find(OPEN) {
                out.push_str(&self.held[..start]);
                self.held.drain(..start + OPEN.len());
                self.in_call = true;
            } else {
                let keep = crate::think::partial_suffix(&self.held, OPEN);
                let emit = self.held.len() - keep;
                out.push_str(&self.held[..emit]);
                self.held.drain(..emit);
                return (out, calls);
            }
        }
    }

    /// What is left at the end (an unfinished call comes back as text).
    pub fn finish(&mut self) -> String {
        let rest = std::mem::take(&mut self.held);
        if std::mem::take(&mut self.in_call) {
            format!("{OPEN}{rest}")
        } else {
            rest
        }
    }
}

fn parse_call(body: &str, schemas: &Map<String, Value>) -> Option<ParsedCall> {
    let body = body.trim();
    if body.starts_with("<function=") {
        return parse_xml_call(body, schemas);
    }
    let v: Value = serde_json::from_str(body).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments") {
        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
        Some(a) => a.clone(),
        None => Value::Object(Default::default()),
    };
    Some(ParsedCall { name, arguments })
}

/// `<function=NAME><parameter=KEY>value</parameter>…</function>`: each value as the schema
/// types it (JSON for numbers, booleans, arrays and objects; text otherwise, one leading and
/// trailing newline removed, as Qwen's parser does).
fn parse_xml_call(body: &str, schemas: &Map<String, Value>) -> Option<ParsedCall> {
    let rest = body.strip_prefix("<function=")?;
    let (name, mut rest) = rest.split_once('>')?;
    let name = name.trim().to_string();
    let properties = schemas.get(&name);
    let mut arguments = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            return after.trim().is_empty().then_some(ParsedCall { name, arguments: Value::Object(arguments) });
        }
        let after = rest.strip_prefix("<parameter=")?;
        let (key, after) = after.split_once('>')?;
        let (raw, after) = after.split_once("</parameter>")?;
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let kind = properties.and_then(|p| p[key.trim()]["type"].as_str()).unwrap_or("string");
        arguments.insert(key.trim().to_string(), typed(raw, kind));
        rest = after;
    }
}

fn typed(raw: &str, kind: &str) -> Value {
    match kind {
        "string" => Value::String(raw.to_string()),
        // A value that does not parse as its type stays text: the client sees what was written.
        _ => serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(pieces: &[&str]) -> (String, Vec<ParsedCall>) {
        let mut p = ToolCallParser::default();
        let (mut text, mut calls) = (String::new(), vec![]);
        for piece in pieces {
            let (t, c) = p.push(piece);
            text += &t;
            calls.extend(c);
        }
        text += &p.finish();
        (text, calls)
    }

    #[test]
    fn parses_calls_split_anywhere() {
        let (text, calls) = run(&[
            "Let me look.\n<tool",
            "_call>\n{\"name\": \"read_file\", \"argu",
            "ments\": {\"path\": \"a.rs\"}}\n</tool_",
            "call>",
        ]);
        assert_eq!(text, "Let me look.\n");
        assert_eq!(calls, vec![ParsedCall { name: "read_file".into(), arguments: json!({"path": "a.rs"}) }]);
        let (_, calls) = run(&["<tool_call>{\"name\":\"a\",\"arguments\":\"{\\\"x\\\":1}\"}</tool_call><tool_call>{\"name\":\"b\"}</tool_call>"]);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, json!({"x": 1}));
        assert_eq!(calls[1].arguments, json!({}));
    }

    #[test]
    fn parses_the_xml_form_typed_by_the_schema_split_anywhere() {
        let tools = [json!({"type": "function", "function": {"name": "run", "parameters": {"type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}, "env": {"type": "object"},
                           "dry": {"type": "boolean"}}}}})];
        let text = "Running it.\n<tool_call>\n<function=run>\n<parameter=command>\nls -l\n  && echo 5\n</parameter>\n\
                    <parameter=timeout>\n30\n</parameter>\n<parameter=env>\n{\"A\": \"1\"}\n</parameter>\n\
                    <parameter=dry>\nfalse\n</parameter>\n</function>\n</tool_call>";
        for size in [1, 3, 7, text.len()] {
            let mut p = ToolCallParser::for_tools(&tools);
            let (mut out, mut calls) = (String::new(), vec![]);
            let chars: Vec<char> = text.chars().collect();
            for piece in chars.chunks(size) {
                let (t, c) = p.push(&piece.iter().collect::<String>());
                out += &t;
                calls.extend(c);
            }
            out += &p.finish();
            assert_eq!(out, "Running it.\n", "pieces of {size}");
            let want = json!({"command": "ls -l\n  && echo 5", "timeout": 30, "env": {"A": "1"}, "dry": false});
            assert_eq!(calls, vec![ParsedCall { name: "run".into(), arguments: want }], "pieces of {size}");
        }
        // Two calls in one turn; a parameter the schema does not know stays text.
        let (_, calls) = run(&["<tool_call><function=a><parameter=x>1</parameter></function></tool_call>\n\
                                <tool_call><function=b></function></tool_call>"]);
        assert_eq!(
            calls,
            vec![
                ParsedCall { name: "a".into(), arguments: json!({"x": "1"}) },
                ParsedCall { name: "b".into(), arguments: json!({}) }
            ]
        );
        // Malformed: passed on as text.
        let broken = "<tool_call><function=a><parameter=x>1</function></tool_call>";
        assert_eq!(run(&[broken]), (broken.into(), vec![]));
    }

    #[test]
    fn keeps_what_is_not_a_call() {
        assert_eq!(
            run(&["a < b and <tool_call>not json</tool_call> end"]),
            ("a < b and <tool_call>not json</tool_call> end".into(), vec![])
        );
        assert_eq!(run(&["<tool_call>{\"name\": \"x\""]), ("<tool_call>{\"name\": \"x\"".into(), vec![]));
        assert_eq!(run(&["plain <tool"]), ("plain <tool".into(), vec![]));
    }
}
