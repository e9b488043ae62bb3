//! Output held to a grammar while decoding: llguidance's matcher, over a token trie built from
//! the model's own tokenizer, says which tokens may come next; the others' logits become -inf
//! before sampling, and each chosen token advances the matcher.
//!
//! A JSON schema, a Lark grammar or a regular expression ([`Grammar`]) becomes a
//! [`Constraint`] per request; the parser factory (the token trie, built once per model, the
//! costly part) is made on the first constrained request. A model's think block
//! (`<think>…</think>`) stays free text: the grammar holds what follows it ([`Thinking`]).

use std::path::Path;

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::{Matcher, ParserFactory};
use mlx_rs::Array;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::grammar_limits;

/// What a request's answer must match.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum Grammar {
    /// A JSON document valid under this JSON Schema (`{"type": "object"}` for any object).
    JsonSchema(Value),
    /// llguidance's Lark dialect.
    Lark(String),
    /// A regular expression over the whole answer.
    Regex(String),
}

/// Where the prompt leaves the answer with respect to a think block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Thinking {
    /// The prompt closed the think block (thinking turned off): the grammar holds it all.
    Closed,
    /// The answer may open with a think block.
    MayOpen,
    /// The prompt opened the think block (the template ended in `<think>`): the answer begins
    /// inside it.
    Open,
}

/// How the model's vocabulary spells the think tags.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ThinkTags {
    None,
    /// Special tokens (referenced as `<think>` in Lark; no text can spell them).
    Special,
    /// Tokens whose text is the tag (Qwen's): matched as text.
    Text,
}

/// Makes constraints for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
    think_tags: ThinkTags,
}

impl Grammars {
    /// The factory for the tokenizer in `dir` (its `tokenizer.json`), answers ending at `eos`,
    /// logits of `vocab` entries (the model's, which may exceed the tokenizer's).
    pub fn load(dir: &Path, eos: &[u32], vocab: usize) -> Result<Grammars> {
        let file = dir.join("tokenizer.json");
        let failed = |e: anyhow::Error| {
            Error::Request(format!("{}: cannot build the grammar's token trie: {e}", file.display()))
        };
        let mut tokenizer = toktrie_hf_tokenizers::ByteTokenizer::from_file(&file).map_err(failed)?;
        if !eos.is_empty() {
            tokenizer.set_eos_tokens(eos);
        }
        let env = tokenizer.into_tok_env(Some(vocab)).map_err(failed)?;
        let trie = env.tok_trie();
        let think_tags = if trie.get_special_token("</think>").is_some() {
            ThinkTags::Special
        } else if trie.token_id(b"</think>").is_some() {
            ThinkTags::Text
        } else {
            ThinkTags::None
        };
        let mut factory = ParserFactory::new_simple(&env).map_err(failed)?;
        factory.quiet();
        Ok(Grammars { factory, vocab, think_tags })
    }

    /// A fresh constraint for `grammar`, applied after the think block `thinking` allows; an
    /// error names what the grammar cannot express, or the limit it passes
    /// ([`crate::grammar_limits`]). llguidance compiles recursively, so the compile runs on a
    /// thread of its own with a stack sized for the largest grammar the limits let through
    /// (the caller's may be the engine thread's 2 MiB: overflowing it aborts the process).
    pub fn constraint(&self, grammar: &Grammar, thinking: Thinking) -> Result<Constraint> {
        let limited = match grammar {
            Grammar::JsonSchema(schema) => {
                grammar_limits::check_schema(schema).map_err(|e| format!("the JSON schema {e}"))
            }
            Grammar::Lark(text) => {
                grammar_limits::check_text_grammar(text).map_err(|e| format!("the Lark grammar {e}"))
            }
            Grammar::Regex(text) => {
                grammar_limits::check_text_grammar(text).map_err(|e| format!("the regular expression {e}"))
            }
        };
        limited.map_err(|message| Error::Field {
            field: "grammar",
            message: format!("too large to enforce: {message}"),
        })?;
        std::thread::scope(|scope| {
            let compile = std::thread::Builder::new()
                .name("ferrite-grammar".into())
                .stack_size(grammar_limits::COMPILE_STACK_BYTES)
                .spawn_scoped(scope, || self.compile(grammar, thinking))
                .map_err(|e| Error::Request(format!("cannot start the grammar compiler's thread: {e}")))?;
            compile.join().unwrap_or_else(|_| Err(Error::Request("the grammar compiler failed".into())))
        })
    }

    fn compile(&self, grammar: &Grammar, thinking: Thinking) -> Result<Constraint> {
        let answer = |schema_form: fn(&Value) -> Value| match grammar {
            Grammar::JsonSchema(schema) => GrammarWithLexer::from_json_schema(schema_form(schema)),
            Grammar::Lark(lark) => GrammarWithLexer::from_lark(lark.clone()),
            Grammar::Regex(rx) => GrammarWithLexer::from_regex(rx),
        };
        let refused = |e: String| {
            let at = match grammar {
                Grammar::JsonSchema(schema) => format!(" (the JSON schema at `{}`)", self.failing_path(schema)),
                _ => String::new(),
            };
            Error::Field { field: "grammar", message: format!("cannot be enforced{at}: {e}") }
        };
        let parser = match self.factory.create_parser(self.top_level(answer(json_for_grammar), thinking)) {
            Ok(parser) => parser,
            // Bounds whose range holds no number of six decimals: the schema as sent.
            Err(_) if matches!(grammar, Grammar::JsonSchema(_)) => self
                .factory
                .create_parser(self.top_level(answer(compact), thinking))
                .map_err(|e| refused(e.to_string()))?,
            Err(e) => return Err(refused(e.to_string())),
        };
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(refused(e));
        }
        Ok(Constraint { matcher, vocab: self.vocab, current: None })
    }

    /// The grammar to hold the answer to: `answer`, behind the rule that lets a think block
    /// through where `thinking` allows one.
    fn top_level(&self, mut answer: GrammarWithLexer, thinking: Thinking) -> TopLevelGrammar {
        match self.after_thinking(thinking) {
            None => TopLevelGrammar::from_grammar(answer),
            Some(start) => {
                answer.name = Some("answer".into());
                TopLevelGrammar { grammars: vec![GrammarWithLexer::from_lark(start), answer], max_tokens: None }
            }
        }
    }

    /// Where in `schema` (which llguidance refused) the refusal comes from, as a JSON
    /// pointer: the deepest subschema that is refused alone (with the root's definitions
    /// beside it, so references still resolve). `""` is the whole schema.
    fn failing_path(&self, schema: &Value) -> String {
        let defs: Vec<(&str, &Value)> =
            ["$defs", "definitions"].into_iter().filter_map(|k| Some((k, schema.get(k)?))).collect();
        let refused = |sub: &Value| {
            let mut sub = compact(sub);
            if let Some(object) = sub.as_object_mut() {
                for (k, v) in &defs {
                    object.entry(k.to_string()).or_insert_with(|| (*v).clone());
                }
            }
            self.factory.create_parser(TopLevelGrammar::from_json_schema(sub)).is_err()
        };
        let (mut path, mut at, mut budget) = (String::new(), schema, 200);
        'descend: loop {
            for (step, child) in subschemas(at) {
                budget -= 1;
                if budget == 0 {
                    break 'descend;
                }
                if refused(child) {
                    path = format!("{path}/{step}");
                    at = child;
                    continue 'descend;
                }
            }
            break;
        }
        path
    }

    /// The Lark grammar that lets a think block through free and then holds the answer to the
    /// grammar named `answer`; `None` where the grammar holds everything.
    fn after_thinking(&self, thinking: Thinking) -> Option<String> {
        // The answer may follow the block after a blank line, as the templates write it.
        let (open, thought) = match self.think_tags {
            ThinkTags::None => return None,
            ThinkTags::Special => ("<think>", "thought: /(?s:.*)/ </think> GAP?"),
            // Lazy: the block's text ends at the first `</think>`.
            ThinkTags::Text => ("\"<think>\"", "thought: thought_text GAP?\nthought_text[lazy]: /(?s:.*)<\\/think>/"),
        };
        let start = match thinking {
            Thinking::Closed => return None,
            Thinking::MayOpen => format!("start: ({open} thought)? @answer"),
            Thinking::Open => "start: thought @answer".to_string(),
        };
        Some(format!("%llguidance {{}}\n{start}\n{thought}\nGAP: /\\n{{1,2}}/\n"))
    }
}

/// A schema's direct subschemas, each with its JSON pointer step (`properties/name`,
/// `items`, `anyOf/0`, …).
fn subschemas(schema: &Value) -> Vec<(String, &Value)> {
    let mut out = Vec::new();
    let Some(object) = schema.as_object() else { return out };
    let escape = |key: &str| key.replace('~', "~0").replace('/', "~1");
    for (keyword, value) in object {
        match (keyword.as_str(), value) {
            ("properties" | "patternProperties" | "$defs" | "definitions" | "dependentSchemas", Value::Object(map)) => {
                out.extend(map.iter().map(|(k, v)| (format!("{keyword}/{}", escape(k)), v)))
            }
            ("anyOf" | "oneOf" | "allOf" | "prefixItems" | "items", Value::Array(list)) => {
                out.extend(list.iter().enumerate().map(|(i, v)| (format!("{keyword}/{i}"), v)))
            }
            (
                "items"
                | "additionalProperties"
                | "additionalItems"
                | "not"
                | "contains"
                | "propertyNames"
                | "unevaluatedProperties"
                | "unevaluatedItems",
                Value::Object(_),
            ) => out.push((keyword.clone(), value)),
            _ => {}
        }
    }
    out
}

/// The schema as the engine holds an answer to it. llguidance's JSON options are set, unless
/// the schema sets its own (`x-guidance`): one space after `,` and `:` and no other
/// whitespace, as `json.dumps` writes (free whitespace lets a small model wander in newlines
/// and indentation until it runs out of tokens). Numbers are written with at most six
/// decimals where no `multipleOf` says otherwise (a small model can loop on digits just the
/// same); every answer still validates against the schema as sent.
pub fn json_for_grammar(schema: &Value) -> Value {
    let mut schema = compact(schema);
    let mut numbers = Vec::new();
    number_paths(&schema, String::new(), &mut numbers);
    for path in numbers {
        if let Some(Value::Object(number)) = schema.pointer_mut(&path) {
            number.insert("multipleOf".into(), serde_json::json!(0.000001));
        }
    }
    schema
}

/// The JSON pointers of the subschemas of `schema` (at `path`) that allow numbers and say
/// nothing of their precision.
fn number_paths(schema: &Value, path: String, out: &mut Vec<String>) {
    let allows_numbers = match &schema["type"] {
        Value::String(t) => t == "number",
        Value::Array(types) => types.iter().any(|t| t == "number"),
        _ => false,
    };
    if allows_numbers && schema.get("multipleOf").is_none() {
        out.push(path.clone());
    }
    for (step, child) in subschemas(schema) {
        number_paths(child, format!("{path}/{step}"), out);
    }
}

/// The schema with llguidance's JSON options set (see [`json_for_grammar`]).
fn compact(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(object) = schema.as_object_mut() {
        object.entry("x-guidance").or_insert_with(
            || serde_json::json!({"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": false}),
        );
    }
    schema
}

/// One request's place in its grammar.
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
    /// The mask for the current state, once computed (a state is masked once, whoever asks).
    current: Option<std::result::Result<Array, Ended>>,
}

/// Why a constrained answer cannot go on.
#[derive(Debug, Clone)]
pub enum Ended {
    /// The grammar is complete: nothing more may follow.
    Complete,
    /// No token can continue the answer (the model's vocabulary cannot spell what the grammar
    /// needs next).
    DeadEnd(String),
}

impl Constraint {
    /// An additive mask [1, vocab] for the next token: 0 where the grammar allows it, -inf
    /// elsewhere; or why nothing may come next.
    pub fn mask(&mut self) -> std::result::Result<Array, Ended> {
        if self.current.is_none() {
            self.current = Some(self.compute());
        }
        self.current.clone().unwrap_or(Err(Ended::Complete))
    }

    fn compute(&mut self) -> std::result::Result<Array, Ended> {
        if self.matcher.is_stopped() {
            return Err(Ended::Complete);
        }
        let allowed = self.matcher.compute_mask().map_err(|e| Ended::DeadEnd(e.to_string()))?;
        if allowed.is_zero() {
            return Err(Ended::DeadEnd("no token of the vocabulary can continue the answer".into()));
        }
        let mut bias = vec![f32::NEG_INFINITY; self.vocab];
        allowed.iter_set_entries(|i| {
            if let Some(b) = bias.get_mut(i) {
                *b = 0.0;
            }
        });
        Ok(Array::from_slice(&bias, &[1, self.vocab as i32]))
    }

    /// Advances over the chosen token.
    pub fn accept(&mut self, token: u32) -> Result<()> {
        self.current = None;
        self.matcher.consume_token(token).map_err(|e| Error::Request(format!("the grammar refused token {token}: {e}")))
    }

    /// Steps back over the last `n` accepted tokens (drafts the verify pass rejected).
    pub fn rollback(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.current = None;
        self.matcher.rollback(n).map_err(|e| Error::Request(format!("the grammar could not step back: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn numbers_get_six_decimals_unless_the_schema_says() {
        let schema = json!({
            "type": "object",
            "properties": {
                "ratio": {"type": "number"},
                "step": {"type": "number", "multipleOf": 0.5},
                "maybe": {"type": ["number", "null"]},
                "list": {"type": "array", "items": {"anyOf": [{"type": "number"}, {"type": "string"}]}},
                "fixed": {"const": {"type": "number"}}
            }
        });
        let held = json_for_grammar(&schema);
        assert_eq!(held["properties"]["ratio"]["multipleOf"], 0.000001);
        assert_eq!(held["properties"]["step"]["multipleOf"], 0.5);
        assert_eq!(held["properties"]["maybe"]["multipleOf"], 0.000001);
        assert_eq!(held["properties"]["list"]["items"]["anyOf"][0]["multipleOf"], 0.000001);
        assert!(held["properties"]["list"]["items"]["anyOf"][1].get("multipleOf").is_none());
        // Data is not a schema: a `const` stays as sent.
        assert_eq!(held["properties"]["fixed"], schema["properties"]["fixed"]);
        assert_eq!(held["x-guidance"]["item_separator"], ", ");
    }
}
