//! The experts of a mixture-of-experts block: every expert's projection stacked into one
//! tensor, run as one gathered matmul per projection over the (token, expert) pairs a router
//! chose, in one of three ways by the step's size ([`Gather`]).

use mlx_rs::{ops, Array};

use super::measured::{Form, Measured};
use super::mlp::swiglu;
use super::packed::Packed;
use super::Linear;
use crate::error::Result;

/// From this many (token, expert) pairs on, the gathered matmuls group rows by expert.
pub const SORT_FROM: usize = 64;

/// One projection of all experts: weights [experts, out, in].
#[derive(Debug, Clone)]
pub enum SwitchLinear {
    Dense { weight: Array },
    Quantized { packed: Packed },
}

/// How a step's gathered matmuls run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gather {
    /// Rows in token order (a few tokens: decode, verify, short prompts).
    Unsorted,
    /// Rows grouped by expert, so each expert's weights are read once.
    Sorted,
    /// Grouped by expert, and the quantized experts dequantized once for the step: for long
    /// prompts on a GPU, where the model's first long prompt timed it faster than `Sorted`
    /// ([`LongPromptGather`]). On the H200 (MLX 0.32.2 CUDA) one 35B-A3B layer's experts for
    /// a 2048-token chunk took 21.8 ms as gathered quantized matmuls and 4.7 ms this way (the
    /// dequantize 1.8 ms of it), with identical outputs (`bench/moe_prefill_kernels.py`);
    /// at 128 tokens the gathered quantized matmuls win (1.6 vs 4.3 ms).
    SortedDequantized,
}

/// How one loaded model runs its long prompts' gathered matmuls, shared by all its MoE layers:
/// the first step for which [`Gather::for_step`] offers `SortedDequantized` times that layer's
/// experts on that step's rows both ways and the faster form is kept. Measured rather than
/// assumed per backend: the H200 favours dequantizing 4.6×, while Metal's gathered quantized
/// kernels, the product's home, were never timed against it.
pub type LongPromptGather = Measured<Gather>;

impl Gather {
    /// The mode for `pairs` (token, expert) pairs over `experts` experts, where dequantizing
    /// the layer's experts would take `dequantized_bytes()` for the step (asked, with MLX's
    /// memory limit, only for long prompts: decode steps skip both). `SortedDequantized` is
    /// only offered: the model's [`LongPromptGather`] decides (on the CPU it keeps `Sorted`).
    pub fn for_step(pairs: usize, experts: usize, dequantized_bytes: impl FnOnce() -> usize) -> Gather {
        if pairs < SORT_FROM {
            return Gather::Unsorted;
        }
        let long = pairs >= DEQUANTIZE_FROM_ROWS_PER_EXPERT * experts;
        if long && dequantized_bytes() <= mlx_rs::memory::memory_limit().unwrap_or(0) / DEQUANTIZE_AT_MOST_LIMIT_PART {
            Gather::SortedDequantized
        } else {
            Gather::Sorted
        }
    }
}

/// A benchmark's override of how long prompts run their experts (`FERRITE_LONG_EXPERTS`):
/// `measure` (the default: timed on a GPU's first long prompt, `quantized` on the CPU),
/// `quantized` or `dequantized`. Dequantized experts on the CPU backend need a float32
/// checkpoint (its gathered matmuls are float32-only).
pub fn long_prompt_gather(text: &str) -> std::result::Result<LongPromptGather, String> {
    match text.trim() {
        "" | "measure" => Ok(LongPromptGather::default()),
        "quantized" => Ok(LongPromptGather::kept(Gather::Sorted)),
        "dequantized" => Ok(LongPromptGather::kept(Gather::SortedDequantized)),
        other => Err(format!("unknown form `{other}` (known: measure, quantized, dequantized)")),
    }
}

/// Average rows per expert from which a long prompt's experts may be dequantized (measured
/// crossover on the H200: about 12).
const DEQUANTIZE_FROM_ROWS_PER_EXPERT: usize = 16;

/// The dequantized experts live for one layer of one prompt chunk (the trunk evaluates long
/// inputs layer by layer for this: see `models::transformer`); they are made only while
/// they take at most this part of MLX's memory limit (a 35B-A3B layer's 1.6 GB passes on a
/// 64 GB Mac, an 80B-A3B layer's 3.2 GB does not), so a long prompt never pushes a machine
/// that holds its model comfortably into swap.
const DEQUANTIZE_AT_MOST_LIMIT_PART: usize = 16;

impl SwitchLinear {
    /// `x`: [..., 1, in] rows, `experts`: matching expert ids.
    fn forward(&self, x: &Array, experts: &Array, mode: Gather) -> Result<Array> {
        let sorted = mode != Gather::Unsorted;
        // Which row of x each product reads, in x's batch shape. Without it MLX builds the
        // same with an arange, a kernel per gathered matmul: at decode it is made here on the
        // host instead. Sorted (long-prompt) matmuls get none, as mlx-lm calls them and as
        // `bench/moe_prefill_kernels.py` timed them: MLX's sorted fast paths are written for
        // that call.
        let rows = if sorted {
            None
        } else {
            let batch = &x.shape()[..x.ndim().saturating_sub(2)];
            let count: i32 = batch.iter().product();
            Some(Array::from_iter(0..count as u32, batch))
        };
        let rows = rows.as_ref();
        Ok(match self {
            SwitchLinear::Dense { weight } if weight.dtype() != x.dtype() => {
                // CPU gather_mm is float32-only: the loader upcast the weights.
                let y = ops::gather_mm(x.as_dtype(weight.dtype())?, weight.swap_axes(-1, -2)?, rows, experts, sorted)?;
                y.as_dtype(x.dtype())?
            }
            SwitchLinear::Dense { weight } => ops::gather_mm(x, weight.swap_axes(-1, -2)?, rows, experts, sorted)?,
            SwitchLinear::Quantized { packed: p } if mode == Gather::SortedDequantized => {
                let w = ops::dequantize(&p.weight, &p.scales, &p.biases, p.spec.group_size, p.spec.bits)?
                    .as_dtype(x.dtype())?;
                ops::gather_mm(x, w.swap_axes(-1, -2)?, rows, experts, sorted)?
            }
            SwitchLinear::Quantized { packed: p } => ops::gather_qmm(
                x,
                &p.weight,
                &p.scales,
                &p.biases,
                rows,
                experts,
                true,
                p.spec.group_size,
                p.spec.bits,
                sorted,
            )?,
        })
    }
}

impl SwitchLinear {
    /// Two projections of every expert as one (each expert's `a` rows, then its `b` rows),
    /// when they are stored alike; evaluated at once so the originals can go.
    pub fn join_rows(a: &SwitchLinear, b: &SwitchLinear) -> Result<Option<SwitchLinear>> {
        let joined = match (a, b) {
            (SwitchLinear::Dense { weight: wa }, SwitchLinear::Dense { weight: wb }) if wa.dtype() == wb.dtype() => {
                SwitchLinear::Dense { weight: ops::concatenate(&[wa, wb], 1)? }
            }
            (SwitchLinear::Quantized { packed: pa }, SwitchLinear::Quantized { packed: pb }) if pa.spec == pb.spec => {
                SwitchLinear::Quantized { packed: Packed::concat(&[pa, pb], 1)? }
            }
            _ => return Ok(None),
        };
        match &joined {
            SwitchLinear::Dense { weight } => weight.eval()?,
            SwitchLinear::Quantized { packed } => packed.eval()?,
        }
        Ok(Some(joined))
    }
}

impl SwitchLinear {
    /// Bytes of this stack dequantized to elements of `element_bytes` (0 when not quantized).
    fn dequantized_bytes(&self, element_bytes: usize) -> usize {
        match self {
            SwitchLinear::Dense { .. } => 0,
            SwitchLinear::Quantized { packed } => {
                let packed_values = packed.weight.size() * 32 / packed.spec.bits as usize;
                packed_values * element_bytes
            }
        }
    }

    /// Experts in the stack.
    pub(super) fn experts(&self) -> i32 {
        match self {
            SwitchLinear::Dense { weight } => weight.dim(0),
            SwitchLinear::Quantized { packed } => packed.weight.dim(0),
        }
    }

    /// This stack with `extra` (one more expert's matrix) appended as the last expert, when
    /// it is stored alike (same dtype or quantization spec, same shape, no bias).
    pub(super) fn with_extra(&self, extra: &Linear) -> Result<Option<SwitchLinear>> {
        let fits = |stack: &Array, one: &Array| stack.shape()[1..] == *one.shape() && stack.dtype() == one.dtype();
        let as_expert = |one: &Array| ops::expand_dims(one, 0);
        let joined = match (self, extra) {
            (SwitchLinear::Dense { weight }, Linear::Dense { weight: w, bias: None }) if fits(weight, w) => {
                SwitchLinear::Dense { weight: ops::concatenate(&[weight, &as_expert(w)?], 0)? }
            }
            (SwitchLinear::Quantized { packed: s }, Linear::Quantized { packed: p, bias: None })
                if s.spec == p.spec && fits(&s.weight, &p.weight) && fits(&s.scales, &p.scales) =>
            {
                let one = Packed {
                    weight: as_expert(&p.weight)?,
                    scales: as_expert(&p.scales)?,
                    biases: as_expert(&p.biases)?,
                    spec: p.spec,
                };
                SwitchLinear::Quantized { packed: Packed::concat(&[s, &one], 0)? }
            }
            _ => return Ok(None),
        };
        match &joined {
            SwitchLinear::Dense { weight } => weight.eval()?,
            SwitchLinear::Quantized { packed } => packed.eval()?,
        }
        Ok(Some(joined))
    }
}

/// The experts' gate and up projections, separate or joined (one gathered matmul per step).
#[derive(Debug, Clone)]
pub enum SwitchGateUp {
    Separate { gate: SwitchLinear, up: SwitchLinear },
    Joined { both: SwitchLinear, hidden: i32 },
}

#[derive(Debug, Clone)]
pub struct SwitchGlu {
    pub gate_up: SwitchGateUp,
    pub down_proj: SwitchLinear,
    /// The model's long-prompt form, shared with its other MoE layers.
    pub long_prompts: LongPromptGather,
}

impl SwitchGlu {
    /// Joins gate and up when they are stored alike (`hidden`: the experts' width).
    pub fn new(
        gate: SwitchLinear,
        up: SwitchLinear,
        down_proj: SwitchLinear,
        hidden: i32,
        long_prompts: LongPromptGather,
    ) -> Result<SwitchGlu> {
        let gate_up = match SwitchLinear::join_rows(&gate, &up)? {
            Some(both) => SwitchGateUp::Joined { both, hidden },
            None => SwitchGateUp::Separate { gate, up },
        };
        Ok(SwitchGlu { gate_up, down_proj, long_prompts })
    }

    /// `x`: [B, L, D], `indices`: [B, L, K] → [B, L, K, D].
    pub fn forward(&self, x: &Array, indices: &Array) -> Result<Array> {
        let bytes = || self.dequantized_bytes(x.item_size());
        let mut mode = Gather::for_step(indices.size(), self.down_proj.experts() as usize, bytes);
        if mode == Gather::SortedDequantized {
            let form = |mode| move || -> Result<Vec<Array>> { Ok(vec![self.forward_with(x, indices, mode)?]) };
            let (sorted, dequantized) = (form(Gather::Sorted), form(Gather::SortedDequantized));
            let forms: [Form<Gather>; 2] = [(Gather::Sorted, &sorted), (Gather::SortedDequantized, &dequantized)];
            mode = self.long_prompts.choose("long prompts' experts, one layer", &forms)?;
        }
        self.forward_with(x, indices, mode)
    }

    /// Bytes of every expert projection dequantized to elements of `element_bytes`.
    fn dequantized_bytes(&self, element_bytes: usize) -> usize {
        let gate_up = match &self.gate_up {
            SwitchGateUp::Joined { both, .. } => both.dequantized_bytes(element_bytes),
            SwitchGateUp::Separate { gate, up } => {
                gate.dequantized_bytes(element_bytes) + up.dequantized_bytes(element_bytes)
            }
        };
        gate_up + self.down_proj.dequantized_bytes(element_bytes)
    }

    pub fn forward_with(&self, x: &Array, indices: &Array, mode: Gather) -> Result<Array> {
        let x = ops::expand_dims_axes(x, &[-2, -3])?;
        // With many (token, expert) pairs, grouping the rows by expert makes the gathered
        // matmuls read each expert's weights once.
        let sort = mode != Gather::Unsorted;
        let (x, idx, inverse) = if sort {
            let k = indices.dim(-1);
            let flat = indices.flatten(None, None)?;
            let order = ops::argsort(&flat)?;
            let inverse = ops::argsort(&order)?;
            let rows = order.floor_divide(Array::from_int(k))?;
            let x = x.flatten(0, -3)?.take_axis(&rows, 0)?;
            (x, flat.take_axis(&order, 0)?, Some(inverse))
        } else {
            (x, indices.clone(), None)
        };
        let (gate, up) = match &self.gate_up {
            SwitchGateUp::Separate { gate, up } => (gate.forward(&x, &idx, mode)?, up.forward(&x, &idx, mode)?),
            SwitchGateUp::Joined { both, hidden } => {
                let parts = both.forward(&x, &idx, mode)?.split_at_indices(&[*hidden], -1)?;
                (parts[0].clone(), parts[1].clone())
            }
        };
        let mut y = self.down_proj.forward(&swiglu(&gate, &up)?, &idx, mode)?;
        if let Some(inverse) = inverse {
            y = ops::unflatten(y.take_axis(&inverse, 0)?, 0, indices.shape())?;
        }
        Ok(y.squeeze_axes(&[-2])?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::QuantSpec;
    use crate::device::on_gpu;
    use mlx_rs::random;

    fn experts(e: i32, out: i32, inp: i32, seed: u64) -> SwitchLinear {
        let w = random::normal::<f32>(&[e, out, inp], None, None, Some(&random::key(seed).unwrap())).unwrap();
        let (weight, scales, biases) = ops::quantize(&w, 32, 4).unwrap();
        SwitchLinear::Quantized {
            packed: Packed { weight, scales, biases, spec: QuantSpec { group_size: 32, bits: 4 } },
        }
    }

    fn glu() -> SwitchGlu {
        SwitchGlu::new(
            experts(8, 32, 64, 1),
            experts(8, 32, 64, 2),
            experts(8, 64, 32, 3),
            32,
            LongPromptGather::default(),
        )
        .unwrap()
    }

    #[test]
    fn dequantized_experts_give_the_gathered_quantized_results() {
        let glu = glu();
        let x = random::normal::<f32>(&[1, 40, 64], None, None, Some(&random::key(4).unwrap())).unwrap();
        let ids = random::randint::<_, u32>(0, 8, &[1, 40, 2], Some(&random::key(5).unwrap())).unwrap();
        let sorted = glu.forward_with(&x, &ids, Gather::Sorted).unwrap();
        let dequantized = glu.forward_with(&x, &ids, Gather::SortedDequantized).unwrap();
        let unsorted = glu.forward_with(&x, &ids, Gather::Unsorted).unwrap();
        assert_eq!(sorted.shape(), &[1, 40, 2, 64]);
        // The dequantized form multiplies through BLAS, which sums in its own order: equal up
        // to f32 rounding, relative to the outputs' size.
        let scale = sorted.abs().unwrap().max(None).unwrap().item_cast::<f32>();
        for other in [&dequantized, &unsorted] {
            let diff = sorted.subtract(other).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>();
            assert!(diff <= 1e-5 * scale.max(1.0), "max |Δ| {diff} for outputs up to {scale}");
        }
    }

    #[test]
    fn long_prompts_sort_and_may_dequantize() {
        let one_layer = || 1 << 30;
        assert_eq!(Gather::for_step(8, 256, one_layer), Gather::Unsorted);
        assert_eq!(Gather::for_step(2048 * 8, 256, one_layer), Gather::SortedDequantized);
        assert_eq!(Gather::for_step(128 * 8, 256, one_layer), Gather::Sorted);
        // Experts too big to dequantize beside the model: never.
        assert_eq!(Gather::for_step(2048 * 8, 256, || usize::MAX / 2), Gather::Sorted);
    }

    #[test]
    fn the_cpu_keeps_quantized_experts_unless_told() {
        let glu = glu();
        let x = random::normal::<f32>(&[1, 200, 64], None, None, Some(&random::key(4).unwrap())).unwrap();
        let ids = random::randint::<_, u32>(0, 8, &[1, 200, 2], Some(&random::key(5).unwrap())).unwrap();
        glu.forward(&x, &ids).unwrap().eval().unwrap();
        if !on_gpu() {
            // Offered (400 pairs over 8 experts) but never timed on the CPU, so not kept.
            assert_eq!(glu.long_prompts.get(), None);
        }
        let told = long_prompt_gather("dequantized").unwrap();
        assert_eq!(told.get(), Some(Gather::SortedDequantized));
        assert_eq!(long_prompt_gather("quantized").unwrap().get(), Some(Gather::Sorted));
        let err = long_prompt_gather("fast").unwrap_err();
        assert!(err.contains("`fast`") && err.contains("dequantized"), "{err}");
    }
}
