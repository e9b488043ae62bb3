//! What speculates: plain decoding, or drafts from the MTP head or a block drafter at a depth.
//! Plain data that requests carry, the tuner chooses among and stores, and the cost model and
//! the depth controller reason about.

/// Which drafter a speculating request drafts with.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DraftWith {
    /// The model's MTP head.
    #[default]
    Mtp,
    /// The DFlash block drafter loaded beside the model ([`crate::EngineOptions::drafter`]);
    /// a request asking for it where none is loaded is refused.
    Block,
}

/// How requests speculate: plain decoding (depth 0), or `depth` drafts a cycle from `drafter`.
/// What the tuner chooses among and stores, and what a server applies per workload class.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Speculation {
    #[serde(default)]
    pub drafter: DraftWith,
    pub depth: usize,
}

impl DraftWith {
    /// Its name in files and reports ("mtp", "block").
    pub fn name(self) -> &'static str {
        match self {
            DraftWith::Mtp => "mtp",
            DraftWith::Block => "block",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        [DraftWith::Mtp, DraftWith::Block].into_iter().find(|d| d.name() == name)
    }
}

impl Speculation {
    pub const PLAIN: Speculation = Speculation { drafter: DraftWith::Mtp, depth: 0 };

    pub fn mtp(depth: usize) -> Self {
        Speculation { drafter: DraftWith::Mtp, depth }
    }

    pub fn block(depth: usize) -> Self {
        Speculation { drafter: DraftWith::Block, depth }
    }

    pub fn is_plain(&self) -> bool {
        self.depth == 0
    }

    /// Of two choices that are as fast, the one to keep: fewer drafts, and at equal depth the
    /// MTP head (it needs no second model in memory).
    pub fn cheaper(self, other: Speculation) -> Speculation {
        let rank = |s: &Speculation| (s.depth, s.drafter == DraftWith::Block);
        if rank(&other) < rank(&self) {
            other
        } else {
            self
        }
    }
}

impl std::fmt::Display for Speculation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.depth, self.drafter) {
            (0, _) => write!(f, "plain decoding"),
            (d, DraftWith::Mtp) => write!(f, "MTP depth {d}"),
            (d, DraftWith::Block) => write!(f, "block depth {d}"),
        }
    }
}
