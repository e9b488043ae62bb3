//! The engine's options as the CLI and the app give them: a profile, a split across ranks,
//! and the benchmarks' overrides (`EngineOptions::with_overrides`) read from this process's
//! environment — here, since the engine reads none.

use std::sync::Arc;

use engine::distributed::Group;
use engine::{EngineOptions, Profile};

/// Options for `profile` (split across `group` when given), with the overrides this process's
/// environment sets; a value one refuses is an error naming the variable.
pub fn from_env(profile: Profile, group: Option<Arc<Group>>) -> engine::Result<EngineOptions> {
    EngineOptions { profile, group, ..Default::default() }.with_overrides(|name| std::env::var(name).ok())
}
