//! A prompt with images through the text model: the tokens' embeddings with each image's
//! features in place of its placeholder tokens, at their MRoPE positions; the cache then
//! holds the shift that places the tokens after the prompt.

use std::sync::Arc;

use image::RgbImage;
use mlx_rs::{ops, Array};

use super::loaded::Vision;
use super::positions::{angles, rope_positions};
use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::models::LanguageModel;

/// Runs `tokens` (each image's placeholders included, `image_token` each) through `model`
/// with `features` [Σ tokens of the images, H] (the vision tower's, in placeholder order) for
/// images of merged grids `grids`, `chunk` positions a pass (a long prompt in one pass would
/// hold its whole attention at once); returns the final hidden states of the last pass
/// [1, ≤ chunk, H] and advances `cache` by L positions (a cached prefix comes later).
pub fn prefill(
    model: &dyn LanguageModel,
    tokens: &[u32],
    image_token: u32,
    features: &Array,
    grids: &[[usize; 3]],
    cache: &mut Cache,
    chunk: usize,
) -> Result<Array> {
    if cache.offset() != 0 {
        return Err(Error::Request("a prompt with images is prefilled from its start".into()));
    }
    let placed = rope_positions(tokens, image_token, grids)?;
    let needed: usize = grids.iter().map(|g| g.iter().product::<usize>()).sum();
    if features.dim(0) as usize != needed {
        return Err(Error::Request(format!("{} image features for {needed} placeholders", features.dim(0))));
    }
    let ids = Array::from_slice(tokens, &[1, tokens.len() as i32]);
    let embedded = model.embed(&ids)?;
    // Text runs from the tokens' own embeddings, image runs from the features, in order.
    let features = features.as_dtype(embedded.dtype())?.expand_dims(0)?;
    let (mut parts, mut used, mut i) = (Vec::new(), 0i32, 0usize);
    while i < tokens.len() {
        let image = tokens[i] == image_token;
        let run = tokens[i..].iter().take_while(|&&t| (t == image_token) == image).count();
        let (from, to) = (i as i32, (i + run) as i32);
        parts.push(if image {
            used += run as i32;
            ops::indexing::IndexOp::index(&features, (.., used - run as i32..used, ..))
        } else {
            ops::indexing::IndexOp::index(&embedded, (.., from..to, ..))
        });
        i += run;
    }
    let embeddings = ops::concatenate(&parts, 1)?;
    let c = model.config();
    let angles = angles(&placed.positions, c.rope_dims() as usize, c.rope_theta(), c.mrope_section())?;
    let (len, chunk) = (tokens.len() as i32, chunk.clamp(1, tokens.len().max(1)) as i32);
    let mut hidden = None;
    for from in (0..len).step_by(chunk as usize) {
        let to = (from + chunk).min(len);
        cache.place_next(&ops::indexing::IndexOp::index(&angles, from..to), placed.delta);
        let part = ops::indexing::IndexOp::index(&embeddings, (.., from..to, ..));
        let h = model.hidden_embedded(&part, cache)?;
        if to < len {
            mlx_rs::transforms::eval(cache.arrays())?;
        }
        hidden = Some(h);
    }
    hidden.ok_or_else(|| Error::Request("an empty prompt".into()))
}

/// A request's images made ready for the model: their patches [rows, patch values] and
/// grids for the tower, and their grids after the spatial merge (one prompt token each).
pub struct ImagePrompt {
    pub patches: Array,
    pub grids: Vec<[usize; 3]>,
    pub merged: Vec<[usize; 3]>,
}

impl ImagePrompt {
    /// Preprocesses `images` and repeats each of `prompt`'s image tokens — one per image, in
    /// their order, as a chat template renders them — for its image's number of tokens.
    pub fn new(vision: &Vision, prompt: &mut Vec<u32>, images: &[Arc<RgbImage>]) -> Result<Self> {
        let placeholders = prompt.iter().filter(|&&t| t == vision.image_token).count();
        if placeholders != images.len() {
            return Err(Error::Request(format!(
                "the prompt has {placeholders} image placeholders for {} images",
                images.len()
            )));
        }
        if prompt.last() == Some(&vision.image_token) {
            return Err(Error::Request("a prompt with images ends with text after them".into()));
        }
        let ms = vision.processor.merge_size;
        let patches = images.iter().map(|i| vision.processor.preprocess(i)).collect::<Result<Vec<_>>>()?;
        let grids: Vec<[usize; 3]> = patches.iter().map(|p| p.grid).collect();
        let merged: Vec<[usize; 3]> = grids.iter().map(|g| [g[0], g[1] / ms, g[2] / ms]).collect();
        let mut sizes = merged.iter().map(|g| g.iter().product::<usize>());
        let mut expanded = Vec::with_capacity(prompt.len());
        for &token in prompt.iter() {
            match token == vision.image_token {
                true => expanded.extend(std::iter::repeat_n(token, sizes.next().unwrap_or(0))),
                false => expanded.push(token),
            }
        }
        *prompt = expanded;
        let width = vision.tower.config.patch_values();
        let values: Vec<f32> = patches.iter().flat_map(|p| p.values.iter().copied()).collect();
        let patches = Array::from_slice(&values, &[(values.len() / width) as i32, width as i32]);
        Ok(ImagePrompt { patches, grids, merged })
    }
}
