//! A test device: `ferrite serve --scripted-replies FILE` answers prompts that match a rule
//! with the rule's reply, fixed in advance and enforced token by token on the model's logits
//! (`GenerateRequest::forced_tokens`), so the answer still goes through the engine's decoding,
//! the tool-call parser and the protocols' streams. The agent tests use it to have a small
//! model call a client's own tool (write a file) and end the turn when the result comes back.
//! Prompts no rule matches are answered by the model as usual.
//!
//! The file is a JSON array of rules, the first match wins:
//! `[{"when": ["<tool_response>", "hello.txt"], "reply": "Done."}, ...]` — `when` lists strings
//! that must all occur in the rendered prompt.

use std::path::Path;

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    pub when: Vec<String>,
    pub reply: String,
}

#[derive(Debug, Clone, Default)]
pub struct ScriptedReplies {
    rules: Vec<Rule>,
}

impl ScriptedReplies {
    pub fn new(rules: Vec<Rule>) -> Self {
        ScriptedReplies { rules }
    }

    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("reading {}: {e}", path.display()))?;
        let rules: Vec<Rule> =
            serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{}: not a list of rules: {e}", path.display()))?;
        if let Some(i) = rules.iter().position(|r| r.when.is_empty()) {
            anyhow::bail!("{}: rule {i} has an empty `when` (it would match every prompt)", path.display());
        }
        Ok(ScriptedReplies { rules })
    }

    /// The reply of the first rule whose strings all occur in `prompt`.
    pub fn reply_for(&self, prompt: &str) -> Option<&str> {
        self.rules.iter().find(|r| r.when.iter().all(|w| prompt.contains(w.as_str()))).map(|r| r.reply.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_rule_whose_strings_all_occur_wins() {
        let rules = vec![
            Rule { when: vec!["<tool_response>".into(), "hello".into()], reply: "done".into() },
            Rule { when: vec!["hello".into()], reply: "call".into() },
        ];
        let script = ScriptedReplies { rules };
        assert_eq!(script.reply_for("say hello"), Some("call"));
        assert_eq!(script.reply_for("say hello <tool_response>ok"), Some("done"));
        assert_eq!(script.reply_for("something else"), None);
    }

    #[test]
    fn a_rule_that_matches_everything_is_refused() {
        let dir = std::env::temp_dir().join(format!("ferrite-scripted-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("rules.json");
        std::fs::write(&path, r#"[{"when": [], "reply": "x"}]"#).unwrap();
        let err = ScriptedReplies::load(&path).unwrap_err().to_string();
        assert!(err.contains("rule 0 has an empty `when`"), "{err}");
        std::fs::write(&path, r#"[{"when": ["a"], "answer": "x"}]"#).unwrap();
        let err = ScriptedReplies::load(&path).unwrap_err().to_string();
        assert!(err.contains("answer"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
