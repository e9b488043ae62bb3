//! Facts about the loaded model that the handlers read without asking the engine thread.

use std::path::PathBuf;

use engine::{Engine, Profile};

use crate::tool_choice::CallSyntax;

/// Facts about the loaded model that handlers need without asking the worker thread.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub id: String,
    pub dir: PathBuf,
    pub model_type: String,
    pub context: usize,
    /// Token ids run from 0 to this (excluded): what a request's `logit_bias` may name.
    pub vocab_size: usize,
    pub backend: String,
    /// The MLX library's version.
    pub mlx_version: String,
    /// Which implementation runs the hybrids' gated delta rule, and why (`None`: the model has
    /// no Gated DeltaNet layer).
    pub delta_rule: Option<(String, String)>,
    /// The BLAS library the CPU's matmuls run on.
    pub blas: String,
    /// How the quantized weights were loaded, and why (e.g. dequantized on the CPU).
    pub weight_form: String,
    pub has_mtp: bool,
    /// Whether the model sees (a vision tower loaded beside it): requests may carry images.
    pub sees: bool,
    /// The block drafter loaded beside the model, if one is.
    pub drafter: Option<DrafterInfo>,
    pub profile: Profile,
    /// The server's cap on tokens generated per request (`--max-output-tokens`), if any.
    pub max_output_tokens: Option<usize>,
    /// The most memory the model and its caches may take (`--max-memory-gb`, or the
    /// machine's memory): a request whose KV cache would not fit what is left is refused or
    /// its answer shortened.
    pub memory_budget: u64,
    /// What one more token of context takes in the KV caches.
    pub kv_bytes_per_token: u64,
    /// How the model writes a tool call (what a forced call's grammar spells).
    pub call_syntax: CallSyntax,
    /// Split across ranks: each rank's host and the collectives' backend.
    pub split: Option<(Vec<String>, String)>,
}

/// The facts `ModelInfo` takes from the worker's options rather than the model.
pub(crate) struct Facts {
    pub id: String,
    pub max_output_tokens: Option<usize>,
    pub memory_budget: Option<u64>,
    /// A split model's hosts and collectives' backend.
    pub split: Option<(Vec<String>, String)>,
}

/// A block drafter as `/v1/status` shows it.
#[derive(Debug, Clone, serde::Serialize)]
pub struct DrafterInfo {
    pub dir: PathBuf,
    /// Tokens a block holds (the anchor and its drafts).
    pub block_size: usize,
    /// The model's layers it reads.
    pub target_layers: Vec<usize>,
}

impl ModelInfo {
    /// The facts of the model `engine` loaded from `dir` under `profile`, with those the
    /// worker's options give.
    pub(crate) fn of(engine: &Engine, facts: Facts, dir: PathBuf, profile: Profile) -> ModelInfo {
        let c = engine.model().config();
        ModelInfo {
            id: facts.id,
            dir,
            model_type: c.model_type.clone(),
            context: c.max_position_embeddings.unwrap_or(32768).max(1) as usize,
            vocab_size: c.vocab_size.max(0) as usize,
            backend: engine.backend().to_string(),
            mlx_version: engine::device::mlx_version(),
            delta_rule: c
                .is_hybrid()
                .then(engine::delta_path::report)
                .flatten()
                .map(|r| (r.path.to_string(), engine::delta_path::describe(r))),
            blas: engine::blas::describe(),
            weight_form: engine.weight_form().to_string(),
            has_mtp: engine.model().mtp().is_some(),
            sees: engine.sees(),
            drafter: engine.drafter().map(|d| DrafterInfo {
                dir: d.dir.clone(),
                block_size: d.spec.block_size,
                target_layers: d.spec.target_layers.clone(),
            }),
            profile,
            max_output_tokens: facts.max_output_tokens,
            memory_budget: facts.memory_budget.unwrap_or_else(engine::device::total_memory),
            kv_bytes_per_token: engine.kv_bytes_per_token(),
            call_syntax: CallSyntax::of(engine.tokenizer()),
            split: facts.split,
        }
    }
}
