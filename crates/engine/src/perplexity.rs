//! How well a model predicts a long text position by position: the negative log-likelihood
//! of each next token, the prompt run through the model in chunks with its cache (as a real
//! prefill runs it), so that quality past the trained context can be measured
//! (`ferrite dev perplexity`).

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::{ops, Array};

use crate::error::Result;
use crate::models::LanguageModel;

/// The NLL (nats) of `ids[i + 1]` given `ids[..=i]`, for every i, computed `chunk` positions
/// at a time.
pub fn position_nll(model: &dyn LanguageModel, ids: &[u32], chunk: usize) -> Result<Vec<f32>> {
    let mut cache = model.new_cache();
    let mut nll = Vec::with_capacity(ids.len().saturating_sub(1));
    for (start, piece) in ids.chunks(chunk.max(1)).enumerate().map(|(i, p)| (i * chunk.max(1), p)) {
        let x = Array::from_slice(piece, &[1, piece.len() as i32]);
        let logits = model.forward(&x, &mut cache)?.index(0).as_dtype(mlx_rs::Dtype::Float32)?;
        // Targets: the next token of each position that has one within `ids`.
        let targets: Vec<i32> = (start + 1..(start + piece.len() + 1).min(ids.len())).map(|i| ids[i] as i32).collect();
        let logits = logits.index(..targets.len() as i32);
        let logprobs = logits.subtract(ops::logsumexp_axis(&logits, -1, true)?)?;
        let picked =
            ops::indexing::take_along_axis(&logprobs, Array::from_slice(&targets, &[targets.len() as i32, 1]), -1)?;
        picked.eval()?;
        nll.extend(picked.as_slice::<f32>().iter().map(|lp| -lp));
    }
    Ok(nll)
}
