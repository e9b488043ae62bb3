//! `ferrite dev vision-tower`: the vision tower's speed on one picture, for bench/vision.sh
//! (mlx-vlm's tower runs the same patches there); `ferrite dev vision-prefill`: a whole prompt
//! with that picture to its first token, for bench/vision_prefill.sh (mlx-vlm's model runs the
//! same tokens and patches).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use engine::vision::{ImageProcessor, Patches, VisionTower};
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

/// The picture a vision benchmark runs, on which checkpoint, how often, and where it writes the
/// patches for its peer.
#[derive(clap::Args)]
pub struct PictureArgs {
    #[arg(long)]
    model: PathBuf,
    #[arg(long, default_value_t = 512)]
    width: u32,
    #[arg(long, default_value_t = 512)]
    height: u32,
    /// Timed runs after a warm-up.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Writes the patches (little-endian f32) here, for the peer to take the same input.
    #[arg(long)]
    patches_out: Option<PathBuf>,
}

impl PictureArgs {
    fn write_patches(&self, patches: &Patches) -> Result<()> {
        if let Some(path) = &self.patches_out {
            std::fs::write(path, patches.values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>())?;
        }
        Ok(())
    }
}

pub fn tower_times(a: &PictureArgs) -> Result<()> {
    let model = &a.model;
    let tower =
        VisionTower::load_checkpoint(model)?.with_context(|| format!("{}: no vision tower", model.display()))?;
    let processor = ImageProcessor::load(model)?;
    let patches = processor.preprocess(&picture(a.width, a.height))?;
    a.write_patches(&patches)?;
    let input = patches.array();
    let mut seconds = Vec::new();
    for run in 0..=a.runs {
        let started = Instant::now();
        tower.forward(&input, &[patches.grid])?.eval()?;
        if run > 0 {
            seconds.push(started.elapsed().as_secs_f64());
        }
    }
    println!("{}", json!({"engine": "ferrite", "grid": patches.grid, "patches": patches.rows(), "seconds": seconds}));
    Ok(())
}

pub fn prefill_times(a: &PictureArgs, text: usize, tokens_out: Option<&Path>) -> Result<()> {
    let model = &a.model;
    let engine = engine::Engine::load(model)?;
    let vision = engine.vision().with_context(|| format!("{}: the model does not see", model.display()))?;
    let picture = Arc::new(picture(a.width, a.height));
    let patches = vision.processor.preprocess(&picture)?;
    let [start, image, end] = vision.markup;
    let vocab = engine.model().config().vocab_size.max(2) as u32;
    // Text ids below the vision tokens; each run's first differs, so none resumes from the
    // prompt cache.
    let ordinary = vocab.min(start.min(image).min(end)).max(2) - 1;
    let words =
        |from: usize, n: usize| (from..from + n).map(|i| 1 + (i as u32 * 7919) % ordinary).collect::<Vec<u32>>();
    let (before, after) = (words(0, text / 2), words(text / 2, text - text / 2));
    let prompt =
        |run: usize| [vec![1 + run as u32 % ordinary], before.clone(), vec![start, image, end], after.clone()].concat();
    a.write_patches(&patches)?;
    let image_tokens = vision.processor.tokens(picture.height() as usize, picture.width() as usize)?;
    if let Some(path) = tokens_out {
        let expanded: Vec<u32> =
            [vec![1], before.clone(), vec![start], vec![image; image_tokens], vec![end], after.clone()].concat();
        std::fs::write(path, serde_json::to_string(&expanded)?)?;
    }
    let (mut seconds, mut first) = (Vec::new(), Vec::new());
    let mut prompt_tokens = 0;
    for run in 0..=a.runs {
        let mut request = engine::GenerateRequest::greedy(prompt(run), 1);
        request.images = vec![picture.clone()];
        let mut generation = engine.generate(request, engine::CancelToken::default())?;
        let mut summary = None;
        for event in generation.by_ref() {
            if let engine::Event::Finished(s) = event? {
                summary = Some(s);
            }
        }
        let summary = summary.context("the generation ended without a summary")?;
        anyhow::ensure!(summary.usage.cached_tokens == 0, "run {run} resumed from the prompt cache");
        prompt_tokens = summary.usage.prompt_tokens;
        // The greedy first token of each run (the peer's must be the same).
        first.push(generation.tokens().first().copied());
        if run > 0 {
            seconds.push(summary.timings.ttft.as_secs_f64());
        }
    }
    let line = json!({"engine": "ferrite", "grid": patches.grid, "image_tokens": image_tokens,
        "prompt_tokens": prompt_tokens, "first": first, "seconds": seconds});
    println!("{line}");
    Ok(())
}
