//! How a model's requests speculate: the drafter and depth every request gets, where they came
//! from (tuned, untuned, the command line), and the choices tuned for workload classes over
//! them. Made once from the model's spec (`launch::spec`), carried whole into the server's
//! config and the loaded model, and replaced whole when a tune stores a new choice.

use engine::workload::WorkloadClass;
use engine::Speculation;

#[derive(Debug, Clone, PartialEq)]
pub struct DepthPlan {
    /// What a request of no tuned class speculates with (depth 0: plain decoding).
    pub speculation: Speculation,
    /// Where that came from, for `/v1/status`.
    pub source: String,
    /// Choices tuned for workload classes: a request of such a class speculates as its class's.
    pub by_class: Vec<(WorkloadClass, Speculation)>,
}

impl DepthPlan {
    /// `speculation` for every request.
    pub fn fixed(speculation: Speculation, source: impl Into<String>) -> Self {
        DepthPlan { speculation, source: source.into(), by_class: Vec::new() }
    }

    /// The MTP depth for every request (`ferrite serve --draft-depth N`, embedding programs).
    pub fn mtp(depth: usize, source: impl Into<String>) -> Self {
        DepthPlan::fixed(Speculation::mtp(depth), source)
    }

    /// The draft depth of a request of no tuned class (0: plain decoding).
    pub fn depth(&self) -> usize {
        self.speculation.depth
    }

    /// How a request of `class` speculates: its class's tuned choice, else the plan's.
    pub fn for_class(&self, class: WorkloadClass) -> Speculation {
        self.by_class.iter().find(|(c, _)| *c == class).map_or(self.speculation, |(_, s)| *s)
    }

    /// Whether any request of this plan drafts with the block drafter.
    pub fn uses_block(&self) -> bool {
        let block = |s: &Speculation| !s.is_plain() && s.drafter == engine::DraftWith::Block;
        block(&self.speculation) || self.by_class.iter().any(|(_, s)| block(s))
    }

    /// This plan after a tune: `class`'s choice replaced (or, with no class, the choice for
    /// every request, tuned just now for `why`).
    pub fn tuned(&self, class: Option<WorkloadClass>, choice: Speculation, why: &str) -> Self {
        match class {
            Some(c) => {
                let mut by_class = self.by_class.clone();
                by_class.retain(|(k, _)| *k != c);
                by_class.push((c, choice));
                DepthPlan { by_class, ..self.clone() }
            }
            None => DepthPlan {
                speculation: choice,
                source: format!("tuned just now ({why})"),
                by_class: self.by_class.clone(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_class_tune_changes_that_class_only() {
        let (code, prose) = (WorkloadClass::ALL[0], WorkloadClass::ALL[1]);
        let plan = DepthPlan { by_class: vec![(prose, Speculation::mtp(3))], ..DepthPlan::mtp(1, "tuned") };
        let tuned = plan.tuned(Some(code), Speculation::block(4), "a class tune");
        assert_eq!(
            (tuned.for_class(code), tuned.for_class(prose), tuned.speculation),
            (Speculation::block(4), Speculation::mtp(3), Speculation::mtp(1))
        );
        assert!(tuned.uses_block() && !plan.uses_block());
        assert_eq!(tuned.source, "tuned");
        let again = tuned.tuned(None, Speculation::PLAIN, "the app's Tune");
        assert_eq!(
            (again.for_class(code), again.depth(), again.source.as_str()),
            (Speculation::block(4), 0, "tuned just now (the app's Tune)")
        );
    }
}
