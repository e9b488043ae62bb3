//! Property tests' inputs (tests only): JSON request bodies built from the fields the APIs
//! read, with values of every type, nested, so the parsers and the conversions to a prompt see
//! well-formed, ill-typed and absurd bodies alike. Each parser's property test lives beside it
//! (`mod fuzz` in openai.rs, anthropic.rs, responses.rs, tools.rs, think.rs); `make test` runs
//! proptest's default number of cases, `PROPTEST_CASES=100000 cargo test -p ferrite-server
//! fuzz` runs longer. A case that fails is shrunk and kept in `proptest-regressions/`.

use proptest::prelude::*;
use serde_json::{Map, Value};

/// Keys the APIs read (any of them may appear at any depth), and a few they do not.
const KEYS: &[&str] = &[
    "model",
    "messages",
    "role",
    "content",
    "type",
    "text",
    "tools",
    "tool_choice",
    "function",
    "name",
    "arguments",
    "parameters",
    "tool_calls",
    "id",
    "tool_call_id",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop",
    "stream",
    "n",
    "seed",
    "input",
    "instructions",
    "output",
    "call_id",
    "system",
    "thinking",
    "budget_tokens",
    "tool_use_id",
    "tool_result",
    "tool_use",
    "is_error",
    "response_format",
    "json_schema",
    "schema",
    "format",
    "reasoning",
    "effort",
    "additional_tools",
    "namespace",
    "custom",
    "custom_tool_call",
    "function_call",
    "function_call_output",
    "previous_response_id",
    "max_output_tokens",
    "stop_sequences",
    "output_config",
    "chat_template_kwargs",
    "enable_thinking",
    "reasoning_effort",
    "logprobs",
    "unknown",
];

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|f| serde_json::Number::from_f64(f).map(Value::Number).unwrap_or(Value::Null)),
        prop::sample::select(KEYS).prop_map(Value::from),
        "\\PC{0,24}".prop_map(Value::from),
        Just(Value::from("<tool_call>{\"name\": \"a\"</tool_call><think>")),
    ]
}

/// Any JSON value, objects keyed mostly by the APIs' field names.
pub fn json() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec((prop::sample::select(KEYS), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect::<Map<_, _>>())),
        ]
    })
}

/// A request body: usually an object, sometimes anything, sometimes bytes that are not JSON.
pub fn body() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        6 => prop::collection::vec((prop::sample::select(KEYS), json()), 0..10)
            .prop_map(|kv| Value::Object(kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect()).to_string().into_bytes()),
        1 => json().prop_map(|v| v.to_string().into_bytes()),
        1 => prop::collection::vec(any::<u8>(), 0..64),
    ]
}

/// `text` cut at the (character-boundary) positions `cuts` pick, in order.
pub fn split<'t>(text: &'t str, cuts: &[prop::sample::Index]) -> Vec<&'t str> {
    let mut at: Vec<usize> =
        cuts.iter().map(|i| i.index(text.len() + 1)).filter(|&i| text.is_char_boundary(i)).collect();
    at.sort();
    let (mut pieces, mut last) = (vec![], 0);
    for i in at {
        pieces.push(&text[last..i]);
        last = i;
    }
    pieces.push(&text[last..]);
    pieces
}
