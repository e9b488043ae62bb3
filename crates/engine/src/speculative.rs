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
//! With depth control, a model that has both drafters keeps the other one standing by: it is
//! told every position as well (the trunk's pass gives both drafters' features), tried for a
//! cycle now and then, and put in use when its figures promise more ([`DrafterChoice`]).
//!
//! Rollback is exact for every kind of state: attention KV caches (trunk and head) are
//! trimmed; Gated DeltaNet conv and recurrent states are restored from the per-position
//! states the verify pass recorded.

use std::time::{Duration, Instant};

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::transforms::eval;
use mlx_rs::{ops, Array, Dtype};
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use crate::cache::Cache;
use crate::costs::MAX_DRAFT_DEPTH;
use crate::depth_control::choice::DrafterChoice;
use crate::depth_control::going_on::AcceptanceMemory;
use crate::depth_control::{CostModel, DepthChanges, DepthController};
use crate::error::{Error, Result};
use crate::grammar::Constraint;
use crate::logits::{self, Chain, GrammarMask, LogitsProcessor};
use crate::models::{BlockDrafter, LanguageModel, MtpHead};
use crate::penalties::{window_of, Penalties, Recent};
use crate::sampling::Sampler;
use crate::speculation::DraftWith;

mod accounting;
mod rejection;
mod slot;
pub use slot::Drafter;
use slot::{PromptAngles, Slot};

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
    /// The drafter in use now, and how often the request switched to the other one.
    pub drafter_now: DraftWith,
    pub switches: usize,
    /// The depth it runs at now (0: plain decoding).
    pub depth_now: usize,
    /// What that depth promises over plain decoding, from the live acceptance.
    pub expected_speedup: f64,
    /// What the request's cycles achieved: their tokens per second against a plain step's
    /// rate when the cost model was measured.
    pub measured_speedup: f64,
    pub changes: DepthChanges,
    pub after_plain: AfterPlain,
}

/// The cycles that came after plain steps (probes, returns to drafting, tries), each first
/// catching its drafter up on them.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AfterPlain {
    pub cycles: usize,
    /// Their time (within the request's draft and verify time).
    #[serde(rename = "time_ms", serialize_with = "accounting::milliseconds")]
    pub time: Duration,
    /// Of `time`, the drafter's catch-up pass over the plain steps' positions (where they are
    /// more than a cycle's own).
    #[serde(rename = "catch_up_time_ms", serialize_with = "accounting::milliseconds")]
    pub catch_up_time: Duration,
}

impl AfterPlain {
    fn merge(&mut self, other: &AfterPlain) {
        self.cycles += other.cycles;
        self.time += other.time;
        self.catch_up_time += other.catch_up_time;
    }
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
            mine.switches += other.switches;
            mine.after_plain.merge(&other.after_plain);
            (mine.depth_now, mine.expected_speedup, mine.measured_speedup, mine.drafter_now) =
                (other.depth_now, other.expected_speedup, other.measured_speedup, other.drafter_now);
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

/// The drafted tokens on the host, from their evaluated row [d] of u32 (none without a row).
fn read_ids(row: Option<&Array>) -> Result<Vec<u32>> {
    Ok(row.map(|r| r.as_slice::<u32>().to_vec()).unwrap_or_default())
}

/// Where a cycle's draft logits come from: the MTP head stepped on its own drafts (its
/// hidden state now), or a block drafter's rows, one per draft position.
enum DraftRows<'m> {
    None,
    Mtp(&'m MtpHead, Array),
    Block(Array),
}

/// When the request's last token-producing step ended, and whether it was a plain step
/// (`accounting` times the next one from it).
#[derive(Debug, Clone, Copy)]
struct LastStep {
    at: Instant,
    plain: bool,
}

pub struct Speculator<'m> {
    model: &'m dyn LanguageModel,
    /// The drafter in use.
    active: Slot<'m>,
    /// With depth control, where the model has both an MTP head and a block drafter: the
    /// other one, told every position too, tried now and then ([`DrafterChoice`]) and put in
    /// use when it promises more.
    standby: Option<Slot<'m>>,
    /// The drafter the request started with: the one whose state the prompt cache keeps and
    /// restores (its checkpoints hold that drafter's features).
    home: DraftWith,
    /// The other drafter, until depth control decides whether it stands by.
    other: Option<Drafter<'m>>,
    choice: DrafterChoice,
    /// This cycle tries the drafter that stood by (it is `active` for the cycle).
    trying: bool,
    /// The depth when no controller chooses it.
    depth: usize,
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
    /// The next cycle's depth, once decided ([`Speculator::next_depth`]).
    decided: Option<usize>,
    /// While the generation decodes plainly (depth 0): the trunk's features at the token it
    /// fed last, whose next token is not read yet, and when it was fed.
    fed: Option<(Array, Instant)>,
    /// A prompt with images: where its positions sit for the MTP head's attention.
    prompt_angles: Option<PromptAngles>,
    /// The request's last step, for timing the next one (`accounting`).
    last_step: Option<LastStep>,
}

impl<'m> Speculator<'m> {
    /// Drafts with `with`: the model's MTP head, or `block` (which must then be given);
    /// `None` when that drafter is missing. Depth control ([`Speculator::control_depth`]) may
    /// switch to the other one where the model has both.
    pub fn new(
        model: &'m dyn LanguageModel,
        block: Option<&'m BlockDrafter>,
        with: DraftWith,
        depth: usize,
        seed: u64,
    ) -> Result<Option<Self>> {
        let (mtp, block) = (model.mtp().map(Drafter::Mtp), block.map(Drafter::Block));
        let (drafter, other) = match with {
            DraftWith::Mtp => (mtp, block),
            DraftWith::Block => (block, mtp),
        };
        let Some(drafter) = drafter else { return Ok(None) };
        let deepest = match drafter {
            Drafter::Mtp(_) => MAX_DRAFT_DEPTH,
            Drafter::Block(block) => block.max_drafts(),
        };
        if depth > deepest {
            return Err(Error::Request(format!("draft depth must be in 0..={deepest}, got {depth}")));
        }
        Ok(Some(Speculator {
            model,
            active: Slot::new(drafter),
            standby: None,
            home: with,
            other,
            choice: DrafterChoice::new(),
            trying: false,
            depth,
            rng: StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15),
            stats: SpecStats { depth, drafted: vec![0; depth], accepted: vec![0; depth], ..Default::default() },
            draft_script: None,
            forced_answer: None,
            penalties: None,
            decided: None,
            fed: None,
            prompt_angles: None,
            last_step: None,
        }))
    }

    /// The trunk's pass over `tokens` [1, L]: its final hidden states and the features this
    /// speculator's drafters read at them ([`Speculator::features`]).
    pub fn trunk(&self, tokens: &Array, cache: &mut Cache) -> Result<(Array, Array)> {
        match self.taps() {
            None => {
                let hidden = self.model.hidden(tokens, cache)?;
                Ok((hidden.clone(), hidden))
            }
            Some(taps) => {
                let (hidden, tapped) = self.model.hidden_tapped(tokens, cache, taps)?;
                let features = self.features(&hidden, tapped)?;
                Ok((hidden, features))
            }
        }
    }

    /// The trunk layers whose outputs a drafter reads (a block drafter's), or `None` (the MTP
    /// head reads the final hidden states).
    pub fn taps(&self) -> Option<&[usize]> {
        self.slots().find_map(|s| match s.drafter {
            Drafter::Block(block) => Some(&block.spec.target_layers[..]),
            Drafter::Mtp(_) => None,
        })
    }

    /// What the drafters read from a trunk pass that gave `hidden` and `tapped` (the tapped
    /// layers' outputs where [`Speculator::taps`] names some, else the hidden states again):
    /// one drafter's, or with two the hidden states and the taps side by side.
    pub fn features(&self, hidden: &Array, tapped: Array) -> Result<Array> {
        Ok(match self.standby {
            Some(_) => ops::concatenate(&[hidden, &tapped], -1)?,
            None => tapped,
        })
    }

    /// Each drafter's part of `features`: the in-use one's, the standby's.
    fn split(&self, features: &Array) -> (Array, Option<Array>) {
        let Some(standby) = &self.standby else { return (features.clone(), None) };
        let taps = self.taps().map_or(0, <[usize]>::len) as i32;
        let width = features.dim(-1) / (1 + taps);
        let part = |slot: &Slot| match slot.drafter {
            Drafter::Mtp(_) => features.index((.., .., ..width)),
            Drafter::Block(_) => features.index((.., .., width..)),
        };
        (part(&self.active), Some(part(standby)))
    }

    fn slots(&self) -> impl Iterator<Item = &Slot<'m>> {
        std::iter::once(&self.active).chain(&self.standby)
    }

    fn slots_mut(&mut self) -> impl Iterator<Item = &mut Slot<'m>> {
        std::iter::once(&mut self.active).chain(&mut self.standby)
    }

    /// The drafter the request started with (the prompt cache's).
    fn home(&self) -> &Slot<'m> {
        self.slots().find(|s| s.drafter.draft_with() == self.home).unwrap_or(&self.active)
    }

    /// What the request started drafting with: whose state the prompt cache keeps for it.
    pub fn draft_with(&self) -> DraftWith {
        self.home
    }

    /// The drafter standing by is told positions whose next tokens are now known (its part
    /// of their features), and takes them in once it has fallen far behind.
    fn tell_standby(&mut self, part: Option<Array>, tokens: &[u32]) -> Result<()> {
        if let (Some(standby), Some(part)) = (&mut self.standby, part) {
            standby.push(part, tokens);
            standby.keep_near(self.model)?;
        }
        Ok(())
    }

    /// Lets the depth follow the request's acceptance ([`DepthController`]), from the depth
    /// given (the tuned one) up to one more; the depth stays fixed where the cost model has
    /// nothing for this drafter. Where the model has another drafter that could pay here, it
    /// stands by. Each drafter's controller starts where the last request with it ended
    /// (`memory`).
    pub fn control_depth(&mut self, costs: CostModel, memory: &AcceptanceMemory) {
        let with = self.active.drafter.draft_with();
        if costs.deepest(with) == 0 {
            return;
        }
        let control = DepthController::new(costs.clone(), with, self.depth).remembering(memory.of(with));
        let mut positions = self.stats.drafted.len().max(self.depth + 1).min(costs.deepest(with));
        self.stats.control = Some(Box::new(ControlStats {
            depth_now: control.depth(),
            expected_speedup: control.expected_speedup(),
            drafter_now: with,
            ..Default::default()
        }));
        self.active.control = Some(control);
        if let Some(other) = self.other.take() {
            let deepest = costs.deepest(other.draft_with());
            let control =
                DepthController::untuned(costs, other.draft_with()).remembering(memory.of(other.draft_with()));
            if control.can_pay() {
                positions = positions.max(deepest);
                let mut slot = Slot::new(other);
                slot.control = Some(control);
                self.standby = Some(slot);
            }
        }
        self.stats.drafted.resize(positions, 0);
        self.stats.accepted.resize(positions, 0);
    }

    /// Keeps where each controlled drafter ended and how its drafts went on, for the next
    /// request.
    pub fn leave_for_next(&self, memory: &mut AcceptanceMemory) {
        for slot in self.slots() {
            if let Some(control) = &slot.control {
                memory.keep(slot.drafter.draft_with(), control.remembered());
            }
        }
    }

    /// A prompt with images: the MTP head's positions inside it are the trunk's, these
    /// `angles` [prompt length - 1, rotary dims / 2] ([`Speculator::observe`] places each
    /// chunk), and run `shift` from their index after it.
    pub(crate) fn place_prompt(&mut self, angles: Array, shift: i32) {
        self.prompt_angles = Some(PromptAngles { angles, shift });
    }

    /// Runs the drafters' own attention positions `shift` from their index, as the trunk's
    /// after a prompt with images ([`crate::vision::ImagePrefill::shift_at`]).
    pub(crate) fn shift_positions(&mut self, shift: i32) {
        for slot in self.slots_mut() {
            slot.cache.set_rope_shift(shift);
        }
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

    /// Feeds the drafters what a prefill chunk taught: `tokens` were just processed by the
    /// trunk, giving `features` [1, L, F] ([`Speculator::trunk`]'s). Each trunk position is
    /// paired with the token after it.
    pub fn observe(&mut self, tokens: &[u32], features: &Array) -> Result<()> {
        let (mine, standby_part) = self.split(features);
        let placed = self.prompt_angles.as_ref();
        self.active.observe(self.model, tokens, &mine, placed)?;
        if let (Some(standby), Some(part)) = (&mut self.standby, standby_part) {
            standby.observe(self.model, tokens, &part, placed)?;
        }
        Ok(())
    }

    /// Feeds the drafters every pending position but the last, so their caches end one
    /// position before the trunk's (what the prompt cache keeps with an answer's state).
    /// Cycles that accepted drafts, and plain cycles, leave several positions pending.
    /// After plain steps (`fed` set) the trunk has also seen the last pending token: the
    /// drafters take every pending position, and the fed one's features become the last.
    pub(crate) fn catch_up(&mut self) -> Result<()> {
        let fed = self.fed.take();
        if fed.is_some() && self.active.pending_tokens.is_empty() {
            self.fed = fed;
            return Ok(());
        }
        let (mine, standby_part) = match &fed {
            Some((features, _)) => {
                let (mine, standby) = self.split(features);
                (Some(mine), standby)
            }
            None => (None, None),
        };
        self.active.catch_up(self.model, mine.as_ref())?;
        if let Some(standby) = &mut self.standby {
            standby.catch_up(self.model, standby_part.as_ref())?;
        }
        Ok(())
    }

    /// The depth of the next cycle, decided once until a cycle or a plain step uses it: the
    /// controller's (a probe's now and then) or the fixed one; now and then a cycle with the
    /// drafter standing by. At 0 the generation decodes plainly on its own pipelined path and
    /// tells the speculator each step ([`Speculator::fed_plain`], [`Speculator::took_plain`]),
    /// so a request sent back to plain decoding runs at plain speed and drafting resumes
    /// where it is.
    pub fn next_depth(&mut self) -> usize {
        if let Some(depth) = self.decided {
            return depth;
        }
        // While plain with probes, the probes alternate between the drafters (trying the one
        // standing by in their turn); otherwise it is tried on its own schedule.
        let plain_probing = self.active.control.as_ref().is_some_and(|c| c.depth() == 0 && c.can_pay());
        let scheduled = self.standby.is_some() && !plain_probing && self.choice.try_standby();
        let mut depth = match scheduled {
            true => 0,
            false => self.active.control.as_mut().map_or(self.depth, |c| c.next_depth()),
        };
        let its_turn = plain_probing && depth > 0 && self.standby.is_some() && self.choice.take_turn();
        if plain_probing && depth > 0 && !its_turn {
            depth = self.active.control.as_mut().map_or(depth, |c| c.afford_probe());
        }
        if scheduled || its_turn {
            self.swap();
            self.trying = true;
            depth = self.active.control.as_ref().map_or(1, |c| c.depth().max(1));
        }
        self.decided = Some(depth);
        depth
    }

    /// Puts the drafter standing by in use, and the one in use on standby.
    fn swap(&mut self) {
        if let Some(standby) = &mut self.standby {
            std::mem::swap(&mut self.active, standby);
        }
    }

    /// A plain step fed the trunk a token and got `features` [1, 1, F] at it (the step's
    /// depth, 0, is used up).
    pub fn fed_plain(&mut self, features: Array) {
        self.decided = None;
        self.fed = Some((features, Instant::now()));
    }

    /// The token the last plain step chose, read back: paired with the features it
    /// followed, for the drafters to catch up on when drafting resumes; counted as a plain
    /// cycle.
    pub fn took_plain(&mut self, token: u32) -> Result<()> {
        let (features, fed_at) =
            self.fed.take().ok_or_else(|| Error::Request("a plain step's token without its hidden state".into()))?;
        let (mine, standby_part) = self.split(&features);
        self.active.push(mine, &[token]);
        self.tell_standby(standby_part, &[token])?;
        self.remember(&[token]);
        self.account(0, 0, 1, Duration::ZERO, fed_at.elapsed());
        self.timed_plain_step();
        Ok(())
    }

    /// The trunk's features, as the request's first drafter reads them, at the last position
    /// it was told of.
    pub(crate) fn last_hidden(&self) -> Option<&Array> {
        let home = self.home();
        // While decoding it is the one pending position's (after a cycle, or `catch_up`).
        home.last_hidden.as_ref().or(home.last_pending())
    }

    /// The request's first drafter's own cache (what the prompt cache keeps of it).
    pub(crate) fn draft_cache(&self) -> &Cache {
        &self.home().cache
    }

    /// Continues from a cached prompt prefix: the drafter's cache then, and the trunk's
    /// features at its last position (the drafter standing by has not seen the prefix).
    pub(crate) fn restore(&mut self, layers: Vec<crate::cache::LayerCache>, last_hidden: Option<Array>) {
        self.active.cache.layers = layers;
        self.active.last_hidden = last_hidden;
    }

    /// The answer ended before the last `n` positions the trunk verified (their tokens are
    /// not the answer's): the drafters forget them as the trunk rolls them back.
    pub(crate) fn forget_last(&mut self, mut n: usize) -> Result<()> {
        // After plain steps the last position fed is `fed`'s (its next token is not known).
        if n > 0 && self.fed.take().is_some() {
            n -= 1;
        }
        if n == 0 {
            return Ok(());
        }
        self.slots_mut().try_for_each(|slot| slot.forget_last(n))
    }

    /// Starts decoding: `first` is the token sampled after the prompt.
    pub fn start(&mut self, first: u32, trunk_cache: &mut Cache) {
        self.prompt_angles = None;
        for slot in self.slots_mut() {
            slot.start(first);
        }
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
        let started = Instant::now();
        // After plain steps the drafter first takes in all but the last of them, as a catch-up
        // of a padded length: the draft then runs on a cycle's usual shapes. The catch-up waits
        // for the drafter's cache, so its time is known for the statistics.
        let pending = self.active.pending_tokens.len();
        if depth > 0 && pending > slot::CYCLE_PENDING {
            self.active.catch_up(self.model, None)?;
            let took = started.elapsed();
            if let (Some(control), true) = (&mut self.stats.control, self.last_step.is_some_and(|last| last.plain)) {
                control.after_plain.catch_up_time += took;
            }
            tracing::debug!(
                "{} caught up on {pending} positions in {:.2} ms",
                self.active.drafter.draft_with().name(),
                took.as_secs_f64() * 1e3
            );
        }
        let hidden =
            self.active.take_pending()?.ok_or_else(|| Error::Request("speculator used before start".into()))?;
        let last_token =
            *self.active.pending_tokens.last().ok_or_else(|| Error::Request("speculator used before start".into()))?;

        // Draft: the MTP head first catches up on the pending positions, then runs on its own
        // output; a block drafter takes them into its context and drafts the whole block at
        // once. A plain cycle (the controller's depth 0) leaves the drafter behind: the
        // positions wait for the next cycle that drafts.
        // `draft_steps`: positions of the drafter's cache the drafts add, rolled back after the
        // verify pass (the head's steps on its own drafts; the block).
        let drafter = self.active.drafter;
        let (mut rows, mut draft_steps) = match (drafter, depth) {
            (_, 0) => (DraftRows::None, 0),
            (Drafter::Mtp(head), _) => {
                let pending = &self.active.pending_tokens;
                let ids = Array::from_slice(pending, &[1, pending.len() as i32]);
                let x = head.forward(self.model, &hidden, &ids, &mut self.active.cache)?;
                (DraftRows::Mtp(head, x.index((.., -1.., ..))), 0)
            }
            (Drafter::Block(block), _) => {
                let logits = block.draft(self.model, Some(&hidden), last_token, depth, &mut self.active.cache)?;
                (DraftRows::Block(logits), block.spec.block_size as i32)
            }
        };
        let (mut drafts, mut draft_scaled) = (Vec::with_capacity(depth), Vec::with_capacity(depth));
        let mut draft_window = self.penalties.as_ref().map(|(p, recent)| Recent::new(*p, recent));
        // A block's drafts, when no processor, penalty or grammar changes a row: the argmax of
        // all rows at once, one operation for the block where each draft took four.
        let block_row = match (&rows, processors.is_empty() && draft_window.is_none() && constraint.is_none()) {
            (DraftRows::Block(all), true) => {
                Some(ops::indexing::argmax_axis(logits::only_row(all)?, -1, None)?.as_dtype(Dtype::Uint32)?)
            }
            _ => None,
        };
        // The grammar's masks: before the first draft, then after each kept draft.
        let mut masks = Vec::new();
        if let Some(c) = constraint.as_deref_mut() {
            masks.push(GrammarMask(
                c.mask().map_err(|e| Error::Request(format!("a speculative cycle after the grammar ended: {e:?}")))?,
            ));
        }
        let one_by_one = if block_row.is_some() { 0 } else { depth };
        for i in 0..one_by_one {
            let logits = match &rows {
                DraftRows::Mtp(head, g) => logits::last_position(&head.logits(self.model, g)?)?,
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
                *g = head.forward(self.model, g, &token.reshape(&[1, 1])?, &mut self.active.cache)?;
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
        // The drafts as one row [d] (none when nothing was drafted).
        let draft_row = match block_row {
            Some(row) => Some(row),
            None if drafts.is_empty() => None,
            None => {
                let each = drafts.iter().map(|t| t.reshape(&[1])).collect::<std::result::Result<Vec<_>, _>>()?;
                Some(ops::concatenate(&each, 0)?)
            }
        };
        let d = draft_row.as_ref().map_or(0, |row| row.dim(0) as usize);
        // Without a grammar, penalties or a script nothing on the host needs the drafts before
        // the verify pass: they feed it on the device, the drafter computes while the host
        // builds the verify pass, and one wait reads the drafts and the verdict together.
        let on_device = constraint.is_none() && self.penalties.is_none() && self.draft_script.is_none();
        let mut draft_ids: Vec<u32> = Vec::with_capacity(d);
        let input = if on_device {
            crate::distributed::schedule(self.model.is_split(), draft_row.iter().chain(draft_scaled.iter()))?;
            let ids: Vec<Array> =
                std::iter::once(Array::from_slice(&[last_token], &[1])).chain(draft_row.clone()).collect();
            ops::concatenate(&ids, 0)?.reshape(&[1, d as i32 + 1])?
        } else {
            eval(draft_row.iter().chain(draft_scaled.iter()))?;
            draft_ids = read_ids(draft_row.as_ref())?;
            // A block's drafts are point masses under sampling too: a script may replace them.
            let scripted = sampler.is_greedy() || matches!(drafter, Drafter::Block(_));
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
        let logits = logits::only_row(&self.model.logits(&h)?)?;
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
            eval(draft_row.iter().chain([&target, &h]))?;
            if on_device {
                draft_ids = read_ids(draft_row.as_ref())?;
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
            eval(q.iter().chain(&draft_row).chain([&p, &h]))?;
            if on_device {
                draft_ids = read_ids(draft_row.as_ref())?;
            }
            // A block's drafts carry no distribution of their own: point masses.
            let q = matches!(drafter, Drafter::Mtp(_)).then_some(&q[..]);
            rejection::sample(&mut self.rng, &draft_ids, &p, q)?
        };
        let now = Instant::now();

        // Keep the accepted prefix: the trunk drops the rejected drafts, the head the
        // positions it drafted on its own hidden states.
        cache.rollback((d - accepted) as i32)?;
        self.active.cache.rollback(draft_steps)?;
        if let Some(c) = constraint {
            c.rollback(d - accepted)?;
            c.accept(next)?;
        }
        let mut committed = draft_ids[..accepted].to_vec();
        committed.push(next);
        let (mine, standby_part) = self.split(&features.index((.., ..accepted as i32 + 1, ..)));
        if depth > 0 {
            self.active.replace(mine, committed.clone());
        } else {
            // Nothing drafted: what was pending still is.
            self.active.push(hidden, &[]);
            self.active.push(mine, &committed);
        }
        self.tell_standby(standby_part, &committed)?;
        self.remember(&committed);
        self.timed_cycle(d, committed.len(), now - started);
        self.account(d, accepted, committed.len(), verified_at - started, now - verified_at);
        Ok(committed)
    }
}
