//! The Qwen3-VL / Qwen3.5 image processor: an image resized so both sides are multiples of a
//! merged patch and its area within the checkpoint's pixel bounds, rescaled and normalised,
//! then cut into patches in the order the vision tower reads them (each merged 2x2 group of
//! patches together). What mlx-vlm's `Qwen3VLImageProcessor` computes, resized as Pillow's
//! bicubic filter does.

use std::path::Path;

use fast_image_resize::images::Image;
use fast_image_resize::{FilterType, PixelType, ResizeAlg, ResizeOptions, Resizer};
use image::RgbImage;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::small_file::{read_text, JSON_CAP};

/// The processor's settings, from the checkpoint's `preprocessor_config.json` (and
/// `processor_config.json`'s `image_processor`, which wins), else Qwen3-VL's defaults.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageProcessor {
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    pub min_pixels: u64,
    pub max_pixels: u64,
    pub rescale_factor: Option<f32>,
    /// Per channel: (x - mean) / std, when the checkpoint normalises.
    pub normalize: Option<([f32; 3], [f32; 3])>,
}

impl Default for ImageProcessor {
    fn default() -> Self {
        ImageProcessor {
            patch_size: 16,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: 56 * 56,
            max_pixels: 14 * 14 * 4 * 1280,
            rescale_factor: Some(1.0 / 255.0),
            normalize: Some(([0.5; 3], [0.5; 3])),
        }
    }
}

/// One image's patches: `values` holds `rows()` rows of `C × temporal × patch × patch`
/// values; `grid` is (frames, patch rows, patch columns).
#[derive(Debug, Clone, PartialEq)]
pub struct Patches {
    pub values: Vec<f32>,
    pub grid: [usize; 3],
}

impl Patches {
    pub fn rows(&self) -> usize {
        self.grid.iter().product()
    }

    /// The patches as the tower takes them: [rows, values a row].
    pub fn array(&self) -> mlx_rs::Array {
        let rows = self.rows().max(1);
        mlx_rs::Array::from_slice(&self.values, &[rows as i32, (self.values.len() / rows) as i32])
    }
}

/// Settings beyond these are no checkpoint's: a file that asks for them is refused.
const MAX_PATCH: usize = 64;
const MAX_MERGE: usize = 8;
const MAX_TEMPORAL: usize = 8;
const MAX_PIXELS: u64 = 64 << 20;
/// The widest aspect ratio the processor takes (as mlx-vlm's).
const MAX_ASPECT: f64 = 200.0;

impl ImageProcessor {
    /// The processor of the checkpoint in `dir`: its settings over the defaults.
    pub fn load(dir: &Path) -> Result<Self> {
        let mut settings = serde_json::Map::new();
        let mut source = dir.join("preprocessor_config.json");
        for (file, key) in [("preprocessor_config.json", None), ("processor_config.json", Some("image_processor"))] {
            let path = dir.join(file);
            if !path.exists() {
                continue;
            }
            let text = read_text(&path, JSON_CAP)?;
            let value: Value =
                serde_json::from_str(&text).map_err(|e| Error::malformed(&path, format!("not JSON: {e}")))?;
            let part = match key {
                Some(key) => value.get(key).cloned().unwrap_or(Value::Null),
                None => value,
            };
            if let Value::Object(map) = part {
                settings.extend(map);
                source = path;
            }
        }
        Self::from_settings(&settings, &source)
    }

    fn from_settings(s: &serde_json::Map<String, Value>, path: &Path) -> Result<Self> {
        let bad = |field: &str, message: String| Error::Config {
            path: path.to_path_buf(),
            field: field.to_string(),
            message,
        };
        let count = |field: &str, default: u64, max: u64| -> Result<u64> {
            match s.get(field) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => v
                    .as_u64()
                    .filter(|n| (1..=max).contains(n))
                    .ok_or_else(|| bad(field, format!("expected a whole number in 1..={max}, got {v}"))),
            }
        };
        let d = ImageProcessor::default();
        let size = s.get("size").and_then(Value::as_object);
        let from_size = |key: &str| size.and_then(|m| m.get(key)).filter(|v| !v.is_null()).cloned();
        let mut pixels = serde_json::Map::new();
        for (field, size_key) in [("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")] {
            if let Some(v) = s.get(field).filter(|v| !v.is_null()).cloned().or_else(|| from_size(size_key)) {
                pixels.insert(field.to_string(), v);
            }
        }
        let pixel_count = |field: &str, default: u64| -> Result<u64> {
            match pixels.get(field) {
                None => Ok(default),
                Some(v) => v
                    .as_u64()
                    .filter(|n| (1..=MAX_PIXELS).contains(n))
                    .ok_or_else(|| bad(field, format!("expected a pixel count in 1..={MAX_PIXELS}, got {v}"))),
            }
        };
        let flag = |field: &str| -> Result<bool> {
            match s.get(field) {
                None | Some(Value::Null) => Ok(true),
                Some(v) => v.as_bool().ok_or_else(|| bad(field, format!("expected true or false, got {v}"))),
            }
        };
        let triple = |field: &str, default: [f32; 3], positive: bool| -> Result<[f32; 3]> {
            let Some(v) = s.get(field).filter(|v| !v.is_null()) else { return Ok(default) };
            let numbers: Option<Vec<f32>> =
                v.as_array().map(|a| a.iter().filter_map(Value::as_f64).map(|x| x as f32).collect());
            match numbers {
                Some(n) if n.len() == 3 && n.iter().all(|x| x.is_finite() && (!positive || *x > 0.0)) => {
                    Ok([n[0], n[1], n[2]])
                }
                _ => Err(bad(
                    field,
                    format!("expected three finite numbers{}, got {v}", if positive { " above 0" } else { "" }),
                )),
            }
        };
        let rescale = match s.get("rescale_factor").filter(|v| !v.is_null()) {
            None => 1.0 / 255.0,
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| bad("rescale_factor", format!("expected a number above 0, got {v}")))?
                as f32,
        };
        let p = ImageProcessor {
            patch_size: count("patch_size", d.patch_size as u64, MAX_PATCH as u64)? as usize,
            temporal_patch_size: count("temporal_patch_size", d.temporal_patch_size as u64, MAX_TEMPORAL as u64)?
                as usize,
            merge_size: count("merge_size", d.merge_size as u64, MAX_MERGE as u64)? as usize,
            min_pixels: pixel_count("min_pixels", d.min_pixels)?,
            max_pixels: pixel_count("max_pixels", d.max_pixels)?,
            rescale_factor: flag("do_rescale")?.then_some(rescale),
            normalize: match flag("do_normalize")? {
                true => Some((triple("image_mean", [0.5; 3], false)?, triple("image_std", [0.5; 3], true)?)),
                false => None,
            },
        };
        if p.min_pixels > p.max_pixels {
            return Err(bad("min_pixels", format!("{} is above max_pixels {}", p.min_pixels, p.max_pixels)));
        }
        Ok(p)
    }

    /// A side's unit: a merged group of patches.
    fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// The size (height, width) an image of `height` × `width` is resized to: each side the
    /// nearest multiple of the factor (halves to even, as Python rounds), then scaled into
    /// the pixel bounds keeping the aspect ratio (qwen2_vl's `smart_resize`).
    pub fn resized_size(&self, height: usize, width: usize) -> Result<(usize, usize)> {
        if height == 0 || width == 0 {
            return Err(Error::Request(format!("an image of {width}x{height} has nothing to resize")));
        }
        let (h, w) = (height as f64, width as f64);
        if h.max(w) / h.min(w) > MAX_ASPECT {
            return Err(Error::Request(format!(
                "the image is {width}x{height}: its aspect ratio is over {MAX_ASPECT}, which the model does not take"
            )));
        }
        let factor = self.factor() as f64;
        let mut h_bar = (h / factor).round_ties_even() * factor;
        let mut w_bar = (w / factor).round_ties_even() * factor;
        if h_bar * w_bar > self.max_pixels as f64 {
            let beta = (h * w / self.max_pixels as f64).sqrt();
            h_bar = factor.max((h / beta / factor).floor() * factor);
            w_bar = factor.max((w / beta / factor).floor() * factor);
        } else if h_bar * w_bar < self.min_pixels as f64 {
            let beta = (self.min_pixels as f64 / (h * w)).sqrt();
            h_bar = (h * beta / factor).ceil() * factor;
            w_bar = (w * beta / factor).ceil() * factor;
        }
        Ok((h_bar as usize, w_bar as usize))
    }

    /// The tokens an image of `height` × `width` takes in the prompt (one per merged group),
    /// known before any pixel is processed.
    pub fn tokens(&self, height: usize, width: usize) -> Result<usize> {
        let (h, w) = self.resized_size(height, width)?;
        Ok((h / self.patch_size) * (w / self.patch_size) / (self.merge_size * self.merge_size))
    }

    /// The image's patches: resized (Pillow's bicubic), rescaled, normalised, repeated over
    /// the temporal patch, and laid out one merged group after another.
    pub fn preprocess(&self, image: &RgbImage) -> Result<Patches> {
        let (height, width) = (image.height() as usize, image.width() as usize);
        let (rh, rw) = self.resized_size(height, width)?;
        let resized =
            if (rh, rw) == (height, width) { image.as_raw().clone() } else { resize(image, rw as u32, rh as u32)? };
        let channel = |c: usize| -> Vec<f32> {
            resized
                .iter()
                .skip(c)
                .step_by(3)
                .map(|&v| {
                    let x = v as f32;
                    let x = self.rescale_factor.map_or(x, |r| x * r);
                    match self.normalize {
                        Some((mean, std)) => (x - mean[c]) / std[c],
                        None => x,
                    }
                })
                .collect()
        };
        let planes = [channel(0), channel(1), channel(2)];
        let (ps, ms, tps) = (self.patch_size, self.merge_size, self.temporal_patch_size);
        let (gh, gw) = (rh / ps, rw / ps);
        let row_len = 3 * tps * ps * ps;
        let mut values = Vec::with_capacity(gh * gw * row_len);
        // Rows in the order (merged row, merged column, row in the group, column in the group);
        // each row is (channel, frame, y, x), the frame repeated for a still image.
        for bh in 0..gh / ms {
            for bw in 0..gw / ms {
                for mh in 0..ms {
                    for mw in 0..ms {
                        let (top, left) = ((bh * ms + mh) * ps, (bw * ms + mw) * ps);
                        for plane in &planes {
                            for _ in 0..tps {
                                for y in top..top + ps {
                                    values.extend_from_slice(&plane[y * rw + left..y * rw + left + ps]);
                                }
                            }
                        }
                    }
                }
            }
        }
        Ok(Patches { values, grid: [1, gh, gw] })
    }
}

/// `image` resized to `width` × `height` with the Catmull-Rom cubic (Pillow's `BICUBIC`),
/// 8 bits a channel as Pillow keeps it. Both resample one axis, round to 8 bits and clip,
/// then the other, and the clipping in between differs by tens of levels at sharp edges with
/// the order: so one pass at a time, in Pillow's (13) order — the rows first, unless the
/// height shrinks by more than twice what the width does (the crate, given both at once,
/// always starts with the columns).
fn resize(image: &RgbImage, width: u32, height: u32) -> Result<Vec<u8>> {
    let failed = |e: &dyn std::fmt::Display| Error::Request(format!("the image cannot be resized: {e}"));
    let options = ResizeOptions::new().resize_alg(ResizeAlg::Convolution(FilterType::CatmullRom));
    let mut resizer = Resizer::new();
    let mut pass = |pixels: Vec<u8>, from: (u32, u32), to: (u32, u32)| -> Result<Vec<u8>> {
        if from == to {
            return Ok(pixels);
        }
        let source = Image::from_vec_u8(from.0, from.1, pixels, PixelType::U8x3).map_err(|e| failed(&e))?;
        let mut target = Image::new(to.0, to.1, PixelType::U8x3);
        resizer.resize(&source, &mut target, &options).map_err(|e| failed(&e))?;
        Ok(target.into_vec())
    };
    let (w, h) = (image.width(), image.height());
    let shrink = |from: u32, to: u32| from as i64 - to as i64;
    if shrink(h, height) > 0 && shrink(h, height) > 2 * shrink(w, width) {
        let columns = pass(image.as_raw().clone(), (w, h), (w, height))?;
        pass(columns, (w, height), (width, height))
    } else {
        let rows = pass(image.as_raw().clone(), (w, h), (width, h))?;
        pass(rows, (width, h), (width, height))
    }
}
