//! What kind of work a request is, for draft depths tuned per kind: its prompt class (code,
//! prose, or an agent's tool turn) and whether it samples. Acceptance differs between them —
//! code drafts well, prose less, sampling less than greedy — so one depth for everything is
//! wrong somewhere; the tuner measures each class on a suite of its own and the server picks
//! the stored depth for each request's class.

use std::fmt;

use serde_json::json;

/// The kind of text a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum PromptClass {
    Code,
    Prose,
    /// A turn of a coding agent: tools offered, the answer often a tool call.
    Agent,
}

/// A prompt class and whether the request samples (temperature above 0) or is greedy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkloadClass {
    pub prompts: PromptClass,
    pub sampled: bool,
}

/// What a coding agent asks.
const CODE: [&str; 4] = [
    "Write a Python function that parses a line of CSV text into a list of fields, handling quoted fields.",
    "Implement binary search over a sorted slice in Rust, returning the index of the target or None.",
    "Write a Python class for a least-recently-used cache with get and put methods.",
    "Write a Rust function that counts the words in a string and returns them in a HashMap.",
];

/// Requests for plain writing.
const PROSE: [&str; 4] = [
    "Explain to a new colleague, in a few paragraphs, why a team keeps a changelog.",
    "Write a short email asking a supplier to move a delivery from Tuesday to Thursday.",
    "Describe the water cycle for a curious ten-year-old.",
    "Summarise the trade-offs between renting and buying a home in a few paragraphs.",
];

/// An agent's turns: each asks for something the offered tools do.
const AGENT: [&str; 4] = [
    "Read src/main.rs and tell me what the program does.",
    "Run the test suite and fix the first failing test.",
    "Find every TODO comment in the repository and list them with their files.",
    "Rename the function parse_line to parse_record everywhere in the project.",
];

impl PromptClass {
    pub const ALL: [PromptClass; 3] = [PromptClass::Code, PromptClass::Prose, PromptClass::Agent];

    fn name(self) -> &'static str {
        match self {
            PromptClass::Code => "code",
            PromptClass::Prose => "prose",
            PromptClass::Agent => "agent",
        }
    }

    /// The tuner's suite for this class (user messages).
    pub const fn prompts(self) -> &'static [&'static str] {
        match self {
            PromptClass::Code => &CODE,
            PromptClass::Prose => &PROSE,
            PromptClass::Agent => &AGENT,
        }
    }

    /// The tools an agent suite's prompts are offered (in the chat template's `tools` form).
    pub fn tools(self) -> Option<serde_json::Value> {
        let tool = |name: &str, description: &str, arg: &str| {
            json!({"type": "function", "function": {"name": name, "description": description,
                "parameters": {"type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}})
        };
        (self == PromptClass::Agent).then(|| {
            json!([
                tool("read_file", "Read a file of the project", "path"),
                tool("run", "Run a shell command in the project and return its output", "command"),
                tool("edit_file", "Replace a file's text", "path"),
            ])
        })
    }

    /// The class of a request: an agent's when it offers tools; else code when its last user
    /// message reads as code or asks for it, else prose.
    pub fn of(last_user_text: &str, offers_tools: bool) -> PromptClass {
        if offers_tools {
            PromptClass::Agent
        } else if looks_like_code(last_user_text) {
            PromptClass::Code
        } else {
            PromptClass::Prose
        }
    }
}

/// Code fences, lines ending in code punctuation, or a request naming a programming task.
fn looks_like_code(text: &str) -> bool {
    if text.contains("```") {
        return true;
    }
    let code_lines = text
        .lines()
        .map(str::trim_end)
        .filter(|l| l.ends_with(['{', '}', ';', ')']) || l.starts_with("    ") || l.starts_with('\t'))
        .count();
    if code_lines >= 2 {
        return true;
    }
    let lower = text.to_lowercase();
    const ASKS: [&str; 14] = [
        "function",
        "class ",
        "implement",
        "python",
        "rust",
        "javascript",
        "typescript",
        "sql",
        "code",
        "script",
        "compile",
        "bug",
        "refactor",
        "regex",
    ];
    ASKS.iter().any(|w| lower.contains(w))
}

impl WorkloadClass {
    pub const ALL: [WorkloadClass; 6] = [
        WorkloadClass { prompts: PromptClass::Code, sampled: false },
        WorkloadClass { prompts: PromptClass::Code, sampled: true },
        WorkloadClass { prompts: PromptClass::Prose, sampled: false },
        WorkloadClass { prompts: PromptClass::Prose, sampled: true },
        WorkloadClass { prompts: PromptClass::Agent, sampled: false },
        WorkloadClass { prompts: PromptClass::Agent, sampled: true },
    ];

    /// A request's class.
    pub fn of(last_user_text: &str, offers_tools: bool, temperature: f32) -> WorkloadClass {
        WorkloadClass { prompts: PromptClass::of(last_user_text, offers_tools), sampled: temperature > 0.0 }
    }

    /// The temperature the tuner measures the class at.
    pub fn temperature(self) -> f32 {
        if self.sampled {
            0.7
        } else {
            0.0
        }
    }

    /// `code/greedy`, `prose/sampled`, …
    pub fn parse(text: &str) -> Result<WorkloadClass, String> {
        WorkloadClass::ALL.into_iter().find(|c| c.to_string() == text).ok_or_else(|| {
            let names: Vec<String> = WorkloadClass::ALL.iter().map(|c| c.to_string()).collect();
            format!("unknown workload class `{text}` (one of {})", names.join(", "))
        })
    }
}

impl fmt::Display for WorkloadClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.prompts.name(), if self.sampled { "sampled" } else { "greedy" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_fall_into_their_class() {
        let class = |text: &str, tools: bool, t: f32| WorkloadClass::of(text, tools, t).to_string();
        assert_eq!(class("Write a Rust function that reverses a list.", false, 0.0), "code/greedy");
        assert_eq!(class("fn main() {\n    println!(\"hi\");\n}", false, 0.7), "code/sampled");
        assert_eq!(class("Here is my file:\n```\nx = 1\n```\nWhat does it do?", false, 0.0), "code/greedy");
        assert_eq!(class("Write a poem about the sea.", false, 1.0), "prose/sampled");
        assert_eq!(class("Describe your weekend.", false, 0.0), "prose/greedy");
        assert_eq!(class("Write a poem about the sea.", true, 0.0), "agent/greedy", "tools offered: an agent");
    }

    #[test]
    fn names_round_trip_and_unknown_ones_are_refused() {
        for c in WorkloadClass::ALL {
            assert_eq!(WorkloadClass::parse(&c.to_string()), Ok(c));
        }
        let err = WorkloadClass::parse("poetry/greedy").unwrap_err();
        assert!(err.contains("poetry/greedy") && err.contains("agent/sampled"), "{err}");
    }

    #[test]
    fn every_class_has_a_suite_and_agents_have_tools() {
        for p in PromptClass::ALL {
            assert_eq!(p.prompts().len(), 4);
            assert_eq!(p.tools().is_some(), p == PromptClass::Agent);
        }
    }
}
