//! Splits streamed model text into reasoning (`<think>…</think>`) and answer content,
//! holding back only what could be the start of a tag.

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Nothing but whitespace seen yet: the text may still open with `<think>`.
    Start,
    Thinking,
    Content,
}

#[derive(Debug)]
pub struct ThinkSplitter {
    mode: Mode,
    held: String,
    /// Right after `</think>`: leading newlines of the answer are dropped.
    trim_next: bool,
}

/// What one piece of text contributes to each channel.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Split {
    pub reasoning: String,
    pub content: String,
}

impl ThinkSplitter {
    /// `thinking`: the prompt already opened a think block (the template ended in `<think>`).
    pub fn new(thinking: bool) -> Self {
        ThinkSplitter {
            mode: if thinking { Mode::Thinking } else { Mode::Start },
            held: String::new(),
            trim_next: false,
        }
    }

    pub fn push(&mut self, text: &str) -> Split {
        self.held.push_str(text);
        let mut out = Split::default();
        loop {
            match self.mode {
                Mode::Start => {
                    let trimmed = self.held.trim_start();
                    if let Some(rest) = trimmed.strip_prefix(OPEN) {
                        self.held = rest.to_string();
                        self.mode = Mode::Thinking;
                    } else if OPEN.starts_with(trimmed) {
                        return out; // still undecided
                    } else {
                        self.mode = Mode::Content;
                    }
                }
                Mode::Thinking => match self.held.find(CLOSE) {
                    Some(at) => {
                        out.reasoning.push_str(&self.held[..at]);
                        self.held = self.held[at + CLOSE.len()..].to_string();
                        self.mode = Mode::Content;
                        self.trim_next = true;
                    }
                    None => {
                        let keep = partial_suffix(&self.held, CLOSE);
                        let emit = self.held.len() - keep;
                        out.reasoning.push_str(&self.held[..emit]);
                        self.held.drain(..emit);
                        return out;
                    }
                },
                Mode::Content => {
                    if self.trim_next {
                        let t = self.held.trim_start_matches(['\n', '\r']).to_string();
                        if t.is_empty() {
                            self.held.clear();
                            return out;
                        }
                        self.held = t;
                        self.trim_next = false;
                    }
                    out.content.push_str(&self.held);
                    self.held.clear();
                    return out;
                }
            }
        }
    }

    /// The rest at the end of the stream.
    pub fn finish(&mut self) -> Split {
        let rest = std::mem::take(&mut self.held);
        match self.mode {
            Mode::Thinking => Split { reasoning: rest, content: String::new() },
            _ => Split { reasoning: String::new(), content: rest },
        }
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `tag`.
pub(crate) fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len().min(text.len() + 1))
        .rev()
        .find(|&n| text.is_char_boundary(text.len() - n) && tag.starts_with(&text[text.len() - n..]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(thinking: bool, pieces: &[&str]) -> (String, String) {
        let mut s = ThinkSplitter::new(thinking);
        let (mut r, mut c) = (String::new(), String::new());
        for p in pieces {
            let o = s.push(p);
            r += &o.reasoning;
            c += &o.content;
        }
        let o = s.finish();
        (r + &o.reasoning, c + &o.content)
    }

    #[test]
    fn splits_think_blocks_across_pieces() {
        assert_eq!(run(false, &["<th", "ink>plan", " it</th", "ink>\n\nAnswer"]), ("plan it".into(), "Answer".into()));
        assert_eq!(run(false, &["Just ", "text <think> inside"]), ("".into(), "Just text <think> inside".into()));
        assert_eq!(run(true, &["reasoning</think>\n", "done"]), ("reasoning".into(), "done".into()));
        assert_eq!(run(true, &["never closed"]), ("never closed".into(), "".into()));
        assert_eq!(run(false, &["\n", "<think>x</think>y"]), ("x".into(), "y".into()));
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn answer() -> impl Strategy<Value = String> {
            let piece = prop_oneof![
                Just("<think>".to_string()),
                Just("</think>".to_string()),
                Just("\n".to_string()),
                "\\PC{0,10}"
            ];
            prop::collection::vec(piece, 0..12).prop_map(|p| p.concat())
        }

        proptest! {
            /// Any split of any text gives the same reasoning and content, and loses nothing
            /// but the tags and the blank line after a closing tag.
            #[test]
            fn any_split_gives_the_same_split(text in answer(), thinking in any::<bool>(), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8)) {
                let whole = run(thinking, &[&text]);
                let pieces = crate::fuzz::split(&text, &cuts);
                prop_assert_eq!(run(thinking, &pieces), whole.clone());
                prop_assert!(whole.0.len() + whole.1.len() <= text.len());
            }
        }
    }
}
