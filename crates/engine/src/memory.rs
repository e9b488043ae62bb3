//! MLX's allocator, as the rest of Ferrite sees it: how much memory MLX holds (in use, its
//! peak, its buffer cache) and releasing the cache. The server reads these for `/v1/status`,
//! `/metrics` and the live view without depending on mlx-rs itself.

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
