//! How an engine is loaded: the one set of choices a program makes before it loads a model
//! (the runtime profile, a split across ranks, and the benchmarks' overrides), passed to
//! `Engine::load_with`. The engine reads no environment: the CLI and the app read the
//! overrides' variables and hand them in through [`EngineOptions::with_overrides`].

use std::sync::Arc;

use crate::distributed::Group;
use crate::error::{Error, Result};
use crate::layers::switch::{long_prompt_gather, Gather};
use crate::layers::Joins;
use crate::profile::Profile;
use crate::weight_form::Override;

#[derive(Clone, Default)]
pub struct EngineOptions {
    /// The runtime profile: memory settings, prefill chunk, warm-up, batching.
    pub profile: Profile,
    /// The form of the quantized weights (`FERRITE_CPU_WEIGHTS`; [`crate::weight_form`]).
    pub weights: Override,
    /// Which projections of one input are joined into one matmul (`FERRITE_JOIN`; `None`:
    /// the model's own choice).
    pub joins: Option<Joins>,
    /// How an MoE model's long prompts run their experts (`FERRITE_LONG_EXPERTS`; `None`:
    /// timed on the first long prompt).
    pub long_experts: Option<Gather>,
    /// The prompt cache's budget in MiB (`FERRITE_PROMPT_CACHE_MB`; `None`: the profile's
    /// share of memory; 0 turns the cache off).
    pub prompt_cache_mb: Option<usize>,
    /// The distributed group the model is split across (every rank of it loads the same
    /// model, then runs the same requests in the same order): `None`, the whole model here.
    pub group: Option<Arc<Group>>,
    /// A DFlash block drafter's folder, loaded beside the model: speculating requests draft
    /// with it instead of the MTP head (`None`: the head, if the model has one).
    pub drafter: Option<std::path::PathBuf>,
}

impl EngineOptions {
    /// These options with the benchmarks' overrides that `lookup` finds set, by variable name
    /// (`FERRITE_CPU_WEIGHTS`, `FERRITE_JOIN`, `FERRITE_LONG_EXPERTS`, `FERRITE_PROMPT_CACHE_MB`;
    /// unset or empty: the default). A value one refuses is a config error
    /// naming the variable.
    pub fn with_overrides(mut self, lookup: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let read = |name: &str| lookup(name).unwrap_or_default();
        let refused = |name: &str| {
            let name = name.to_string();
            move |message: String| Error::Config { path: "environment".into(), field: name.clone(), message }
        };
        self.weights = Override::parse(&read("FERRITE_CPU_WEIGHTS")).map_err(refused("FERRITE_CPU_WEIGHTS"))?;
        self.joins = Joins::parse_override(&read("FERRITE_JOIN")).map_err(refused("FERRITE_JOIN"))?;
        self.long_experts =
            long_prompt_gather(&read("FERRITE_LONG_EXPERTS")).map_err(refused("FERRITE_LONG_EXPERTS"))?.get();
        let cache = read("FERRITE_PROMPT_CACHE_MB");
        self.prompt_cache_mb = match cache.trim() {
            "" => None,
            mb => Some(
                mb.parse()
                    .map_err(|_| refused("FERRITE_PROMPT_CACHE_MB")(format!("`{mb}` is not a whole number of MiB")))?,
            ),
        };
        Ok(self)
    }
}
