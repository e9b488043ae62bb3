//! A request with images: made ready when its generation starts (each image token repeated
//! for its image's size), looked up in the prompt cache by its images' content
//! ([`ImagePrompt::cache_key`]), and prefilled a chunk a pass from where the cached prefix
//! ends, with the images' features in place of their tokens at their MRoPE positions. In a
//! batch its row keeps its rotary shift (`BatchCache`). It speculates
//! with the MTP head, exactly: the verify passes run at the trunk's shifted positions; the
//! head reads the prompt's hidden states (at image positions too) at the trunk's MRoPE
//! positions, and its positions after the prompt are shifted as the trunk's; a block drafter
//! reads the trunk's layers over the images as over text (its own positions are its
//! context's, images or not).

use super::Generation;
use crate::cache::Cache;
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::models::LanguageModel;
use crate::request::GenerateRequest;
use crate::vision::{ImagePrefill, ImagePrompt, Vision};

/// A generation's images: ready for the tower, the prompt's key in the prompt cache, and,
/// once the prefill starts, what it needs from there on.
pub(crate) struct Images {
    prompt: ImagePrompt,
    key: Vec<u32>,
    prefill: Option<ImagePrefill>,
}

impl Engine {
    /// The request's images made ready (`None` without any); refused by name for a model
    /// that reads text only.
    pub(super) fn prepare_images(&self, request: &mut GenerateRequest) -> Result<Option<Images>> {
        if request.images.is_empty() {
            return Ok(None);
        }
        let vision = self.vision.as_ref().ok_or_else(|| {
            Error::Request(format!(
                "the request has {} image(s), but {} reads text only (it has no vision tower)",
                request.images.len(),
                self.dir.file_name().map_or_else(|| self.dir.display().to_string(), |n| n.to_string_lossy().into())
            ))
        })?;
        let prompt = ImagePrompt::new(vision, &mut request.prompt, &request.images)?;
        let key = prompt.cache_key(&request.prompt, vision.image_token);
        Ok(Some(Images { prompt, key, prefill: None }))
    }
}

impl Images {
    /// Starts the prefill at `from` (after a cached prefix of that many positions, restored
    /// into `cache`): the tower runs on the images not all cached, and the cache continues
    /// from the positions the prefix ends at (the shift returned).
    pub(super) fn begin(
        &mut self,
        model: &dyn LanguageModel,
        vision: &Vision,
        head: &[u32],
        from: usize,
        cache: &mut Cache,
    ) -> Result<i32> {
        let prefill = ImagePrefill::new(model, vision, &self.prompt, head, from)?;
        let shift = prefill.shift_at(from);
        cache.set_rope_shift(shift);
        self.prefill = Some(prefill);
        Ok(shift)
    }

    /// Feeds `head[range]`: the final hidden states and the tapped layers' outputs, or the
    /// hidden states again without `taps` ([`ImagePrefill::pass`], lazy).
    pub(super) fn feed(
        &self,
        model: &dyn LanguageModel,
        head: &[u32],
        range: std::ops::Range<usize>,
        cache: &mut Cache,
        taps: Option<&[usize]>,
    ) -> Result<(mlx_rs::Array, mlx_rs::Array)> {
        let prefill = self
            .prefill
            .as_ref()
            .ok_or_else(|| Error::Request("a prompt with images fed before its prefill".into()))?;
        prefill.pass(model, head, range, cache, taps)
    }

    /// Once the prefill started: the rotary angles of every position it feeds.
    pub(super) fn angles(&self) -> Option<&mlx_rs::Array> {
        self.prefill.as_ref().map(|p| p.angles())
    }

    /// How far the positions after the whole prompt run from their index.
    pub(super) fn shift_after(&self) -> i32 {
        self.prefill.as_ref().map_or(0, |p| p.delta())
    }
}

impl Generation<'_> {
    /// The tokens the prompt cache knows this request's prompt by: its images' placeholders
    /// spelled by their content.
    pub(super) fn prompt_key(&self) -> &[u32] {
        self.images.as_ref().map_or(&self.request.prompt, |i| &i.key)
    }
}
