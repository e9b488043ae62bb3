//! Builds layers from checkpoint tensors, checking every shape against the config. A layer
//! is quantized when its `.scales` tensor is present (as mlx-lm decides), with the bits and
//! group size of the config's `quantization` block or its per-layer override.

use super::packed::Packed;
use super::parallel::{split_error, AllSum, Shard, Split};
use super::switch::{LongPromptGather, SwitchLinear};
use super::{Embedding, Linear, Projections, RmsNorm};
use crate::config::{QuantSpec, Quantization};
use crate::error::{Error, Result};
use crate::weights::Weights;

pub struct Loader<'a> {
    pub weights: &'a mut Weights,
    pub quant: Option<&'a Quantization>,
    pub config_path: std::path::PathBuf,
    /// Which projections of one input are joined into one matrix ([`Projections::new`]).
    pub joins: Joins,
    /// How this model's MoE layers run long prompts, settled by the first one.
    pub long_prompt_gather: LongPromptGather,
    /// The dtype quantized matrices are dequantized to at load, if they are
    /// ([`crate::weight_form`]).
    pub dequantize: Option<mlx_rs::Dtype>,
    /// This process's part of a model split across a distributed group (tensor parallelism),
    /// or `None`: the whole model.
    pub shard: Option<Shard>,
}

/// Projections that read one input, by where they sit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JoinGroup {
    /// q, k, v (and the output gate) of full attention.
    Attention,
    /// gate and up of a dense MLP or shared expert.
    Mlp,
    /// The rest: Gated DeltaNet inputs, the MoE router with the shared expert's gate.
    Other,
}

/// Which groups of projections a model joins at load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Joins {
    pub attention: bool,
    pub mlp: bool,
    pub other: bool,
}

impl Joins {
    pub const ALL: Joins = Joins { attention: true, mlp: true, other: true };
    pub const NONE: Joins = Joins { attention: false, mlp: false, other: false };

    /// MoE and hybrid models join everything: their decode steps are many small matmuls, and
    /// joining cut the 35B-A3B step from 3,855 MLX operations to 2,912 on the H200. Dense
    /// models keep the checkpoint's matrices: joining their large q/k/v and gate/up together
    /// gained nothing there (8B-shaped) or lost 7% (32B-shaped), and raised the prefill's
    /// peak memory.
    pub fn for_model(sparse_or_hybrid: bool) -> Joins {
        if sparse_or_hybrid {
            Joins::ALL
        } else {
            Joins::NONE
        }
    }

    /// A benchmark's override (`FERRITE_JOIN`): `auto` (the model's own), `all`, `none`, or a
    /// comma list of `attention`, `mlp`, `other`.
    pub fn parse(text: &str, auto: Joins) -> std::result::Result<Joins, String> {
        match text.trim() {
            "auto" | "" => return Ok(auto),
            "all" => return Ok(Joins::ALL),
            "none" => return Ok(Joins::NONE),
            _ => {}
        }
        let mut joins = Joins::NONE;
        for group in text.split(',').map(str::trim) {
            match group {
                "attention" => joins.attention = true,
                "mlp" => joins.mlp = true,
                "other" => joins.other = true,
                other => {
                    return Err(format!(
                        "unknown group `{other}` (expected auto, all, none, or a comma list of attention, mlp, other)"
                    ))
                }
            }
        }
        Ok(joins)
    }

    /// `FERRITE_JOIN` as an override: `auto` (or empty) is none, the model keeps its own.
    pub fn parse_override(text: &str) -> std::result::Result<Option<Joins>, String> {
        match text.trim() {
            "" | "auto" => Ok(None),
            _ => Joins::parse(text, Joins::NONE).map(Some),
        }
    }

    pub fn contains(&self, group: JoinGroup) -> bool {
        match group {
            JoinGroup::Attention => self.attention,
            JoinGroup::Mlp => self.mlp,
            JoinGroup::Other => self.other,
        }
    }
}

impl Loader<'_> {
    /// Several projections of one input, joined when this model joins their group.
    pub fn projections(&self, group: JoinGroup, parts: Vec<Linear>) -> Result<Projections> {
        if self.joins.contains(group) {
            Projections::new(parts)
        } else {
            Ok(Projections::Separate(parts))
        }
    }

    fn spec(&self, path: &str) -> Result<Option<QuantSpec>> {
        if !self.weights.contains(&format!("{path}.scales")) {
            return Ok(None);
        }
        match self.quant.and_then(|q| q.spec_for(path)) {
            Some(spec) => Ok(Some(spec)),
            None => Err(Error::UnsupportedQuantization {
                path: self.config_path.clone(),
                detail: format!("`{path}` is quantized but the config gives no bits/group size for it"),
            }),
        }
    }

    /// Quantized weights of a matrix of logical shape [..lead, out, in].
    fn packed(&mut self, path: &str, lead: &[i32], out: i32, inp: i32, spec: QuantSpec) -> Result<Packed> {
        if inp % spec.group_size != 0 || (inp * spec.bits) % 32 != 0 {
            return Err(Error::UnsupportedQuantization {
                path: self.config_path.clone(),
                detail: format!(
                    "`{path}`: input size {inp} does not fit group size {} / {} bits",
                    spec.group_size, spec.bits
                ),
            });
        }
        let shape = |last: i32| [lead, &[out, last]].concat();
        Ok(Packed {
            weight: self.weights.take(&format!("{path}.weight"), Some(&shape(inp * spec.bits / 32)))?,
            scales: self.weights.take(&format!("{path}.scales"), Some(&shape(inp / spec.group_size)))?,
            biases: self.weights.take(&format!("{path}.biases"), Some(&shape(inp / spec.group_size)))?,
            spec,
        })
    }

    pub fn linear(&mut self, path: &str, inp: i32, out: i32, bias: bool) -> Result<Linear> {
        self.linear_split(path, inp, out, bias, None)
    }

    /// A linear layer of which this rank holds `split` (the whole one with `None`).
    pub fn linear_split(&mut self, path: &str, inp: i32, out: i32, bias: bool, split: Option<Split>) -> Result<Linear> {
        let bias = if bias { Some(self.weights.take(&format!("{path}.bias"), Some(&[out]))?) } else { None };
        let bias = match (&split, bias) {
            (Some(split), Some(b)) => split.bias(b, self.rank())?,
            (_, bias) => bias,
        };
        Ok(match self.spec(path)? {
            Some(spec) => {
                let packed = self.packed(path, &[], out, inp, spec)?;
                let packed = self.split_packed(path, packed, split.as_ref())?;
                match held(self.dequantize, packed, false)? {
                    Held::Dense(weight) => Linear::Dense { weight, bias },
                    Held::Packed(packed) => Linear::Quantized { packed, bias },
                }
            }
            None => {
                let weight = self.weights.take(&format!("{path}.weight"), Some(&[out, inp]))?;
                Linear::Dense { weight: split_dense(weight, split.as_ref())?, bias }
            }
        })
    }

    fn split_packed(&self, path: &str, packed: Packed, split: Option<&Split>) -> Result<Packed> {
        match split {
            Some(split) => split.packed(&packed).map_err(|m| split_error(&self.config_path, path, m)),
            None => Ok(packed),
        }
    }

    /// The tensor `name` of `shape`, of which this rank holds `rows` along axis 0 (all of it
    /// with `None`).
    pub fn tensor_rows(&mut self, name: &str, shape: &[i32], rows: Option<&[i32]>) -> Result<mlx_rs::Array> {
        let tensor = self.weights.take(name, Some(shape))?;
        match rows {
            Some(rows) => super::parallel::take(&tensor, rows, 0),
            None => Ok(tensor),
        }
    }

    /// This rank's index in its group (0 alone).
    pub fn rank(&self) -> i32 {
        self.shard.as_ref().map_or(0, Shard::rank)
    }

    /// This rank's contiguous part of `n` units (`what`: "attention heads", ...) as (first,
    /// count): all of them when the model is not split.
    pub fn part(&self, n: i32, what: &str) -> Result<(i32, i32)> {
        match &self.shard {
            Some(shard) => shard.part(n, what).map_err(|m| split_error(&self.config_path, what, m)),
            None => Ok((0, n)),
        }
    }

    /// `make()`'s split when the model is split, else `None` (the whole weight).
    pub fn split(&self, make: impl FnOnce() -> Split) -> Option<Split> {
        self.shard.as_ref().map(|_| make())
    }

    /// The sum across the group that follows this model's row-split projections.
    pub fn all_sum(&self) -> AllSum {
        AllSum::new(self.shard.as_ref().map(Shard::group))
    }

    pub fn embedding(&mut self, path: &str, vocab: i32, dim: i32) -> Result<Embedding> {
        Ok(match self.spec(path)? {
            Some(spec) => match held(self.dequantize, self.packed(path, &[], vocab, dim, spec)?, false)? {
                Held::Dense(weight) => Embedding::Dense { weight },
                Held::Packed(packed) => Embedding::Quantized { packed },
            },
            None => Embedding::Dense { weight: self.weights.take(&format!("{path}.weight"), Some(&[vocab, dim]))? },
        })
    }

    /// Every expert's projection, of which this rank holds `split` of each expert's matrix.
    pub fn switch_linear(
        &mut self,
        path: &str,
        experts: i32,
        inp: i32,
        out: i32,
        split: Option<Split>,
    ) -> Result<SwitchLinear> {
        Ok(match self.spec(path)? {
            // MLX's CPU gather_mm supports only float32.
            Some(spec) => {
                let packed = self.packed(path, &[experts], out, inp, spec)?;
                let packed = self.split_packed(path, packed, split.as_ref())?;
                match held(self.dequantize, packed, !crate::device::on_gpu())? {
                    Held::Dense(weight) => SwitchLinear::Dense { weight },
                    Held::Packed(packed) => SwitchLinear::Quantized { packed },
                }
            }
            None => {
                let weight = self.weights.take(&format!("{path}.weight"), Some(&[experts, out, inp]))?;
                let mut weight = split_dense(weight, split.as_ref())?;
                // MLX's CPU gather_mm supports only float32 (mlx-lm fails there).
                if weight.dtype() != mlx_rs::Dtype::Float32 && !crate::device::on_gpu() {
                    weight = weight.as_dtype(mlx_rs::Dtype::Float32)?;
                }
                SwitchLinear::Dense { weight }
            }
        })
    }

    pub fn rms_norm(&mut self, path: &str, dim: i32, eps: f32) -> Result<RmsNorm> {
        Ok(RmsNorm { weight: self.weights.take(&format!("{path}.weight"), Some(&[dim]))?, eps })
    }
}

fn split_dense(weight: mlx_rs::Array, split: Option<&Split>) -> Result<mlx_rs::Array> {
    match split {
        Some(split) => split.dense(&weight),
        None => Ok(weight),
    }
}

/// A quantized matrix as the model holds it.
enum Held {
    Dense(mlx_rs::Array),
    Packed(Packed),
}

/// `packed` dequantized to `dequantize` when the model dequantizes at load (to f32 when
/// `f32_only`), evaluated now so that the packed form is dropped instead of being dequantized
/// again by every forward pass; else as stored.
fn held(dequantize: Option<mlx_rs::Dtype>, packed: Packed, f32_only: bool) -> Result<Held> {
    let Some(dtype) = dequantize else { return Ok(Held::Packed(packed)) };
    let dtype = if f32_only { mlx_rs::Dtype::Float32 } else { dtype };
    let p = &packed;
    let weight =
        mlx_rs::ops::dequantize(&p.weight, &p.scales, &p.biases, p.spec.group_size, p.spec.bits)?.as_dtype(dtype)?;
    weight.eval()?;
    Ok(Held::Dense(weight))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_overrides_parse_and_name_what_was_wrong() {
        let auto = Joins::for_model(false);
        assert_eq!(Joins::parse("auto", Joins::ALL), Ok(Joins::ALL));
        assert_eq!(Joins::parse("none", Joins::ALL), Ok(Joins::NONE));
        assert_eq!(Joins::parse("all", auto), Ok(Joins::ALL));
        assert_eq!(Joins::parse("mlp", auto), Ok(Joins { mlp: true, ..Joins::NONE }));
        assert_eq!(Joins::parse("attention, other", auto), Ok(Joins { attention: true, other: true, ..Joins::NONE }));
        let err = Joins::parse("mlp,qkv", auto).unwrap_err();
        assert!(err.contains("`qkv`"), "{err}");
    }
}
