//! Several generations decoded together: each step is one forward pass over the weights for
//! all of them (`LanguageModel::hidden_rows`), each sequence with its own cache, sampler,
//! penalties, grammar and stop strings. A generation joins after its prefill and leaves when
//! it ends (its last event says why); the others go on untouched. Batched sequences decode
//! plainly: the MTP head drafts for one sequence at a time.

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::{async_eval, eval};
use mlx_rs::{ops, Array};

use crate::cache::Cache;
use crate::error::Result;
use crate::generate::{Event, Generation};

/// The running generations, each under the caller's key (a request's id).
pub struct Batch<'a, K> {
    running: Vec<(K, Generation<'a>)>,
}

impl<K> Default for Batch<'_, K> {
    fn default() -> Self {
        Batch { running: Vec::new() }
    }
}

impl<'a, K: Clone> Batch<'a, K> {
    /// Prefills `generation` and adds it to the batch from the next step on.
    pub fn join(&mut self, key: K, mut generation: Generation<'a>) -> Result<()> {
        generation.start_batched()?;
        self.running.push((key, generation));
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.running.len()
    }

    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }

    /// One token for every running generation: the events of this step under their keys (a
    /// generation's text, and the last event of each that ended, which leaves the batch). An
    /// error of the shared forward pass ends every generation with it.
    pub fn step(&mut self) -> Vec<(K, Result<Event>)> {
        let mut events = Vec::new();
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
