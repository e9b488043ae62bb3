//! Model architectures, one file each, and the decoder trunk they share.

pub mod dflash;
pub mod hybrid;
mod language_model;
pub mod mtp;
pub mod qwen3;
pub mod qwen3_5;
pub mod qwen3_5_vision;
pub mod qwen3_moe;
pub mod qwen3_next;
pub mod transformer;

use std::path::Path;

use crate::architecture::Architecture;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::layers::parallel::Shard;
use crate::layers::switch::LongPromptGather;
use crate::layers::{Joins, Loader};
use crate::options::EngineOptions;
use crate::weight_form::{self, WeightChoice};
use crate::weights::Weights;

pub use language_model::LanguageModel;
pub use transformer::Transformer;

pub use dflash::BlockDrafter;
pub use mtp::MtpHead;

/// The projections this model joins at load: its own choice, or the options' (a probe for
/// benchmarks, see `bench/README.md`).
fn joins_for(config: &ModelConfig, wanted: Option<Joins>) -> Joins {
    wanted.unwrap_or_else(|| Joins::for_model(config.is_hybrid() || config.num_experts > 0))
}

/// Loads the model in `dir` (config.json + safetensors), dispatching on `model_type` (the
/// tests' shorthand; the engine loads through [`load_with`]).
#[cfg(feature = "dev")]
pub fn load(dir: &Path) -> Result<Box<dyn LanguageModel>> {
    load_with(dir, &EngineOptions::default()).map(|(model, _)| model)
}

/// Weights larger than the machine's memory cannot run here: refused before anything is
/// mapped or allocated (`total_memory` 0: unknown, not checked).
/// Split across `ranks`, each holds about its share.
fn check_fits_memory(dir: &Path, total_memory: u64, ranks: u64) -> Result<()> {
    let bytes = crate::weights::weight_bytes(dir)? / ranks.max(1);
    if total_memory > 0 && bytes > total_memory {
        let gb = |b: u64| b as f64 / 1e9;
        return Err(crate::error::Error::malformed(
            dir,
            format!(
                "its weights are {:.1} GB{}, more than this machine's {:.1} GB of memory: it cannot run here",
                gb(bytes),
                if ranks > 1 { format!(" for each of {ranks} ranks") } else { String::new() },
                gb(total_memory)
            ),
        ));
    }
    Ok(())
}

/// Loads the model in `dir` as `options` say — the weight form this backend and machine call
/// for, or the one they name ([`crate::weight_form`]); split across their group, each rank
/// its part — and says which form it is.
pub fn load_with(dir: &Path, options: &EngineOptions) -> Result<(Box<dyn LanguageModel>, WeightChoice)> {
    let shard = options.group.clone().filter(|g| g.size() > 1).map(Shard::new);
    load_split(dir, options, shard)
}

/// As [`load_with`], holding only `shard`'s part of each layer when given (tensor
/// parallelism across a distributed group: [`crate::layers::parallel`]).
fn load_split(
    dir: &Path,
    options: &EngineOptions,
    shard: Option<Shard>,
) -> Result<(Box<dyn LanguageModel>, WeightChoice)> {
    let mut config = ModelConfig::load(dir)?;
    let ranks = shard.as_ref().map_or(1, |s| s.size() as u64);
    check_fits_memory(dir, crate::device::total_memory(), ranks)?;
    let mut weights = Weights::load(dir)?;
    if config.is_hybrid() {
        hybrid::normalize_layout(&mut weights, config.quant.as_mut())?;
    }
    if !config.is_hybrid() {
        let dropped = weights.drop_prefix("mtp.");
        if dropped > 0 {
            tracing::info!(
                "{}: ignoring {dropped} mtp.* tensors (no MTP head for {})",
                dir.display(),
                config.model_type
            );
        }
    }
    let weight_choice = weight_form::choose(&weights, &config, options.weights);
    tracing::info!("{}: weights {weight_choice}", dir.display());
    let model = {
        let mut loader = Loader {
            weights: &mut weights,
            quant: config.quant.as_ref(),
            config_path: config.path.clone(),
            joins: joins_for(&config, options.joins),
            long_prompt_gather: options.long_experts.map(LongPromptGather::kept).unwrap_or_default(),
            dequantize: weight_choice.form.dequantize_to(),
            shard,
        };
        match config.architecture {
            Architecture::Qwen3 => qwen3::build(&config, &mut loader)?,
            Architecture::Qwen3Moe => qwen3_moe::build(&config, &mut loader)?,
            Architecture::Qwen3Next => qwen3_next::build(&config, &mut loader)?,
            Architecture::Qwen35 | Architecture::Qwen35Moe => qwen3_5::build(&config, &mut loader)?,
        }
    };
    weights.finish()?;
    Ok((Box::new(model), weight_choice))
}
