//! MLX's allocator, as the rest of Ferrite sees it: how much memory MLX holds (in use, its
//! peak, its buffer cache) and releasing the cache, and what a token of context costs in KV
//! cache. The server reads these for `/v1/status`, `/metrics`, the live view and its check that
//! a request fits the machine's memory, without depending on mlx-rs itself.

/// MLX's allocator counters, in bytes, read now (0 for a counter MLX cannot report).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MlxMemory {
    /// Held by live arrays.
    pub active: u64,
    /// The most `active` has been since the last reset (a generation resets it).
    pub peak: u64,
    /// Freed buffers MLX keeps for reuse; [`clear_cache`] gives them back.
    pub cache: u64,
}

/// The counters now.
pub fn mlx_memory() -> MlxMemory {
    let read = |v: mlx_rs::error::Result<usize>| v.unwrap_or(0) as u64;
    MlxMemory {
        active: read(mlx_rs::memory::active_memory()),
        peak: read(mlx_rs::memory::peak_memory()),
        cache: read(mlx_rs::memory::cache_memory()),
    }
}

/// Gives MLX's buffer cache back to the system (after an unload, or a long request).
pub fn clear_cache() {
    if let Err(e) = mlx_rs::memory::clear_cache() {
        tracing::warn!("MLX could not clear its buffer cache: {e}");
    }
}

/// Bytes one more token of context takes in `model`'s KV caches: K and V of every attention
/// layer (Gated DeltaNet layers keep a fixed-size state instead) and of the MTP head's layers,
/// in the dtype the model computes in (its embeddings' output).
pub fn kv_bytes_per_token(model: &dyn crate::models::LanguageModel) -> crate::Result<u64> {
    let c = model.config();
    let attention_layers = (0..c.num_hidden_layers).filter(|&i| !c.is_linear_layer(i)).count()
        + model.mtp().map_or(0, |head| head.layers.len());
    let token = mlx_rs::Array::from_slice(&[0u32], &[1, 1]);
    let item_bytes = model.embed(&token)?.item_size() as u64;
    let per_layer = 2 * c.num_key_value_heads.max(0) as u64 * c.head_dim().max(0) as u64;
    Ok(attention_layers as u64 * per_layer * item_bytes)
}

/// How many tokens of KV cache fit in what `budget` bytes leave after what MLX holds now
/// (the weights, the prompt cache, any cache kept from the last request).
pub fn kv_room_tokens(budget: u64, kv_bytes_per_token: u64) -> usize {
    let free = budget.saturating_sub(mlx_memory().active);
    (free / kv_bytes_per_token.max(1)).min(usize::MAX as u64) as usize
}

/// MLX's peak memory since the last reset (each request resets it).
pub fn peak_memory_bytes() -> usize {
    mlx_rs::memory::peak_memory().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_an_array_holds() {
        // (Other tests allocate and free in this process meanwhile: only what this array
        // guarantees is asserted.)
        let a = mlx_rs::ops::ones::<f32>(&[256, 1024]).unwrap();
        a.eval().unwrap();
        let held = mlx_memory();
        assert!(held.active >= 1 << 20, "{held:?}");
        assert!(held.peak >= held.active, "{held:?}");
        drop(a);
        clear_cache();
    }
}
