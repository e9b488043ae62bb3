//! Exact speculative decoding, drafted by the model's own MTP head or by a block drafter
//! (DFlash, [`crate::models::dflash`]).
//!
//! A cycle drafts `depth` tokens, verifies all `depth + 1` positions in one trunk pass, and
//! commits the accepted drafts plus one token from the trunk. Greedy: a draft is accepted
//! when it equals the trunk's argmax, so the output is the trunk's greedy output. Sampling:
//! standard rejection sampling (accept with min(1, p/q), else draw from the normalised
//! residual max(0, p - q)), so the output distribution is the trunk's. The MTP head samples
//! its drafts (q is its distribution); a block drafter's drafts are its argmax, a point mass:
//! accepted with probability p(d), else the token is drawn from p without d.
//!
//! Both drafters read what the trunk computed at the positions it processed — the MTP head
//! its final hidden state, a block drafter the outputs of its tapped layers — called
//! `features` here; the bookkeeping of which positions a drafter has seen is the same.
//!
//! Rollback is exact for every kind of state: attention KV caches (trunk and head) are
//! trimmed; Gated DeltaNet conv and recurrent states are restored from the per-position
//! states the verify pass recorded.

use std::time::{Duration, Instant};

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::eval;
use mlx_rs::{ops, Array, Dtype};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::cache::Cache;
use crate::costs::MAX_DRAFT_DEPTH;
use crate::depth_control::{CostModel, DepthChanges, DepthController};
use crate::error::{Error, Result};
use crate::grammar::Constraint;
use crate::logits::{self, Chain, GrammarMask, LogitsProcessor};
use crate::models::{BlockDrafter, LanguageModel, MtpHead};
use crate::penalties::{window_of, Penalties, Recent};
use crate::sampling::Sampler;
use crate::speculation::DraftWith;

/// Per-request statistics of speculative decoding.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SpecStats {
    pub depth: usize,
    pub cycles: usize,
    /// Per draft position: how often a draft was made there and how often it was accepted.
    pub drafted: Vec<usize>,
    pub accepted: Vec<usize>,
    pub committed: usize,
    pub draft_time: Duration,
    pub verify_time: Duration,
    /// With the depth controller ([`crate::depth_control`]): what it decided.
    pub control: Option<Box<ControlStats>>,
}

/// The depth controller's state for a request (or its decisions summed, in totals).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ControlStats {
    /// The depth it runs at now (0: plain decoding).
    pub depth_now: usize,
    /// What that depth promises over plain decoding, from the live acceptance.
    pub expected_speedup: f64,
    /// What the request's cycles achieved: their tokens per second against a plain step's
    /// rate when the cost model was measured.
    pub measured_speedup: f64,
    pub changes: DepthChanges,
}

impl SpecStats {
    /// Acceptance rate at each draft position (1-based position = index + 1).
    pub fn acceptance(&self) -> Vec<f64> {
        self.drafted.iter().zip(&self.accepted).map(|(&d, &a)| if d > 0 { a as f64 / d as f64 } else { 0.0 }).collect()
    }

    /// Adds another request's figures (for totals across requests).
    pub fn merge(&mut self, other: &SpecStats) {
        if self.drafted.len() < other.drafted.len() {
            self.drafted.resize(other.drafted.len(), 0);
            self.accepted.resize(other.accepted.len(), 0);
        }
        for (i, (&d, &a)) in other.drafted.iter().zip(&other.accepted).enumerate() {
            self.drafted[i] += d;
            self.accepted[i] += a;
        }
        self.depth = self.depth.max(other.depth);
        self.cycles += other.cycles;
        self.committed += other.committed;
        self.draft_time += other.draft_time;
        self.verify_time += other.verify_time;
        if let Some(other) = &other.control {
            let mine = self.control.get_or_insert_with(Default::default);
            mine.changes.merge(&other.changes);
            (mine.depth_now, mine.expected_speedup, mine.measured_speedup) =
                (other.depth_now, other.expected_speedup, other.measured_speedup);
        }
    }

    /// Mean tokens committed per cycle (1 = nothing accepted).
    pub fn tokens_per_cycle(&self) -> f64 {
        if self.cycles == 0 {
            0.0
        } else {
            self.committed as f64 / self.cycles as f64
        }
    }
}

/// What writes the drafts.
#[derive(Clone, Copy)]
pub enum Drafter<'m> {
    /// The model's multi-token-prediction head, one draft per step.
    Mtp(&'m MtpHead),
    /// A DFlash drafter: a block of drafts in one pass.
    Block(&'m BlockDrafter),
}

/// The drafted tokens (each a one-element u32 array, evaluated) on the host.
fn read_ids(drafts: &[Array]) -> Result<Vec<u32>> {
    Ok(drafts.iter().map(|t| t.try_item_exact::<u32>()).collect::<std::result::Result<_, _>>()?)
}

/// Where a cycle's draft logits come from: the MTP head stepped on its own drafts (its
/// hidden state now), or a block drafter's rows, one per draft position.
enum DraftRows<'m> {
    None,
    Mtp(&'m MtpHead, Array),
    Block(Array),
}

pub struct Speculator<'m> {
    model: &'m dyn LanguageModel,
    drafter: Drafter<'m>,
    depth: usize,
    /// The drafter's own cache: the MTP head's layers, or a block drafter's context.
    draft_cache: Cache,
    /// Trunk features [1, L, F] whose next tokens (`pending_tokens`) are known but which
    /// the drafter has not seen yet.
    pending_hidden: Option<Array>,
    pending_tokens: Vec<u32>,
    /// The trunk's features at the last position it processed.
    last_hidden: Option<Array>,
    rng: StdRng,
    pub stats: SpecStats,
    /// Replaces the drafts with these tokens (indexed by output position), so tests can drive
    /// the accept / partial-accept / rollback paths: greedy only for the MTP head (its sampled
    /// drafts carry its distribution), also sampling for a block drafter (point masses).
    pub draft_script: Option<Vec<u32>>,
    /// Greedy only: the answer fixed in advance (its tokens, then the end token): the verify
    /// pass takes its tokens in place of the trunk's choices, the drafts stay the head's own,
    /// so acceptance is the head's on that text (a benchmark's teacher forcing).
    pub forced_answer: Option<(Vec<u32>, u32)>,
    /// The request's penalties and the latest committed tokens they look at (prompt first).
    penalties: Option<(Penalties, Vec<u32>)>,
    /// Chooses each cycle's depth from live acceptance, when on.
    control: Option<DepthController>,
    /// The next cycle's depth, once decided ([`Speculator::next_depth`]).
    decided: Option<usize>,
    /// While the generation decodes plainly (depth 0): the trunk's hidden state at the token
    /// it fed last, whose next token is not read yet, and when it was fed.
    fed: Option<(Array, Instant)>,
}

impl<'m> Speculator<'m> {
    /// Drafts with `block` when given, else with the model's MTP head; `None` when it has
    /// neither.
    pub fn new(
        model: &'m dyn LanguageModel,
        block: Option<&'m BlockDrafter>,
        depth: usize,
        seed: u64,
    ) -> Result<Option<Self>> {
        let Some(drafter) = block.map(Drafter::Block).or(model.mtp().map(Drafter::Mtp)) else {
            return Ok(None);
        };
        let (deepest, draft_cache) = match drafter {
            Drafter::Mtp(head) => (MAX_DRAFT_DEPTH, head.new_cache()),
            Drafter::Block(block) => (block.max_drafts(), block.new_cache()),
        };
        if depth > deepest {
            return Err(Error::Request(format!("draft depth must be in 0..={deepest}, got {depth}")));
        }
        Ok(Some(Speculator {
            model,
            drafter,
            depth,
            draft_cache,
            pending_hidden: None,
            pending_tokens: Vec::new(),
            last_hidden: None,
            rng: StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15),
            stats: SpecStats { depth, drafted: vec![0; depth], accepted: vec![0; depth], ..Default::default() },
            draft_script: None,
            forced_answer: None,
            penalties: None,
            control: None,
            decided: None,
            fed: None,
        }))
    }

    /// The trunk's pass over `tokens` [1, L]: its final hidden states and the features this
    /// speculator's drafter reads at them.
    pub fn trunk(&self, tokens: &Array, cache: &mut Cache) -> Result<(Array, Array)> {
        match self.drafter {
            Drafter::Mtp(_) => {
                let hidden = self.model.hidden(tokens, cache)?;
                Ok((hidden.clone(), hidden))
            }
            Drafter::Block(block) => self.model.hidden_tapped(tokens, cache, &block.spec.target_layers),
        }
    }

    /// The trunk layers whose outputs the drafter reads (a block drafter's), or `None` (the
    /// MTP head reads the final hidden states).
    pub fn taps(&self) -> Option<&[usize]> {
        match self.drafter {
            Drafter::Mtp(_) => None,
            Drafter::Block(block) => Some(&block.spec.target_layers),
        }
    }

    /// Shows the drafter trunk positions it has not seen: their `features` [1, L, F] and the
    /// tokens after them (`next_tokens`, L of them).
    fn show(&mut self, features: &Array, next_tokens: &[u32]) -> Result<()> {
        match self.drafter {
            Drafter::Mtp(head) => {
                let ids = Array::from_slice(next_tokens, &[1, next_tokens.len() as i32]);
                let _ = head.forward(self.model, features, &ids, &mut self.draft_cache)?;
            }
            Drafter::Block(block) => block.extend(features, &mut self.draft_cache)?,
        }
        eval(self.draft_cache.arrays())?;
        Ok(())
    }

    /// What drafts: the MTP head or a block drafter.
    pub fn draft_with(&self) -> DraftWith {
        match self.drafter {
            Drafter::Mtp(_) => DraftWith::Mtp,
            Drafter::Block(_) => DraftWith::Block,
        }
    }

    /// Lets the depth follow the request's acceptance ([`DepthController`]), from the depth
    /// given (the tuned one) up to one more; the depth stays fixed where the cost model has
    /// nothing for this drafter.
    pub fn control_depth(&mut self, costs: CostModel) {
        let with = self.draft_with();
        let deepest = costs.deepest(with);
        if deepest == 0 {
            return;
        }
        let control = DepthController::new(costs, with, self.depth);
        let positions = self.stats.drafted.len().max(self.depth + 1).min(deepest);
        self.stats.drafted.resize(positions, 0);
        self.stats.accepted.resize(positions, 0);
        self.stats.control = Some(Box::new(ControlStats {
            depth_now: control.depth(),
            expected_speedup: control.expected_speedup(),
            ..Default::default()
        }));
        self.control = Some(control);
    }

    /// Runs the drafter's own attention positions `shift` from their index, as the trunk's
    /// after a prompt with images ([`crate::vision::ImagePrefill::shift_at`]).
    pub(crate) fn shift_positions(&mut self, shift: i32) {
        self.draft_cache.set_rope_shift(shift);
    }

    /// Penalises drafts and verification alike: each position's window holds the tokens
    /// before it, drafted ones included, so the output is what plain penalised decoding gives.
    pub fn penalise(&mut self, penalties: Penalties, prompt: &[u32]) {
        if !penalties.is_off() {
            self.penalties = Some((penalties, window_of(prompt).to_vec()));
        }
    }

    /// Adds committed tokens to the penalties' window.
    fn remember(&mut self, tokens: &[u32]) {
        if let Some((_, recent)) = &mut self.penalties {
            recent.extend(tokens);
            *recent = window_of(recent).to_vec();
        }
    }

    /// Feeds the drafter what a prefill chunk taught: `tokens` were just processed by the
    /// trunk, giving `hidden` [1, L, F] ([`Speculator::trunk`]'s features). Each trunk position
    /// is paired with the token after it.
    pub fn observe(&mut self, tokens: &[u32], hidden: &Array) -> Result<()> {
        let n = tokens.len() as i32;
        let mut parts = Vec::new();
        parts.extend(self.last_hidden.take());
        let next_tokens = if parts.is_empty() { &tokens[1..] } else { tokens };
        if n > 1 {
            parts.push(hidden.index((.., ..n - 1, ..)));
        }
        if !next_tokens.is_empty() {
            self.show(&ops::concatenate(&parts, 1)?, next_tokens)?;
        }
        self.last_hidden = Some(hidden.index((.., n - 1.., ..)));
        Ok(())
    }

    /// Feeds the drafter every pending position but the last, so its cache ends one position
    /// before the trunk's (what the prompt cache keeps with an answer's state). Cycles that
    /// accepted drafts, and plain cycles, leave several positions pending.
    /// After plain steps (`fed` set) the trunk has also seen the last pending token: the head
    /// takes every pending position, and the fed one's hidden state becomes the last.
    pub(crate) fn catch_up(&mut self) -> Result<()> {
        let n = self.pending_tokens.len();
        let fed = self.fed.take();
        let keep = if fed.is_some() { 0 } else { 1 };
        if n <= keep {
            self.fed = fed;
            return Ok(());
        }
        let Some(hidden) = self.pending_hidden.take() else { return Ok(()) };
        let k = (n - keep) as i32;
        let tokens: Vec<u32> = self.pending_tokens.drain(..n - keep).collect();
        self.show(&hidden.index((.., ..k, ..)), &tokens)?;
        match fed {
            Some((last, _)) => self.last_hidden = Some(last),
            None => self.pending_hidden = Some(hidden.index((.., k.., ..))),
        }
        Ok(())
    }

    /// The depth of the next cycle, decided once until a cycle or a plain step uses it: the
    /// controller's (a probe's now and then) or the fixed one. At 0 the generation decodes
    /// plainly on its own pipelined path and tells the speculator each step
    /// ([`Speculator::fed_plain`], [`Speculator::took_plain`]), so a request sent back to
    /// plain decoding runs at plain speed and drafting resumes where it is.
    pub fn next_depth(&mut self) -> usize {
        if let Some(depth) = self.decided {
            return depth;
        }
        let depth = self.control.as_mut().map_or(self.depth, |c| c.next_depth());
        self.decided = Some(depth);
        depth
    }

    /// A plain step fed the trunk a token and got `hidden` [1, 1, H] at it (the step's depth,
    /// 0, is used up).
    pub fn fed_plain(&mut self, hidden: Array) {
        self.decided = None;
        self.fed = Some((hidden, Instant::now()));
    }

    /// The token the last plain step chose, read back: paired with the hidden state it
    /// followed, for the head to catch up on when drafting resumes; counted as a plain cycle.
    pub fn took_plain(&mut self, token: u32) -> Result<()> {
        let (hidden, fed_at) =
            self.fed.take().ok_or_else(|| Error::Request("a plain step's token without its hidden state".into()))?;
        self.pending_hidden = Some(match self.pending_hidden.take() {
            Some(before) => ops::concatenate(&[before, hidden], 1)?,
            None => hidden,
        });
        self.pending_tokens.push(token);
        self.remember(&[token]);
        self.account(0, 0, 1, Duration::ZERO, fed_at.elapsed());
        Ok(())
    }

    /// The trunk's hidden state at the last position the head was told of.
    pub(crate) fn last_hidden(&self) -> Option<&Array> {
        // While decoding it is the one pending position's (after a cycle, or `catch_up`).
        let pending = self.pending_hidden.as_ref().filter(|_| self.pending_tokens.len() == 1);
        self.last_hidden.as_ref().or(pending)
    }

    /// The drafter's own cache (what the prompt cache keeps of it).
    pub(crate) fn draft_cache(&self) -> &Cache {
        &self.draft_cache
    }

    /// Continues from a cached prompt prefix: the drafter's cache then, and the trunk's
    /// features at its last position.
    pub(crate) fn restore(&mut self, layers: Vec<crate::cache::LayerCache>, last_hidden: Option<Array>) {
        self.draft_cache.layers = layers;
        self.last_hidden = last_hidden;
    }

    /// Starts decoding: `first` is the token sampled after the prompt.
    pub fn start(&mut self, first: u32, trunk_cache: &mut Cache) {
        self.pending_hidden = self.last_hidden.take();
        self.pending_tokens = vec![first];
        self.remember(&[first]);
        trunk_cache.set_record(true);
    }

    /// One draft-verify cycle; returns the committed tokens (1 to depth + 1).
    ///
    /// Under a grammar (`constraint`, whose state must have a mask: the caller checked) each
    /// draft is masked with the grammar's state after the drafts before it and advances it; a
    /// draft after which the grammar allows nothing ends the draft there. Each verified
    /// position is masked with the same states, so the committed tokens are what plain
    /// constrained decoding gives; the grammar then steps back over the rejected drafts and on
    /// over the token the verify pass chose.
    pub fn cycle(
        &mut self,
        cache: &mut Cache,
        sampler: &mut Sampler,
        mut constraint: Option<&mut Constraint>,
        processors: &[Box<dyn LogitsProcessor>],
    ) -> Result<Vec<u32>> {
        let depth = self.next_depth();
        self.decided = None;
        let hidden = self.pending_hidden.take().ok_or_else(|| Error::Request("speculator used before start".into()))?;
        let last_token =
            *self.pending_tokens.last().ok_or_else(|| Error::Request("speculator used before start".into()))?;

        // Draft: the MTP head first catches up on the pending positions, then runs on its own
        // output; a block drafter takes them into its context and drafts the whole block at
        // once. A plain cycle (the controller's depth 0) leaves the drafter behind: the
        // positions wait for the next cycle that drafts.
        let started = Instant::now();
        // `draft_steps`: positions of the drafter's cache the drafts add, rolled back after the
        // verify pass (the head's steps on its own drafts; the block).
        let (mut rows, mut draft_steps) = match (self.drafter, depth) {
            (_, 0) => (DraftRows::None, 0),
            (Drafter::Mtp(head), _) => {
                let ids = Array::from_slice(&self.pending_tokens, &[1, self.pending_tokens.len() as i32]);
                let x = head.forward(self.model, &hidden, &ids, &mut self.draft_cache)?;
                (DraftRows::Mtp(head, x.index((.., -1.., ..))), 0)
            }
            (Drafter::Block(block), _) => {
                let logits = block.draft(self.model, Some(&hidden), last_token, depth, &mut self.draft_cache)?;
                (DraftRows::Block(logits), block.spec.block_size as i32)
            }
        };
        let (mut drafts, mut draft_scaled) = (Vec::with_capacity(depth), Vec::with_capacity(depth));
        let mut draft_window = self.penalties.as_ref().map(|(p, recent)| Recent::new(*p, recent));
        // The grammar's masks: before the first draft, then after each kept draft.
        let mut masks = Vec::new();
        if let Some(c) = constraint.as_deref_mut() {
            masks.push(GrammarMask(
                c.mask().map_err(|e| Error::Request(format!("a speculative cycle after the grammar ended: {e:?}")))?,
            ));
        }
        for i in 0..depth {
            let logits = match &rows {
                DraftRows::Mtp(head, g) => head.logits(self.model, g)?.index((.., -1, ..)),
                DraftRows::Block(all) => all.index((.., i as i32, ..)),
                DraftRows::None => break,
            };
            let logits = Chain::at(processors, draft_window.as_ref(), masks.get(i)).apply(&logits)?;
            // The head samples its drafts; a block's drafts are its argmax (a point mass).
            let token = if sampler.is_greedy() || matches!(rows, DraftRows::Block(_)) {
                ops::indexing::argmax_axis(&logits, -1, None)?
            } else {
                let scaled = sampler.scaled_logits(&logits)?;
                let t = sampler.draw(&scaled)?;
                draft_scaled.push(scaled);
                t
            };
            if let (DraftRows::Mtp(head, g), true) = (&mut rows, i + 1 < depth) {
                *g = head.forward(self.model, g, &token.reshape(&[1, 1])?, &mut self.draft_cache)?;
                draft_steps += 1;
                if constraint.is_some() {
                    // The head's next step runs while the host masks the grammar's next state.
                    crate::distributed::schedule(self.model.is_split(), [&*g])?;
                }
            }
            if let Some(c) = constraint.as_deref_mut() {
                // The next mask needs this draft on the host.
                let id = token.as_dtype(Dtype::Uint32)?.try_item_exact::<u32>()?;
                c.accept(id)?;
                match c.mask() {
                    Ok(mask) => masks.push(GrammarMask(mask)),
                    Err(_) => {
                        // Nothing may follow this draft: it is not verified (the verify pass
                        // chooses the token here itself); the drafter's step on it is rolled
                        // back with its other drafts.
                        c.rollback(1)?;
                        if draft_scaled.len() > drafts.len() {
                            draft_scaled.pop();
                        }
                        break;
                    }
                }
            }
            if let Some(window) = &mut draft_window {
                window.push(&token)?;
            }
            drafts.push(token.as_dtype(Dtype::Uint32)?);
        }
        let d = drafts.len();
        // Without a grammar, penalties or a script nothing on the host needs the drafts before
        // the verify pass: they feed it on the device, the drafter computes while the host
        // builds the verify pass, and one wait reads the drafts and the verdict together.
        let on_device = constraint.is_none() && self.penalties.is_none() && self.draft_script.is_none();
        let mut draft_ids: Vec<u32> = Vec::with_capacity(d);
        let input = if on_device {
            crate::distributed::schedule(self.model.is_split(), drafts.iter().chain(draft_scaled.iter()))?;
            let mut ids = vec![Array::from_slice(&[last_token], &[1])];
            for t in &drafts {
                ids.push(t.reshape(&[1])?);
            }
            ops::concatenate(&ids, 0)?.reshape(&[1, d as i32 + 1])?
        } else {
            eval(drafts.iter().chain(draft_scaled.iter()))?;
            draft_ids = read_ids(&drafts)?;
            // A block's drafts are point masses under sampling too: a script may replace them.
            let scripted = sampler.is_greedy() || matches!(self.drafter, Drafter::Block(_));
            if let (Some(script), true, None) = (&self.draft_script, scripted, &constraint) {
                let at = 1 + self.stats.committed;
                for (i, id) in draft_ids.iter_mut().enumerate() {
                    *id = script.get(at + i).copied().unwrap_or(*id);
                }
            }
            let mut input = vec![last_token];
            input.extend(&draft_ids);
            Array::from_slice(&input, &[1, d as i32 + 1])
        };
        let verified_at = Instant::now();

        // Verify all drafted positions in one trunk pass.
        let (h, features) = self.trunk(&input, cache)?;
        let logits = self.model.logits(&h)?.index(0);
        // Row j predicts the token after input[j]: its window ends with drafts 1..=j, its mask
        // is the grammar's state after them.
        let windows: Vec<Recent> = match &self.penalties {
            Some((p, recent)) => (0..=d)
                .map(|j| Recent::new(*p, &recent.iter().chain(&draft_ids[..j]).copied().collect::<Vec<_>>()))
                .collect(),
            None => vec![],
        };
        if !masks.is_empty() && masks.len() <= d {
            return Err(Error::Request("a grammar's mask is missing for a verified position".into()));
        }
        let rows: Vec<Chain> = (0..=d).map(|j| Chain::at(processors, windows.get(j), masks.get(j))).collect();
        let logits = logits::apply_rows(&logits, &rows)?;
        let (accepted, next) = if sampler.is_greedy() {
            let target = ops::indexing::argmax_axis(&logits, -1, None)?.as_dtype(Dtype::Uint32)?;
            eval(drafts.iter().chain([&target, &h]))?;
            if on_device {
                draft_ids = read_ids(&drafts)?;
            }
            let mut target = target.as_slice::<u32>().to_vec();
            if let Some((answer, end)) = &self.forced_answer {
                let at = 1 + self.stats.committed;
                for (j, t) in target.iter_mut().enumerate() {
                    *t = answer.get(at + j).copied().unwrap_or(*end);
                }
            }
            let k = draft_ids.iter().zip(&target).take_while(|(a, b)| a == b).count();
            (k, target[k])
        } else {
            let p = ops::softmax_axis(sampler.scaled_logits(&logits)?, -1, None)?;
            let q: Vec<Array> =
                draft_scaled.iter().map(|s| ops::softmax_axis(s, -1, None)).collect::<std::result::Result<_, _>>()?;
            eval(q.iter().chain(&drafts).chain([&p, &h]))?;
            if on_device {
                draft_ids = read_ids(&drafts)?;
            }
            // A block's drafts carry no distribution of their own: point masses.
            let q = matches!(self.drafter, Drafter::Mtp(_)).then_some(&q[..]);
            self.rejection_sample(&draft_ids, &p, q)?
        };
        let now = Instant::now();

        // Keep the accepted prefix: the trunk drops the rejected drafts, the head the
        // positions it drafted on its own hidden states.
        cache.rollback((d - accepted) as i32)?;
        self.draft_cache.rollback(draft_steps)?;
        if let Some(c) = constraint {
            c.rollback(d - accepted)?;
            c.accept(next)?;
        }
        let mut committed = draft_ids[..accepted].to_vec();
        committed.push(next);
        let new_hidden = features.index((.., ..accepted as i32 + 1, ..));
        if depth > 0 {
            self.pending_hidden = Some(new_hidden);
            self.pending_tokens = committed.clone();
        } else {
            self.pending_hidden = Some(ops::concatenate(&[hidden, new_hidden], 1)?);
            self.pending_tokens.extend(&committed);
        }
        self.remember(&committed);
        self.account(d, accepted, committed.len(), verified_at - started, now - verified_at);
        Ok(committed)
    }

    /// A cycle's figures into the statistics and the controller: `drafted` drafts of which
    /// the first `accepted` were kept, `committed` tokens.
    fn account(&mut self, drafted: usize, accepted: usize, committed: usize, draft: Duration, verify: Duration) {
        let s = &mut self.stats;
        s.cycles += 1;
        s.committed += committed;
        for i in 0..drafted {
            s.drafted[i] += 1;
            s.accepted[i] += usize::from(i < accepted);
        }
        s.draft_time += draft;
        s.verify_time += verify;
        if let Some(control) = &mut self.control {
            control.record(drafted, accepted);
            let cycles_s = (s.draft_time + s.verify_time).as_secs_f64();
            let measured = if cycles_s > 0.0 { s.committed as f64 * control.plain_step_s() / cycles_s } else { 0.0 };
            s.control = Some(Box::new(ControlStats {
                depth_now: control.depth(),
                expected_speedup: control.expected_speedup(),
                measured_speedup: measured,
                changes: control.changes.clone(),
            }));
        }
    }

    /// Accepts draft i with probability min(1, p_i(d) / q_i(d)); the first rejection draws
    /// from max(0, p_i - q_i) renormalised; if all pass, the bonus token comes from p_depth.
    /// Without `q` each draft is a point mass: accepted with probability p_i(d), the residual
    /// is p_i without d.
    fn rejection_sample(&mut self, drafts: &[u32], p: &Array, q: Option<&[Array]>) -> Result<(usize, u32)> {
        let vocab = p.dim(-1) as usize;
        let p_all = p.as_slice::<f32>();
        for (i, &d) in drafts.iter().enumerate() {
            let p_i = &p_all[i * vocab..(i + 1) * vocab];
            let q_i = q.map(|q| q[i].as_slice::<f32>());
            let (pd, qd) = (p_i[d as usize], q_i.map_or(1.0, |q_i| q_i[d as usize]));
            if qd > 0.0 && self.rng.random::<f32>() * qd < pd {
                continue;
            }
            let residual: Vec<f32> = match q_i {
                Some(q_i) => p_i.iter().zip(q_i).map(|(a, b)| (a - b).max(0.0)).collect(),
                None => p_i.iter().enumerate().map(|(t, &a)| if t == d as usize { 0.0 } else { a }).collect(),
            };
            return Ok((i, self.draw_host(&residual).unwrap_or_else(|| self.draw_host(p_i).unwrap_or(0))));
        }
        let last = &p_all[drafts.len() * vocab..(drafts.len() + 1) * vocab];
        Ok((drafts.len(), self.draw_host(last).unwrap_or(0)))
    }

    /// Samples an index from unnormalised non-negative weights; `None` if they sum to 0.
    fn draw_host(&mut self, weights: &[f32]) -> Option<u32> {
        let total: f64 = weights.iter().map(|&w| w as f64).sum();
        if total <= 0.0 {
            return None;
        }
        let mut r = self.rng.random::<f64>() * total;
        for (i, &w) in weights.iter().enumerate() {
            r -= w as f64;
            if r < 0.0 {
                return Some(i as u32);
            }
        }
        weights.iter().rposition(|&w| w > 0.0).map(|i| i as u32)
    }
}
