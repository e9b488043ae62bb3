//! The generation API the CLI, the server and the app build on: a request in, a stream of
//! events out (text deltas, then one summary with finish reason, usage and timings),
//! cancelable at any token.
//!
//! Decoding is pipelined as in mlx-lm: the graph for token n+1 is built and handed to MLX
//! (`async_eval`) before token n is read back, so the host never leaves the device idle.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use mlx_rs::ops::indexing::{IndexOp, NewAxis};
use mlx_rs::transforms::eval;
use mlx_rs::Array;

use crate::cache::{Cache, LayerCache};
use crate::distributed::schedule;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::forced::ForcedAnswer;
use crate::grammar::{Constraint, Ended};
use crate::logits::{Chain, GrammarMask, LogitBias, LogitsProcessor};
use crate::penalties::Recent;
use crate::prompt_cache::Checkpoint;
use crate::request::{CancelToken, Event, FinishReason, GenerateRequest, Summary, Timings, Usage};
use crate::sampling::Sampler;
use crate::speculation::DraftWith;
use crate::speculative::{SpecStats, Speculator};
use crate::stop::StopMatcher;
use crate::tokenizer::StreamDecoder;

mod batched;
mod images;
mod plain_stretch;

impl Engine {
    /// Starts `request` (checked first): iterate the generation for its events. `cancel`
    /// ends it at its next token.
    pub fn generate(&self, request: GenerateRequest, cancel: CancelToken) -> Result<Generation<'_>> {
        if request.prompt.is_empty() {
            return Err(Error::Request("the prompt is empty".into()));
        }
        let vocab = self.model.config().vocab_size as u32;
        if let Some(bad) = request.prompt.iter().find(|&&t| t >= vocab) {
            return Err(Error::Request(format!("token id {bad} is outside the vocabulary ({vocab})")));
        }
        if request.stop.iter().any(String::is_empty) {
            return Err(Error::Request("a stop string is empty".into()));
        }
        let penalties = request.sampling.penalties;
        if let Some(bad) = request.forced_tokens.iter().flatten().find(|&&t| t >= vocab) {
            return Err(Error::Request(format!("forced token id {bad} is outside the vocabulary ({vocab})")));
        }
        let forced = match (&request.forced_tokens, self.tokenizer.eos_ids.first()) {
            (Some(tokens), Some(&end)) => Some(ForcedAnswer::new(tokens.clone(), end)),
            (Some(_), None) => return Err(Error::Request("a forced answer needs an end-of-sequence token".into())),
            (None, _) => None,
        };
        let constraint = request.grammar.as_ref().map(|g| self.constraint(g, &request.prompt)).transpose()?;
        // The request's own logits processors, ahead of the penalties and the grammar's mask.
        let mut processors: Vec<Box<dyn LogitsProcessor>> = Vec::new();
        if let Some(bias) = LogitBias::new(&request.sampling.logit_bias, vocab as usize)? {
            processors.push(Box::new(bias));
        }
        // Split across ranks, every rank runs the request: with rank 0's seed.
        let mut request = request;
        if self.group().is_some() && request.sampling.seed.is_none() {
            request.sampling.seed = Some(crate::sampling::fresh_seed());
        }
        self.tell_followers_generate(&request)?;
        let sampler = Sampler::new(request.sampling.clone())?;
        let images = self.prepare_images(&mut request)?;
        let depth = if forced.is_some() && !sampler.is_greedy() { 0 } else { request.draft_depth };
        let spec = match depth {
            0 => None,
            depth => {
                let seed = request.sampling.seed.unwrap_or(0);
                let block = match request.draft_with {
                    DraftWith::Block => Some(self.drafter.as_ref().ok_or_else(|| {
                        Error::Request(
                            "block drafting was asked, but no block drafter is loaded beside the model".into(),
                        )
                    })?),
                    // The MTP head drafts; a block drafter may stand by (depth control).
                    DraftWith::Mtp => self.drafter.as_ref(),
                };
                let mut spec = Speculator::new(self.model.as_ref(), block, request.draft_with, depth, seed)?;
                if let Some(s) = &mut spec {
                    s.draft_script = request.draft_script.clone();
                    if let (Some(tokens), Some(&end)) = (&request.forced_tokens, self.tokenizer.eos_ids.first()) {
                        s.forced_answer = Some((tokens.clone(), end));
                    }
                    s.penalise(penalties, &request.prompt);
                    if let (Some(costs), None, false) = (&self.depth_costs, &request.draft_script, request.fixed_depth)
                    {
                        let memory = self.acceptance_memory.lock().map(|m| m.clone()).unwrap_or_default();
                        s.control_depth(costs.clone(), &memory);
                    }
                }
                if spec.is_none() {
                    tracing::warn!("{}: no MTP head and no drafter, decoding without speculation", self.dir.display());
                }
                spec
            }
        };
        Ok(Generation {
            spec,
            queue: VecDeque::new(),
            engine: self,
            cache: self.model.new_cache(),
            sampler,
            recent: (!penalties.is_off()).then(|| Recent::new(penalties, &request.prompt)),
            forced,
            constraint,
            processors,
            cached_tokens: 0,
            stops: StopMatcher::new(request.stop.clone()),
            request,
            cancel,
            decoder: StreamDecoder::new(),
            generated: 0,
            tokens: Vec::new(),
            checkpoints: Vec::new(),
            spec_before_batch: None,
            started: Instant::now(),
            first_token_at: None,
            last_token_at: None,
            phase: Phase::Waiting,
            lent: false,
            images,
        })
    }
}

/// One running request; iterate it for events.
pub struct Generation<'a> {
    engine: &'a Engine,
    request: GenerateRequest,
    cancel: CancelToken,
    cache: Cache,
    sampler: Sampler,
    /// The tokens the penalties look at, when the request has any.
    recent: Option<Recent>,
    /// Tests only: the answer fixed in advance.
    forced: Option<ForcedAnswer>,
    /// The request's own logits processors (its `logit_bias`): the head of every position's
    /// chain ([`Chain::at`]).
    processors: Vec<Box<dyn LogitsProcessor>>,
    /// The request's grammar, where the answer has got to in it.
    constraint: Option<Constraint>,
    /// Prompt tokens restored from the prompt cache.
    cached_tokens: usize,
    decoder: StreamDecoder,
    stops: StopMatcher,
    /// Speculative decoding with the MTP head, and the tokens its last cycle committed.
    spec: Option<Speculator<'a>>,
    queue: VecDeque<u32>,
    generated: usize,
    /// Every token generated so far (including one that ended the generation).
    tokens: Vec<u32>,
    /// A hybrid's checkpoints of the prompt, for the entry kept at the answer's end.
    checkpoints: Vec<Checkpoint>,
    /// The speculative figures of a generation that went on decoding plainly in a batch.
    spec_before_batch: Option<SpecStats>,
    started: Instant,
    first_token_at: Option<Instant>,
    last_token_at: Option<Instant>,
    /// Where the generation has got to.
    phase: Phase,
    /// Set while a batch holds the cache (as a row of its own, [`Generation::lend_cache`]):
    /// where the cache is, in any phase from decoding to done, not a phase of its own.
    lent: bool,
    /// The prompt's images (`generate/images.rs`).
    images: Option<images::Images>,
}

/// A generation's phases, in the order it goes through them. A speculative one decodes
/// without a pending token (its cycles commit tokens into `queue`).
enum Phase {
    /// Nothing of the prompt fed to the model yet.
    Waiting,
    /// A prefill under way.
    Prefilling(Prefill),
    /// Decoding; `pending` is the next token, scheduled on the device but not read back yet.
    Decoding { pending: Option<Array> },
    /// The grammar allowed nothing for the token drawn last (it is never used): the answer
    /// ends there.
    GrammarEnded(Ended),
    /// The answer ended after the text already returned: its last event is still to come.
    Finishing(FinishReason),
    /// The last event was returned.
    Done,
}

/// A prefill under way: prompt tokens in the cache so far, and a hybrid's checkpoints.
struct Prefill {
    at: usize,
    checkpoints: Vec<Checkpoint>,
}

impl Generation<'_> {
    /// Logits of the last position → the next token (lazy).
    fn step(&mut self, tokens: &Array) -> Result<Array> {
        let last = self.last_logits(tokens)?;
        self.choose(last)
    }

    /// The logits of the last position after `tokens` (lazy).
    fn last_logits(&mut self, tokens: &Array) -> Result<Array> {
        let logits = self.engine.model.forward(tokens, &mut self.cache)?;
        crate::logits::last_position(&logits)
    }

    /// The next token from the last position's logits (lazy): the forced answer's, then the
    /// logits chain (the request's bias, penalties, the grammar's mask), then sampled.
    fn choose(&mut self, mut last: Array) -> Result<Array> {
        if let Some(forced) = &mut self.forced {
            last = forced.apply(&last)?;
        }
        let mask = self.grammar_mask().map(GrammarMask);
        let last = Chain::at(&self.processors, self.recent.as_ref(), mask.as_ref()).apply(&last)?;
        let token = self.sampler.sample(&last)?;
        if let Some(recent) = &mut self.recent {
            recent.push(&token)?;
        }
        Ok(token)
    }

    /// The whole prompt in, the first token out (lazy): [`Generation::begin_prefill`], every
    /// chunk, then [`Generation::end_prefill`].
    fn prefill(&mut self) -> Result<Array> {
        if matches!(self.phase, Phase::Waiting) {
            self.begin_prefill()?;
        }
        let chunk = self.prefill_size(self.engine.prefill_chunk);
        while self.prefill_chunk(chunk)? {}
        self.end_prefill()
    }

    /// Prompt tokens per pass: the engine's `size`, or the request's own where it is smaller.
    fn prefill_size(&self, size: usize) -> usize {
        self.request.prefill_chunk.map_or(size, |own| own.clamp(1, size.max(1)))
    }

    /// Restores the longest cached prefix of the prompt (it is not computed again) and sets
    /// where the prefill starts.
    fn begin_prefill(&mut self) -> Result<()> {
        mlx_rs::memory::reset_peak_memory()?;
        let head = self.request.prompt.len() - 1;
        let hit = match self.engine.prompt_cache.lock() {
            Ok(mut cache) => cache.lookup(self.prompt_key(), head, self.spec.as_ref().map(|s| s.draft_with()))?,
            _ => None,
        };
        let mut prefill = Prefill { at: 0, checkpoints: Vec::new() };
        if let Some(hit) = hit {
            self.cached_tokens = hit.len;
            prefill = Prefill { at: hit.len, checkpoints: hit.checkpoints.clone() };
            let mtp = hit.restore(&mut self.cache);
            if let (Some(spec), Some((layers, last_hidden))) = (&mut self.spec, mtp) {
                spec.restore(layers, last_hidden);
            }
        }
        if let (Some(images), Some(vision)) = (&mut self.images, &self.engine.vision) {
            let model = self.engine.model.as_ref();
            let shift = images.begin(model, vision, &self.request.prompt[..head], prefill.at, &mut self.cache)?;
            if let (Some(spec), Some(angles)) = (&mut self.spec, images.angles()) {
                spec.shift_positions(shift);
                spec.place_prompt(angles.clone(), images.shift_after());
            }
        }
        self.phase = Phase::Prefilling(prefill);
        Ok(())
    }

    /// Prompt tokens not yet in the cache (the last one, fed by [`Generation::end_prefill`],
    /// not counted).
    pub(crate) fn prefill_remaining(&self) -> usize {
        let head = self.request.prompt.len() - 1;
        match &self.phase {
            Phase::Prefilling(p) => head.saturating_sub(p.at),
            _ => 0,
        }
    }

    /// Feeds the next chunk of the prompt (but its last token) to the model, ending at the
    /// next multiple of `size`; whether another follows. A hybrid's state is checkpointed at
    /// multiples of the engine's prefill chunk (and at the prompt's end), whatever `size`; a
    /// cancelled request stops here.
    fn prefill_chunk(&mut self, size: usize) -> Result<bool> {
        let model = self.engine.model.as_ref();
        let head = &self.request.prompt[..self.request.prompt.len() - 1];
        let cancelled = self.cancelled()?;
        let Phase::Prefilling(prefill) = &mut self.phase else { return Ok(false) };
        if prefill.at >= head.len() || cancelled {
            return Ok(false);
        }
        let size = size.max(1);
        let end = ((prefill.at / size + 1) * size).min(head.len());
        let part = &head[prefill.at..end];
        let ids = || Array::from_slice(part, &[1, part.len() as i32]);
        // Only the cache is evaluated: the logits of these positions are never computed.
        match (&self.images, &mut self.spec) {
            (Some(images), spec) => {
                let taps = spec.as_ref().and_then(|s| s.taps());
                let (hidden, tapped) = images.feed(model, head, prefill.at..end, &mut self.cache, taps)?;
                if let Some(spec) = spec {
                    let features = spec.features(&hidden, tapped)?;
                    spec.observe(part, &features)?;
                }
            }
            (None, Some(spec)) => {
                let (_, features) = spec.trunk(&ids(), &mut self.cache)?;
                spec.observe(part, &features)?;
            }
            (None, None) => drop(model.hidden(&ids(), &mut self.cache)?),
        }
        eval(self.cache.arrays())?;
        prefill.at = end;
        let boundary = end.is_multiple_of(self.engine.prefill_chunk.max(1)) || end == head.len();
        if boundary && self.cache.layers.iter().any(|l| matches!(l, LayerCache::Linear(_))) {
            prefill.checkpoints.push(Checkpoint::of(&self.cache, self.spec.as_ref().and_then(|s| s.last_hidden())));
        }
        Ok(end < head.len())
    }

    /// Keeps the prompt's state in the prompt cache, feeds its last token and draws the first
    /// token of the answer (lazy).
    fn end_prefill(&mut self) -> Result<Array> {
        let model = self.engine.model.as_ref();
        let prefill = match std::mem::replace(&mut self.phase, Phase::Decoding { pending: None }) {
            Phase::Prefilling(prefill) => prefill,
            _ => Prefill { at: 0, checkpoints: Vec::new() },
        };
        let prompt = self.request.prompt.clone();
        let (head, last) = prompt.split_at(prompt.len() - 1);
        if prefill.at == head.len() && !head.is_empty() && !self.cancelled()? {
            // The drafter's cache is kept only when it saw the whole head (one position fewer).
            let mtp = self
                .spec
                .as_ref()
                .map(|s| (s.draft_with(), s.draft_cache()))
                .filter(|(_, m)| m.offset() as usize + 1 == head.len());
            self.checkpoints = prefill.checkpoints.clone();
            if let Ok(mut cache) = self.engine.prompt_cache.lock() {
                cache.insert(&self.prompt_key()[..head.len()], &self.cache, mtp, prefill.checkpoints)?;
            }
        }
        let Some(spec) = &mut self.spec else {
            return self.step(&Array::from_slice(last, &[1, 1]));
        };
        if let Some(images) = &self.images {
            // The head's positions after the prompt run as the trunk's do.
            spec.shift_positions(images.shift_after());
        }
        let (hidden, features) = spec.trunk(&Array::from_slice(last, &[1, 1]), &mut self.cache)?;
        spec.observe(last, &features)?;
        let mut last = crate::logits::last_position(&model.logits(&hidden)?)?;
        if let Some(forced) = &mut self.forced {
            last = forced.apply(&last)?;
        }
        // The first token's penalties look at the prompt alone (the speculator's cycles keep
        // their own window from here on).
        let mask = self.grammar_mask().map(GrammarMask);
        let last = Chain::at(&self.processors, self.recent.as_ref(), mask.as_ref()).apply(&last)?;
        self.sampler.sample(&last)
    }

    /// Once `token` is read back: the grammar advances over it, and with `logits` (the step
    /// after it, already running) the next token is drawn and scheduled.
    /// `now`: start computing the next token at once; else the caller does (a batch starts
    /// all its rows' together: one launch a step instead of one a row).
    fn schedule_after(&mut self, token: u32, logits: Option<Array>, now: bool) -> Result<()> {
        if let Some(c) = &mut self.constraint {
            c.accept(token)?;
        }
        if let Some(logits) = logits {
            let next = self.choose(logits)?;
            if now {
                schedule(self.engine.model.is_split(), [&next])?;
            }
            self.set_pending(next);
        }
        Ok(())
    }

    /// The next token drawn but not read yet (a batch schedules its rows' at once).
    pub(crate) fn pending(&self) -> Option<&Array> {
        match &self.phase {
            Phase::Decoding { pending } => pending.as_ref(),
            _ => None,
        }
    }

    /// Keeps `next` as the token to read back next; dropped when the answer has already
    /// ended (the grammar allowed nothing for it, or a stop came first).
    fn set_pending(&mut self, next: Array) {
        if let Phase::Decoding { pending } = &mut self.phase {
            *pending = Some(next);
        }
    }

    /// The grammar's mask for the next token (-inf outside the allowed tokens); `None` without
    /// a grammar, or when it allows nothing: then the phase says why (the token drawn
    /// without the mask is never used).
    fn grammar_mask(&mut self) -> Option<Array> {
        match self.constraint.as_mut()?.mask() {
            Ok(mask) => Some(mask),
            Err(ended) => {
                self.phase = Phase::GrammarEnded(ended);
                None
            }
        }
    }

    /// Why the grammar ended the answer, once it has (the phase then moves on to done).
    fn take_grammar_end(&mut self) -> Option<Ended> {
        match std::mem::replace(&mut self.phase, Phase::Done) {
            Phase::GrammarEnded(ended) => Some(ended),
            other => {
                self.phase = other;
                None
            }
        }
    }

    /// The next token of a speculative generation: from the last cycle's commits, or a new
    /// cycle; `None` when the request's grammar allows nothing more (the phase says why).
    fn next_speculative(&mut self) -> Result<Option<u32>> {
        if let Some(token) = self.queue.pop_front() {
            return Ok(Some(token));
        }
        if matches!(self.phase, Phase::Waiting | Phase::Prefilling(_)) {
            let token = self.prefill()?.try_item_cast::<u32>()?;
            if matches!(self.phase, Phase::GrammarEnded(_)) {
                return Ok(None);
            }
            if let Some(c) = &mut self.constraint {
                c.accept(token)?;
            }
            if let Some(spec) = &mut self.spec {
                spec.start(token, &mut self.cache);
            }
            return Ok(Some(token));
        }
        if matches!(self.phase, Phase::GrammarEnded(_)) {
            return Ok(None);
        }
        if self.pending().is_none() {
            if let Some(c) = &mut self.constraint {
                if let Err(ended) = c.mask() {
                    self.phase = Phase::GrammarEnded(ended);
                    return Ok(None);
                }
            }
            let spec =
                self.spec.as_mut().ok_or_else(|| Error::Request("speculative step without a speculator".into()))?;
            if spec.next_depth() > 0 {
                let cycle =
                    spec.cycle(&mut self.cache, &mut self.sampler, self.constraint.as_mut(), &self.processors)?;
                self.queue.extend(cycle);
                let token = self
                    .queue
                    .pop_front()
                    .ok_or_else(|| Error::Request("a speculative cycle committed no token".into()))?;
                return Ok(Some(token));
            }
            self.begin_plain_stretch()?;
        }
        self.plain_stretch_step().map(Some)
    }

    /// The finishing event for a grammar that allows nothing more.
    fn grammar_finished(&mut self, ended: Ended) -> Event {
        match ended {
            Ended::Complete => self.finished(FinishReason::Stop),
            Ended::DeadEnd(why) => {
                tracing::warn!("the request's grammar ended the answer: {why}");
                self.finished(FinishReason::GrammarDeadEnd)
            }
        }
    }

    fn summary(&self, finish_reason: FinishReason) -> Summary {
        let now = Instant::now();
        let first = self.first_token_at.unwrap_or(now);
        let prefill = first.duration_since(self.started);
        let decode = self.last_token_at.unwrap_or(first).duration_since(first);
        let rate = |n: usize, d: Duration| if d.as_secs_f64() > 0.0 { n as f64 / d.as_secs_f64() } else { 0.0 };
        Summary {
            finish_reason,
            usage: Usage {
                prompt_tokens: self.request.prompt.len(),
                completion_tokens: self.generated,
                cached_tokens: self.cached_tokens,
            },
            speculative: self.spec.as_ref().map(|s| s.stats.clone()).or_else(|| self.spec_before_batch.clone()),
            stop_string: self.stops.matched.clone(),
            timings: Timings {
                ttft: prefill,
                prompt_tps: rate(self.request.prompt.len(), prefill),
                decode_tps: rate(self.generated.saturating_sub(1), decode),
                total: now.duration_since(self.started),
                peak_memory_bytes: mlx_rs::memory::peak_memory().unwrap_or(0),
            },
        }
    }

    /// The final event; speculative figures also go into the engine's totals, and the state
    /// after the answer into the prompt cache.
    fn finished(&mut self, reason: FinishReason) -> Event {
        if !self.lent {
            self.keep_answer_state(); // a batched one's, when the batch gives its cache back
        }
        let summary = self.summary(reason);
        if let (Some(stats), Ok(mut totals)) = (&summary.speculative, self.engine.spec_totals.lock()) {
            totals.merge(stats);
        }
        if let (Some(spec), Ok(mut memory)) = (&self.spec, self.engine.acceptance_memory.lock()) {
            spec.leave_for_next(&mut memory);
        }
        Event::Finished(summary)
    }

    /// Keeps the state after the prompt and the answer (where an agent's next turn begins)
    /// in the prompt cache: it replaces the prompt's entry, which it extends. The cache holds
    /// every token fed to the model: the prompt, then the answer but its last token.
    fn keep_answer_state(&mut self) {
        let mut fed = self.cache.offset() as usize;
        let prompt = self.request.prompt.len();
        // A speculative answer that ended inside a cycle (its end token or its last allowed
        // one among accepted drafts) left the trunk past its last token: the positions after
        // it are rolled back as rejected drafts are, so the state after the answer is kept.
        let answered = prompt + self.tokens.len();
        if let (Some(spec), true) = (&mut self.spec, fed >= answered && !self.tokens.is_empty()) {
            let excess = fed + 1 - answered;
            if self.cache.rollback(excess as i32).is_err() || spec.forget_last(excess).is_err() {
                return;
            }
            fed = answered - 1;
        }
        let out = fed <= prompt || fed > answered;
        if out || self.cancelled().unwrap_or(true) {
            return;
        }
        // The head's cache must reach the position before the trunk's last.
        if let Some(spec) = &mut self.spec {
            if let Err(e) = spec.catch_up() {
                tracing::warn!("the state after the answer was not kept: {e}");
                return;
            }
        }
        let tokens: Vec<u32> = self.prompt_key().iter().chain(&self.tokens).take(fed).copied().collect();
        // The MTP head's cache must end one position before the trunk's (as after a prefill):
        // an entry without it would change how a speculating request drafts.
        let mtp = match &self.spec {
            Some(s) if s.draft_cache().offset() as usize + 1 != fed => return,
            Some(s) => Some((s.draft_with(), s.draft_cache())),
            None => None,
        };
        let mut checkpoints = self.checkpoints.clone();
        if self.cache.layers.iter().any(|l| matches!(l, LayerCache::Linear(_))) {
            checkpoints.push(Checkpoint::of(&self.cache, self.spec.as_ref().and_then(|s| s.last_hidden())));
        }
        if let Ok(mut cache) = self.engine.prompt_cache.lock() {
            if let Err(e) = cache.insert(&tokens, &self.cache, mtp, checkpoints) {
                tracing::warn!("the state after the answer was not kept: {e}");
            }
        }
    }

    /// The engine this generation runs on.
    pub fn engine(&self) -> &Engine {
        self.engine
    }

    /// Whether this request was cancelled (agreed across the ranks of a split model, see
    /// [`crate::lockstep`]).
    fn cancelled(&self) -> Result<bool> {
        self.engine.agreed_cancel(&self.cancel)
    }

    fn advance(&mut self) -> Result<Event> {
        loop {
            if let Phase::Finishing(reason) = self.phase {
                return Ok(self.finished(reason));
            }
            if self.cancelled()? {
                return Ok(self.finished(FinishReason::Cancelled));
            }
            let token = if self.spec.is_some() {
                match self.next_speculative()? {
                    Some(token) => token,
                    None => {
                        let ended = self.take_grammar_end().unwrap_or(Ended::Complete);
                        return Ok(self.grammar_finished(ended));
                    }
                }
            } else {
                let y = match std::mem::replace(&mut self.phase, Phase::Decoding { pending: None }) {
                    Phase::Decoding { pending: Some(y) } => y,
                    Phase::Decoding { pending: None } => return Ok(self.finished(FinishReason::Length)),
                    waiting @ (Phase::Waiting | Phase::Prefilling(_)) => {
                        self.phase = waiting;
                        self.prefill()?
                    }
                    Phase::GrammarEnded(ended) => return Ok(self.grammar_finished(ended)),
                    Phase::Finishing(reason) => return Ok(self.finished(reason)),
                    Phase::Done => return Err(Error::Request("the generation has already ended".into())),
                };
                if let Some(ended) = self.take_grammar_end() {
                    return Ok(self.grammar_finished(ended));
                }
                let more = self.generated + 1 < self.request.max_tokens;
                if self.constraint.is_some() {
                    // The next mask needs this token, the next forward pass only its array:
                    // the pass runs while the host reads the token and computes the mask.
                    let logits = if more {
                        let l = self.last_logits(&y.index(NewAxis))?;
                        schedule(self.engine.model.is_split(), [&l])?;
                        Some(l)
                    } else {
                        None
                    };
                    let token = y.try_item_cast::<u32>()?;
                    self.schedule_after(token, logits, true)?;
                    token
                } else {
                    if more {
                        let next = self.step(&y.index(NewAxis))?;
                        schedule(self.engine.model.is_split(), [&next])?;
                        self.set_pending(next);
                    }
                    y.try_item_cast::<u32>()?
                }
            };
            let out = self.take(token)?;
            if !out.is_empty() {
                return Ok(Event::Text(out));
            }
        }
    }

    /// Takes a generated token: counts it, turns it into text, looks for stop strings, and
    /// sets `finish` when it ends the answer; returns the text that may be sent now.
    fn take(&mut self, token: u32) -> Result<String> {
        let now = Instant::now();
        self.first_token_at.get_or_insert(now);
        self.last_token_at = Some(now);
        self.generated += 1;
        self.tokens.push(token);

        let mut reason = None;
        let mut text = if !self.request.ignore_eos && self.engine.tokenizer.eos_ids.contains(&token) {
            reason = Some(FinishReason::Stop);
            self.decoder.flush(&self.engine.tokenizer)?
        } else {
            self.decoder.push(&self.engine.tokenizer, token)?
        };
        if reason.is_none() && self.generated >= self.request.max_tokens {
            reason = Some(FinishReason::Length);
            text.push_str(&self.decoder.flush(&self.engine.tokenizer)?);
        }
        // The grammar allows nothing after this token (and no verified token waits): the
        // answer ends here, so the text held back for a stop string is the answer's too.
        // (The mask asked for here is the one the next step needs: computed once either way.)
        let grammar_done =
            reason.is_none() && self.queue.is_empty() && self.constraint.as_mut().is_some_and(|c| c.mask().is_err());
        if grammar_done {
            text.push_str(&self.decoder.flush(&self.engine.tokenizer)?);
        }
        let (mut out, hit) = self.stops.push(&text);
        if hit {
            reason = Some(FinishReason::Stop);
        } else if reason.is_some() || grammar_done {
            out.push_str(&self.stops.flush());
        }
        if let Some(reason) = reason {
            self.phase = Phase::Finishing(reason);
        }
        Ok(out)
    }
}

impl Generation<'_> {
    /// The depth controller's state now, for a speculating request with the controller on.
    pub fn depth_control(&self) -> Option<crate::speculative::ControlStats> {
        self.spec.as_ref().and_then(|s| s.stats.control.as_deref().cloned())
    }

    /// The request's first drafter's own cache (what it has read so far), for a speculating
    /// request: to inspect.
    pub fn draft_cache(&self) -> Option<&Cache> {
        self.spec.as_ref().map(|s| s.draft_cache())
    }

    /// Prompt tokens restored from the prompt cache: known once the prefill has begun (the
    /// first [`Iterator::next`], or joining a batch), 0 before.
    pub fn cached_tokens(&self) -> usize {
        self.cached_tokens
    }

    /// The tokens generated so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Runs the generation to its end and returns the generated token ids.
    pub fn token_ids(mut self) -> Result<Vec<u32>> {
        for event in self.by_ref() {
            event?;
        }
        Ok(std::mem::take(&mut self.tokens))
    }
}

/// A split model's ranks run every request to the same end: rank 0's generation dropped
/// before its end is cancelled and run out, so the others stop at the same step.
impl Drop for Generation<'_> {
    fn drop(&mut self) {
        if self.is_done() || self.engine.group().is_none_or(|g| g.rank() > 0) {
            return;
        }
        self.cancel.cancel();
        for event in self.by_ref() {
            if event.is_err() {
                break;
            }
        }
    }
}

impl Iterator for Generation<'_> {
    type Item = Result<Event>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.is_done() {
            return None;
        }
        let event = self.advance();
        let event = match (event, self.engine.group()) {
            // A forward pass failed mid-way (a lost rank): its collectives are not to be
            // waited on again.
            (Err(Error::Mlx(e)), Some(group)) => {
                group.mark_broken(&e.to_string());
                Err(Error::GroupDown(group.broken().unwrap_or_default()))
            }
            (event, _) => event,
        };
        if !matches!(event, Ok(Event::Text(_))) {
            self.phase = Phase::Done;
        }
        Some(event)
    }
}
