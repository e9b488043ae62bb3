//! Runtime profiles: named, documented sets of the knobs that trade speed for heat and
//! memory. Every caller (CLI, server, app) resolves a profile through [`Profile::named`], so
//! one name always means the same knobs, and [`Profile::knobs`] shows all of them.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProfileName {
    /// Cool and steady for hours; leaves the rest of the machine usable (the default).
    #[default]
    Sustained,
    /// Flat out: bigger prefill chunks, a warm-up at load, weights kept resident.
    Turbo,
}

impl ProfileName {
    pub const ALL: [ProfileName; 2] = [ProfileName::Sustained, ProfileName::Turbo];
}

impl fmt::Display for ProfileName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ProfileName::Sustained => "sustained",
            ProfileName::Turbo => "turbo",
        })
    }
}

impl FromStr for ProfileName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "sustained" => Ok(ProfileName::Sustained),
            "turbo" => Ok(ProfileName::Turbo),
            other => Err(format!("unknown profile `{other}` (expected sustained or turbo)")),
        }
    }
}

/// The knobs themselves. Nothing else in the engine changes with the profile.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Profile {
    pub name: ProfileName,
    /// Prompt tokens per prefill step (bigger: faster prefill, higher peak memory).
    pub prefill_chunk: usize,
    /// Run a short generation at load so the first request pays no kernel compilation.
    pub warmup: bool,
    /// Cap on MLX's buffer cache, as a fraction of MLX's memory limit (`None`: MLX's default).
    pub cache_limit_fraction: Option<f64>,
    /// Release MLX's buffer cache after a request whose context reached this many tokens.
    pub trim_cache_after_tokens: Option<usize>,
    /// Ask the OS to keep the weights resident (Metal's wired limit; no effect elsewhere).
    pub wire_weights: bool,
    /// The prompt cache's budget, as a fraction of the machine's memory (0: no cache).
    pub prompt_cache_fraction: f64,
    /// Requests decoded together at most (one forward pass a step for all of them); more wait
    /// in the queue.
    pub max_sequences: usize,
    /// Prompt tokens of a newcomer prefilled per decode step while others decode (a divisor
    /// of `prefill_chunk`): smaller keeps their tokens coming, larger brings the newcomer's
    /// first token sooner (bench/results/batch.md measures both).
    pub prefill_interleave: usize,
    /// The share of the memory left beside the model that the KV caches of a batch may
    /// reserve (each request its prompt and longest answer); a newcomer beyond it waits until
    /// others end. A request alone may use all of it.
    pub batch_memory_share: f64,
    /// Seconds a speculating request keeps the model to itself while others wait, where the
    /// tuner measured that its speculation gains more than batching them
    /// (`engine::batch_rule`); then they decode together anyway. Longer serves more tokens a
    /// second; shorter brings the waiting ones' first token sooner.
    pub speculation_hold_s: f64,
}

impl Profile {
    pub fn named(name: ProfileName) -> Profile {
        match name {
            ProfileName::Sustained => Profile {
                name,
                prefill_chunk: 2048,
                warmup: false,
                cache_limit_fraction: Some(0.25),
                trim_cache_after_tokens: Some(8192),
                wire_weights: false,
                prompt_cache_fraction: 1.0 / 16.0,
                max_sequences: 4,
                prefill_interleave: 256,
                batch_memory_share: 0.5,
                speculation_hold_s: 6.0,
            },
            ProfileName::Turbo => Profile {
                name,
                prefill_chunk: 8192,
                warmup: true,
                cache_limit_fraction: None,
                trim_cache_after_tokens: None,
                wire_weights: true,
                prompt_cache_fraction: 1.0 / 8.0,
                max_sequences: 8,
                prefill_interleave: 512,
                batch_memory_share: 0.9,
                speculation_hold_s: 3.0,
            },
        }
    }

    /// The prompt cache's budget in bytes on a machine with `total_memory` bytes
    /// (`EngineOptions::prompt_cache_mb` overrides it).
    pub fn prompt_cache_bytes(&self, total_memory: u64) -> usize {
        (total_memory as f64 * self.prompt_cache_fraction) as usize
    }

    /// Every knob with its value, for status pages and response metadata.
    pub fn knobs(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or_default()
    }

    /// The cap this profile puts on MLX's buffer cache, in bytes (`None`: MLX's default, its
    /// memory limit).
    pub fn cache_limit_bytes(&self) -> Option<u64> {
        let limit = mlx_rs::memory::memory_limit().ok()? as f64;
        self.cache_limit_fraction.map(|f| (limit * f) as u64)
    }

    /// Applies the process-wide MLX settings (buffer-cache cap, wired limit).
    pub fn apply_memory_settings(&self, weight_bytes: usize) {
        let limit = mlx_rs::memory::memory_limit().unwrap_or(0);
        let cache_limit = match self.cache_limit_fraction {
            Some(f) if limit > 0 => (limit as f64 * f) as usize,
            _ => limit,
        };
        if cache_limit > 0 {
            let _ = mlx_rs::memory::set_cache_limit(cache_limit);
        }
        // Only Metal has a wired limit; elsewhere MLX refuses it, which is fine.
        #[cfg(target_os = "macos")]
        {
            let wired = if self.wire_weights { weight_bytes } else { 0 };
            if let Err(e) = mlx_rs::memory::set_wired_limit(wired) {
                tracing::warn!("could not set the wired limit to {wired} bytes: {e}");
            }
        }
        #[cfg(not(target_os = "macos"))]
        let _ = weight_bytes;
    }
}

impl Default for Profile {
    fn default() -> Self {
        Profile::named(ProfileName::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for name in ProfileName::ALL {
            assert_eq!(name.to_string().parse::<ProfileName>().unwrap(), name);
            assert_eq!(Profile::named(name).name, name);
        }
        assert_eq!("Turbo".parse::<ProfileName>().unwrap(), ProfileName::Turbo);
        assert!("fast".parse::<ProfileName>().unwrap_err().contains("fast"));
        assert_eq!(Profile::default().name, ProfileName::Sustained);
    }

    #[test]
    fn knobs_show_every_field() {
        let k = Profile::named(ProfileName::Turbo).knobs();
        for field in [
            "name",
            "prefill_chunk",
            "warmup",
            "cache_limit_fraction",
            "trim_cache_after_tokens",
            "wire_weights",
            "prompt_cache_fraction",
            "max_sequences",
            "prefill_interleave",
            "batch_memory_share",
            "speculation_hold_s",
        ] {
            assert!(k.get(field).is_some(), "{field} missing from {k}");
        }
        assert_eq!(k["name"], "turbo");
    }
}
