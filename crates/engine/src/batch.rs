//! Several generations decoded together: each step is one forward pass over the weights for
//! all of them (`LanguageModel::hidden_batch`), their caches stacked as the rows of one
//! [`BatchCache`] while they are in the batch, each with its own sampler, penalties, grammar
//! and stop strings. A generation joins after its prefill and leaves when
//! it ends (its last event says why); the others go on untouched. Batched sequences decode
//! plainly: the MTP head drafts for one sequence at a time, so a speculative generation
//! joins between its cycles and goes on without drafts.
//!
//! A newcomer's prompt is prefilled one chunk (the engine's prefill chunk) per decode step
//! while others decode ([`Batch::queue`]), so their tokens keep coming during a long prompt;
//! with nobody decoding it is prefilled at once.

use std::collections::VecDeque;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{ops, Array};

use crate::batch_cache::BatchCache;
use crate::error::Result;
use crate::generate::Generation;
use crate::request::Event;

/// A split model's ranks follow rank 0's requests one at a time ([`crate::lockstep`]): when
/// each joins or leaves a batch is not something the others could follow.
fn refuse_unbatchable(generation: &Generation) -> Result<()> {
    if generation.engine().group().is_some() {
        return Err(crate::error::Error::Request("a model split across ranks runs one request at a time".into()));
    }
    Ok(())
}

/// The running generations, each under the caller's key (a request's id).
pub struct Batch<'a, K> {
    running: Vec<(K, Generation<'a>)>,
    /// The running generations' caches, row i that of `running[i]`.
    cache: BatchCache,
    /// Generations whose prompts are being prefilled, a chunk a step, first come first.
    joining: VecDeque<(K, Generation<'a>)>,
}

impl<K> Default for Batch<'_, K> {
    fn default() -> Self {
        Batch { running: Vec::new(), cache: BatchCache::default(), joining: VecDeque::new() }
    }
}

impl<'a, K: Clone> Batch<'a, K> {
    /// Adds `generation` to the batch from the next step on: a new one is prefilled now, a
    /// started one ([`Generation::can_join_batch`]) goes on plainly.
    pub fn join(&mut self, key: K, mut generation: Generation<'a>) -> Result<()> {
        refuse_unbatchable(&generation)?;
        if !generation.needs_prefill() && !generation.can_join_batch() {
            return Err(crate::error::Error::Request(
                "a generation joins a batch before it starts or between its steps".into(),
            ));
        }
        generation.start_batched()?;
        self.enter(key, generation)
    }

    /// A generation whose prompt is in becomes the batch's last row.
    fn enter(&mut self, key: K, mut generation: Generation<'a>) -> Result<()> {
        self.cache.push(generation.lend_cache())?;
        self.running.push((key, generation));
        Ok(())
    }

    /// Running generation `i` leaves the batch with its cache.
    fn leave(&mut self, i: usize) -> Result<(K, Generation<'a>)> {
        let cache = self.cache.remove(i)?;
        let (key, mut generation) = self.running.remove(i);
        generation.return_cache(cache);
        Ok((key, generation))
    }

    /// As [`Batch::join`], but a new generation's prompt is prefilled a chunk per step while
    /// others decode; it decodes with them once its prompt is in.
    pub fn queue(&mut self, key: K, mut generation: Generation<'a>) -> Result<()> {
        refuse_unbatchable(&generation)?;
        if !generation.needs_prefill() {
            return self.join(key, generation);
        }
        generation.begin_batched_prefill()?;
        self.joining.push_back((key, generation));
        Ok(())
    }

    /// Generations in the batch, prefilling or decoding.
    pub fn len(&self) -> usize {
        self.running.len() + self.joining.len()
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty() && self.joining.is_empty()
    }

    /// Tokens of context the batch's KV caches hold now (a running row as long as the longest,
    /// [`BatchCache`] pads them), and may hold at most: every generation as long as the
    /// longest prompt and answer asked.
    pub fn kv_tokens(&self) -> (usize, usize) {
        let now = self.cache.rows() * self.cache.padded_len().max(0) as usize
            + self.joining.iter().map(|(_, g)| g.kv_tokens().0).sum::<usize>();
        (now, self.kv_tokens_with(0))
    }

    /// The most tokens of KV cache the batch may hold were a generation that may take `asked`
    /// to join it.
    pub fn kv_tokens_with(&self, asked: usize) -> usize {
        let most = self.running.iter().chain(&self.joining).map(|(_, g)| g.kv_tokens().1).max().unwrap_or(0);
        (self.len() + usize::from(asked > 0)) * most.max(asked)
    }

    /// Tokens generated so far by the generation under `key` (0 while its prompt is being
    /// prefilled), if it is in the batch.
    pub fn generated(&self, key: &K) -> Option<usize>
    where
        K: PartialEq,
    {
        self.running.iter().chain(&self.joining).find(|(k, _)| k == key).map(|(_, g)| g.tokens().len())
    }

    /// Prompt tokens the generation under `key` restored from the prompt cache, if it is in
    /// the batch (its prefill begins when it is queued).
    pub fn cached_tokens(&self, key: &K) -> Option<usize>
    where
        K: PartialEq,
    {
        self.running.iter().chain(&self.joining).find(|(k, _)| k == key).map(|(_, g)| g.cached_tokens())
    }

    /// Generations whose prompts are still being prefilled, and their tokens left to feed.
    pub fn prefilling(&self) -> (usize, usize) {
        (self.joining.len(), self.joining.iter().map(|(_, g)| g.prefill_remaining()).sum())
    }

    /// The next chunk of the first newcomer's prompt (all of it when nobody decodes); a
    /// newcomer whose prompt is in joins the decoding ones. A failed prefill ends that
    /// generation alone.
    fn prefill_some(&mut self, events: &mut Vec<(K, Result<Event>)>) {
        let alone = self.running.is_empty();
        let Some((_, generation)) = self.joining.front_mut() else { return };
        let done = (|| -> Result<bool> {
            while generation.prefill_step()? {
                if !alone {
                    return Ok(false);
                }
            }
            generation.finish_batched_prefill()?;
            Ok(true)
        })();
        match done {
            Ok(false) => {}
            Ok(true) => {
                if let Some((key, generation)) = self.joining.pop_front() {
                    if let Err(e) = self.enter(key.clone(), generation) {
                        events.push((key, Err(e)));
                    }
                }
            }
            Err(e) => {
                if let Some((key, _)) = self.joining.pop_front() {
                    events.push((key, Err(e)));
                }
            }
        }
    }

    /// One token for every running generation: the events of this step under their keys (a
    /// generation's text, and the last event of each that ended, which leaves the batch). An
    /// error of the shared forward pass ends every generation with it.
    pub fn step(&mut self) -> Vec<(K, Result<Event>)> {
        let mut events = Vec::new();
        self.prefill_some(&mut events);
        // Each one's input: the token it drew last (still on the device). One that ended, or
        // whose token now is its last, leaves before the step: its cache holds what it fed.
        let mut inputs = Vec::new();
        let mut last = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let outcome = self.running[i].1.next_input();
            if let Ok((token, true)) = outcome {
                inputs.push(token);
                i += 1;
                continue;
            }
            let (key, generation) = match self.leave(i) {
                Ok(left) => left,
                Err(e) => return self.fail(e, events),
            };
            match outcome {
                Ok((token, _)) => last.push((key, generation, token)),
                Err(event) => events.push((key, Ok(*event))),
            }
        }
        // Those that left with their last token end with it.
        for (key, mut generation, token) in last {
            match token.try_item_cast::<u32>().map_err(Into::into).and_then(|t| generation.after_step(t, None)) {
                Ok(ended) => events.extend(ended.into_iter().map(|e| (key.clone(), Ok(e)))),
                Err(e) => events.push((key, Err(e))),
            }
        }
        match self.decode(&inputs) {
            Ok(more) => events.extend(more),
            Err(e) => return self.fail(e, events),
        }
        for i in (0..self.running.len()).rev() {
            if self.running[i].1.is_done() {
                if let Err(e) = self.leave(i) {
                    return self.fail(e, events);
                }
            }
        }
        events
    }

    /// An error of the shared forward pass ends every generation with it.
    fn fail(&mut self, e: crate::error::Error, mut events: Vec<(K, Result<Event>)>) -> Vec<(K, Result<Event>)> {
        let message = e.to_string();
        self.cache = BatchCache::default();
        for (key, generation) in self.running.drain(..) {
            if !generation.is_done() {
                events.push((key, Err(crate::error::Error::Request(message.clone()))));
            }
        }
        events
    }

    /// The shared forward pass for the rows (`inputs`, one token each), then each one's token.
    fn decode(&mut self, inputs: &[Array]) -> Result<Vec<(K, Result<Event>)>> {
        let logits = match self.running.first() {
            Some((_, generation)) => {
                let model = generation.model();
                let rows = inputs.iter().map(|t| t.reshape(&[1, 1])).collect::<Result<Vec<_>, _>>()?;
                let hidden = model.hidden_batch(&ops::concatenate(&rows, 0)?, &mut self.cache)?;
                let logits = model.logits(&hidden)?;
                async_eval([&logits])?;
                Some(logits)
            }
            None => None,
        };
        // The step runs on the device while the host reads the tokens drawn last.
        eval(inputs)?;
        let mut events = Vec::new();
        for (row, ((key, generation), token)) in self.running.iter_mut().zip(inputs).enumerate() {
            let row = row as i32;
            let next = logits.as_ref().map(|l| l.index((row..row + 1, -1, ..)));
            for event in generation.after_step(token.try_item_cast::<u32>()?, next)? {
                events.push((key.clone(), Ok(event)));
            }
        }
        // Every row's next token in one launch.
        async_eval(self.running.iter().filter_map(|(_, generation)| generation.pending()))?;
        Ok(events)
    }
}
