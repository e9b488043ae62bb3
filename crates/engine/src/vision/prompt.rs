//! A prompt with images through the text model: the tokens' embeddings with each image's
//! features in place of its placeholder tokens, at their MRoPE positions; the cache then
//! holds the shift that places the tokens after the prompt.

use mlx_rs::{ops, Array};

use super::positions::{angles, rope_positions};
use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::models::LanguageModel;

/// Runs `tokens` (each image's placeholders included, `image_token` each) through `model`
/// with `features` [Σ tokens of the images, H] (the vision tower's, in placeholder order) for
/// images of merged grids `grids`; returns the final hidden states [1, L, H] and advances
/// `cache` by L positions. The whole prompt in one pass (a cached prefix comes later).
pub fn prefill(
    model: &dyn LanguageModel,
    tokens: &[u32],
    image_token: u32,
    features: &Array,
    grids: &[[usize; 3]],
    cache: &mut Cache,
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
    cache.place_next(&angles, placed.delta);
    model.hidden_embedded(&embeddings, cache)
}
