//! What a caller asks of the engine and hears back: the request, the events of its answer
//! (text deltas, then one summary with finish reason, usage and timings), and the token that
//! cancels it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::grammar::Grammar;
use crate::sampling::SamplingParams;
use crate::speculation::{DraftWith, Speculation};
use crate::speculative::SpecStats;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends before the first occurrence of any of these strings.
    pub stop: Vec<String>,
    /// Keep going past end-of-sequence tokens (benchmarks need a fixed length).
    pub ignore_eos: bool,
    /// Tokens drafted per cycle (0 = plain decoding; at most 4 with the MTP head, a block's
    /// drafts with a block drafter).
    pub draft_depth: usize,
    /// What drafts: the model's MTP head, or the block drafter loaded beside it.
    #[serde(default)]
    pub draft_with: DraftWith,
    /// Keep `draft_depth` for every cycle even where the engine's depth controller is on (the
    /// tuner measures each depth as it is).
    pub fixed_depth: bool,
    /// Tests only: drafts taken from this script (see `Speculator::draft_script`).
    #[doc(hidden)]
    pub draft_script: Option<Vec<u32>>,
    /// Tests only: the answer is these tokens, then end-of-sequence, enforced on the logits
    /// (see `forced.rs`). Sampled: decoded plainly; greedy: with speculation where asked, the
    /// verify pass taking the answer's tokens and the drafts the head's own (benchmarks
    /// measure acceptance on a fixed text this way).
    #[doc(hidden)]
    pub forced_tokens: Option<Vec<u32>>,
    /// What the answer must match, enforced on the logits (speculation stays on: drafts and
    /// verified positions are masked alike).
    pub grammar: Option<Grammar>,
    /// The prompt's images, one per image token in `prompt` (in order), for a model that
    /// sees ([`crate::vision`]); the prompt cache knows them by their content. The ranks of a
    /// split model are not sent images.
    #[serde(skip)]
    pub images: Vec<std::sync::Arc<image::RgbImage>>,
    /// Prompt tokens per prefill pass for this request, below the profile's (`None`: the
    /// profile's). The tuner prefills in small passes so that a fresh CUDA machine compiles
    /// one of MLX's quantized-matmul tiles instead of three (`tune::PREFILL_ROWS`).
    #[serde(default)]
    pub prefill_chunk: Option<usize>,
}

impl GenerateRequest {
    pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> Self {
        GenerateRequest {
            prompt,
            max_tokens,
            sampling: SamplingParams::greedy(),
            stop: vec![],
            ignore_eos: false,
            draft_depth: 0,
            draft_with: DraftWith::Mtp,
            fixed_depth: false,
            draft_script: None,
            forced_tokens: None,
            grammar: None,
            images: Vec::new(),
            prefill_chunk: None,
        }
    }
}

impl GenerateRequest {
    /// Speculates as `choice` says (depth 0: plain decoding).
    pub fn speculate(&mut self, choice: Speculation) {
        (self.draft_with, self.draft_depth) = (choice.drafter, choice.depth);
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    Cancelled,
    /// The request's grammar allowed no token of the vocabulary next.
    GrammarDeadEnd,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose state came from the prompt cache (not prefilled again).
    pub cached_tokens: usize,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Timings {
    /// Request start to the first generated token.
    pub ttft: Duration,
    pub prompt_tps: f64,
    /// Tokens after the first, over the time since the first.
    pub decode_tps: f64,
    pub total: Duration,
    /// MLX peak memory during the request.
    pub peak_memory_bytes: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub finish_reason: FinishReason,
    pub usage: Usage,
    pub timings: Timings,
    /// Present when the request decoded speculatively.
    pub speculative: Option<SpecStats>,
    /// The stop string that ended the text, if one did.
    pub stop_string: Option<String>,
}

#[derive(Debug, Clone)]
pub enum Event {
    Text(String),
    Finished(Summary),
}

/// Shared flag that stops a generation at its next token.
#[derive(Debug, Clone, Default)]
pub struct CancelToken(Arc<AtomicBool>);

impl CancelToken {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
    pub fn is_cancelled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
    /// Whether `other` is this token (a clone of it), not just in the same state.
    pub fn same_as(&self, other: &CancelToken) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
