//! OpenAI's `response_format`: `text`, `json_object` or `json_schema`. The engine holds the
//! answer to it while decoding ([`Expect::grammar`]); the complete answer is still checked and
//! the outcome reported beside it (`{"valid": true}`, or why not: an answer cut short by
//! `max_tokens` is not a whole document).
//!
//! Ferrite's extension: `{"type": "grammar", "syntax": "lark" | "regex", "definition": …}`
//! (the shape OpenAI gives a custom tool's grammar) holds the answer to a Lark grammar in
//! llguidance's dialect or to a regular expression.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;

#[derive(Debug, Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    json_schema: Option<JsonSchema>,
    /// `grammar` (Ferrite's extension): `lark` or `regex`, and the grammar.
    #[serde(default)]
    syntax: Option<String>,
    #[serde(default)]
    definition: Option<String>,
}

#[derive(Debug, Deserialize)]
struct JsonSchema {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    schema: Option<Value>,
}

/// What the answer must be.
pub enum Expect {
    JsonObject,
    Schema { name: String, schema: Value, validator: Box<jsonschema::Validator> },
}

impl ResponseFormat {
    /// Checks the request's format up front, so a bad schema is a 400 before any generation.
    pub fn expectation(&self) -> Result<Option<Expect>, ApiError> {
        match self.kind.as_str() {
            "text" | "grammar" => Ok(None),
            "json_object" => Ok(Some(Expect::JsonObject)),
            "json_schema" => {
                let param = "response_format.json_schema";
                let spec = self.json_schema.as_ref().ok_or_else(|| {
                    ApiError::bad_request("response_format of type json_schema needs a `json_schema` object")
                        .with_param(param)
                })?;
                let schema = spec.schema.as_ref().ok_or_else(|| {
                    ApiError::bad_request("response_format.json_schema needs a `schema`").with_param(param)
                })?;
                let validator = validator(schema, "response_format.json_schema.schema", param)?;
                Ok(Some(Expect::Schema {
                    name: spec.name.clone().unwrap_or_else(|| "schema".into()),
                    schema: schema.clone(),
                    validator: Box::new(validator),
                }))
            }
            other => Err(ApiError::bad_request(format!(
                "response_format.type `{other}` is not one of text, json_object, json_schema, grammar"
            ))
            .with_param("response_format.type")),
        }
    }

    /// The grammar of a `grammar` format (`None` for the others).
    pub fn custom_grammar(&self) -> Result<Option<engine::Grammar>, ApiError> {
        if self.kind != "grammar" {
            return Ok(None);
        }
        custom_grammar(self.syntax.as_deref(), self.definition.as_deref(), "response_format").map(Some)
    }
}

/// The validator of a JSON schema a request sent at `field` (errors carry `param`), once the
/// schema is within the engine's limits on what it can enforce (checked first: a schema past
/// them could exhaust the stack of whichever compiles it, the validator's builder included).
pub fn validator(schema: &Value, field: &str, param: &str) -> Result<jsonschema::Validator, ApiError> {
    engine::check_schema(schema).map_err(|e| {
        ApiError::bad_request(format!("{field}: too large to enforce: the JSON schema {e}")).with_param(param)
    })?;
    jsonschema::validator_for(schema)
        .map_err(|e| ApiError::bad_request(format!("{field} is not a valid JSON Schema: {e}")).with_param(param))
}

/// A `{"type": "grammar", "syntax", "definition"}` format's grammar; errors name `field`'s
/// member that was wrong.
pub fn custom_grammar(
    syntax: Option<&str>,
    definition: Option<&str>,
    field: &str,
) -> Result<engine::Grammar, ApiError> {
    let definition = match definition {
        Some(d) if !d.trim().is_empty() => d.to_string(),
        _ => {
            let param = format!("{field}.definition");
            return Err(
                ApiError::bad_request(format!("{param}: a grammar format needs its grammar")).with_param(&param)
            );
        }
    };
    if let Err(e) = engine::check_text_grammar(&definition) {
        let param = format!("{field}.definition");
        return Err(ApiError::bad_request(format!("{param}: too large to enforce: the grammar {e}")).with_param(&param));
    }
    match syntax {
        Some("lark") => Ok(engine::Grammar::Lark(definition)),
        Some("regex") => Ok(engine::Grammar::Regex(definition)),
        other => {
            let param = format!("{field}.syntax");
            Err(ApiError::bad_request(format!("{param}: {other:?} is not `lark` or `regex`")).with_param(&param))
        }
    }
}

impl Expect {
    /// The grammar the engine enforces while decoding.
    pub fn grammar(&self) -> engine::Grammar {
        match self {
            Expect::JsonObject => engine::Grammar::JsonSchema(json!({"type": "object"})),
            Expect::Schema { schema, .. } => engine::Grammar::JsonSchema(schema.clone()),
        }
    }

    /// `Ok(())` when the answer is what was asked for, else why not.
    pub fn check(&self, answer: &str) -> Result<(), String> {
        let value: Value =
            serde_json::from_str(answer.trim()).map_err(|e| format!("the answer is not a JSON document: {e}"))?;
        match self {
            Expect::JsonObject if value.is_object() => Ok(()),
            Expect::JsonObject => Err("the answer is JSON but not an object".into()),
            Expect::Schema { name, validator, .. } => {
                let errors: Vec<String> = validator
                    .iter_errors(&value)
                    .take(5)
                    .map(|e| {
                        let at = e.instance_path().to_string();
                        format!("{}: {e}", if at.is_empty() { "/".to_string() } else { at })
                    })
                    .collect();
                if errors.is_empty() {
                    Ok(())
                } else {
                    Err(format!("the answer does not match schema `{name}`: {}", errors.join("; ")))
                }
            }
        }
    }

    /// The report that goes beside the answer.
    pub fn report(&self, answer: &str) -> Value {
        match self.check(answer) {
            Ok(()) => json!({"valid": true}),
            Err(error) => json!({"valid": false, "error": error}),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expect(v: Value) -> Result<Option<Expect>, ApiError> {
        serde_json::from_value::<ResponseFormat>(v).unwrap().expectation()
    }

    #[test]
    fn json_object_wants_an_object() {
        let e = expect(json!({"type": "json_object"})).unwrap().unwrap();
        assert!(e.check(" {\"a\": 1}\n").is_ok());
        assert!(e.check("[1]").unwrap_err().contains("not an object"));
        assert!(e.check("```json\n{}\n```").unwrap_err().contains("not a JSON document"));
    }

    #[test]
    fn schemas_are_checked_and_name_the_failing_place() {
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]});
        let e = expect(json!({"type": "json_schema", "json_schema": {"name": "count", "schema": schema}}))
            .unwrap()
            .unwrap();
        assert!(e.check("{\"n\": 3}").is_ok());
        let err = e.check("{\"n\": \"three\"}").unwrap_err();
        assert!(err.contains("count") && err.contains("/n"), "{err}");
        assert!(e.check("{}").unwrap_err().contains("required") || e.check("{}").unwrap_err().contains("\"n\""));
    }

    #[test]
    fn bad_formats_are_refused_up_front() {
        assert!(expect(json!({"type": "text"})).unwrap().is_none());
        assert!(expect(json!({"type": "xml"})).is_err());
        assert!(expect(json!({"type": "json_schema"})).is_err());
        let bad = expect(json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}));
        assert!(bad.err().unwrap().message.contains("not a valid JSON Schema"));
    }
}
