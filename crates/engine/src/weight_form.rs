//! The form a model's quantized matrices take in memory. MLX's CPU backend multiplies
//! quantized weights with kernels of its own that do not use BLAS, and they run an order of
//! magnitude below BLAS on the same matrices dequantized, at decode as well as at prefill
//! (bench/results/cpu.md). So on the CPU backend a model whose dequantized weights fit a
//! memory budget is dequantized once, at load, to f32 (BLAS has no bf16 product; MLX's own
//! bf16 one is as slow as the quantized kernels). GPUs keep the checkpoint's form.

use std::fmt;

use mlx_rs::Dtype;

use crate::config::Quantization;
use crate::weights::Weights;

/// How quantized matrices are held.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightForm {
    /// As the checkpoint stores them (also every model with no quantized matrix).
    AsStored,
    /// Dequantized at load to this dtype.
    Dequantized(Dtype),
}

impl WeightForm {
    /// The dtype quantized matrices become at load, if any.
    pub fn dequantize_to(self) -> Option<Dtype> {
        match self {
            WeightForm::AsStored => None,
            WeightForm::Dequantized(dtype) => Some(dtype),
        }
    }
}

/// What a model loads as, and why (logged at load, shown by `/v1/status` and the CLI).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightChoice {
    pub form: WeightForm,
    pub why: String,
}

impl fmt::Display for WeightChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.form {
            WeightForm::AsStored => write!(f, "as stored ({})", self.why),
            WeightForm::Dequantized(dtype) => write!(f, "dequantized to {} at load ({})", dtype_name(dtype), self.why),
        }
    }
}

/// A benchmark's override of the rule (`FERRITE_CPU_WEIGHTS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Override {
    #[default]
    Auto,
    Quantized,
    Dequantized(Dtype),
}

impl Override {
    /// `auto` (or empty), `quantized`, `f32` or `bf16`.
    pub fn parse(text: &str) -> Result<Override, String> {
        match text.trim() {
            "" | "auto" => Ok(Override::Auto),
            "quantized" => Ok(Override::Quantized),
            "f32" => Ok(Override::Dequantized(Dtype::Float32)),
            "bf16" => Ok(Override::Dequantized(Dtype::Bfloat16)),
            other => Err(format!("unknown weight form `{other}` (expected auto, quantized, f32 or bf16)")),
        }
    }
}

/// The rule's inputs, gathered so that the rule itself is a plain function.
#[derive(Debug, Clone, Copy)]
pub struct Facts {
    /// Bytes the quantized matrices take as stored (weights, scales, biases).
    pub quantized_bytes: u64,
    /// Bytes the same matrices take dequantized to f32.
    pub f32_bytes: u64,
    pub on_gpu: bool,
    /// The machine's memory (0 if unknown).
    pub total_memory: u64,
}

/// The share of the machine's memory that dequantized weights may take.
pub const BUDGET_SHARE: u64 = 4;

/// Decides the form from `facts`, honouring `wanted` when it is not `Auto`.
pub fn decide(facts: Facts, wanted: Override) -> WeightChoice {
    let mb = |bytes: u64| format!("{:.0} MB", bytes as f64 / 1e6);
    let chosen = |form, why: String| WeightChoice { form, why };
    if facts.quantized_bytes == 0 {
        return chosen(WeightForm::AsStored, "no quantized matrices".into());
    }
    match wanted {
        Override::Quantized => return chosen(WeightForm::AsStored, "FERRITE_CPU_WEIGHTS=quantized".into()),
        Override::Dequantized(dtype) => {
            let bytes = facts.f32_bytes / if dtype == Dtype::Float32 { 1 } else { 2 };
            return chosen(
                WeightForm::Dequantized(dtype),
                format!("{}, FERRITE_CPU_WEIGHTS={}", mb(bytes), dtype_name(dtype)),
            );
        }
        Override::Auto => {}
    }
    if facts.on_gpu {
        return chosen(WeightForm::AsStored, "quantized kernels on the GPU".into());
    }
    let budget = facts.total_memory / BUDGET_SHARE;
    if facts.f32_bytes <= budget {
        let why =
            format!("{} in f32, within the CPU budget of {} (a quarter of memory)", mb(facts.f32_bytes), mb(budget));
        chosen(WeightForm::Dequantized(Dtype::Float32), why)
    } else {
        let why = format!(
            "{} in f32 would exceed the CPU budget of {} (a quarter of memory)",
            mb(facts.f32_bytes),
            mb(budget)
        );
        chosen(WeightForm::AsStored, why)
    }
}

/// The facts of a checkpoint about to be built: a matrix is quantized when its `.scales`
/// tensor is present, as the loader decides.
pub fn facts(weights: &Weights, quant: Option<&Quantization>, on_gpu: bool) -> Facts {
    let (mut quantized_bytes, mut f32_bytes) = (0u64, 0u64);
    for (name, weight) in weights.arrays() {
        let Some(path) = name.strip_suffix(".weight") else { continue };
        let Some(spec) = quant.and_then(|q| q.spec_for(path)) else { continue };
        let part = |suffix: &str| weights.array(&format!("{path}.{suffix}")).map(|a| a.nbytes() as u64);
        let (Some(scales), Some(biases)) = (part("scales"), part("biases")) else { continue };
        quantized_bytes += weight.nbytes() as u64 + scales + biases;
        let values = weight.size() as u64 * 32 / spec.bits.max(1) as u64;
        f32_bytes += values * 4;
    }
    Facts { quantized_bytes, f32_bytes, on_gpu, total_memory: crate::device::total_memory() }
}

/// The form the checkpoint in `dir` loads in here, `wanted` overriding the rule (its tensors
/// are mapped, not read).
pub fn for_checkpoint(dir: &std::path::Path, wanted: Override) -> crate::Result<WeightChoice> {
    let config = crate::config::ModelConfig::load(dir)?;
    let weights = Weights::load(dir)?;
    Ok(choose(&weights, &config, wanted))
}

/// The form a checkpoint's `weights` load in on this backend and machine, or the one `wanted`
/// names.
pub fn choose(weights: &Weights, config: &crate::config::ModelConfig, wanted: Override) -> WeightChoice {
    decide(facts(weights, config.quant.as_ref(), crate::device::on_gpu()), wanted)
}

fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Float32 => "f32",
        Dtype::Bfloat16 => "bf16",
        Dtype::Float16 => "f16",
        _ => "another dtype",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GB: u64 = 1_000_000_000;

    fn facts(f32_bytes: u64, on_gpu: bool, total_memory: u64) -> Facts {
        Facts { quantized_bytes: f32_bytes / 4, f32_bytes, on_gpu, total_memory }
    }

    #[test]
    fn small_models_are_dequantized_on_the_cpu_and_large_ones_stay_quantized() {
        // The embedded 20M model (~80 MB in f32) and an 8B model (~32 GB) on a 24 GB machine.
        let small = decide(facts(82_000_000, false, 24 * GB), Override::Auto);
        assert_eq!(small.form, WeightForm::Dequantized(Dtype::Float32), "{small}");
        assert!(small.to_string().contains("82 MB"), "{small}");
        let large = decide(facts(32 * GB, false, 24 * GB), Override::Auto);
        assert_eq!(large.form, WeightForm::AsStored, "{large}");
        assert!(large.why.contains("exceed"), "{large}");
        // The budget is a quarter of memory: 6 GB of 24.
        assert_eq!(decide(facts(6 * GB, false, 24 * GB), Override::Auto).form, WeightForm::Dequantized(Dtype::Float32));
        assert_eq!(decide(facts(6 * GB + 1, false, 24 * GB), Override::Auto).form, WeightForm::AsStored);
    }

    #[test]
    fn gpus_and_unquantized_models_keep_their_form() {
        assert_eq!(decide(facts(82_000_000, true, 24 * GB), Override::Auto).form, WeightForm::AsStored);
        let dense = Facts { quantized_bytes: 0, f32_bytes: 0, on_gpu: false, total_memory: 24 * GB };
        assert_eq!(decide(dense, Override::Dequantized(Dtype::Float32)).form, WeightForm::AsStored);
    }

    #[test]
    fn the_override_wins_and_names_itself() {
        let q = decide(facts(82_000_000, false, 24 * GB), Override::Quantized);
        assert_eq!(q.form, WeightForm::AsStored);
        assert!(q.why.contains("FERRITE_CPU_WEIGHTS"), "{q}");
        let bf16 = decide(facts(32 * GB, false, 24 * GB), Override::Dequantized(Dtype::Bfloat16));
        assert_eq!(bf16.form, WeightForm::Dequantized(Dtype::Bfloat16));
        assert_eq!(Override::parse("f32"), Ok(Override::Dequantized(Dtype::Float32)));
        assert_eq!(Override::parse(""), Ok(Override::Auto));
        assert!(Override::parse("int4").unwrap_err().contains("`int4`"));
    }
}
