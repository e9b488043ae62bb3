//! Ferrite's inference engine: MLX-format checkpoints of the Qwen3 family run through
//! mlx-rs, with caches, sampling and a streaming generation API. It knows nothing of HTTP.

pub mod blas;
pub mod cache;
pub mod checkpoint;
pub mod config;
pub mod device;
pub mod error;
mod ffi;
pub mod generate;
pub mod graph;
pub mod inspect;
mod laps;
pub mod layers;
pub mod models;
pub mod penalties;
pub mod profile;
pub mod sampling;
pub mod speculative;
pub mod tokenizer;
pub mod tune;
pub mod weight_form;
pub mod weights;

pub use error::{Error, Result};
pub use generate::{CancelToken, Engine, Event, FinishReason, GenerateRequest, Summary};
pub use penalties::Penalties;
pub use profile::{Profile, ProfileName};
pub use sampling::SamplingParams;
