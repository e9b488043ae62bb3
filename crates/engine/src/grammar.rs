//! Output held to a grammar while decoding: llguidance's matcher, over a token trie built from
//! the model's own tokenizer, says which tokens may come next; the others' logits become -inf
//! before sampling, and each chosen token advances the matcher.
//!
//! A JSON schema, a Lark grammar or a regular expression ([`Grammar`]) becomes a
//! [`Constraint`] per request; the parser factory (the token trie, built once per model, the
//! costly part) is made on the first constrained request.

use std::path::Path;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use mlx_rs::Array;
use serde_json::Value;

use crate::error::{Error, Result};

/// What a request's answer must match.
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// A JSON document valid under this JSON Schema (`{"type": "object"}` for any object).
    JsonSchema(Value),
    /// llguidance's Lark dialect.
    Lark(String),
    /// A regular expression over the whole answer.
    Regex(String),
}

/// Makes constraints for one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
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
        let mut factory = ParserFactory::new_simple(&env).map_err(failed)?;
        factory.quiet();
        Ok(Grammars { factory, vocab })
    }

    /// A fresh constraint for `grammar`; an error names what the grammar cannot express.
    pub fn constraint(&self, grammar: &Grammar) -> Result<Constraint> {
        let top = match grammar {
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)),
            Grammar::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
            Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
        };
        let parser = self
            .factory
            .create_parser(top)
            .map_err(|e| Error::Field { field: "grammar", message: format!("cannot be enforced: {e}") })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::Field { field: "grammar", message: format!("cannot be enforced: {e}") });
        }
        Ok(Constraint { matcher, vocab: self.vocab, current: None })
    }
}

/// The schema with llguidance's JSON options set, unless it sets its own (`x-guidance`): one
/// space after `,` and `:` and no other whitespace, as `json.dumps` writes. Free whitespace
/// lets a small model wander in newlines and indentation until it runs out of tokens.
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
