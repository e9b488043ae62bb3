//! Finds tool calls in streamed answer text, in both forms Qwen models write: Qwen3's JSON
//! (`<tool_call>{"name": …, "arguments": {…}}</tool_call>`) and the XML form of Qwen3.5/3.6
//! and Qwen3-Coder (`<tool_call><function=NAME><parameter=KEY>value</parameter>…</function>
//! </tool_call>`), whose values are typed by the tool's JSON schema. Text outside calls passes
//! through. A call is streamed as the model writes it: it begins once its name is known, its
//! arguments follow in fragments (the JSON form's arguments as written; the XML form's one
//! parameter at a time), and it ends with the whole call. A block that is neither form is
//! passed through as text (with a warning), so nothing the model wrote is lost; a call that
//! began and then goes wrong ends with the arguments it had (also with a warning).

use serde_json::{Map, Value};

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: Value,
}

/// What a stream learns about tool calls, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum CallEvent {
    /// A call began: its tool's name. Its arguments follow.
    Begin { name: String },
    /// More of the begun call's arguments: the fragments joined are its arguments document.
    Arguments(String),
    /// A call is complete: the one begun, or (when it could not be streamed) a whole new one.
    End(ParsedCall),
}

impl CallEvent {
    /// The complete calls among `events` (what a non-streamed answer needs).
    pub fn completed(events: Vec<CallEvent>) -> impl Iterator<Item = ParsedCall> {
        events.into_iter().filter_map(|e| match e {
            CallEvent::End(call) => Some(call),
            _ => None,
        })
    }
}

/// Text that is certainly not part of a call, and what was learnt about calls.
#[derive(Debug, Default, PartialEq)]
pub struct Parsed {
    pub text: String,
    pub calls: Vec<CallEvent>,
}

#[derive(Debug, Default)]
pub struct ToolCallParser {
    /// Outside a call: text that may begin `<tool_call>`; inside: the call's body so far.
    held: String,
    in_call: bool,
    /// The call being streamed, once its name is known.
    streaming: Option<Streaming>,
    /// Each offered tool's parameter schemas by name (`properties`), to type XML values.
    schemas: Map<String, Value>,
}

/// A call whose name is known: how far its body has been read, and what was sent of it.
#[derive(Debug)]
struct Streaming {
    name: String,
    /// Bytes of the body read so far.
    read: usize,
    form: Form,
    /// The arguments sent so far.
    sent: String,
}

#[derive(Debug)]
enum Form {
    /// The arguments object as written, up to its closing brace.
    Json { depth: u32, in_string: bool, escaped: bool, done: bool },
    /// One JSON member per `<parameter>`, the closing brace at `</function>`.
    Xml { parameters: usize, done: bool },
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

    /// Reads more of the answer.
    pub fn push(&mut self, text: &str) -> Parsed {
        self.held.push_str(text);
        let mut out = Parsed::default();
        loop {
            if self.in_call {
                let Some(end) = self.held.find(CLOSE) else {
                    // Stream what is certainly body: not a `</tool_call>` still arriving.
                    let keep = crate::think::partial_suffix(&self.held, CLOSE);
                    let body = self.held[..self.held.len() - keep].to_string();
                    self.stream(&body, &mut out.calls);
                    return out;
                };
                let body = self.held[..end].to_string();
                self.stream(&body, &mut out.calls);
                self.end_call(&body, &mut out);
                self.held.drain(..end + CLOSE.len());
                self.in_call = false;
            } else if let Some(start) = self.held.find(OPEN) {
                out.text.push_str(&self.held[..start]);
                self.held.drain(..start + OPEN.len());
                self.in_call = true;
            } else {
                let keep = crate::think::partial_suffix(&self.held, OPEN);
                let emit = self.held.len() - keep;
                out.text.push_str(&self.held[..emit]);
                self.held.drain(..emit);
                return out;
            }
        }
    }

    /// What is left at the end: an unfinished call comes back as text, or, when it had begun,
    /// ends with the arguments it had.
    pub fn finish(&mut self) -> Parsed {
        let rest = std::mem::take(&mut self.held);
        let mut out = Parsed::default();
        if !std::mem::take(&mut self.in_call) {
            out.text = rest;
            return out;
        }
        self.stream(&rest, &mut out.calls);
        match self.streaming.take() {
            Some(s) => {
                tracing::warn!("the answer ended inside a call of `{}`: it ends with the arguments it had", s.name);
                s.end(&mut out.calls);
            }
            None => out.text = format!("{OPEN}{rest}"),
        }
        out
    }

    /// Sends what `body` (the call's body so far) adds to the call being streamed, beginning it
    /// once its name is known.
    fn stream(&mut self, body: &str, events: &mut Vec<CallEvent>) {
        if self.streaming.is_none() {
            let Some((name, read, form)) = header(body) else { return };
            events.push(CallEvent::Begin { name: name.clone() });
            self.streaming = Some(Streaming { name, read, form, sent: String::new() });
        }
        let Some(s) = self.streaming.as_mut() else { return };
        let before = s.sent.len();
        match &mut s.form {
            Form::Json { depth, in_string, escaped, done } => {
                let mut end = body.len();
                for (i, c) in body[s.read..].char_indices() {
                    if *done {
                        end = s.read + i;
                        break;
                    }
                    match (c, *in_string, *escaped) {
                        (_, true, true) => *escaped = false,
                        ('\\', true, false) => *escaped = true,
                        ('"', _, false) => *in_string = !*in_string,
                        ('{' | '[', false, _) => *depth += 1,
                        ('}' | ']', false, _) => {
                            *depth = depth.saturating_sub(1);
                            *done = *depth == 0;
                        }
                        _ => {}
                    }
                }
                s.sent.push_str(&body[s.read..end]);
                s.read = end;
            }
            Form::Xml { parameters, done } => loop {
                if *done {
                    break;
                }
                let rest = &body[s.read..];
                let trimmed = rest.trim_start();
                if trimmed.starts_with("</function>") {
                    s.sent.push_str(if *parameters == 0 { "{}" } else { "}" });
                    *done = true;
                    s.read = body.len() - trimmed.len() + "</function>".len();
                    break;
                }
                let Some(((key, raw), after)) = trimmed.strip_prefix("<parameter=").and_then(|p| {
                    let (key, p) = p.split_once('>')?;
                    let (raw, after) = p.split_once("</parameter>")?;
                    Some(((key.trim(), raw), after))
                }) else {
                    break;
                };
                let value = parameter_value(raw, key, self.schemas.get(&s.name));
                let member = format!("{}{}: {value}", if *parameters == 0 { "{" } else { ", " }, Value::from(key));
                s.sent.push_str(&member);
                *parameters += 1;
                s.read = body.len() - after.len();
            },
        }
        if s.sent.len() > before {
            events.push(CallEvent::Arguments(s.sent[before..].to_string()));
        }
    }

    /// The call's body is complete: the call ends, or the block goes back as text.
    fn end_call(&mut self, body: &str, out: &mut Parsed) {
        let parsed = parse_call(body, &self.schemas);
        match (self.streaming.take(), parsed) {
            (_, Some(call)) => out.calls.push(CallEvent::End(call)),
            (Some(s), None) => {
                tracing::warn!("a call of `{}` is malformed: it ends with the arguments it had: {body:?}", s.name);
                s.end(&mut out.calls);
            }
            (None, None) => {
                tracing::warn!("a <tool_call> block that is not a call was passed on as text: {body:?}");
                out.text.push_str(&format!("{OPEN}{body}{CLOSE}"));
            }
        }
    }
}

impl Streaming {
    /// Ends a call cut short with the arguments sent: the XML form's parameters so far make a
    /// whole object once closed; JSON arguments cut short stay text.
    fn end(mut self, events: &mut Vec<CallEvent>) {
        if let Form::Xml { parameters, done: false } = self.form {
            let close = if parameters == 0 { "{}" } else { "}" };
            self.sent.push_str(close);
            events.push(CallEvent::Arguments(close.into()));
        }
        let arguments = serde_json::from_str(&self.sent).unwrap_or(Value::String(self.sent));
        events.push(CallEvent::End(ParsedCall { name: self.name, arguments }));
    }
}

/// A call's name, where its arguments begin in `body`, and their form, once the body shows
/// them: `<function=NAME>`, or `{"name": "NAME", "arguments": {` (arguments given as a string,
/// or before the name, are not streamed: the call comes whole at its end).
fn header(body: &str) -> Option<(String, usize, Form)> {
    let start = body.len() - body.trim_start().len();
    let text = &body[start..];
    if let Some(rest) = text.strip_prefix("<function=") {
        let (name, _) = rest.split_once('>')?;
        let read = start + "<function=".len() + name.len() + 1;
        return Some((name.trim().to_string(), read, Form::Xml { parameters: 0, done: false }));
    }
    let rest = text.strip_prefix('{')?.trim_start();
    let rest = rest.strip_prefix("\"name\"")?.trim_start().strip_prefix(':')?.trim_start();
    let rest = rest.strip_prefix('"')?;
    let (name, rest) = rest.split_once('"')?;
    if name.contains('\\') {
        return None;
    }
    let rest = rest.trim_start().strip_prefix(',')?.trim_start();
    let rest = rest.strip_prefix("\"arguments\"")?.trim_start().strip_prefix(':')?.trim_start();
    rest.starts_with('{').then(|| {
        let read = body.len() - rest.len();
        (name.to_string(), read, Form::Json { depth: 0, in_string: false, escaped: false, done: false })
    })
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
        arguments.insert(key.trim().to_string(), parameter_value(raw, key.trim(), properties));
        rest = after;
    }
}

/// An XML parameter's value, typed by the tool's schema (`properties`).
fn parameter_value(raw: &str, key: &str, properties: Option<&Value>) -> Value {
    let raw = raw.strip_prefix('\n').unwrap_or(raw);
    let raw = raw.strip_suffix('\n').unwrap_or(raw);
    let kind = properties.and_then(|p| p[key]["type"].as_str()).unwrap_or("string");
    typed(raw, kind)
}

fn typed(raw: &str, kind: &str) -> Value {
    // The templates write values with Jinja's `string` filter, which is Python's `str`: the
    // models learnt `True`, `False` and `None` for JSON's `true`, `false` and `null`.
    match (kind, raw.trim()) {
        ("string", _) => Value::String(raw.to_string()),
        ("boolean", "True" | "true") => Value::Bool(true),
        ("boolean", "False" | "false") => Value::Bool(false),
        (_, "None") => Value::Null,
        // A value that does not parse as its type stays text: the client sees what was written.
        _ => serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Text, complete calls and every event, pushing `pieces` one by one.
    fn run_events(p: &mut ToolCallParser, pieces: &[&str]) -> (String, Vec<CallEvent>) {
        let (mut text, mut events) = (String::new(), vec![]);
        for piece in pieces {
            let out = p.push(piece);
            text += &out.text;
            events.extend(out.calls);
        }
        let out = p.finish();
        text += &out.text;
        events.extend(out.calls);
        (text, events)
    }

    fn run(pieces: &[&str]) -> (String, Vec<ParsedCall>) {
        let (text, events) = run_events(&mut ToolCallParser::default(), pieces);
        (text, CallEvent::completed(events).collect())
    }

    /// Each call's streamed arguments, joined (the events must be well ordered).
    fn streamed(events: &[CallEvent]) -> Vec<(String, String)> {
        let mut calls: Vec<(String, String)> = vec![];
        let mut open = false;
        for e in events {
            match e {
                CallEvent::Begin { name } => {
                    assert!(!open, "a call began inside another: {events:?}");
                    calls.push((name.clone(), String::new()));
                    open = true;
                }
                CallEvent::Arguments(a) => calls.last_mut().filter(|_| open).expect("arguments outside a call").1 += a,
                CallEvent::End(_) => open = false,
            }
        }
        calls
    }

    fn pieces_of(text: &str, size: usize) -> Vec<String> {
        text.chars().collect::<Vec<_>>().chunks(size).map(|c| c.iter().collect()).collect()
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
            let pieces = pieces_of(text, size);
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (out, events) = run_events(&mut ToolCallParser::for_tools(&tools), &pieces);
            assert_eq!(out, "Running it.\n", "pieces of {size}");
            let want = json!({"command": "ls -l\n  && echo 5", "timeout": 30, "env": {"A": "1"}, "dry": false});
            let streamed = streamed(&events);
            assert_eq!(streamed.len(), 1, "{events:?}");
            assert_eq!(serde_json::from_str::<Value>(&streamed[0].1).unwrap(), want, "pieces of {size}");
            let calls: Vec<ParsedCall> = CallEvent::completed(events).collect();
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
        // Malformed after its name: the call that began ends with the arguments it had.
        let broken = "<tool_call><function=a><parameter=x>1</function></tool_call> and on";
        let (text, events) = run_events(&mut ToolCallParser::default(), &[broken]);
        assert_eq!(text, " and on");
        assert_eq!(events.first(), Some(&CallEvent::Begin { name: "a".into() }));
        assert_eq!(events.last(), Some(&CallEvent::End(ParsedCall { name: "a".into(), arguments: json!({}) })));
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

    #[test]
    fn streams_json_arguments_as_written_split_anywhere() {
        let text = "I'll write it.\n<tool_call>\n{\"name\": \"write\", \"arguments\": {\"path\": \"a}.rs\", \
                    \"body\": \"fn x() { \\\"}\\\" }\", \"n\": [1, {\"k\": 2}]}}\n</tool_call>\n\
                    <tool_call>\n{\"name\": \"read\", \"arguments\": {}}\n</tool_call>";
        let want = json!({"path": "a}.rs", "body": "fn x() { \"}\" }", "n": [1, {"k": 2}]});
        for size in [1, 2, 5, 11, text.len()] {
            let pieces = pieces_of(text, size);
            let pieces: Vec<&str> = pieces.iter().map(String::as_str).collect();
            let (out, events) = run_events(&mut ToolCallParser::default(), &pieces);
            assert_eq!(out, "I'll write it.\n\n", "pieces of {size}");
            let streamed = streamed(&events);
            assert_eq!(streamed.iter().map(|c| c.0.as_str()).collect::<Vec<_>>(), ["write", "read"]);
            assert_eq!(serde_json::from_str::<Value>(&streamed[0].1).unwrap(), want, "pieces of {size}");
            assert_eq!(streamed[1].1, "{}");
            if size == 1 {
                // Written one character at a time, the arguments come in many fragments.
                let fragments = events.iter().filter(|e| matches!(e, CallEvent::Arguments(_))).count();
                assert!(fragments > 20, "{fragments} fragments");
            }
            let calls: Vec<ParsedCall> = CallEvent::completed(events).collect();
            assert_eq!(calls[0], ParsedCall { name: "write".into(), arguments: want.clone() });
        }
        // Arguments written as a string, or before the name: no fragments, the whole call at its end.
        for body in [r#"{"name": "a", "arguments": "{\"x\": 1}"}"#, r#"{"arguments": {"x": 1}, "name": "a"}"#] {
            let block = format!("<tool_call>{body}</tool_call>");
            let (_, events) = run_events(&mut ToolCallParser::default(), &[&block]);
            assert_eq!(events, vec![CallEvent::End(ParsedCall { name: "a".into(), arguments: json!({"x": 1}) })]);
        }
    }

    #[test]
    fn a_call_cut_short_ends_with_what_it_had() {
        // The answer ran out of tokens inside the arguments: the call ends, its arguments as text.
        let (text, events) =
            run_events(&mut ToolCallParser::default(), &["<tool_call>{\"name\": \"w\", \"arguments\": {\"a\": 1"]);
        assert_eq!(text, "");
        let want = ParsedCall { name: "w".into(), arguments: Value::String("{\"a\": 1".into()) };
        assert_eq!(events.last(), Some(&CallEvent::End(want)));
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        /// Text with the markers the parser looks for, so calls and near-calls are common.
        fn answer() -> impl Strategy<Value = String> {
            let piece = prop_oneof![
                Just("<tool_call>".to_string()),
                Just("</tool_call>".to_string()),
                Just("<function=run>".to_string()),
                Just("<parameter=x>".to_string()),
                Just("</parameter>".to_string()),
                Just("</function>".to_string()),
                Just("{\"name\": \"a\", \"arguments\": {".to_string()),
                Just("}".to_string()),
                Just("\"".to_string()),
                "\\PC{0,12}",
            ];
            prop::collection::vec(piece, 0..16).prop_map(|p| p.concat())
        }

        proptest! {
            /// However the text is split, the parser never panics, and what it returns does not
            /// depend on the split: the same text, the same complete calls, well-ordered events.
            #[test]
            fn any_split_gives_the_same_answer(text in answer(), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8)) {
                let tools = [json!({"type": "function", "function": {"name": "run", "parameters": {"properties": {"x": {"type": "integer"}}}}})];
                let whole = run_events(&mut ToolCallParser::for_tools(&tools), &[&text]);
                let pieces = crate::fuzz::split(&text, &cuts);
                let split = run_events(&mut ToolCallParser::for_tools(&tools), &pieces);
                prop_assert_eq!(&whole.0, &split.0);
                let calls = |e: &Vec<CallEvent>| CallEvent::completed(e.clone()).collect::<Vec<_>>();
                prop_assert_eq!(calls(&whole.1), calls(&split.1));
                // Every call that began ended (streamed() checks the order).
                let begun = streamed(&split.1).len();
                prop_assert!(begun <= calls(&split.1).len());
            }
        }
    }
}
