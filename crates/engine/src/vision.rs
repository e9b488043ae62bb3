//! Images in, for the models that see: untrusted image bytes decoded within bounds, and the
//! Qwen3-VL / Qwen3.5 image processor (resized to the checkpoint's pixel bounds, rescaled,
//! normalised and cut into the patches its vision tower embeds), as mlx-vlm's processor does,
//! and the tower itself (`models/qwen3_5_vision.rs`).

mod decode;
mod loaded;
mod positions;
mod processor;
mod prompt;

pub use crate::models::qwen3_5_vision::{VisionConfig, VisionTower};
pub use decode::{decode, ImageLimits};
pub use loaded::Vision;
pub use positions::{angles, interleaved_axes, rope_positions, RopePositions};
pub use processor::{ImageProcessor, Patches};
pub use prompt::{prefill, ImagePrefill, ImagePrompt};
