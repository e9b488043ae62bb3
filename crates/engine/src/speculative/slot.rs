//! One drafter's side of a speculating request: its own cache, the trunk positions it has not
//! seen yet, and the controller of its depth. A request that may switch drafters holds two
//! (the one in use and the one standing by); both are told every position the trunk
//! processes, and each takes them in when it next drafts.

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::eval;
use mlx_rs::{ops, Array};

use crate::cache::Cache;
use crate::depth_control::DepthController;
use crate::error::Result;
use crate::models::{BlockDrafter, LanguageModel, MtpHead};
use crate::speculation::DraftWith;

/// What writes the drafts.
#[derive(Clone, Copy)]
pub enum Drafter<'m> {
    /// The model's multi-token-prediction head, one draft per step.
    Mtp(&'m MtpHead),
    /// A DFlash drafter: a block of drafts in one pass.
    Block(&'m BlockDrafter),
}

impl Drafter<'_> {
    pub fn draft_with(self) -> DraftWith {
        match self {
            Drafter::Mtp(_) => DraftWith::Mtp,
            Drafter::Block(_) => DraftWith::Block,
        }
    }
}

/// A prompt's rotary placement where it holds images ([`crate::vision::RopePositions`]): every
/// prompt position's angles [L, rotary dims / 2], and the shift of the positions after it.
pub struct PromptAngles {
    pub angles: Array,
    pub shift: i32,
}

/// Positions the drafter standing by may fall behind before it takes them in: it holds their
/// features meanwhile, and a drafter that is never used again must not hold a whole answer's.
const MOST_BEHIND: usize = 256;
/// A cycle's own pending positions (its committed tokens) are at most a block's: more come from
/// plain steps, and are taken in first ([`Slot::catch_up`]), padded to a power of two.
pub(super) const CYCLE_PENDING: usize = 8;

/// How many positions a catch-up of `n` runs: a power of two past a cycle's own. On a GPU each
/// new length of a pass costs MLX's CUDA backend several milliseconds the first time it meets it
/// (once a process) and far more the first time on a machine, and a plain stretch's length is
/// new almost every time; padded, a request meets a handful of lengths. The padding follows the
/// real positions, which never attend to it, and is rolled back.
fn padded(n: usize) -> usize {
    if n <= CYCLE_PENDING {
        n
    } else {
        n.next_power_of_two()
    }
}

pub(super) struct Slot<'m> {
    pub(super) drafter: Drafter<'m>,
    /// The drafter's own cache: the MTP head's layers, or a block drafter's context.
    pub(super) cache: Cache,
    /// Trunk features whose next tokens (`pending_tokens`) are known but which the drafter
    /// has not seen yet, in parts joined when used (a part a cycle or a plain step: joining
    /// them one by one would copy a long plain stretch's features again at every step).
    pending: Vec<Array>,
    pub(super) pending_tokens: Vec<u32>,
    /// The trunk's features at the last position the drafter was told of.
    pub(super) last_hidden: Option<Array>,
    /// Chooses this drafter's depth from its live acceptance, when on.
    pub(super) control: Option<DepthController>,
}

impl<'m> Slot<'m> {
    pub(super) fn new(drafter: Drafter<'m>) -> Self {
        let cache = match drafter {
            Drafter::Mtp(head) => head.new_cache(),
            Drafter::Block(block) => block.new_cache(),
        };
        Slot { drafter, cache, pending: Vec::new(), pending_tokens: Vec::new(), last_hidden: None, control: None }
    }

    /// Shows the drafter trunk positions it has not seen: their `features` [1, L, F] and the
    /// tokens after them (`next_tokens`, L of them). A catch-up (`placed` is then `None`) runs
    /// a padded length ([`padded`]).
    fn show(
        &mut self,
        model: &dyn LanguageModel,
        features: &Array,
        next_tokens: &[u32],
        placed: Option<&PromptAngles>,
        catching_up: bool,
    ) -> Result<()> {
        let n = next_tokens.len();
        let pad = if catching_up { padded(n) - n } else { 0 };
        let with_padding;
        let (features, next_tokens) = match pad {
            0 => (features, next_tokens),
            _ => {
                let zeros = ops::zeros_dtype(&[1, pad as i32, features.dim(2)], features.dtype())?;
                let mut tokens = next_tokens.to_vec();
                tokens.resize(n + pad, 0);
                with_padding = (ops::concatenate(&[features, &zeros], 1)?, tokens);
                (&with_padding.0, with_padding.1.as_slice())
            }
        };
        match self.drafter {
            Drafter::Mtp(head) => {
                // The head's slot `j` reads the trunk's features at position `j`: inside a
                // prompt with images it takes that position's angles, as the trunk did (a block
                // drafter's positions are its context's own).
                let (at, n) = (self.cache.offset(), next_tokens.len() as i32);
                if let Some(p) = placed.filter(|p| at + n <= p.angles.dim(0)) {
                    self.cache.place_next(&p.angles.index(at..at + n), p.shift);
                }
                let ids = Array::from_slice(next_tokens, &[1, next_tokens.len() as i32]);
                let _ = head.forward(model, features, &ids, &mut self.cache)?;
            }
            Drafter::Block(block) => block.extend(features, &mut self.cache)?,
        }
        if pad > 0 {
            self.cache.rollback(pad as i32)?;
        }
        eval(self.cache.arrays())?;
        Ok(())
    }

    /// A prefill chunk: `tokens` were just processed by the trunk, giving `features`
    /// [1, L, F]. Each trunk position is paired with the token after it; `placed`: the
    /// prompt's rotary placement, where it holds images.
    pub(super) fn observe(
        &mut self,
        model: &dyn LanguageModel,
        tokens: &[u32],
        features: &Array,
        placed: Option<&PromptAngles>,
    ) -> Result<()> {
        let n = tokens.len() as i32;
        let mut parts = Vec::new();
        parts.extend(self.last_hidden.take());
        let next_tokens = if parts.is_empty() { &tokens[1..] } else { tokens };
        if n > 1 {
            parts.push(features.index((.., ..n - 1, ..)));
        }
        if !next_tokens.is_empty() {
            self.show(model, &ops::concatenate(&parts, 1)?, next_tokens, placed, false)?;
        }
        self.last_hidden = Some(features.index((.., n - 1.., ..)));
        Ok(())
    }

    /// Decoding starts: `first` is the token sampled after the prompt.
    pub(super) fn start(&mut self, first: u32) {
        self.pending = self.last_hidden.take().into_iter().collect();
        self.pending_tokens = vec![first];
    }

    /// Positions whose features and next tokens are now known.
    pub(super) fn push(&mut self, features: Array, tokens: &[u32]) {
        self.pending.push(features);
        self.pending_tokens.extend(tokens);
    }

    /// Replaces what is pending (after a cycle that drafted from it).
    pub(super) fn replace(&mut self, features: Array, tokens: Vec<u32>) {
        self.pending = vec![features];
        self.pending_tokens = tokens;
    }

    /// The pending features joined [1, L, F], taken (`None` before decoding started).
    pub(super) fn take_pending(&mut self) -> Result<Option<Array>> {
        Ok(match std::mem::take(&mut self.pending).as_slice() {
            [] => None,
            [one] => Some(one.clone()),
            parts => Some(ops::concatenate(parts, 1)?),
        })
    }

    /// Drops the last `n` pending positions (at least one stays).
    pub(super) fn forget_last(&mut self, n: usize) -> Result<()> {
        let keep = self.pending_tokens.len().checked_sub(n).filter(|&k| k > 0).ok_or_else(|| {
            crate::error::Error::Request(format!(
                "cannot forget {n} of {} pending positions",
                self.pending_tokens.len()
            ))
        })?;
        let Some(features) = self.take_pending()? else { return Ok(()) };
        self.pending = vec![features.index((.., ..keep as i32, ..))];
        self.pending_tokens.truncate(keep);
        Ok(())
    }

    /// The features at the one pending position, while decoding (after a cycle, or
    /// [`Slot::catch_up`]).
    pub(super) fn last_pending(&self) -> Option<&Array> {
        match (self.pending.as_slice(), self.pending_tokens.len()) {
            ([one], 1) => Some(one),
            _ => None,
        }
    }

    /// Shows the drafter every pending position but the last (all of them when `fed` holds
    /// the features at a position the trunk has seen after them, whose next token is not
    /// known: it becomes the last), so its cache ends one position before the trunk's.
    pub(super) fn catch_up(&mut self, model: &dyn LanguageModel, fed: Option<&Array>) -> Result<()> {
        let n = self.pending_tokens.len();
        let keep = if fed.is_some() { 0 } else { 1 };
        if n <= keep {
            if let Some(fed) = fed {
                self.last_hidden = Some(fed.clone());
            }
            return Ok(());
        }
        let Some(features) = self.take_pending()? else { return Ok(()) };
        let k = (n - keep) as i32;
        let tokens: Vec<u32> = self.pending_tokens.drain(..n - keep).collect();
        self.show(model, &features.index((.., ..k, ..)), &tokens, None, true)?;
        match fed {
            Some(fed) => self.last_hidden = Some(fed.clone()),
            None => self.pending = vec![features.index((.., k.., ..))],
        }
        Ok(())
    }

    /// The drafter standing by takes in what it fell behind by once that is many positions.
    pub(super) fn keep_near(&mut self, model: &dyn LanguageModel) -> Result<()> {
        if self.pending_tokens.len() > MOST_BEHIND {
            self.catch_up(model, None)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cycle's own pending positions run as they are; a plain stretch's catch-up runs the
    /// next power of two.
    #[test]
    fn catch_ups_run_a_few_lengths() {
        let runs: Vec<usize> = [1, 5, 8, 9, 16, 17, 100, 129].into_iter().map(padded).collect();
        assert_eq!(runs, [1, 5, 8, 16, 16, 32, 128, 256]);
    }
}
