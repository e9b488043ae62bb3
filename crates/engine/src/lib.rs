//! Ferrite's inference engine: MLX-format checkpoints of the Qwen3 family run through
//! mlx-rs, with caches, sampling and a streaming generation API. It knows nothing of HTTP.

mod architecture;
pub mod batch;
// Public for the engine's own tests (the `dev` feature), private to the server and the app.
#[cfg(feature = "dev")]
pub mod batch_cache;
#[cfg(not(feature = "dev"))]
mod batch_cache;
pub mod batch_rule;
pub mod blas;
// Public for the engine's own tests (the `dev` feature), private to the server and the app.
#[cfg(feature = "dev")]
pub mod cache;
#[cfg(not(feature = "dev"))]
mod cache;
#[cfg(feature = "dev")]
pub mod checkpoint;
mod config;
pub mod costs;
// Public for the engine's own tests (the `dev` feature), private to the server and the app.
#[cfg(feature = "dev")]
pub mod depth_control;
#[cfg(not(feature = "dev"))]
mod depth_control;
pub mod device;
pub mod distributed;
mod engine;
mod error;
mod ffi;
mod forced;
pub mod generate;
mod grammar;
mod grammar_limits;
#[cfg(feature = "dev")]
pub mod graph;
pub mod inspect;
pub mod kernel_cache;
mod laps;
mod layers;
mod lockstep;
mod logits;
pub mod memory;
// Public for the engine's own tests (the `dev` feature), private to the server and the app.
#[cfg(feature = "dev")]
pub mod models;
#[cfg(not(feature = "dev"))]
mod models;
mod options;
mod paired;
pub mod penalties;
#[cfg(feature = "dev")]
pub mod perplexity;
mod profile;
pub mod prompt_cache;
mod request;
mod sampling;
mod small_file;
mod speculation;
pub mod speculative;
mod stop;
pub mod tokenizer;
pub mod tune;
pub mod vision;
pub mod weight_form;
mod weights;
pub mod workload;

pub use architecture::Architecture;
pub use config::{ModelConfig, Quantization};
pub use engine::Engine;
pub use error::{Error, Result};
pub use grammar::{json_for_grammar, Grammar};
pub use grammar_limits::{check_schema, check_text_grammar};
pub use options::EngineOptions;
pub use request::{CancelToken, Event, FinishReason, GenerateRequest, Summary};
pub use speculation::{DraftWith, Speculation};
/// Which implementation runs the hybrids' gated delta rule, and its self-check.
pub mod delta_path {
    pub use crate::layers::delta_check::{check_model, choose, self_check, Tolerance};
    pub use crate::layers::delta_path::{
        current, describe, passed, report, verdicts, DeltaPath, DeltaReport, KernelUse,
    };
}
/// Which implementation runs quantized matmuls of a few rows, and its self-check.
pub mod matmul_path {
    pub use crate::layers::matmul_path::{choose, current, report, self_check, MatmulPath, MatmulReport};
}
pub use penalties::Penalties;
pub use profile::{Profile, ProfileName};
pub use sampling::SamplingParams;
