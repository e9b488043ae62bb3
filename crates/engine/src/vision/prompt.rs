//! A prompt with images through the text model: the tokens' embeddings with each image's
//! features in place of its placeholder tokens, at their MRoPE positions; the cache then
//! holds the shift that places the tokens after the prompt. A prefill may resume after a
//! cached prefix ([`ImagePrefill`]): the prompt cache knows each image by its content
//! ([`ImagePrompt::cache_key`]), so the same screenshot twice is one prefix.

use std::ops::Range;
use std::sync::Arc;

use image::RgbImage;
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, Array};
use sha2::{Digest, Sha256};

use super::loaded::Vision;
use super::positions::{angles, rope_positions, RopePositions};
use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::models::LanguageModel;

/// The embeddings [1, to - from, H] of `tokens[from..to]`: text tokens' own, image tokens'
/// rows of `features` [rows, H] in order, the first image token at or after `from` taking row
/// `first_row`.
fn embed_range(
    model: &dyn LanguageModel,
    tokens: &[u32],
    range: Range<usize>,
    image_token: u32,
    features: &Array,
    first_row: usize,
) -> Result<Array> {
    let (from, to) = (range.start, range.end);
    let ids = Array::from_slice(&tokens[from..to], &[1, (to - from) as i32]);
    let embedded = model.embed(&ids)?;
    let features = features.as_dtype(embedded.dtype())?.expand_dims(0)?;
    let (mut parts, mut row, mut i) = (Vec::new(), first_row as i32, from);
    while i < to {
        let image = tokens[i] == image_token;
        let run = tokens[i..to].iter().take_while(|&&t| (t == image_token) == image).count();
        parts.push(if image {
            row += run as i32;
            features.index((.., row - run as i32..row, ..))
        } else {
            embedded.index((.., (i - from) as i32..(i + run - from) as i32, ..))
        });
        i += run;
    }
    Ok(ops::concatenate(&parts, 1)?)
}

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
    let c = model.config();
    let angles = angles(&placed.positions, c.rope_dims() as usize, c.rope_theta(), c.mrope_section())?;
    let run = ImagePrefill { placed, angles, features: features.clone(), rows_before: 0, image_token };
    let chunk = chunk.max(1);
    let mut hidden = None;
    for from in (0..tokens.len()).step_by(chunk) {
        let to = (from + chunk).min(tokens.len());
        hidden = Some(run.pass(model, tokens, from..to, cache, None)?.0);
        if to < tokens.len() {
            mlx_rs::transforms::eval(cache.arrays())?;
        }
    }
    hidden.ok_or_else(|| Error::Request("an empty prompt".into()))
}

/// A prompt's prefill with images, from wherever a cached prefix ends: the positions and
/// rotary angles of the whole prompt, and the tower's features of the images not all cached.
pub struct ImagePrefill {
    placed: RopePositions,
    /// [L, rotary dims / 2]: every prompt position's.
    angles: Array,
    /// The tower's features of the images from the first one with a placeholder not cached.
    features: Array,
    /// Image tokens before those images (their features are not computed).
    rows_before: usize,
    image_token: u32,
}

impl ImagePrefill {
    /// For the prompt `tokens` (the image tokens repeated as [`ImagePrompt::new`] made them)
    /// resumed at `from`: runs `vision`'s tower on the images with a placeholder at or after
    /// `from` only.
    pub fn new(
        model: &dyn LanguageModel,
        vision: &Vision,
        images: &ImagePrompt,
        tokens: &[u32],
        from: usize,
    ) -> Result<Self> {
        let placed = rope_positions(tokens, vision.image_token, &images.merged)?;
        let c = model.config();
        let angles = angles(&placed.positions, c.rope_dims() as usize, c.rope_theta(), c.mrope_section())?;
        // The images whose placeholders all lie before `from` need no features.
        let (mut rows_before, mut first, mut at) = (0, images.merged.len(), 0);
        for (i, grid) in images.merged.iter().enumerate() {
            let start = at + tokens[at..].iter().position(|&t| t == vision.image_token).unwrap_or(0);
            let count: usize = grid.iter().product();
            if start + count > from {
                first = i;
                break;
            }
            rows_before += count;
            at = start + count;
        }
        let features = match images.rows.get(first..) {
            Some(rows) if !rows.is_empty() => {
                let patches = images.patches.index(rows[0].start as i32..rows[rows.len() - 1].end as i32);
                vision.tower.forward(&patches, &images.grids[first..])?
            }
            _ => ops::zeros::<f32>(&[0, c.hidden_size])?,
        };
        Ok(ImagePrefill { placed, angles, features, rows_before, image_token: vision.image_token })
    }

    /// The rotary angles [L, rotary dims / 2] of every position of the prompt it feeds.
    pub fn angles(&self) -> &Array {
        &self.angles
    }

    /// How far the rotary positions after the whole prompt run from their index.
    pub fn delta(&self) -> i32 {
        self.placed.delta
    }

    /// How far the rotary positions after the first `len` tokens run from their index (what
    /// a cache restored to `len` positions continues with).
    pub fn shift_at(&self, len: usize) -> i32 {
        let next = self.placed.positions[..len].iter().flatten().max().map_or(0, |&p| p + 1);
        next - len as i32
    }

    /// Feeds `tokens[range]` through `model`: their embeddings (features for image tokens) at
    /// their angles; the cache then continues with the prompt's shift. Returns the final
    /// hidden states [1, L, H] and what a drafter reads at them: the outputs of layers `taps`
    /// concatenated (a block drafter's), else the hidden states again (lazy).
    pub fn pass(
        &self,
        model: &dyn LanguageModel,
        tokens: &[u32],
        range: Range<usize>,
        cache: &mut Cache,
        taps: Option<&[usize]>,
    ) -> Result<(Array, Array)> {
        let before = tokens[..range.start].iter().filter(|&&t| t == self.image_token).count();
        let first_row = before.checked_sub(self.rows_before).ok_or_else(|| {
            Error::Request("a prefill with images resumed before the images it has features for".into())
        })?;
        let part = embed_range(model, tokens, range.clone(), self.image_token, &self.features, first_row)?;
        cache.place_next(&self.angles.index(range.start as i32..range.end as i32), self.placed.delta);
        match taps {
            Some(taps) => model.hidden_tapped_embedded(&part, cache, taps),
            None => model.hidden_embedded(&part, cache).map(|h| (h.clone(), h)),
        }
    }
}

/// A request's images made ready for the model: their patches [rows, patch values] and
/// grids for the tower, and their grids after the spatial merge (one prompt token each).
pub struct ImagePrompt {
    pub patches: Array,
    pub grids: Vec<[usize; 3]>,
    pub merged: Vec<[usize; 3]>,
    /// Each image's rows of `patches`.
    rows: Vec<Range<usize>>,
    /// Each image's SHA-256 over its size and pixels.
    hashes: Vec<[u8; 32]>,
}

/// The ids an image's `count` placeholders have in the prompt cache's keys: above every
/// vocabulary (the top bit set), from its hash, so two images share a key only if their
/// hashes agree (a run of 8 placeholders spells 248 bits of it).
fn content_ids(hash: &[u8; 32], count: usize) -> impl Iterator<Item = u32> + '_ {
    (0..count).map(move |k| {
        let word = u32::from_le_bytes([
            hash[4 * (k % 8)],
            hash[4 * (k % 8) + 1],
            hash[4 * (k % 8) + 2],
            hash[4 * (k % 8) + 3],
        ]);
        0x8000_0000 | ((word ^ (k as u32).wrapping_mul(0x9e37_79b9)) & 0x7fff_ffff)
    })
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
        let mut rows = Vec::with_capacity(patches.len());
        for p in &patches {
            let start = rows.last().map_or(0, |r: &Range<usize>| r.end);
            rows.push(start..start + p.values.len() / width);
        }
        let values: Vec<f32> = patches.iter().flat_map(|p| p.values.iter().copied()).collect();
        let patches = Array::from_slice(&values, &[(values.len() / width) as i32, width as i32]);
        let hashes = images
            .iter()
            .map(|i| {
                let mut h = Sha256::new();
                h.update(i.width().to_le_bytes());
                h.update(i.height().to_le_bytes());
                h.update(i.as_raw());
                h.finalize().into()
            })
            .collect();
        Ok(ImagePrompt { patches, grids, merged, rows, hashes })
    }

    /// `prompt` (as [`ImagePrompt::new`] left it) as the prompt cache knows it: each image's
    /// placeholders replaced by ids from the image's content ([`content_ids`]), so a cached
    /// prefix is reused only for the same images, and text before the first image still
    /// matches a text-only prompt's.
    pub fn cache_key(&self, prompt: &[u32], image_token: u32) -> Vec<u32> {
        let mut key = Vec::with_capacity(prompt.len());
        let (mut images, mut i) = (self.hashes.iter().zip(&self.merged), 0);
        while i < prompt.len() {
            if prompt[i] != image_token {
                key.push(prompt[i]);
                i += 1;
                continue;
            }
            let Some((hash, grid)) = images.next() else { break };
            let count: usize = grid.iter().product::<usize>().min(prompt.len() - i);
            key.extend(content_ids(hash, count));
            i += count;
        }
        key.extend(&prompt[key.len()..]);
        key
    }
}
