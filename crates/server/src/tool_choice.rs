//! `tool_choice` as the three APIs spell it, and the grammar a forced call is held to. With
//! `required` (Anthropic's `any`) or a named tool, the answer after any think block is one or
//! more tool calls in the form the model's chat template writes them — Qwen3's JSON
//! (`<tool_call>\n{"name": …, "arguments": …}\n</tool_call>`) or the XML form of Qwen3.5 and
//! Qwen3-Coder (`<function=…><parameter=…>`) — each call's arguments held to its tool's JSON
//! schema while decoding.

use engine::tokenizer::{ChatMessage, Tokenizer, ToolCall};
use engine::Grammar;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::job::Prompt;

/// The tools a chat prompt offers, in the chat template's form.
pub fn offered(prompt: &Prompt) -> Vec<Value> {
    match prompt {
        Prompt::Chat { template_vars, loaded_tools, .. } => {
            let listed = template_vars.get("tools").and_then(Value::as_array).map(Vec::as_slice).unwrap_or_default();
            listed.iter().chain(loaded_tools).cloned().collect()
        }
        Prompt::Text(_) => vec![],
    }
}

/// Which tools the answer may or must call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides (the default).
    Auto,
    /// The tools are hidden from the prompt.
    None,
    /// At least one call (exactly one without parallel calls), of any offered tool.
    Required { parallel: bool },
    /// One call of this tool.
    Named(String),
}

/// How the model writes a call, as its chat template and vocabulary show it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CallSyntax {
    pub form: CallForm,
    /// `<tool_call>` and `</tool_call>` are tokens of their own (Qwen's added tokens), which
    /// the grammar names as tokens: llguidance takes every added `<…>` token for a special
    /// token that no text spells.
    pub tags_are_tokens: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallForm {
    Json,
    Xml,
}

impl CallSyntax {
    /// The form the chat template writes an assistant's call in (the JSON form where the
    /// template writes none).
    pub fn of(tokenizer: &Tokenizer) -> CallSyntax {
        let mut turn = ChatMessage::new("assistant", "");
        turn.tool_calls.push(ToolCall::new("probe", json!({"p": 1})));
        let messages = [ChatMessage::new("user", "?"), turn];
        let form = match tokenizer.apply_chat_template(&messages, false, &Default::default()) {
            Ok(text) if text.contains("<function=probe>") => CallForm::Xml,
            _ => CallForm::Json,
        };
        let tags_are_tokens =
            tokenizer.token_to_id("<tool_call>").is_some() && tokenizer.token_to_id("</tool_call>").is_some();
        CallSyntax { form, tags_are_tokens }
    }

    /// The call's opening and closing tags in Lark.
    fn tags(&self) -> (String, String) {
        if self.tags_are_tokens {
            ("<tool_call>".into(), "</tool_call>".into())
        } else {
            (literal("<tool_call>"), literal("</tool_call>"))
        }
    }
}

impl ToolChoice {
    /// OpenAI's chat `tool_choice`: `none`, `auto`, `required` or
    /// `{"type": "function", "function": {"name": …}}`.
    pub fn openai(value: Option<&Value>, parallel: Option<bool>) -> Result<ToolChoice, ApiError> {
        fn named(v: &Value) -> Option<&str> {
            (v["type"] == "function").then(|| v["function"]["name"].as_str()).flatten()
        }
        Self::read(value, parallel, named)
    }

    /// The Responses API's `tool_choice`: as chat's, with the name beside the type
    /// (`{"type": "function" | "custom", "name": …}`).
    pub fn responses(value: Option<&Value>, parallel: Option<bool>) -> Result<ToolChoice, ApiError> {
        fn named(v: &Value) -> Option<&str> {
            matches!(v["type"].as_str(), Some("function" | "custom")).then(|| v["name"].as_str()).flatten()
        }
        Self::read(value, parallel, named)
    }

    /// Anthropic's `tool_choice`: `{"type": "auto" | "any" | "tool" | "none", "name",
    /// "disable_parallel_tool_use"}`.
    pub fn anthropic(value: Option<&Value>) -> Result<ToolChoice, ApiError> {
        let Some(value) = value else { return Ok(ToolChoice::Auto) };
        let parallel = !value["disable_parallel_tool_use"].as_bool().unwrap_or(false);
        match (value["type"].as_str(), value["name"].as_str()) {
            (Some("auto"), _) => Ok(ToolChoice::Auto),
            (Some("none"), _) => Ok(ToolChoice::None),
            (Some("any"), _) => Ok(ToolChoice::Required { parallel }),
            (Some("tool"), Some(name)) => Ok(ToolChoice::Named(name.to_string())),
            (Some("tool"), None) => Err(bad("tool_choice", "a `tool` choice needs the tool's `name`")),
            // Choices this server does not know leave the model to decide.
            (Some(_), _) => Ok(ToolChoice::Auto),
            (None, _) => Err(bad("tool_choice", "must be an object with a `type`: auto, any, tool or none")),
        }
    }

    fn read(
        value: Option<&Value>,
        parallel: Option<bool>,
        named: fn(&Value) -> Option<&str>,
    ) -> Result<ToolChoice, ApiError> {
        let field = "tool_choice";
        match value {
            None | Some(Value::Null) => Ok(ToolChoice::Auto),
            Some(Value::String(s)) => match s.as_str() {
                "auto" => Ok(ToolChoice::Auto),
                "none" => Ok(ToolChoice::None),
                "required" => Ok(ToolChoice::Required { parallel: parallel.unwrap_or(true) }),
                other => Err(bad(field, &format!("unknown choice `{other}` (auto, none, required, or a named tool)"))),
            },
            Some(v) => match named(v) {
                Some(name) => Ok(ToolChoice::Named(name.to_string())),
                // Choices Ferrite does not hold the answer to (`allowed_tools`, hosted tools)
                // leave the model to decide.
                None if v["type"].is_string() => Ok(ToolChoice::Auto),
                None => Err(bad(field, "must be a string or an object with a `type`")),
            },
        }
    }

    /// The grammar the answer is held to, for `tools` in the chat template's form (`{"type":
    /// "function", "function": {"name", "parameters"}}`); `None` when the model may answer
    /// freely.
    pub fn grammar(&self, tools: &[Value], syntax: CallSyntax) -> Result<Option<Grammar>, ApiError> {
        let offered: Vec<(&str, Value)> = tools
            .iter()
            .filter_map(|t| {
                let f = &t["function"];
                let parameters = match &f["parameters"] {
                    Value::Object(o) if !o.is_empty() => f["parameters"].clone(),
                    _ => json!({"type": "object"}),
                };
                Some((f["name"].as_str()?, parameters))
            })
            .collect();
        let (chosen, parallel): (Vec<_>, bool) = match self {
            ToolChoice::Auto | ToolChoice::None => return Ok(None),
            ToolChoice::Required { .. } if offered.is_empty() => {
                return Err(bad("tool_choice", "`required` needs at least one tool in `tools`"))
            }
            ToolChoice::Required { parallel } => (offered.iter().collect(), *parallel),
            ToolChoice::Named(name) => match offered.iter().find(|(n, _)| n == name) {
                Some(tool) => (vec![tool], false),
                None => return Err(bad("tool_choice", &format!("names `{name}`, which is not among `tools`"))),
            },
        };
        for (name, parameters) in &chosen {
            engine::check_schema(parameters).map_err(|e| {
                bad("tools", &format!("the parameters of `{name}` are too large to enforce: the JSON schema {e}"))
            })?;
        }
        let mut lark = String::from("%llguidance {}\n");
        lark += if parallel { "start: call (\"\\n\" call)*\n" } else { "start: call\n" };
        let alternatives: Vec<String> = (0..chosen.len()).map(|i| format!("call_{i}")).collect();
        lark += &format!("call: {}\n", alternatives.join(" | "));
        let (open, close) = syntax.tags();
        for (i, (name, parameters)) in chosen.into_iter().enumerate() {
            let (body, rules) = match syntax.form {
                CallForm::Json => json_call(i, name, parameters),
                CallForm::Xml => xml_call(i, name, parameters),
            };
            lark += &format!("call_{i}: {open} {} {body} {} {close}\n{rules}", literal("\n"), literal("\n"));
        }
        Ok(Some(Grammar::Lark(lark)))
    }
}

fn bad(field: &'static str, message: &str) -> ApiError {
    ApiError::bad_request(format!("{field}: {message}")).with_param(field)
}

/// A Lark string literal.
fn literal(text: &str) -> String {
    serde_json::to_string(text).unwrap_or_default()
}

/// A call's body in the JSON form, `{"name": NAME, "arguments": ARGS}` with ARGS held to the
/// schema, and the rules it uses.
fn json_call(i: usize, name: &str, parameters: &Value) -> (String, String) {
    let head = format!("{{\"name\": {}, \"arguments\": ", literal(name));
    (
        format!("{} args_{i} {}", literal(&head), literal("}")),
        format!("args_{i}: %json {}\n", engine::json_for_grammar(parameters)),
    )
}

/// A call's body in the XML form: `<function=NAME>\n`, one `<parameter=KEY>\nVALUE\n</parameter>\n`
/// per property in the schema's order (the required ones always), `</function>`; and the rules
/// it uses. Text values are raw text up to `</parameter>`, as the templates write them; the
/// others JSON held to their schema.
fn xml_call(i: usize, name: &str, parameters: &Value) -> (String, String) {
    let required: Vec<&str> =
        parameters["required"].as_array().map(|r| r.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    let empty = serde_json::Map::new();
    let properties = parameters["properties"].as_object().unwrap_or(&empty);
    let mut rules = String::new();
    let mut sequence = Vec::new();
    for (j, (key, schema)) in properties.iter().enumerate() {
        let rule = format!("p_{i}_{j}");
        let open = literal(&format!("<parameter={key}>\n"));
        let value = match (schema["type"].as_str(), schema["enum"].as_array()) {
            (Some("string") | None, Some(choices)) if choices.iter().all(Value::is_string) => {
                let choices: Vec<String> = choices.iter().filter_map(Value::as_str).map(literal).collect();
                format!("({}) {}", choices.join(" | "), literal("\n</parameter>\n"))
            }
            // Text (an untyped value is read back as text too). Lazy: the value ends at the
            // first `</parameter>`.
            (Some("string") | None, _) => {
                rules += &format!("text_{i}_{j}[lazy]: /(?s:.*)\\n<\\/parameter>/\n");
                format!("text_{i}_{j} {}", literal("\n"))
            }
            _ => {
                rules += &format!("value_{i}_{j}: %json {}\n", engine::json_for_grammar(schema));
                format!("value_{i}_{j} {}", literal("\n</parameter>\n"))
            }
        };
        rules += &format!("{rule}: {open} {value}\n");
        sequence.push(if required.contains(&key.as_str()) { rule } else { format!("{rule}?") });
    }
    let head = literal(&format!("<function={name}>\n"));
    (format!("{head} {} {}", sequence.join(" "), literal("</function>")), rules)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "read", "parameters": {"type": "object",
                "properties": {"path": {"type": "string"}, "line": {"type": "integer"}}, "required": ["path"]}}}),
            json!({"type": "function", "function": {"name": "list", "parameters": {}}}),
        ]
    }

    #[test]
    fn each_api_spells_its_choices() {
        let required = ToolChoice::Required { parallel: true };
        assert_eq!(ToolChoice::openai(Some(&json!("required")), None).unwrap(), required);
        assert_eq!(
            ToolChoice::openai(Some(&json!("required")), Some(false)).unwrap(),
            ToolChoice::Required { parallel: false }
        );
        let named = ToolChoice::Named("read".into());
        assert_eq!(
            ToolChoice::openai(Some(&json!({"type": "function", "function": {"name": "read"}})), None).unwrap(),
            named
        );
        assert_eq!(ToolChoice::responses(Some(&json!({"type": "function", "name": "read"})), None).unwrap(), named);
        assert_eq!(ToolChoice::anthropic(Some(&json!({"type": "tool", "name": "read"}))).unwrap(), named);
        assert_eq!(ToolChoice::anthropic(Some(&json!({"type": "any"}))).unwrap(), required);
        assert_eq!(ToolChoice::anthropic(None).unwrap(), ToolChoice::Auto);
        assert!(ToolChoice::openai(Some(&json!("always")), None).is_err());
        assert!(ToolChoice::anthropic(Some(&json!({"type": "tool"}))).is_err());
    }

    #[test]
    fn a_forced_choice_names_an_offered_tool() {
        let form = CallSyntax { form: CallForm::Json, tags_are_tokens: true };
        assert_eq!(ToolChoice::Auto.grammar(&tools(), form).unwrap(), None);
        let err = ToolChoice::Named("write".into()).grammar(&tools(), form).unwrap_err();
        assert!(err.message.contains("write"), "{}", err.message);
        assert!(ToolChoice::Required { parallel: true }.grammar(&[], form).is_err());
    }

    #[test]
    fn the_grammar_writes_the_templates_forms() {
        let Some(Grammar::Lark(json_form)) = ToolChoice::Named("read".into())
            .grammar(&tools(), CallSyntax { form: CallForm::Json, tags_are_tokens: false })
            .unwrap()
        else {
            panic!("a named tool is held by a grammar")
        };
        assert!(
            json_form.contains(r#"call_0: "<tool_call>" "\n" "{\"name\": \"read\", \"arguments\": ""#),
            "{json_form}"
        );
        assert!(!json_form.contains("list"), "{json_form}");
        let Some(Grammar::Lark(xml)) = ToolChoice::Required { parallel: true }
            .grammar(&tools(), CallSyntax { form: CallForm::Xml, tags_are_tokens: true })
            .unwrap()
        else {
            panic!("required is held by a grammar")
        };
        assert!(xml.contains("<function=read>") && xml.contains("<function=list>"), "{xml}");
        // `path` is required, `line` optional and typed JSON.
        assert!(xml.contains("p_0_0 p_0_1?") || xml.contains("p_0_1 p_0_0?"), "{xml}");
        assert!(xml.contains(r#"%json {"type":"integer""#), "{xml}");
    }
}
