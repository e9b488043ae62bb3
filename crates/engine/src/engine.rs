//! The engine: a loaded model with its tokenizer, profile, prompt cache and speculation
//! settings, and how it is loaded (whole, or a rank's part of a split model).

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use mlx_rs::Array;

use crate::depth_control::going_on::AcceptanceMemory;
use crate::depth_control::CostModel;
use crate::device::{self, Backend};
use crate::distributed::Group;
use crate::error::{Error, Result};
use crate::grammar::{Constraint, Grammar, Grammars, Thinking};
use crate::models::{self, BlockDrafter, LanguageModel};
use crate::options::EngineOptions;
use crate::profile::Profile;
use crate::prompt_cache::{CacheStats, PromptCache};
use crate::request::GenerateRequest;
use crate::speculation::DraftWith;
use crate::speculative::SpecStats;
use crate::tokenizer::Tokenizer;
use crate::weight_form::WeightChoice;

/// A loaded model with its tokenizer. Read through its accessors: what it holds is fixed at
/// load, but for the prefill chunk (tests shorten it).
pub struct Engine {
    pub(crate) model: Box<dyn LanguageModel>,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) dir: PathBuf,
    pub(crate) backend: Backend,
    /// The form its quantized matrices were loaded in, and why.
    pub(crate) weight_form: WeightChoice,
    pub(crate) prefill_chunk: usize,
    /// See [`Engine::prefill_interleave`].
    pub(crate) prefill_interleave: usize,
    /// The runtime profile this engine was loaded with (its prefill chunk is `prefill_chunk`).
    pub(crate) profile: Profile,
    /// Speculative-decoding figures summed over every request this engine served.
    pub(crate) spec_totals: std::sync::Mutex<SpecStats>,
    /// The state after recent prompts, for requests that start the same way.
    pub(crate) prompt_cache: std::sync::Mutex<PromptCache>,
    /// What one more token of context takes in the KV caches ([`crate::memory::kv_bytes_per_token`]).
    pub(crate) kv_bytes_per_token: u64,
    /// Constraint makers for this vocabulary, built by the first request with a grammar.
    pub(crate) grammars: std::sync::OnceLock<std::result::Result<Grammars, String>>,
    /// When set, a speculating request's depth follows its acceptance under this cost model
    /// ([`Engine::set_depth_control`]).
    pub(crate) depth_costs: Option<CostModel>,
    /// Where each drafter's last controlled request ended and how its drafts went on: where
    /// the next request's depth control starts ([`crate::depth_control::going_on`]).
    pub(crate) acceptance_memory: std::sync::Mutex<AcceptanceMemory>,
    /// The distributed group this engine's model is split across, if it is.
    pub(crate) group: Option<Arc<Group>>,
    /// A block drafter loaded beside the model ([`EngineOptions::drafter`]): speculating
    /// requests draft with it instead of the MTP head.
    pub(crate) drafter: Option<BlockDrafter>,
    /// Rank 0 told the other ranks it is done ([`Engine::dismiss_followers`]).
    pub(crate) dismissed: AtomicBool,
    /// The vision tower and image processor of a model that sees (whole models only).
    pub(crate) vision: Option<crate::vision::Vision>,
}

impl Engine {
    /// The distributed group the model is split across (`None`: whole in this process).
    pub fn group(&self) -> Option<&Group> {
        self.group.as_deref()
    }

    /// Runs a whole request and returns its text and summary.
    pub fn generate_text(&self, request: GenerateRequest) -> Result<(String, crate::request::Summary)> {
        let mut text = String::new();
        for event in self.generate(request, crate::request::CancelToken::default())? {
            match event? {
                crate::request::Event::Text(t) => text.push_str(&t),
                crate::request::Event::Finished(summary) => return Ok((text, summary)),
            }
        }
        Err(Error::Request("generation ended without a summary".into()))
    }

    /// The prompt tokens `images` add beyond their one image token each (0 for a model that
    /// does not see, or an image it would refuse: the request says why when it starts).
    pub fn image_tokens(&self, images: &[Arc<image::RgbImage>]) -> usize {
        let Some(vision) = &self.vision else { return 0 };
        let size = |i: &image::RgbImage| vision.processor.tokens(i.height() as usize, i.width() as usize).unwrap_or(1);
        images.iter().map(|i| size(i).saturating_sub(1)).sum()
    }

    /// Whether the model sees: it takes images ([`GenerateRequest::images`]).
    pub fn sees(&self) -> bool {
        self.vision.is_some()
    }

    /// The vision tower, image processor and image markup of a model that sees.
    pub fn vision(&self) -> Option<&crate::vision::Vision> {
        self.vision.as_ref()
    }

    /// The model (its config, MTP head, forward passes).
    pub fn model(&self) -> &dyn LanguageModel {
        self.model.as_ref()
    }

    /// The block drafter loaded beside the model, if one is.
    pub fn drafter(&self) -> Option<&BlockDrafter> {
        self.drafter.as_ref()
    }

    /// Whether speculating requests have something to draft with (a block drafter or the
    /// model's MTP head).
    pub fn can_draft(&self) -> bool {
        self.drafter.is_some() || self.model.mtp().is_some()
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The tokenizer, to change (tests give a made checkpoint other end-of-sequence ids).
    pub fn tokenizer_mut(&mut self) -> &mut Tokenizer {
        &mut self.tokenizer
    }

    /// The folder it was loaded from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Where MLX runs it.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The form its quantized matrices were loaded in, and why.
    pub fn weight_form(&self) -> &WeightChoice {
        &self.weight_form
    }

    /// The runtime profile it was loaded with.
    pub fn profile(&self) -> &Profile {
        &self.profile
    }

    /// Prompt tokens per prefill pass (the profile's, unless changed).
    pub fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    /// Prompt tokens of a newcomer prefilled per step of a running batch: the profile's, a
    /// divisor of the prefill chunk (else the prefill chunk itself).
    pub fn prefill_interleave(&self) -> usize {
        match self.prefill_interleave {
            n if n > 0 && self.prefill_chunk.is_multiple_of(n) => n,
            _ => self.prefill_chunk.max(1),
        }
    }

    /// Prefill `tokens` prompt tokens of a newcomer per step of a running batch (benchmarks
    /// compare settings; see [`Engine::prefill_interleave`]).
    pub fn set_prefill_interleave(&mut self, tokens: usize) {
        self.prefill_interleave = tokens;
    }

    /// Prefill `tokens` prompt tokens per pass (at least 1): tests make long prompts span
    /// several chunks with small models.
    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens.max(1);
    }

    /// Turns the runtime depth controller on (speculating requests then draft as deep as their
    /// acceptance pays for, from the requested depth up to one more, down to plain decoding) or
    /// off (the requested depth throughout). On measures what a draft step of the MTP head, a
    /// pass of the block drafter and each verify pass cost against a plain step on this model
    /// (a fraction of a second); a model with neither drafter has nothing to control.
    pub fn set_depth_control(&mut self, on: bool) -> Result<()> {
        self.depth_costs = None;
        // What earlier requests left was judged under the costs being replaced.
        self.acceptance_memory = Default::default();
        if on && self.group.is_some() {
            // Its decisions follow each rank's own timings: the ranks would part ways.
            return Err(Error::Request("the depth controller cannot run on a model split across ranks".into()));
        }
        if on && self.can_draft() {
            let prompt = synthetic_prompt(self.model.config().vocab_size.max(2) as u32, 32);
            let costs = crate::costs::measure_costs(self.model.as_ref(), self.drafter.as_ref(), &prompt, 5)?;
            tracing::info!("draft depth follows acceptance; costs against a plain step: {costs:?}");
            self.depth_costs = Some(CostModel::from(&costs));
        }
        Ok(())
    }

    /// Sets the depth controller's cost model directly (`None`: off), e.g. one measured before;
    /// the next request starts afresh, not where the last one ended.
    pub fn set_depth_costs(&mut self, costs: Option<CostModel>) {
        self.depth_costs = costs;
        self.acceptance_memory = Default::default();
    }

    /// The depth controller's cost model, when it is on.
    pub fn depth_costs(&self) -> Option<&CostModel> {
        self.depth_costs.as_ref()
    }

    /// The prompt cache's counters.
    pub fn prompt_cache_stats(&self) -> CacheStats {
        self.prompt_cache.lock().map(|c| c.stats()).unwrap_or_default()
    }

    /// A new, empty prompt cache of `bytes` (0 turns it off). Split across ranks, every rank
    /// must set the same budget (their caches must keep the same entries).
    pub fn set_prompt_cache_budget(&mut self, bytes: usize) {
        self.prompt_cache = std::sync::Mutex::new(PromptCache::new(bytes));
    }

    /// Gives the prompt cache a disk tier in `settings.dir` (shared by every model and process
    /// that uses the folder) of at most `settings.budget` bytes; 0 takes it away.
    pub fn set_prompt_disk(&self, settings: &crate::prompt_cache::DiskSettings) -> Result<()> {
        let (root, budget) = (&settings.dir, settings.budget);
        if budget > 0 && self.group.is_some() {
            // Each machine's folder holds its own blocks: the ranks' hits would differ.
            return Err(Error::Request("the prompt cache's disk tier is off on a model split across ranks".into()));
        }
        let tier = match budget {
            0 => None,
            _ => Some(
                crate::prompt_cache::DiskTier::open(settings, &self.identity()?, self.model.new_cache().layers.len())
                    .map_err(|e| Error::io(root, e))?,
            ),
        };
        if let Ok(mut c) = self.prompt_cache.lock() {
            c.set_disk(tier);
        }
        Ok(())
    }

    /// What makes this model's cached state this model's: its config, its weight files, the
    /// form they were loaded in and where it runs, and its block drafter's config and files
    /// (the drafter's cache is kept with the model's): a block written by another is never read.
    pub(crate) fn identity(&self) -> Result<Vec<u8>> {
        let mut id = folder_identity(&self.dir)?;
        id.extend(format!("\n{}\n{}", self.weight_form, self.backend).bytes());
        if let Some(drafter) = &self.drafter {
            id.extend(b"\ndrafter\n");
            id.extend(folder_identity(&drafter.dir)?);
        }
        Ok(id)
    }

    /// Waits until the prompt cache's disk tier has written every block it was given (tests,
    /// and anything that reads the folder right after a request).
    pub fn wait_for_prompt_disk(&self) {
        if let Ok(c) = self.prompt_cache.lock() {
            c.flush_disk();
        }
    }

    /// Empties the prompt cache (its counters stay); on every rank of a split model.
    pub fn clear_prompt_cache(&self) {
        if let Err(e) = self.tell_followers_clear() {
            tracing::error!("the other ranks could not be told to clear their prompt caches: {e}");
        }
        if let Ok(mut c) = self.prompt_cache.lock() {
            c.clear();
        }
    }

    /// The constraint for `grammar`, on this model's vocabulary, holding what follows the think
    /// block the answer to `prompt` may have.
    pub(crate) fn constraint(&self, grammar: &Grammar, prompt: &[u32]) -> Result<Constraint> {
        let grammars = self.grammars.get_or_init(|| {
            let vocab = self.model.config().vocab_size as usize;
            Grammars::load(&self.dir, &self.tokenizer.eos_ids, vocab).map_err(|e| e.to_string())
        });
        match grammars {
            Ok(g) => g.constraint(grammar, self.thinking_after(prompt)),
            Err(e) => Err(Error::Request(e.clone())),
        }
    }

    /// Where the answer to `prompt` starts with respect to a think block: inside one the
    /// template opened (the prompt ends with `<think>` and a newline), after one it closed
    /// (thinking turned off: `<think>\n\n</think>\n\n`), or free to open one.
    pub(crate) fn thinking_after(&self, prompt: &[u32]) -> Thinking {
        let tag = |t: &str| self.tokenizer.token_to_id(t);
        let tail = &prompt[prompt.len().saturating_sub(4)..];
        let last = |id: Option<u32>| id.and_then(|id| tail.iter().rposition(|&t| t == id));
        let rest_blank = |at: usize| self.tokenizer.decode(&tail[at + 1..]).is_ok_and(|rest| rest.trim().is_empty());
        match (last(tag("<think>")), last(tag("</think>"))) {
            (_, Some(close)) if rest_blank(close) => Thinking::Closed,
            (Some(open), None) if rest_blank(open) => Thinking::Open,
            _ => Thinking::MayOpen,
        }
    }

    /// Bytes one more token of context takes in the KV caches.
    pub fn kv_bytes_per_token(&self) -> u64 {
        self.kv_bytes_per_token
    }

    /// Speculative-decoding figures summed over every request this engine served.
    pub fn spec_totals(&self) -> SpecStats {
        self.spec_totals.lock().map(|t| t.clone()).unwrap_or_default()
    }

    /// Loads with the default options (the Sustained profile, no overrides, whole).
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_with(dir, &EngineOptions::default())
    }

    /// Loads as `options` say: their profile's memory settings applied and its warm-up run,
    /// the benchmarks' overrides taken, split across their group (every rank of it must load
    /// the same model and then run the same requests in the same order, since each layer sums
    /// across them).
    pub fn load_with(dir: &Path, options: &EngineOptions) -> Result<Self> {
        let profile = options.profile.clone();
        let backend = device::backend();
        let group = options.group.clone().filter(|g| g.size() > 1);
        let (model, weight_form) = models::load_with(dir, options)?;
        let mut tokenizer = Tokenizer::load(dir)?;
        let drafter = match &options.drafter {
            // The other ranks follow rank 0's requests with their own speculator: without
            // the drafter their passes would part from rank 0's.
            Some(_) if group.is_some() => {
                return Err(Error::Request(
                    "a block drafter cannot run on a model split across ranks yet: draft with the MTP head".into(),
                ))
            }
            Some(path) => {
                let compute = model.embed(&Array::from_slice(&[0u32], &[1, 1]))?.dtype();
                let drafter = BlockDrafter::load(path, model.config(), weight_form.form.dequantize_to(), compute)?;
                tracing::info!(
                    "block drafter {} loaded: blocks of {}, reading layers {:?}",
                    path.display(),
                    drafter.spec.block_size,
                    drafter.spec.target_layers
                );
                Some(drafter)
            }
            None => None,
        };
        tracing::info!(
            "loaded {} from {} on {backend} ({} profile)",
            model.config().model_type,
            dir.display(),
            profile.name
        );
        if backend == Backend::Cpu {
            tracing::info!("CPU matmuls run on {}", crate::blas::describe());
            if let Some((run, shared)) = crate::kernel_cache::folders() {
                let shared =
                    shared.map_or("none: the folder is not this user's own".into(), |s| s.display().to_string());
                tracing::debug!("MLX compiles CPU kernels in {} (shared: {shared})", run.display());
            }
        }
        if model.config().is_hybrid() {
            crate::layers::delta_check::choose(None);
            // The layers see the embeddings' dtype: the kernels are checked on it.
            let dtype = model.embed(&Array::from_slice(&[0u32], &[1, 1]))?.dtype();
            let head = model.mtp().map(|m| m.layers.as_slice()).unwrap_or_default();
            crate::layers::delta_check::check_model(model.layers().iter().chain(head), dtype);
        }
        if model.config().quant.is_some() {
            crate::layers::matmul_path::choose(None);
        }
        profile.apply_memory_settings(crate::weights::weight_bytes(dir)? as usize);
        // Split, each rank holds its share of the key/value heads.
        let ranks = group.as_ref().map_or(1, |g| g.size() as u64);
        let drafter_kv = drafter.as_ref().map(|d| d.kv_bytes_per_token(model.as_ref())).transpose()?.unwrap_or(0);
        let kv_bytes_per_token = crate::memory::kv_bytes_per_token(model.as_ref())? / ranks + drafter_kv;
        let vision = match group {
            None => crate::vision::Vision::load(dir, model.config().vocab_size as usize)?,
            Some(_) => None,
        };
        if let Some(vision) = &vision {
            tokenizer.set_image_tokens(&vision.markup)?;
        }
        let engine = Engine {
            model,
            tokenizer,
            dir: dir.to_path_buf(),
            backend,
            weight_form,
            prefill_chunk: profile.prefill_chunk,
            prefill_interleave: profile.prefill_interleave,
            prompt_cache: std::sync::Mutex::new(PromptCache::new(prompt_cache_bytes(
                &profile,
                options.prompt_cache_mb,
                group.as_deref(),
            )?)),
            profile,
            spec_totals: Default::default(),
            kv_bytes_per_token,
            grammars: Default::default(),
            depth_costs: None,
            acceptance_memory: Default::default(),
            group,
            dismissed: AtomicBool::new(false),
            drafter,
            vision,
        };
        // The other ranks of a split model warm up as they follow rank 0's warm-up.
        if engine.profile.warmup && engine.leads() {
            engine.warm_up()?;
        }
        Ok(engine)
    }

    /// Short generations down each path a request may take ([`warm_up_requests`]), so that
    /// kernels are compiled before the first real request.
    fn warm_up(&self) -> Result<()> {
        let started = Instant::now();
        let vocab = self.model.config().vocab_size.max(2) as u32;
        let block_drafts = self.drafter.as_ref().map(BlockDrafter::max_drafts);
        for request in warm_up_requests(synthetic_prompt(vocab, 16), self.model.mtp().is_some(), block_drafts) {
            self.generate_text(request)?;
        }
        if let Ok(mut totals) = self.spec_totals.lock() {
            *totals = SpecStats::default();
        }
        self.clear_prompt_cache();
        crate::kernel_cache::publish();
        tracing::info!("warm-up took {:.2} s", started.elapsed().as_secs_f64());
        Ok(())
    }

    /// Called once a request is over (its client has the answer): the prompt cache's new entry
    /// goes to its disk tier, and at long context the Sustained profile hands MLX's buffer
    /// cache back to the system.
    pub fn after_request(&self, context_tokens: usize) {
        crate::kernel_cache::publish();
        // The request has answered: its prompt's state goes to disk now.
        if let Ok(mut c) = self.prompt_cache.lock() {
            c.persist();
        }
        if self.profile.trim_cache_after_tokens.is_some_and(|limit| context_tokens >= limit) {
            let _ = mlx_rs::memory::clear_cache();
        }
    }
}

/// A warm-up's generations: plain decoding, then a short speculation with each drafter there
/// is — the MTP head (`mtp`) at depth 2, a block drafter drafting up to `block_drafts` at up to
/// 2. A drafter's first cycles otherwise compile its kernels inside the first request that
/// drafts with it (on a fresh GPU machine, seconds).
fn warm_up_requests(prompt: Vec<u32>, mtp: bool, block_drafts: Option<usize>) -> Vec<GenerateRequest> {
    let mut plain = GenerateRequest::greedy(prompt, 4);
    plain.ignore_eos = true;
    let drafting =
        |with: DraftWith, depth: usize| GenerateRequest { draft_depth: depth, draft_with: with, ..plain.clone() };
    let mut requests = vec![plain.clone()];
    if mtp {
        requests.push(drafting(DraftWith::Mtp, 2));
    }
    if let Some(most) = block_drafts.filter(|&most| most > 0) {
        requests.push(drafting(DraftWith::Block, most.min(2)));
    }
    requests
}

/// `n` token ids spread over a vocabulary of `vocab` ids: a prompt for warm-ups and probes.
pub(crate) fn synthetic_prompt(vocab: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919 + 1) % vocab.max(1)).collect()
}

/// The prompt cache's budget under `profile` (`mb`, when given, instead); split across ranks,
/// the smallest rank's, so that every rank keeps and drops the same entries.
fn prompt_cache_bytes(profile: &Profile, mb: Option<usize>, group: Option<&Group>) -> Result<usize> {
    let mine = mb.map_or_else(|| profile.prompt_cache_bytes(device::total_memory()), |mb| mb << 20);
    let Some(group) = group else { return Ok(mine) };
    let all = group.all_gather(&Array::from_slice(&[mine as u64 as i64], &[1]))?;
    group.eval([&all])?;
    Ok(all.as_slice::<i64>().iter().copied().min().unwrap_or(0).max(0) as usize)
}

/// A checkpoint folder's config.json and its weight files' names and sizes.
fn folder_identity(dir: &Path) -> Result<Vec<u8>> {
    let config = dir.join("config.json");
    let mut id = std::fs::read(&config).map_err(|e| Error::io(&config, e))?;
    for file in crate::weights::weight_files(dir)? {
        let size = std::fs::metadata(&file).map_err(|e| Error::io(&file, e))?.len();
        id.extend(format!("\n{}:{size}", file.file_name().unwrap_or_default().to_string_lossy()).bytes());
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A warm-up drafts with every drafter the model has, not only the MTP head: a model with
    /// a block drafter and no head warms the drafter, one with both warms both.
    #[test]
    fn the_warm_up_drafts_with_each_drafter_there_is() {
        let paths = |mtp, block| -> Vec<(usize, DraftWith)> {
            warm_up_requests(vec![1, 2, 3], mtp, block).iter().map(|r| (r.draft_depth, r.draft_with)).collect()
        };
        assert_eq!(paths(false, None), [(0, DraftWith::Mtp)]);
        assert_eq!(paths(true, None), [(0, DraftWith::Mtp), (2, DraftWith::Mtp)]);
        assert_eq!(paths(false, Some(7)), [(0, DraftWith::Mtp), (2, DraftWith::Block)]);
        assert_eq!(paths(true, Some(1)), [(0, DraftWith::Mtp), (2, DraftWith::Mtp), (1, DraftWith::Block)]);
        assert_eq!(paths(false, Some(0)), [(0, DraftWith::Mtp)], "a drafter that drafts nothing is not run");
        assert!(warm_up_requests(vec![1], true, Some(7)).iter().all(|r| r.ignore_eos && r.max_tokens == 4));
    }
}
