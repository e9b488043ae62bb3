//! How large a grammar a request may ask for. llguidance compiles JSON schemas and Lark
//! grammars recursively (a schema's references followed as it compiles them), so a request of
//! a few kilobytes — hundreds of chained `$ref`s, thousands of properties — can need more
//! stack than any thread has. These checks run before anything compiles, walk the schema
//! without recursion, and name where a limit was passed; the compiler itself then runs on a
//! thread whose stack is sized for the largest grammar they let through
//! ([`COMPILE_STACK_BYTES`]).

use std::collections::{HashMap, HashSet};

use serde_json::Value;

/// Values of every kind in one schema (subschemas, keywords' values, enum members).
pub const MAX_SCHEMA_VALUES: usize = 50_000;
/// Object properties in one schema, all objects together (OpenAI's structured outputs allow
/// 5,000).
pub const MAX_SCHEMA_PROPERTIES: usize = 5_000;
/// Nesting of a schema, counting the levels each `$ref` leads into (a reference to a
/// definition is as deep as the definition itself).
pub const MAX_SCHEMA_DEPTH: usize = 256;
/// Bytes of a Lark grammar or a regular expression.
pub const MAX_GRAMMAR_BYTES: usize = 1 << 20;
/// Nesting of brackets in a Lark grammar or a regular expression.
pub const MAX_GRAMMAR_NESTING: usize = 200;
/// The stack the compiler runs on. It is reserved, not committed: only the pages a compile
/// touches take memory.
pub const COMPILE_STACK_BYTES: usize = 256 << 20;

/// Checks `schema` against the limits above; the error names the JSON pointer where one was
/// passed and the limit.
pub fn check_schema(schema: &Value) -> Result<(), String> {
    count_values(schema)?;
    deepest_reference_chain(schema)
}

/// Checks a Lark grammar's or a regular expression's size and bracket nesting (brackets in
/// quoted strings aside).
pub fn check_text_grammar(text: &str) -> Result<(), String> {
    if text.len() > MAX_GRAMMAR_BYTES {
        return Err(format!("is {} bytes, more than the {MAX_GRAMMAR_BYTES} allowed", text.len()));
    }
    let (mut depth, mut deepest) = (0usize, 0usize);
    let (mut quoted, mut escaped) = (false, false);
    for c in text.chars() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '"' => quoted = !quoted,
            '(' | '[' | '{' if !quoted => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            ')' | ']' | '}' if !quoted => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    if deepest > MAX_GRAMMAR_NESTING {
        return Err(format!("nests brackets {deepest} deep, more than the {MAX_GRAMMAR_NESTING} allowed"));
    }
    Ok(())
}

/// Counts every value and every object property, without recursion.
fn count_values(schema: &Value) -> Result<(), String> {
    let (mut values, mut properties) = (0usize, 0usize);
    let mut stack = vec![(schema, String::new())];
    while let Some((value, at)) = stack.pop() {
        values += 1;
        if values > MAX_SCHEMA_VALUES {
            return Err(format!("has more than {MAX_SCHEMA_VALUES} values (passed at `{at}`)"));
        }
        match value {
            Value::Object(map) => {
                if let Some(Value::Object(props)) = map.get("properties") {
                    properties += props.len();
                    if properties > MAX_SCHEMA_PROPERTIES {
                        return Err(format!(
                            "has more than {MAX_SCHEMA_PROPERTIES} properties in all (passed at `{at}/properties`)"
                        ));
                    }
                }
                if let Some(Value::Array(required)) = map.get("required") {
                    if required.len() > MAX_SCHEMA_PROPERTIES {
                        return Err(format!(
                            "requires {} properties at `{at}/required`, more than the {MAX_SCHEMA_PROPERTIES} allowed",
                            required.len()
                        ));
                    }
                }
                stack.extend(map.iter().map(|(k, v)| (v, format!("{at}/{}", escape(k)))));
            }
            Value::Array(list) => stack.extend(list.iter().enumerate().map(|(i, v)| (v, format!("{at}/{i}")))),
            _ => {}
        }
    }
    Ok(())
}

/// The schema's depth with every local `$ref` followed (a reference back into a definition
/// being expanded — a recursive schema — adds nothing: llguidance names such a rule once),
/// computed bottom-up with an explicit stack.
fn deepest_reference_chain(schema: &Value) -> Result<(), String> {
    enum Step<'a> {
        Enter(&'a Value, String),
        Leave(&'a Value, String),
    }
    let key = |v: &Value| v as *const Value as usize;
    let mut depth: HashMap<usize, usize> = HashMap::new();
    let mut open: HashSet<usize> = HashSet::new();
    let mut stack = vec![Step::Enter(schema, String::new())];
    while let Some(step) = stack.pop() {
        match step {
            Step::Enter(value, at) => {
                if depth.contains_key(&key(value)) || !open.insert(key(value)) {
                    continue;
                }
                stack.push(Step::Leave(value, at.clone()));
                for (child, child_at) in children(schema, value, &at) {
                    stack.push(Step::Enter(child, child_at));
                }
            }
            Step::Leave(value, at) => {
                open.remove(&key(value));
                let below = children(schema, value, &at)
                    .iter()
                    .map(|(child, _)| depth.get(&key(child)).copied().unwrap_or(0))
                    .max()
                    .unwrap_or(0);
                let here = below + 1;
                if here > MAX_SCHEMA_DEPTH {
                    return Err(format!(
                        "nests more than {MAX_SCHEMA_DEPTH} levels deep, counting the levels its `$ref`s lead into (at `{at}`)"
                    ));
                }
                depth.insert(key(value), here);
            }
        }
    }
    Ok(())
}

/// A value's children: its members, and for an object with a local `$ref`, the value it
/// points at.
fn children<'a>(root: &'a Value, value: &'a Value, at: &str) -> Vec<(&'a Value, String)> {
    match value {
        Value::Object(map) => {
            let mut out: Vec<(&Value, String)> = map.iter().map(|(k, v)| (v, format!("{at}/{}", escape(k)))).collect();
            if let Some(target) = map.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix('#')) {
                if let Some(found) = root.pointer(target) {
                    out.push((found, target.to_string()));
                }
            }
            out
        }
        Value::Array(list) => list.iter().enumerate().map(|(i, v)| (v, format!("{at}/{i}"))).collect(),
        _ => Vec::new(),
    }
}

fn escape(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `n` definitions, each a reference to the next: the shape that overflowed the engine
    /// thread's stack at ~700.
    fn chain(n: usize) -> Value {
        let mut defs = serde_json::Map::new();
        for i in 0..n {
            defs.insert(format!("d{i}"), json!({"$ref": format!("#/$defs/d{}", i + 1)}));
        }
        defs.insert(format!("d{n}"), json!({"type": "string"}));
        json!({"$ref": "#/$defs/d0", "$defs": defs})
    }

    #[test]
    fn ordinary_schemas_pass() {
        let schema = json!({
            "type": "object",
            "properties": {"tree": {"$ref": "#/$defs/node"}, "n": {"type": "integer"}},
            "required": ["tree"],
            "$defs": {"node": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}
        });
        check_schema(&schema).unwrap();
        check_schema(&chain(20)).unwrap();
        check_text_grammar("start: \"(\" x \")\"\nx: /[a-z]+/").unwrap();
    }

    #[test]
    fn long_reference_chains_are_refused_by_place() {
        let e = check_schema(&chain(700)).unwrap_err();
        assert!(e.contains("levels deep") && e.contains("/$defs/d"), "{e}");
    }

    #[test]
    fn thousands_of_properties_are_refused() {
        let names: Vec<String> = (0..7000).map(|i| format!("p{i}")).collect();
        let props: serde_json::Map<String, Value> =
            names.iter().map(|n| (n.clone(), json!({"type": "string"}))).collect();
        let e = check_schema(&json!({"type": "object", "properties": props, "required": names})).unwrap_err();
        assert!(e.contains("properties"), "{e}");
        let e = check_schema(&json!({"type": "object", "required": names})).unwrap_err();
        assert!(e.contains("/required"), "{e}");
    }

    /// A schema of random shape, with `$ref`s to random places in it (cycles included).
    fn schema() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(json!({"type": "string"})),
            Just(json!({"type": "integer"})),
            (0..40usize).prop_map(|i| json!({"$ref": format!("#/$defs/d{i}")})),
            Just(json!({"$ref": "#"})),
            Just(json!({"$ref": "#/nowhere"})),
        ];
        let node = leaf.prop_recursive(8, 200, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 1..6).prop_map(|v| json!({"anyOf": v})),
                prop::collection::vec(inner.clone(), 1..6).prop_map(|v| {
                    let props: serde_json::Map<String, Value> =
                        v.into_iter().enumerate().map(|(i, s)| (format!("p{i}"), s)).collect();
                    json!({"type": "object", "properties": props})
                }),
                inner.prop_map(|s| json!({"type": "array", "items": s})),
            ]
        });
        (node.clone(), prop::collection::vec(node, 0..40)).prop_map(|(root, defs)| {
            let defs: serde_json::Map<String, Value> =
                defs.into_iter().enumerate().map(|(i, d)| (format!("d{i}"), d)).collect();
            let mut root = root;
            if let Some(o) = root.as_object_mut() {
                o.insert("$defs".into(), Value::Object(defs));
            }
            root
        })
    }

    proptest::proptest! {
        /// Any schema is checked without recursion, to the same answer every time; a long
        /// chain prepended to one that passed makes it fail.
        #[test]
        fn any_schema_is_checked_without_a_crash(s in schema()) {
            let first = check_schema(&s);
            proptest::prop_assert_eq!(&first, &check_schema(&s));
            if first.is_ok() {
                let mut deeper = chain(MAX_SCHEMA_DEPTH + 10);
                deeper["$defs"][format!("d{}", MAX_SCHEMA_DEPTH + 10)] = s;
                proptest::prop_assert!(check_schema(&deeper).is_err());
            }
        }

        /// Any text: a size and nesting verdict, never a crash.
        #[test]
        fn any_text_grammar_is_checked(text in "[(\\[\\]{}\"\\\\a-z ]{0,400}") {
            let _ = check_text_grammar(&text);
        }
    }

    #[test]
    fn deep_or_huge_text_grammars_are_refused() {
        let deep = format!("start: {}\"a\"{}", "(".repeat(1000), ")".repeat(1000));
        assert!(check_text_grammar(&deep).unwrap_err().contains("nests"));
        assert!(check_text_grammar(&"a".repeat(MAX_GRAMMAR_BYTES + 1)).unwrap_err().contains("bytes"));
        // Brackets inside a string literal are text.
        check_text_grammar(&format!("start: \"{}\"", "(".repeat(1000))).unwrap();
    }
}
