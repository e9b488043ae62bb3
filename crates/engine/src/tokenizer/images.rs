//! Images in a chat's messages: each renders as the model's image markup (its vision start,
//! image and vision end tokens) where it sits, marked as the template's own text is, so a
//! client's text can neither spell nor move it.

use super::{Tokenizer, MARK_CLOSE, MARK_OPEN};
use crate::error::{Error, Result};

impl Tokenizer {
    /// Makes images render as these tokens, in order (a model that sees: its vision start,
    /// image and vision end tokens); each must be one of the tokenizer's special tokens.
    pub fn set_image_tokens(&mut self, ids: &[u32]) -> Result<()> {
        let marks = ids
            .iter()
            .map(|&id| {
                let text = self.inner.id_to_token(id);
                text.as_ref().and_then(|t| self.specials.iter().position(|s| s == t)).ok_or_else(|| Error::Tokenizer {
                    path: self.path.clone(),
                    message: format!("token {id} ({text:?}) stands for images but is not a special token"),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        self.image_marks = Some(marks);
        Ok(())
    }

    /// A message's text marked ([`Self::mark_specials`]) with the image markup's marks at
    /// `images` (where the client's own text cannot reach them).
    pub(super) fn mark_content(&self, text: &str, images: &[usize]) -> Result<String> {
        if images.is_empty() {
            return Ok(self.mark_specials(text));
        }
        let marks = self.image_marks.as_ref().ok_or_else(|| Error::Request("the model reads text only".into()))?;
        // Marked past the specials and the mark character: encoded as the tokens themselves.
        let past = self.specials.len() + 1;
        let markup: String = marks.iter().map(|i| format!("{MARK_OPEN}{}{MARK_CLOSE}", past + i)).collect();
        let (mut out, mut from) = (String::with_capacity(text.len()), 0);
        for &at in images {
            let part =
                text.get(from..at).ok_or_else(|| Error::Request(format!("an image at byte {at} of a message")))?;
            out.push_str(&self.mark_specials(part));
            out.push_str(&markup);
            from = at;
        }
        out.push_str(&self.mark_specials(&text[from..]));
        Ok(out)
    }
}
