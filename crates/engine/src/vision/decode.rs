//! Image bytes from a request, decoded to RGB within bounds. A request body is untrusted: the
//! size is checked from the header before anything is decoded (a small file that claims a huge
//! canvas is a decompression bomb), the decoder's allocations are capped as well, and a file
//! whose bytes are not what its label says is refused by name.

use std::io::Cursor;

use image::{DynamicImage, ImageFormat, ImageReader, Limits, Rgb, RgbImage};

use crate::error::{Error, Result};

/// The bounds an image must keep before it is decoded.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ImageLimits {
    /// Encoded bytes.
    pub max_bytes: usize,
    /// Width or height, in pixels.
    pub max_side: u32,
    /// Width × height.
    pub max_pixels: u64,
}

impl Default for ImageLimits {
    /// A 20 MB file of at most 40 megapixels (a 16K-wide screenshot's 8:1 strip; a phone
    /// photo is 12-48): every image a coding agent sends fits, and decoding one takes at most
    /// a few hundred megabytes.
    fn default() -> Self {
        ImageLimits { max_bytes: 20 << 20, max_side: 16_384, max_pixels: 40_000_000 }
    }
}

/// The formats read, with the media types a client labels them with.
const FORMATS: [(ImageFormat, &str); 4] = [
    (ImageFormat::Png, "image/png"),
    (ImageFormat::Jpeg, "image/jpeg"),
    (ImageFormat::Gif, "image/gif"),
    (ImageFormat::WebP, "image/webp"),
];

fn refused(why: impl Into<String>) -> Error {
    Error::Request(why.into())
}

/// Decodes `bytes` (labelled `media_type` by the client, when it said) to RGB: an alpha
/// channel is dropped and grey is repeated, as PIL's `convert("RGB")` does; an animation
/// gives its first frame.
pub fn decode(bytes: &[u8], media_type: Option<&str>, limits: &ImageLimits) -> Result<RgbImage> {
    if bytes.is_empty() {
        return Err(refused("the image is empty"));
    }
    if bytes.len() > limits.max_bytes {
        return Err(refused(format!("the image is {} bytes; at most {} are read", bytes.len(), limits.max_bytes)));
    }
    let read = FORMATS.iter().map(|(_, name)| *name).collect::<Vec<_>>().join(", ");
    let (format, name) = image::guess_format(bytes)
        .ok()
        .and_then(|f| FORMATS.iter().find(|(known, _)| *known == f).copied())
        .ok_or_else(|| refused(format!("the image's bytes are not an image in a format read here ({read})")))?;
    if let Some(label) = media_type {
        let label = label.trim().to_ascii_lowercase();
        let same = label == name || (name == "image/jpeg" && label == "image/jpg");
        if !same {
            return Err(refused(format!("the image is labelled {label} but its bytes are {name}")));
        }
    }
    let reader = || ImageReader::with_format(Cursor::new(bytes), format);
    let (width, height) =
        reader().into_dimensions().map_err(|e| refused(format!("the {name} image's header cannot be read: {e}")))?;
    if width == 0 || height == 0 {
        return Err(refused(format!("the {name} image is {width}x{height}: nothing to see")));
    }
    if width.max(height) > limits.max_side || width as u64 * height as u64 > limits.max_pixels {
        return Err(refused(format!(
            "the {name} image is {width}x{height}; at most {} pixels a side and {} in all are decoded",
            limits.max_side, limits.max_pixels
        )));
    }
    let mut capped = Limits::default();
    capped.max_image_width = Some(limits.max_side);
    capped.max_image_height = Some(limits.max_side);
    // The decoded canvas at its widest (RGBA, 16 bits a channel) and the decoder's own buffers.
    capped.max_alloc = Some(limits.max_pixels * 8 + (64 << 20));
    let mut reader = reader();
    reader.limits(capped);
    let image = reader.decode().map_err(|e| refused(format!("the {name} image cannot be decoded: {e}")))?;
    Ok(to_rgb8(image))
}

/// 8 bits a channel. A 16-bit channel keeps its high byte, as Pillow reads a 16-bit RGB PNG
/// (the `image` crate would round `v / 257`: half the values one level apart). Pillow 13
/// clips a 16-bit grey PNG to 255 when converting it to RGB (all but the darkest pixels
/// white); its high byte is kept here instead, and mlx-vlm sees another image there.
fn to_rgb8(image: DynamicImage) -> RgbImage {
    use DynamicImage::{ImageLuma16, ImageLumaA16, ImageRgb16, ImageRgba16};
    if !matches!(image, ImageRgb16(_) | ImageRgba16(_) | ImageLuma16(_) | ImageLumaA16(_)) {
        return image.to_rgb8();
    }
    // At 16 bits the conversion only drops alpha and repeats grey: the values stay exact.
    let wide = image.to_rgb16();
    RgbImage::from_fn(wide.width(), wide.height(), |x, y| Rgb(wide.get_pixel(x, y).0.map(|v| (v >> 8) as u8)))
}
