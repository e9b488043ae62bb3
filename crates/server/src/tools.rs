//! Finds Qwen's `<tool_call>{"name": …, "arguments": {…}}</tool_call>` blocks in streamed
//! answer text. Text outside them passes through; a block that is not valid JSON is passed
//! through as text too, so nothing the model wrote is lost.

use serde_json::Value;

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
}

impl ToolCallParser {
    /// Returns the text that is certainly not part of a call, and the calls completed.
    pub fn push(&mut self, text: &str) -> (String, Vec<ParsedCall>) {
        self.held.push_str(text);
        let (mut out, mut calls) = (String::new(), Vec::new());
        loop {
            if self.in_call {
                let Some(end) = self.held.find(CLOSE) else { return (out, calls) };
                let body = self.held[..end].to_string();
                match parse_call(&body) {
                    Some(call) => calls.push(call),
                    None => out.push_str(&format!("{OPEN}{body}{CLOSE}")),
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

fn parse_call(body: &str) -> Option<ParsedCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments") {
        Some(Value::String(s)) => serde_json::from_str(s).unwrap_or(Value::String(s.clone())),
        Some(a) => a.clone(),
        None => Value::Object(Default::default()),
    };
    Some(ParsedCall { name, arguments })
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
    fn keeps_what_is_not_a_call() {
        assert_eq!(
            run(&["a < b and <tool_call>not json</tool_call> end"]),
            ("a < b and <tool_call>not json</tool_call> end".into(), vec![])
        );
        assert_eq!(run(&["<tool_call>{\"name\": \"x\""]), ("<tool_call>{\"name\": \"x\"".into(), vec![]));
        assert_eq!(run(&["plain <tool"]), ("plain <tool".into(), vec![]));
    }
}
