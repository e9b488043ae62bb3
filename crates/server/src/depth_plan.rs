//! The draft depths a model is served with: the depth every request gets, where it came from
//! (tuned, untuned, the command line), and the depths tuned for workload classes over it.
//! Made once from the model's spec (`launch::spec`), carried whole into the server's config
//! and the loaded model, and replaced whole when a tune stores a new depth.

use engine::workload::WorkloadClass;

#[derive(Debug, Clone, PartialEq)]
pub struct DepthPlan {
    /// MTP draft depth for a request of no tuned class (0 = plain decoding).
    pub depth: usize,
    /// Where that depth came from, for `/v1/status`.
    pub source: String,
    /// Depths tuned for workload classes: a request of such a class runs at its class's depth.
    pub by_class: Vec<(WorkloadClass, usize)>,
}

impl DepthPlan {
    /// `depth` for every request.
    pub fn fixed(depth: usize, source: impl Into<String>) -> Self {
        DepthPlan { depth, source: source.into(), by_class: Vec::new() }
    }

    /// The draft depth for a request of `class`: its class's tuned depth, else the plan's.
    pub fn for_class(&self, class: WorkloadClass) -> usize {
        self.by_class.iter().find(|(c, _)| *c == class).map_or(self.depth, |(_, d)| *d)
    }

    /// This plan after a tune: `class`'s depth replaced (or, with no class, the depth for
    /// every request, tuned just now for `why`).
    pub fn tuned(&self, class: Option<WorkloadClass>, depth: usize, why: &str) -> Self {
        match class {
            Some(c) => {
                let mut by_class = self.by_class.clone();
                by_class.retain(|(k, _)| *k != c);
                by_class.push((c, depth));
                DepthPlan { by_class, ..self.clone() }
            }
            None => DepthPlan { depth, source: format!("tuned just now ({why})"), by_class: self.by_class.clone() },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_class_tune_changes_that_class_only() {
        let (code, prose) = (WorkloadClass::ALL[0], WorkloadClass::ALL[1]);
        let plan = DepthPlan { by_class: vec![(prose, 3)], ..DepthPlan::fixed(1, "tuned") };
        let tuned = plan.tuned(Some(code), 2, "a class tune");
        assert_eq!((tuned.for_class(code), tuned.for_class(prose), tuned.depth), (2, 3, 1));
        assert_eq!(tuned.source, "tuned");
        let again = tuned.tuned(None, 0, "the app's Tune");
        assert_eq!(
            (again.for_class(code), again.depth, again.source.as_str()),
            (2, 0, "tuned just now (the app's Tune)")
        );
    }
}
