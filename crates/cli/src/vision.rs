//! `ferrite dev vision-tower`: the vision tower's speed on one picture, for bench/vision.sh
//! (mlx-vlm's tower runs the same patches there).

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use engine::vision::{ImageProcessor, VisionTower};
use serde_json::json;

/// A deterministic picture with edges and gradients (what a screenshot has).
fn picture(width: u32, height: u32) -> image::RgbImage {
    image::RgbImage::from_fn(width, height, |x, y| {
        let edge = if (x / 17 + y / 11) % 2 == 0 { 60 } else { 0 };
        image::Rgb([
            (x * 255 / width.max(1)) as u8,
            ((y * 255 / height.max(1)) as u8).saturating_add(edge),
            ((x ^ y) % 256) as u8,
        ])
    })
}

pub fn tower_times(model: &Path, width: u32, height: u32, runs: usize, patches_out: Option<&Path>) -> Result<()> {
    let tower =
        VisionTower::load_checkpoint(model)?.with_context(|| format!("{}: no vision tower", model.display()))?;
    let processor = ImageProcessor::load(model)?;
    let patches = processor.preprocess(&picture(width, height))?;
    if let Some(path) = patches_out {
        std::fs::write(path, patches.values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
    }
    let input = patches.array();
    let mut seconds = Vec::new();
    for run in 0..=runs {
        let started = Instant::now();
        tower.forward(&input, &[patches.grid])?.eval()?;
        if run > 0 {
            seconds.push(started.elapsed().as_secs_f64());
        }
    }
    println!("{}", json!({"engine": "ferrite", "grid": patches.grid, "patches": patches.rows(), "seconds": seconds}));
    Ok(())
}
