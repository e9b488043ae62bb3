//! Several generations decoded together: each step is one forward pass over the weights for
//! all of them (`LanguageModel::hidden_rows`), each sequence with its own cache, sampler,
//! penalties, grammar and stop strings. A generation joins after its prefill and leaves when
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

use crate::cache::Cache;
use crate::error::Result;
use crate::generate::{Event, Generation};

/// The running generations, each under the caller's key (a request's id).
pub struct Batch<'a, K> {
    running: Vec<(K, Generation<'a>)>,
    /// Generations whose prompts are being prefilled, a chunk a step, first come first.
    joining: VecDeque<(K, Generation<'a>)>,
}

impl<K> Default for Batch<'_, K> {
    fn default() -> Self {
        Batch { running: Vec::new(), joining: VecDeque::new() }
    }
}

impl<'a, K: Clone> Batch<'a, K> {
    /// Adds `generation` to the batch from the next step on: a new one is prefilled now, a
    /// started one ([`Generation::can_join_batch`]) goes on plainly.
    pub fn join(&mut self, key: K, mut generation: Generation<'a>) -> Result<()> {
        if !generation.needs_prefill() && !generation.can_join_batch() {
            return Err(crate::error::Error::Request(
                "a generation joins a batch before it starts or between its steps".into(),
            ));
        }
        generation.start_batched()?;
        self.running.push((key, generation));
        Ok(())
    }

    /// As [`Batch::join`], but a new generation's prompt is prefilled a chunk per step while
    /// others decode; it decodes with them once its prompt is in.
    pub fn queue(&mut self, key: K, mut generation: Generation<'a>) -> Result<()> {
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

    /// Tokens of context the batch's KV caches hold now, and may hold at most (each its
    /// prompt and longest answer), all together.
    pub fn kv_tokens(&self) -> (usize, usize) {
        self.running.iter().chain(&self.joining).map(|(_, g)| g.kv_tokens()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// Tokens generated so far by the generation under `key` (0 while its prompt is being
    /// prefilled), if it is in the batch.
    pub fn generated(&self, key: &K) -> Option<usize>
    where
        K: PartialEq,
    {
        self.running.iter().chain(&self.joining).find(|(k, _)| k == key).map(|(_, g)| g.tokens().len())
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
            Ok(true) => self.running.extend(self.joining.pop_front()),
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
        // Each one's input: the token it drew last (still on the device).
        let mut inputs = Vec::new();
        let mut going = Vec::new();
        for (key, generation) in &mut self.running {
            match generation.next_input() {
                Ok((token, more)) => {
                    inputs.push(token);
                    going.push(more);
                }
                Err(last) => {
                    events.push((key.clone(), Ok(*last)));
                    inputs.push(Array::from_int(0));
                    going.push(false);
                }
            }
        }
        if let Err(e) = self.decode(&inputs, &going, &mut events) {
            let message = e.to_string();
            for (key, generation) in self.running.drain(..) {
                if !generation.is_done() {
                    events.push((key, Err(crate::error::Error::Request(message.clone()))));
                }
            }
            return events;
        }
        self.running.retain(|(_, generation)| !generation.is_done());
        events
    }

    /// The shared forward pass for the generations that go on, then each one's token.
    fn decode(&mut self, inputs: &[Array], going: &[bool], events: &mut Vec<(K, Result<Event>)>) -> Result<()> {
        let rows: Vec<usize> = (0..self.running.len()).filter(|&i| going[i]).collect();
        // The next step runs on the device while the host reads this step's tokens.
        let logits = match rows.as_slice() {
            [] => None,
            _ => {
                let tokens = ops::concatenate(
                    &rows.iter().map(|&i| inputs[i].reshape(&[1, 1])).collect::<Result<Vec<_>, _>>()?,
                    0,
                )?;
                let model = match self.running.first() {
                    Some((_, generation)) => generation.model(),
                    None => return Ok(()),
                };
                let mut caches: Vec<&mut Cache> = Vec::with_capacity(rows.len());
                for (i, (_, generation)) in self.running.iter_mut().enumerate() {
                    if going[i] {
                        caches.push(generation.cache_mut());
                    }
                }
                let hidden = model.hidden_rows(&tokens, &mut caches)?;
                let logits = model.logits(&hidden)?;
                async_eval([&logits])?;
                Some(logits)
            }
        };
        let live: Vec<&Array> =
            (0..self.running.len()).filter(|&i| !self.running[i].1.is_done()).map(|i| &inputs[i]).collect();
        eval(live.iter().copied())?;
        let mut row: i32 = 0;
        for (i, (key, generation)) in self.running.iter_mut().enumerate() {
            if generation.is_done() {
                continue;
            }
            let token = inputs[i].try_item_cast::<u32>()?;
            let next = match (&logits, going[i]) {
                (Some(l), true) => {
                    row += 1;
                    Some(l.index((row - 1..row, -1, ..)))
                }
                _ => None,
            };
            for event in generation.after_step(token, next)? {
                events.push((key.clone(), Ok(event)));
            }
        }
        Ok(())
    }
}
