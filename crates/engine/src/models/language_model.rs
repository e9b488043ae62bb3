//! The one interface the generator, the speculator and the tools use to run a model.

use mlx_rs::Array;

use super::mtp::{MtpHead, Trunk};
use crate::batch_cache::BatchCache;
use crate::cache::Cache;
use crate::config::ModelConfig;
use crate::error::Result;

/// What the generator needs from a model.
pub trait LanguageModel: Trunk + Send {
    /// Final hidden states [B, L, H] (after the last norm) for token ids [B, L], advancing
    /// `cache` by L positions.
    fn hidden(&self, tokens: &Array, cache: &mut Cache) -> Result<Array>;
    /// Final hidden states [B, L, H] and the outputs of decoder layers `taps` concatenated
    /// on the last axis [B, L, taps × H] (what a block drafter reads), advancing `cache` by L.
    fn hidden_tapped(&self, tokens: &Array, cache: &mut Cache, taps: &[usize]) -> Result<(Array, Array)> {
        let _ = (tokens, cache, taps);
        Err(crate::error::Error::Request("this model cannot give its layers' outputs to a block drafter".into()))
    }
    /// Final hidden states [B, L, H] for input embeddings [B, L, H] (the tokens' own, with an
    /// image's rows in place of its placeholders), advancing `cache` by L positions.
    fn hidden_embedded(&self, embeddings: &Array, cache: &mut Cache) -> Result<Array> {
        let _ = (embeddings, cache);
        Err(crate::error::Error::Request("this model takes token ids only".into()))
    }
    /// [`LanguageModel::hidden_tapped`] for input embeddings (a block drafter reading a prompt
    /// with images).
    fn hidden_tapped_embedded(&self, embeddings: &Array, cache: &mut Cache, taps: &[usize]) -> Result<(Array, Array)> {
        let _ = (embeddings, cache, taps);
        Err(crate::error::Error::Request("this model takes token ids only".into()))
    }
    /// Logits [B, L, vocab] for token ids [B, L], advancing `cache` by L positions.
    fn forward(&self, tokens: &Array, cache: &mut Cache) -> Result<Array> {
        let h = self.hidden(tokens, cache)?;
        self.logits(&h)
    }
    /// Final hidden states [rows, 1, H] for one token id a row ([rows, 1]), each row a
    /// sequence of its own whose state is that row of `cache`, advanced by one position:
    /// several sequences decoded in one pass over the weights.
    fn hidden_batch(&self, tokens: &Array, cache: &mut BatchCache) -> Result<Array>;
    /// An empty cache for one sequence.
    fn new_cache(&self) -> Cache;
    fn config(&self) -> &ModelConfig;
    /// The decoder layers, for probes that time them one by one (`graph::prefill_times`).
    fn layers(&self) -> &[crate::layers::DecoderLayer] {
        &[]
    }
    /// The multi-token-prediction head, when the checkpoint has one.
    fn mtp(&self) -> Option<&MtpHead> {
        None
    }
    /// Whether this process holds only a part of the model (a rank of a split model).
    fn is_split(&self) -> bool {
        false
    }
}
