//! A request with images: made ready when its generation starts (each image token repeated
//! for its image's size), its prompt prefilled in one pass with the images' features in
//! place of those tokens, and kept out of the prompt cache and of batches — both know a
//! sequence by its tokens and positions only, and an image's tokens are all alike and its
//! positions not consecutive. It decodes plainly: speculation with images comes later.

use mlx_rs::transforms::eval;

use super::{Generation, Phase};
use crate::engine::Engine;
use crate::error::{Error, Result};
use crate::request::GenerateRequest;
use crate::vision::{prefill, ImagePrompt};

impl Engine {
    /// The request's images made ready (`None` without any); refused by name for a model
    /// that reads text only.
    pub(super) fn prepare_images(&self, request: &mut GenerateRequest) -> Result<Option<ImagePrompt>> {
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
        ImagePrompt::new(vision, &mut request.prompt, &request.images).map(Some)
    }
}

impl Generation<'_> {
    /// Whether the prompt holds images.
    pub(crate) fn has_images(&self) -> bool {
        self.images.is_some()
    }

    /// The prompt but its last token, the engine's prefill chunk a pass: the vision tower's
    /// features in place of the image tokens, at their MRoPE positions ([`prefill`]). It is
    /// all done in this one call.
    pub(super) fn prefill_images(&mut self) -> Result<bool> {
        let (Some(images), Some(vision)) = (&self.images, &self.engine.vision) else { return Ok(false) };
        let head = &self.request.prompt[..self.request.prompt.len() - 1];
        let features = vision.tower.forward(&images.patches, &images.grids)?;
        let chunk = self.engine.prefill_chunk;
        let model = self.engine.model.as_ref();
        prefill(model, head, vision.image_token, &features, &images.merged, &mut self.cache, chunk)?;
        eval(self.cache.arrays())?;
        if let Phase::Prefilling(p) = &mut self.phase {
            p.at = head.len();
        }
        Ok(false)
    }
}
