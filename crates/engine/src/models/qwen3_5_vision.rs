//! The vision tower of Qwen3.5 / Qwen3.6 checkpoints (Qwen3-VL's, without DeepStack): image
//! patches to the text model's embeddings, one per merged group of patches.
//!
//! Patches ([rows, C × T × P × P], [`crate::vision::ImageProcessor`]'s order) go through the
//! patch embedding (a 3-D convolution whose kernel is its stride: one matrix product), plus a
//! learned position embedding bilinearly interpolated from its square grid to the image's
//! grid; then `depth` pre-norm blocks (LayerNorm, attention with 2-D rotary positions — half
//! the rotary frequencies follow the patch's row, half its column — within each image only,
//! a tanh-GELU MLP); then the merger: LayerNorm, each merged group's patches side by side,
//! two linear layers with an exact GELU between, to the text model's width.
//! mlx-vlm's `qwen3_vl/vision.py` is the reference (`tests/vision.rs`).

use std::path::Path;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{fast, nn, ops, Array, Dtype};
use serde_json::Value;

use crate::error::{Error, Result};
use crate::layers::Linear;
use crate::small_file::{read_text, JSON_CAP};
use crate::weights::Weights;

/// The tower's shape, from `vision_config` in the checkpoint's `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    pub out_hidden_size: usize,
    pub num_position_embeddings: usize,
}

/// The LayerNorms' epsilon (Qwen3-VL's, fixed in its code).
const EPS: f32 = 1e-6;
/// The rotary base of the patches' positions.
const THETA: f32 = 10_000.0;

impl VisionConfig {
    /// The `vision_config` of a parsed `config.json` at `path`; `None` when the model does not see.
    pub fn from_config(config: &Value, path: &Path) -> Result<Option<Self>> {
        let Some(v) = config.get("vision_config").filter(|v| !v.is_null()) else { return Ok(None) };
        let bad = |field: &str, message: String| Error::Config {
            path: path.to_path_buf(),
            field: format!("vision_config.{field}"),
            message,
        };
        let count = |field: &str, max: u64| -> Result<usize> {
            let value = v.get(field).ok_or_else(|| bad(field, "missing".into()))?;
            value
                .as_u64()
                .filter(|n| (1..=max).contains(n))
                .map(|n| n as usize)
                .ok_or_else(|| bad(field, format!("expected a whole number in 1..={max}, got {value}")))
        };
        if let Some(layers) = v.get("deepstack_visual_indexes").and_then(Value::as_array).filter(|a| !a.is_empty()) {
            return Err(bad(
                "deepstack_visual_indexes",
                format!("DeepStack is not read here (Qwen3.5 has none), got {layers:?}"),
            ));
        }
        let c = VisionConfig {
            depth: count("depth", 256)?,
            hidden_size: count("hidden_size", 16_384)?,
            intermediate_size: count("intermediate_size", 65_536)?,
            num_heads: count("num_heads", 256)?,
            in_channels: v.get("in_channels").map_or(Ok(3), |_| count("in_channels", 4))?,
            patch_size: count("patch_size", 64)?,
            temporal_patch_size: count("temporal_patch_size", 8)?,
            spatial_merge_size: count("spatial_merge_size", 8)?,
            out_hidden_size: count("out_hidden_size", 65_536)?,
            num_position_embeddings: count("num_position_embeddings", 1 << 20)?,
        };
        if !c.hidden_size.is_multiple_of(c.num_heads) || !(c.hidden_size / c.num_heads).is_multiple_of(4) {
            return Err(bad(
                "num_heads",
                format!("{} heads do not split {} into rotary halves", c.num_heads, c.hidden_size),
            ));
        }
        let side = c.grid_side();
        if side * side != c.num_position_embeddings {
            return Err(bad("num_position_embeddings", format!("{} is not a square grid", c.num_position_embeddings)));
        }
        Ok(Some(c))
    }

    fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }

    /// Values in one patch row.
    pub fn patch_values(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }

    fn grid_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt().round() as usize
    }
}

struct LayerNorm {
    weight: Array,
    bias: Array,
}

impl LayerNorm {
    fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::layer_norm(x, &self.weight, &self.bias, EPS)?)
    }
}

struct Block {
    norm1: LayerNorm,
    norm2: LayerNorm,
    qkv: Linear,
    proj: Linear,
    fc1: Linear,
    fc2: Linear,
}

struct Merger {
    norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
}

/// A loaded vision tower.
pub struct VisionTower {
    pub config: VisionConfig,
    patch_embed: Linear,
    pos_embed: Array,
    blocks: Vec<Block>,
    merger: Merger,
}

/// Takes the tower's tensors (under `model.visual.` as Qwen publishes them, or `vision_tower.`
/// as mlx-vlm saves them), checking each shape.
struct TowerWeights<'a> {
    weights: &'a mut Weights,
    prefix: &'static str,
    /// The dtype the tower computes in ([`compute_dtype`]); `None`: as stored.
    dtype: Option<Dtype>,
}

impl TowerWeights<'_> {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Array> {
        let shape: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        let array = self.weights.take(&format!("{}{name}", self.prefix), Some(&shape))?;
        Ok(match self.dtype {
            Some(dtype) if dtype != array.dtype() => array.as_dtype(dtype)?,
            _ => array,
        })
    }

    fn linear(&mut self, name: &str, inp: usize, out: usize) -> Result<Linear> {
        Ok(Linear::Dense {
            weight: self.take(&format!("{name}.weight"), &[out, inp])?,
            bias: Some(self.take(&format!("{name}.bias"), &[out])?),
        })
    }

    fn layer_norm(&mut self, name: &str, dim: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: self.take(&format!("{name}.weight"), &[dim])?,
            bias: self.take(&format!("{name}.bias"), &[dim])?,
        })
    }
}

impl VisionTower {
    /// Whether `weights` hold a vision tower.
    pub(crate) fn present(weights: &Weights) -> bool {
        ["model.visual.", "vision_tower."].iter().any(|p| weights.contains(&format!("{p}patch_embed.proj.weight")))
    }

    /// The tower of the checkpoint in `dir`: `None` when its config has no `vision_config`
    /// or its weights no tower (a text-only conversion).
    pub fn load_checkpoint(dir: &Path) -> Result<Option<Self>> {
        let path = dir.join("config.json");
        let text = read_text(&path, JSON_CAP)?;
        let config: Value =
            serde_json::from_str(&text).map_err(|e| Error::malformed(&path, format!("not JSON: {e}")))?;
        Self::load_configured(dir, &config)
    }

    /// [`VisionTower::load_checkpoint`] with the checkpoint's `config.json` already parsed,
    /// computing in [`compute_dtype`]'s dtype for this machine.
    pub fn load_configured(dir: &Path, config: &Value) -> Result<Option<Self>> {
        Self::load_in(dir, config, compute_dtype(crate::device::on_gpu()))
    }

    /// The tower computing in `dtype` (`None`: the checkpoint's).
    pub fn load_in(dir: &Path, config: &Value, dtype: Option<Dtype>) -> Result<Option<Self>> {
        let Some(config) = VisionConfig::from_config(config, &dir.join("config.json"))? else { return Ok(None) };
        let mut weights = Weights::load(dir)?;
        if !Self::present(&weights) {
            return Ok(None);
        }
        Self::load(&mut weights, &config, dtype).map(Some)
    }

    fn load(weights: &mut Weights, config: &VisionConfig, dtype: Option<Dtype>) -> Result<Self> {
        let prefix =
            if weights.contains("model.visual.patch_embed.proj.weight") { "model.visual." } else { "vision_tower." };
        let mut w = TowerWeights { weights, prefix, dtype };
        let c = config;
        let (h, t, p, ch) = (c.hidden_size, c.temporal_patch_size, c.patch_size, c.in_channels);
        // The convolution's kernel as one matrix over a patch row's (channel, frame, y, x)
        // order: PyTorch's layout [H, C, T, P, P] as published, or MLX's [H, T, P, P, C] as
        // mlx-vlm saves it.
        let name = "patch_embed.proj.weight";
        let full = format!("{prefix}{name}");
        let stored = w.weights.array(&full).map(Array::shape).unwrap_or_default().to_vec();
        let kernel = if stored == [h, t, p, p, ch].map(|d| d as i32) {
            w.take(name, &[h, t, p, p, ch])?.transpose_axes(&[0, 4, 1, 2, 3])?
        } else {
            w.take(name, &[h, ch, t, p, p])?
        };
        let patch_embed = Linear::Dense {
            weight: kernel.reshape(&[h as i32, c.patch_values() as i32])?,
            bias: Some(w.take("patch_embed.proj.bias", &[h])?),
        };
        let pos_embed = w.take("pos_embed.weight", &[c.num_position_embeddings, h])?;
        let blocks = (0..c.depth)
            .map(|i| {
                let b = format!("blocks.{i}");
                Ok(Block {
                    norm1: w.layer_norm(&format!("{b}.norm1"), h)?,
                    norm2: w.layer_norm(&format!("{b}.norm2"), h)?,
                    qkv: w.linear(&format!("{b}.attn.qkv"), h, 3 * h)?,
                    proj: w.linear(&format!("{b}.attn.proj"), h, h)?,
                    fc1: w.linear(&format!("{b}.mlp.linear_fc1"), h, c.intermediate_size)?,
                    fc2: w.linear(&format!("{b}.mlp.linear_fc2"), c.intermediate_size, h)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let merged = h * c.spatial_merge_size * c.spatial_merge_size;
        let merger = Merger {
            norm: w.layer_norm("merger.norm", h)?,
            fc1: w.linear("merger.linear_fc1", merged, merged)?,
            fc2: w.linear("merger.linear_fc2", merged, c.out_hidden_size)?,
        };
        Ok(VisionTower { config: config.clone(), patch_embed, pos_embed, blocks, merger })
    }

    /// The dtype the tower computes in: its weights'.
    pub fn dtype(&self) -> Dtype {
        self.pos_embed.dtype()
    }

    /// Every weight, to load them now rather than at the first image.
    pub fn arrays(&self) -> Vec<&Array> {
        fn linear(l: &Linear) -> Vec<&Array> {
            match l {
                Linear::Dense { weight, bias } => std::iter::once(weight).chain(bias.iter()).collect(),
                Linear::Quantized { packed, bias } => {
                    [&packed.weight, &packed.scales, &packed.biases].into_iter().chain(bias.iter()).collect()
                }
            }
        }
        fn norm(n: &LayerNorm) -> Vec<&Array> {
            vec![&n.weight, &n.bias]
        }
        let mut all = vec![&self.pos_embed];
        all.extend(linear(&self.patch_embed));
        for b in &self.blocks {
            all.extend([norm(&b.norm1), norm(&b.norm2)].concat());
            all.extend([linear(&b.qkv), linear(&b.proj), linear(&b.fc1), linear(&b.fc2)].concat());
        }
        all.extend(norm(&self.merger.norm));
        all.extend([linear(&self.merger.fc1), linear(&self.merger.fc2)].concat());
        all
    }

    /// The embeddings [Σ t·h·w / merge², out_hidden] of the images whose patches [Σ t·h·w,
    /// patch values] are `patches`, each image's (frames, rows, columns) in `grids`.
    pub fn forward(&self, patches: &Array, grids: &[[usize; 3]]) -> Result<Array> {
        let c = &self.config;
        let rows: usize = grids.iter().map(|g| g.iter().product::<usize>()).sum();
        let ms = c.spatial_merge_size;
        if patches.shape() != [rows as i32, c.patch_values() as i32]
            || grids.iter().any(|g| g[0] == 0 || g[1] % ms != 0 || g[2] % ms != 0)
        {
            return Err(Error::Request(format!(
                "vision tower: patches {:?} do not fit the grids {grids:?} (rows of {} values, sides multiples of {ms})",
                patches.shape(),
                c.patch_values()
            )));
        }
        let dtype = self.dtype();
        let mut x = self.patch_embed.forward(&patches.as_dtype(dtype)?)?;
        x = x.add(self.position_embeddings(grids)?)?;
        let (cos, sin) = self.rotary(grids)?;
        for block in &self.blocks {
            x = x.add(self.attention(block, &block.norm1.forward(&x)?, grids, &cos, &sin)?)?;
            let y = block
                .fc2
                .forward(&in_dtype_of(|h| nn::gelu_approximate(h), &block.fc1.forward(&block.norm2.forward(&x)?)?)?)?;
            x = x.add(y)?;
        }
        let merged = (c.hidden_size * ms * ms) as i32;
        let x = self.merger.norm.forward(&x)?.reshape(&[-1, merged])?;
        self.merger.fc2.forward(&in_dtype_of(|h| nn::gelu(h), &self.merger.fc1.forward(&x)?)?)
    }

    /// Each patch's position embedding: the learned grid's four nearest entries to where the
    /// patch falls when the grid is stretched over the image, weighted bilinearly.
    fn position_embeddings(&self, grids: &[[usize; 3]]) -> Result<Array> {
        let n = self.config.grid_side();
        let ms = self.config.spatial_merge_size;
        // Positions along a side as MLX's linspace computes them (f32), floored and ceiled.
        let along = |len: usize| -> Vec<(i32, i32, f32)> {
            let step = if len > 1 { (n - 1) as f32 / (len - 1) as f32 } else { 0.0 };
            (0..len)
                .map(|i| {
                    let at = i as f32 * step;
                    let floor = at as i32;
                    (floor, (floor + 1).min(n as i32 - 1), at - floor as f32)
                })
                .collect()
        };
        let (mut index, mut weight) = (vec![Vec::new(); 4], vec![Vec::new(); 4]);
        for &[t, h, w] in grids {
            let (hs, ws) = (along(h), along(w));
            for _ in 0..t {
                for (r, c) in merged_order(h, w, ms) {
                    let ((f0, c0, dh), (f1, c1, dw)) = (hs[r], ws[c]);
                    let n = n as i32;
                    let corners = [(f0, f1), (f0, c1), (c0, f1), (c0, c1)];
                    let weights = [(1.0 - dh) * (1.0 - dw), (1.0 - dh) * dw, dh * (1.0 - dw), dh * dw];
                    for k in 0..4 {
                        index[k].push(corners[k].0 * n + corners[k].1);
                        weight[k].push(weights[k]);
                    }
                }
            }
        }
        let mut sum: Option<Array> = None;
        for k in 0..4 {
            let rows = self.pos_embed.take_axis(Array::from_slice(&index[k], &[index[k].len() as i32]), 0)?;
            let wk = Array::from_slice(&weight[k], &[weight[k].len() as i32, 1]).as_dtype(rows.dtype())?;
            let term = rows.multiply(wk)?;
            sum = Some(match sum {
                Some(s) => s.add(term)?,
                None => term,
            });
        }
        sum.ok_or_else(|| Error::Request("vision tower: no patches".into()))
    }

    /// cos and sin [rows, head_dim] of every patch's rotary angles: the first half of the
    /// frequencies at its row, the second at its column, each repeated for the two halves
    /// that rotate together.
    fn rotary(&self, grids: &[[usize; 3]]) -> Result<(Array, Array)> {
        let dim = (self.config.head_dim() / 2) as i32;
        let ms = self.config.spatial_merge_size;
        let (mut rows, mut cols) = (Vec::new(), Vec::new());
        for &[t, h, w] in grids {
            for _ in 0..t {
                for (r, c) in merged_order(h, w, ms) {
                    rows.push(r as i32);
                    cols.push(c as i32);
                }
            }
        }
        let longest = grids.iter().map(|g| g[1].max(g[2])).max().unwrap_or(1) as i32;
        let exponents = ops::arange::<_, f32>(0, dim, 2)?.divide(Array::from_f32(dim as f32))?;
        let inv_freq = Array::from_f32(1.0).divide(ops::power(Array::from_f32(THETA), exponents)?)?;
        let table = ops::outer(ops::arange::<_, f32>(0, longest, None)?, inv_freq)?;
        let at = |ids: &[i32]| table.take_axis(Array::from_slice(ids, &[ids.len() as i32]), 0);
        let freqs = ops::concatenate(&[at(&rows)?, at(&cols)?], -1)?;
        let twice = |a: Array| -> Result<Array> { Ok(ops::concatenate(&[a.clone(), a], -1)?) };
        Ok((twice(ops::cos(&freqs)?)?, twice(ops::sin(&freqs)?)?))
    }

    fn attention(&self, block: &Block, x: &Array, grids: &[[usize; 3]], cos: &Array, sin: &Array) -> Result<Array> {
        let c = &self.config;
        let (len, heads, hd) = (x.dim(0), c.num_heads as i32, c.head_dim() as i32);
        let qkv = block.qkv.forward(x)?.reshape(&[len, 3, heads, hd])?;
        // [len, heads, hd] each; rotated in f32 and cast back, as mlx-vlm rotates.
        let rotate = |t: Array| -> Result<Array> {
            let half = hd / 2;
            let halves = ops::concatenate(&[t.index((.., .., half..)).negative()?, t.index((.., .., ..half))], -1)?;
            let cos = cos.expand_dims(1)?;
            let sin = sin.expand_dims(1)?;
            Ok(t.multiply(&cos)?.add(halves.multiply(&sin)?)?.as_dtype(t.dtype())?)
        };
        let q = rotate(qkv.index((.., 0, .., ..)))?.transpose_axes(&[1, 0, 2])?;
        let k = rotate(qkv.index((.., 1, .., ..)))?.transpose_axes(&[1, 0, 2])?;
        let v = qkv.index((.., 2, .., ..)).transpose_axes(&[1, 0, 2])?;
        let scale = (hd as f32).powf(-0.5);
        let fused = fused_head_dim(hd);
        let (q, k, v) = (pad_heads(q, fused)?, pad_heads(k, fused)?, pad_heads(v, fused)?);
        // Each image (each frame) attends to itself only.
        let mut outputs = Vec::new();
        let mut start = 0i32;
        for &[t, h, w] in grids {
            for _ in 0..t {
                let end = start + (h * w) as i32;
                let part = |a: &Array| a.index((.., start..end, ..)).expand_dims(0);
                let o = fast::scaled_dot_product_attention(part(&q)?, part(&k)?, part(&v)?, scale, None, None)?;
                outputs.push(o.squeeze_axes(&[0])?);
                start = end;
            }
        }
        let o = ops::concatenate(&outputs, 1)?.index((.., .., ..hd));
        let o = o.transpose_axes(&[1, 0, 2])?.reshape(&[len, heads * hd])?;
        block.proj.forward(&o)
    }
}

/// The dtype a tower computes in (`None`: the checkpoint's): on MLX's CPU backend f32, which
/// BLAS multiplies (it has no bf16 product, and MLX's own runs an order of magnitude slower:
/// bench/results/vision.md), as the text model's weights are dequantized there
/// (`weight_form`); GPUs keep the checkpoint's.
pub fn compute_dtype(on_gpu: bool) -> Option<Dtype> {
    (!on_gpu).then_some(Dtype::Float32)
}

/// `activation(x)` in x's dtype: mlx-rs's GELUs hold their constants as f32 arrays, which would
/// lift a bf16 tower's activations (and every product and residual after them) to f32, where
/// a GPU multiplies many times slower; mlx-vlm's stay in bf16.
fn in_dtype_of(activation: impl Fn(&Array) -> mlx_rs::error::Result<Array>, x: &Array) -> Result<Array> {
    Ok(activation(x)?.as_dtype(x.dtype())?)
}

/// The head size MLX's fused attention takes for heads of `hd`: its kernels are built for 64, 80
/// and 128, and another size falls back to products that hold every score of a picture (Qwen3.5's
/// tower has heads of 72). mlx-vlm pads the same way.
fn fused_head_dim(hd: i32) -> i32 {
    [64, 80, 128].into_iter().find(|&d| hd <= d).unwrap_or(hd)
}

/// `x` [heads, len, hd] with zero columns up to `to`: zeros add nothing to q·k, and give zero
/// output columns (cut off after the attention) when they are v's.
fn pad_heads(x: Array, to: i32) -> Result<Array> {
    let hd = x.dim(-1);
    if hd == to {
        return Ok(x);
    }
    Ok(ops::pad(&x, [(0, 0), (0, 0), (0, to - hd)].as_slice(), None, None)?)
}

/// (row, column) of each patch of an h × w grid in the processor's order: merged group by
/// merged group, row-major inside each.
fn merged_order(h: usize, w: usize, ms: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..h / ms).flat_map(move |bh| {
        (0..w / ms).flat_map(move |bw| (0..ms).flat_map(move |mh| (0..ms).map(move |mw| (bh * ms + mh, bw * ms + mw))))
    })
}
