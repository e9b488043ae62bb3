//! Plain stretches of a speculating request: where the depth controller sent it back to plain
//! decoding, its tokens come from plain pipelined steps (the next step scheduled before the
//! last token is read), and the speculator is told each one so a probe drafts from where the
//! answer is.

use mlx_rs::ops::indexing::{IndexOp, NewAxis};
use mlx_rs::Array;

use super::{schedule, Generation, Phase};
use crate::error::{Error, Result};
use crate::penalties::Recent;

impl Generation<'_> {
    /// The depth controller sent the request back to plain decoding (depth 0): from here its
    /// tokens come from plain pipelined steps, as a request without speculation decodes, and
    /// the speculator is told each one. The last committed token is fed now and the next one
    /// scheduled; the trunk stops recording per-position states (nothing is rolled back).
    pub(super) fn begin_plain_stretch(&mut self) -> Result<()> {
        let last = *self.tokens.last().ok_or_else(|| Error::Request("plain decoding before the first token".into()))?;
        self.cache.set_record(false);
        self.catch_up_plain_choice();
        let (hidden, logits) = self.feed_plain(&Array::from_slice(&[last], &[1, 1]))?;
        if let Some(spec) = &mut self.spec {
            spec.fed_plain(hidden);
        }
        let next = self.choose(logits)?;
        schedule(self.engine.model.is_split(), [&next])?;
        self.set_pending(next);
        Ok(())
    }

    /// Before plain steps follow speculative cycles: the plain path's own state of the answer —
    /// a forced script's position, the penalties' window — catches up with the tokens the
    /// cycles committed (their drafts and verify passes kept their own).
    pub(super) fn catch_up_plain_choice(&mut self) {
        if let Some(forced) = &mut self.forced {
            forced.skip_to(self.tokens.len());
        }
        let penalties = self.request.sampling.penalties;
        if !penalties.is_off() {
            let seen: Vec<u32> = self.request.prompt.iter().chain(&self.tokens).copied().collect();
            self.recent = Some(Recent::new(penalties, &seen));
        }
    }

    /// The trunk's step on `token` [1, 1]: the features the drafter reads at it and its
    /// logits (lazy).
    fn feed_plain(&mut self, token: &Array) -> Result<(Array, Array)> {
        let spec = self.spec.as_ref().ok_or_else(|| Error::Request("plain stretch without a speculator".into()))?;
        let (hidden, features) = spec.trunk(token, &mut self.cache)?;
        let logits = crate::logits::last_position(&self.engine.model.logits(&hidden)?)?;
        Ok((features, logits))
    }

    /// The token a plain stretch scheduled last, read back. While the depth stays 0 the step
    /// on it is fed and the next token scheduled before it is read (as plain decoding
    /// pipelines); otherwise drafting resumes after it (the trunk records again for the next
    /// verify pass).
    pub(super) fn plain_stretch_step(&mut self) -> Result<u32> {
        let y = match &mut self.phase {
            Phase::Decoding { pending } => pending.take(),
            _ => None,
        }
        .ok_or_else(|| Error::Request("a plain step without a scheduled token".into()))?;
        let spec = self.spec.as_mut().ok_or_else(|| Error::Request("plain stretch without a speculator".into()))?;
        let more = self.generated + 1 < self.request.max_tokens;
        if !(more && spec.next_depth() == 0) {
            let token = y.try_item_cast::<u32>()?;
            spec.took_plain(token)?;
            self.cache.set_record(true);
            if let Some(c) = &mut self.constraint {
                c.accept(token)?;
            }
            return Ok(token);
        }
        let (hidden, logits) = self.feed_plain(&y.index(NewAxis))?;
        let split = self.engine.model.is_split();
        let next = if self.constraint.is_some() {
            // The next mask needs this token on the host: the step runs meanwhile.
            schedule(split, [&logits])?;
            None
        } else {
            let next = self.choose(logits.clone())?;
            schedule(split, [&next])?;
            Some(next)
        };
        let token = y.try_item_cast::<u32>()?;
        if let Some(spec) = &mut self.spec {
            spec.took_plain(token)?;
            spec.fed_plain(hidden);
        }
        match next {
            Some(next) => self.set_pending(next),
            None => self.schedule_after(token, Some(logits), true)?,
        }
        Ok(token)
    }
}
