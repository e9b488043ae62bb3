//! What a batched decode step (`batch.rs`) asks of each generation in it: a prefill fed
//! chunk by chunk between the batch's steps, the token scheduled last, the cache lent as one
//! of the batch's rows and given back.

use mlx_rs::transforms::async_eval;
use mlx_rs::Array;

use super::{Generation, Phase};
use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::request::{Event, FinishReason};

impl<'a> Generation<'a> {
    /// Makes the generation ready for a batch's next step: a new one is prefilled and its
    /// first token scheduled; a speculative one goes on decoding plainly
    /// ([`Generation::can_join_batch`]). A batch decodes plainly: the MTP head drafts for one
    /// sequence at a time.
    pub(crate) fn start_batched(&mut self) -> Result<()> {
        if self.needs_prefill() {
            self.begin_batched_prefill()?;
            let chunk = self.prefill_size(self.engine.prefill_chunk);
            while self.prefill_chunk(chunk)? {}
            self.finish_batched_prefill()
        } else {
            self.leave_speculation()
        }
    }

    /// Whether nothing of the prompt has been fed to the model yet.
    pub(crate) fn needs_prefill(&self) -> bool {
        matches!(self.phase, Phase::Waiting)
    }

    /// Starts a prefill a batch feeds chunk by chunk ([`Generation::prefill_step`]), without
    /// speculation.
    pub(crate) fn begin_batched_prefill(&mut self) -> Result<()> {
        self.spec = None;
        self.begin_prefill()
    }

    /// One interleaved chunk of the prompt (the engine's [`Engine::prefill_interleave`]
    /// tokens, or the request's fewer); whether another follows.
    pub(crate) fn prefill_step(&mut self) -> Result<bool> {
        self.prefill_chunk(self.prefill_size(self.engine.prefill_interleave()))
    }

    /// Ends a batched prefill: the first token is scheduled.
    pub(crate) fn finish_batched_prefill(&mut self) -> Result<()> {
        let first = self.end_prefill()?;
        async_eval([&first])?;
        self.set_pending(first);
        Ok(())
    }

    /// Whether the generation can go on in a batch from here: it has started, has not ended,
    /// and every token it committed has been returned (a speculative one is between cycles).
    pub fn can_join_batch(&self) -> bool {
        let Phase::Decoding { pending } = &self.phase else { return false };
        let between = self.queue.is_empty() && (self.spec.is_some() || pending.is_some());
        self.generated > 0 && between
    }

    /// A speculative generation between cycles goes on decoding plainly: its trunk cache holds
    /// every token but the last, which is fed now to schedule the next; the penalties' window
    /// is rebuilt from what was generated; the MTP head and its cache are dropped (their
    /// figures stay for the summary). One the depth controller had sent back to plain
    /// decoding already has its next token scheduled and its window current.
    fn leave_speculation(&mut self) -> Result<()> {
        let Some(spec) = self.spec.take() else { return Ok(()) };
        self.spec_before_batch = Some(spec.stats.clone());
        if self.pending().is_some() {
            return Ok(());
        }
        self.catch_up_plain_choice();
        let last = *self
            .tokens
            .last()
            .ok_or_else(|| Error::Request("a generation joined a batch before its first token".into()))?;
        let next = self.step(&Array::from_slice(&[last], &[1, 1]))?;
        async_eval([&next])?;
        self.set_pending(next);
        Ok(())
    }

    /// The token scheduled last (lazy) and whether another step follows it; or, when the
    /// generation ends before it (cancelled, or its grammar allowed nothing), its last event.
    pub(crate) fn next_input(&mut self) -> std::result::Result<(Array, bool), Box<Event>> {
        if self.cancel.is_cancelled() {
            self.phase = Phase::Done;
            return Err(Box::new(self.finished(FinishReason::Cancelled)));
        }
        if let Some(ended) = self.take_grammar_end() {
            return Err(Box::new(self.grammar_finished(ended)));
        }
        let more = self.generated + 1 < self.request.max_tokens;
        if let Phase::Decoding { pending } = &mut self.phase {
            if let Some(token) = pending.take() {
                return Ok((token, more));
            }
        }
        self.phase = Phase::Done;
        Err(Box::new(self.finished(FinishReason::Length)))
    }

    /// Tokens of context its KV cache holds now, and may hold at most (the prompt and the
    /// longest answer).
    pub(crate) fn kv_tokens(&self) -> (usize, usize) {
        (self.cache.offset().max(0) as usize, self.request.prompt.len() + self.request.max_tokens)
    }

    /// Hands the cache to a batch, which steps it as one of its rows.
    pub(crate) fn lend_cache(&mut self) -> Cache {
        self.lent = true;
        std::mem::take(&mut self.cache)
    }

    /// Takes the cache back from the batch it left; an ended generation's state after the
    /// answer then goes into the prompt cache.
    pub(crate) fn return_cache(&mut self, cache: Cache) {
        self.cache = cache;
        self.lent = false;
        if self.is_done() {
            self.keep_answer_state();
        }
    }

    pub(crate) fn model(&self) -> &'a dyn crate::models::LanguageModel {
        self.engine.model.as_ref()
    }

    pub(crate) fn is_done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    /// Takes the token the step read back: the grammar advances over it; with `logits` (the
    /// step that follows it) the next token is scheduled. Returns its text and, when it ended
    /// the answer, the last event.
    /// The caller schedules the next token ([`Generation::pending`]).
    pub(crate) fn after_step(&mut self, token: u32, logits: Option<Array>) -> Result<Vec<Event>> {
        self.schedule_after(token, logits, false)?;
        let out = self.take(token)?;
        let mut events = Vec::new();
        if !out.is_empty() {
            events.push(Event::Text(out));
        }
        if let Phase::Finishing(reason) = self.phase {
            events.push(self.finished(reason));
            self.phase = Phase::Done;
        }
        Ok(events)
    }
}
