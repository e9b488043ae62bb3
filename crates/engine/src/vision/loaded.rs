//! What a model that sees loads beside its text model: the vision tower, the image processor
//! and the token that stands for an image in a prompt.

use std::path::Path;

use serde_json::Value;

use super::processor::ImageProcessor;
use crate::error::{Error, Result};
use crate::models::qwen3_5_vision::VisionTower;
use crate::small_file::{read_text, JSON_CAP};

pub struct Vision {
    pub tower: VisionTower,
    pub processor: ImageProcessor,
    /// The token each image's features replace (`image_token_id`, Qwen's `<|image_pad|>`);
    /// a prompt holds one per image, the engine repeats it for the image's size.
    pub image_token: u32,
    /// What a chat renders for an image: the vision start, image and vision end tokens.
    pub markup: [u32; 3],
}

impl Vision {
    /// The checkpoint's vision parts: `None` for a model that reads text only (no
    /// `vision_config`, or a conversion that dropped the tower).
    pub fn load(dir: &Path, vocab: usize) -> Result<Option<Self>> {
        let path = dir.join("config.json");
        let config: Value = serde_json::from_str(&read_text(&path, JSON_CAP)?)
            .map_err(|e| Error::malformed(&path, format!("not JSON: {e}")))?;
        let Some(tower) = VisionTower::load_configured(dir, &config)? else { return Ok(None) };
        let id = |field: &str| -> Result<u32> {
            let id = config.get(field).and_then(Value::as_u64).filter(|&t| (t as usize) < vocab);
            id.map(|t| t as u32).ok_or_else(|| Error::Config {
                path: path.clone(),
                field: field.into(),
                message: format!("a model that sees needs this token, an id below {vocab}"),
            })
        };
        let image_token = id("image_token_id")?;
        let markup = [id("vision_start_token_id")?, image_token, id("vision_end_token_id")?];
        let processor = ImageProcessor::load(dir)?;
        let (t, p) = (&tower.config, &processor);
        if (p.patch_size, p.temporal_patch_size, p.merge_size)
            != (t.patch_size, t.temporal_patch_size, t.spatial_merge_size)
        {
            return Err(Error::malformed(
                dir,
                format!(
                    "the image processor cuts patches of {}x{} over {} frames merged {}x{}, the vision tower takes {}x{} over {} merged {}x{}",
                    p.patch_size, p.patch_size, p.temporal_patch_size, p.merge_size, p.merge_size,
                    t.patch_size, t.patch_size, t.temporal_patch_size, t.spatial_merge_size, t.spatial_merge_size
                ),
            ));
        }
        mlx_rs::transforms::eval(tower.arrays())?;
        Ok(Some(Vision { processor, tower, image_token, markup }))
    }
}
