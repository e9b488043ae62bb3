//! Images in requests, as the three APIs send them — OpenAI's `image_url` and the Responses
//! API's `input_image` (a `data:` URL), Anthropic's `image` blocks (base64), at the top level
//! or inside a `tool_result` — decoded within bounds by the engine (`vision::decode`) for a
//! model that sees, in the order the prompt places them. Whatever is wrong is refused with
//! the block's path: a model that reads text only, a URL to fetch, bad base64, a file that is
//! not what it says, too large or too many.

use std::sync::Arc;

use base64::Engine as _;
use engine::vision::{decode, ImageLimits};
use image::RgbImage;

use crate::error::ApiError;

/// Images one request may carry: each takes hundreds to thousands of prompt tokens.
pub(crate) const MAX_IMAGES: usize = 32;

/// The images of a request, as its prompt meets them.
pub(crate) struct Images {
    sees: bool,
    limits: ImageLimits,
    list: Vec<Arc<RgbImage>>,
}

fn refused(path: &str, why: impl std::fmt::Display) -> ApiError {
    ApiError::bad_request(format!("{path}: {why}")).with_param(path)
}

impl Images {
    /// For a model that sees (`sees`), or one that reads text only (every image refused).
    pub(crate) fn new(sees: bool) -> Self {
        Images { sees, limits: ImageLimits::default(), list: Vec::new() }
    }

    pub(crate) fn sees(&self) -> bool {
        self.sees
    }

    /// An image given as a URL at `path` (OpenAI's `image_url.url`, the Responses API's
    /// `image_url`): a `data:` URL with base64 bytes; any other is not fetched.
    pub(crate) fn url(&mut self, url: &str, path: &str) -> Result<(), ApiError> {
        self.check(path)?;
        let Some(rest) = url.strip_prefix("data:") else {
            return Err(refused(path, "images are not fetched from URLs: send the image as a data: URL (base64)"));
        };
        let (label, data) =
            rest.split_once(',').ok_or_else(|| refused(path, "a data: URL needs a comma before its data"))?;
        let Some(media_type) = label.strip_suffix(";base64") else {
            return Err(refused(path, "a data: URL's image must be base64 (data:image/png;base64,...)"));
        };
        self.base64(Some(media_type), data, path)
    }

    /// base64 `data` labelled `media_type` (Anthropic's image `source`) at `path`.
    pub(crate) fn base64(&mut self, media_type: Option<&str>, data: &str, path: &str) -> Result<(), ApiError> {
        self.check(path)?;
        // Checked before decoding: base64 is a third larger than the bytes it holds.
        if data.len() / 4 * 3 > self.limits.max_bytes + 3 {
            return Err(refused(path, format!("the image is over {} bytes", self.limits.max_bytes)));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map_err(|e| refused(path, format!("the image's base64 does not decode: {e}")))?;
        let media_type = media_type.filter(|m| !m.is_empty());
        let image = decode(&bytes, media_type, &self.limits).map_err(|e| refused(path, request_message(&e)))?;
        self.list.push(Arc::new(image));
        Ok(())
    }

    /// A model that reads text only takes no image; one that sees at most [`MAX_IMAGES`].
    fn check(&self, path: &str) -> Result<(), ApiError> {
        if !self.sees {
            return Err(refused(path, "images are not supported: the model reads text only"));
        }
        if self.list.len() >= MAX_IMAGES {
            return Err(refused(path, format!("a request carries at most {MAX_IMAGES} images")));
        }
        Ok(())
    }

    /// The images, in the order the prompt placed them.
    pub(crate) fn into_list(self) -> Vec<Arc<RgbImage>> {
        self.list
    }
}

/// An image part's URL as the APIs send it: `{"url": ...}` (OpenAI's `image_url`) or the
/// URL itself (the Responses API's `input_image`).
#[derive(Debug, serde::Deserialize)]
#[serde(untagged)]
pub(crate) enum ImageUrl {
    Url(String),
    Object { url: String },
}

impl ImageUrl {
    pub(crate) fn url(&self) -> &str {
        match self {
            ImageUrl::Url(u) | ImageUrl::Object { url: u } => u,
        }
    }
}

/// Typed parts (kind, text, image URL) as one text, and where the image parts sit in it
/// (each decoded into `images`); other kinds are left out.
pub(crate) fn text_and_images<'p>(
    parts: impl Iterator<Item = (&'p str, Option<&'p str>, Option<&'p str>)>,
    images: &mut Images,
    path: &str,
) -> Result<(String, Vec<usize>), ApiError> {
    let (mut text, mut at) = (String::new(), Vec::new());
    for (j, (kind, part_text, url)) in parts.enumerate() {
        match (kind, part_text) {
            (kind, Some(t)) if kind.ends_with("text") => text.push_str(t),
            ("image_url" | "input_image", _) => {
                images.url(url.unwrap_or_default(), &format!("{path}[{j}].image_url"))?;
                at.push(text.len());
            }
            _ => {}
        }
    }
    Ok((text, at))
}

/// An engine refusal without its `request: ` prefix (the path says where).
fn request_message(e: &engine::Error) -> String {
    match e {
        engine::Error::Request(why) => why.clone(),
        other => other.to_string(),
    }
}
