//! How a model name becomes a running model, the same way for the CLI and the app: the name
//! is resolved through the store (folder, catalog id or alias, registered id, repository), the
//! catalog's block drafter comes along when it is installed, and how requests speculate (plain,
//! the MTP head or the block drafter, at a depth) comes from what `ferrite tune` stored for this
//! machine, model and profile.

use std::path::Path;

use anyhow::Result;
use engine::batch_rule::{BatchGain, BatchRule};
use engine::workload::WorkloadClass;
use engine::{DraftWith, ProfileName, Speculation};
use store::tuning::{model_identity, TunedDrafter, TunedResult, TuningFile, TuningKey};

use crate::depth_plan::DepthPlan;
use crate::{ModelSpec, Resolver};

/// A model name: a folder, a catalog id or alias, a registered id, or a repository.
pub fn resolve(name: &str) -> Result<store::Resolved> {
    // A folder works without a store (and without a config directory to read).
    let builtin = store::Catalog::load(None)?;
    if let Some(resolved) = store::models::folder_model(Path::new(name), &builtin) {
        return Ok(resolved);
    }
    Ok(store::Store::open_default()?.resolve(name)?)
}

/// This machine as the tuning file keys it: chip, cores, memory, OS, MLX backend and
/// version, Ferrite version.
pub fn machine_fingerprint() -> String {
    let m = telemetry::machine::facts();
    format!(
        "{} ({} cores), {} GiB, {}, MLX {} on {}, ferrite {}",
        m.cpu,
        m.cores,
        m.memory_gib,
        m.os,
        engine::device::mlx_version(),
        engine::device::backend(),
        env!("CARGO_PKG_VERSION")
    )
}

pub fn tuning_key(dir: &Path, profile: ProfileName) -> TuningKey {
    TuningKey { machine: machine_fingerprint(), model: model_identity(dir), profile: profile.to_string(), class: None }
}

/// The key of a result for one workload class.
pub fn class_tuning_key(dir: &Path, profile: ProfileName, class: WorkloadClass) -> TuningKey {
    TuningKey { class: Some(class.to_string()), ..tuning_key(dir, profile) }
}

/// A stored result's choice.
pub fn stored_choice(r: &TunedResult) -> Speculation {
    let drafter = match r.drafter {
        TunedDrafter::Mtp => DraftWith::Mtp,
        TunedDrafter::Block => DraftWith::Block,
    };
    Speculation { drafter, depth: r.depth }
}

/// A choice as the tuning file stores it.
pub fn tuned_drafter(choice: Speculation) -> TunedDrafter {
    match choice.drafter {
        DraftWith::Mtp => TunedDrafter::Mtp,
        DraftWith::Block => TunedDrafter::Block,
    }
}

/// The choices stored for workload classes on this machine, for this model folder and profile.
pub fn class_choices(dir: &Path, profile: ProfileName) -> Vec<(WorkloadClass, Speculation)> {
    let (file, _) = TuningFile::load(&store::config::config_dir());
    let key = tuning_key(dir, profile);
    WorkloadClass::ALL
        .into_iter()
        .filter_map(|class| {
            let found = file.find(&TuningKey { class: Some(class.to_string()), ..key.clone() })?;
            Some((class, stored_choice(found)))
        })
        .collect()
}

/// When a speculating request hands itself to a batch (`engine::batch_rule`): batching's gains
/// as tuned on this machine for this model folder and profile (the overall result's, else the
/// latest class result's), against the overall result's speed-up. Untuned: always.
pub fn batch_rule(dir: &Path, profile: ProfileName) -> BatchRule {
    let (file, _) = TuningFile::load(&store::config::config_dir());
    let key = tuning_key(dir, profile);
    let overall = file.find(&key);
    let same_model = |r: &&store::tuning::TunedResult| {
        r.key.machine == key.machine && r.key.model == key.model && r.key.profile == key.profile
    };
    let gains = overall
        .filter(|r| !r.batch_gains.is_empty())
        .or_else(|| {
            file.results.iter().filter(same_model).filter(|r| !r.batch_gains.is_empty()).max_by_key(|r| r.measured_at)
        })
        .map(|r| r.batch_gains.iter().map(|&(sequences, gain)| BatchGain { sequences, gain }).collect())
        .unwrap_or_default();
    BatchRule::new(gains, overall.map_or(1.0, |r| r.speedup))
}

/// The stored choice for this machine, model folder and profile, with where it came from.
pub fn stored(dir: &Path, profile: ProfileName) -> (Speculation, String) {
    let (file, warning) = TuningFile::load(&store::config::config_dir());
    if let Some(w) = warning {
        tracing::warn!("{w}");
    }
    let key = tuning_key(dir, profile);
    match file.find(&key) {
        Some(r) => (stored_choice(r), format!("tuned {} ({}; `ferrite tune --show`)", date(r.measured_at), r.why)),
        None => match machine_changed(&file.results, &key) {
            Some(what) => (
                Speculation::PLAIN,
                format!("untuned since {what}: plain decoding until it is tuned again (`ferrite tune`)"),
            ),
            None => (Speculation::PLAIN, "untuned: plain decoding (`ferrite tune` measures this machine)".into()),
        },
    }
}

/// What changed since this model and profile were last tuned on this machine, when they were
/// tuned under another fingerprint (a new Ferrite or MLX, more memory): the fingerprints'
/// differing parts, old → new, from the most recent such result.
fn machine_changed(results: &[store::tuning::TunedResult], key: &TuningKey) -> Option<String> {
    let before = results
        .iter()
        .filter(|r| r.key.model == key.model && r.key.profile == key.profile && r.key.machine != key.machine)
        .max_by_key(|r| r.measured_at)?;
    let (old, new): (Vec<&str>, Vec<&str>) =
        (before.key.machine.split(", ").collect(), key.machine.split(", ").collect());
    let changes: Vec<String> =
        old.iter().zip(&new).filter(|(a, b)| a != b).map(|(a, b)| format!("{a} → {b}")).collect();
    let what = if changes.is_empty() || old.len() != new.len() {
        format!("the machine changed ({} → {})", before.key.machine, key.machine)
    } else {
        format!("the last tune ({}): {}", date(before.measured_at), changes.join("; "))
    };
    Some(what)
}

/// `--draft-depth`: a number (MTP drafts a cycle), or `auto` for the stored result.
pub fn draft_depth(arg: &str, dir: &Path, profile: ProfileName) -> Result<(Speculation, String)> {
    if arg == "auto" {
        return Ok(stored(dir, profile));
    }
    let depth: usize =
        arg.parse().map_err(|_| anyhow::anyhow!("--draft-depth: `{arg}` is neither a number nor `auto`"))?;
    anyhow::ensure!(
        depth <= engine::costs::MAX_DRAFT_DEPTH,
        "--draft-depth: at most {}",
        engine::costs::MAX_DRAFT_DEPTH
    );
    Ok((Speculation::mtp(depth), "given on the command line".into()))
}

/// A model by name with how it speculates for a profile. The catalog's block drafter is loaded
/// beside it when installed (a tune measures it, the stored choices may draft with it).
pub fn spec(name: &str, draft_depth_arg: &str, profile: ProfileName) -> Result<ModelSpec> {
    let model = resolve(name)?;
    let (speculation, source) = draft_depth(draft_depth_arg, &model.dir, profile)?;
    // A depth given on the command line holds for every request; `auto` takes each class's.
    let by_class = if draft_depth_arg == "auto" { class_choices(&model.dir, profile) } else { Vec::new() };
    let batch_rule = batch_rule(&model.dir, profile);
    let mut plan = DepthPlan { speculation, source, by_class };
    if model.drafter.is_none() {
        plan = without_block(plan, "its block drafter is not installed (`ferrite pull` fetches it)");
    }
    Ok(ModelSpec {
        depth: plan,
        dir: model.dir,
        id: model.id,
        aliases: model.aliases,
        batch_rule,
        drafter: model.drafter,
    })
}

/// `spec` drafting with the block drafter in `drafter` (`--drafter`): a depth given on the
/// command line (`draft_depth_arg`) counts that drafter's drafts; `auto` keeps the stored
/// choices.
pub fn with_drafter(spec: ModelSpec, drafter: std::path::PathBuf, draft_depth_arg: &str) -> ModelSpec {
    let depth = match draft_depth_arg {
        "auto" => spec.depth,
        _ => DepthPlan { speculation: Speculation::block(spec.depth.depth()), ..spec.depth },
    };
    ModelSpec { drafter: Some(drafter), depth, ..spec }
}

/// `spec` without its block drafter (a model split across ranks cannot run one yet): choices
/// that drafted with it decode plainly.
pub fn without_drafter(spec: ModelSpec, why: &str) -> ModelSpec {
    ModelSpec { drafter: None, depth: without_block(spec.depth, why), ..spec }
}

/// A plan whose choices draft with a block drafter that is not there (deleted since the tune,
/// or not loadable) decodes those plainly, and says why, rather than failing each request.
fn without_block(plan: DepthPlan, why: &str) -> DepthPlan {
    if !plan.uses_block() {
        return plan;
    }
    let plain = |s: Speculation| if s.drafter == DraftWith::Block { Speculation::PLAIN } else { s };
    DepthPlan {
        source: format!("{}; {why}: plain decoding", plan.source),
        speculation: plain(plan.speculation),
        by_class: plan.by_class.into_iter().map(|(c, s)| (c, plain(s))).collect(),
    }
}

/// The prompt cache's disk tier as the config file sets it (`[prompt_cache]`; default: in
/// the models folder), or `FERRITE_PROMPT_DISK_GB` (0: off), with the installation's key;
/// `None` without a usable store or key.
pub fn prompt_disk() -> Option<engine::prompt_cache::DiskSettings> {
    let gb = std::env::var("FERRITE_PROMPT_DISK_GB").ok().and_then(|v| v.parse::<f64>().ok());
    let store = match store::Store::open_default() {
        Ok(store) => store,
        Err(e) => {
            tracing::warn!("the prompt cache stays in memory (no store: {e})");
            return None;
        }
    };
    let (dir, budget) = store.prompt_disk()?;
    let budget = match gb {
        Some(gb) if gb <= 0.0 => return None,
        Some(gb) => (gb * 1e9) as u64,
        None => budget,
    };
    match store.prompt_cache_key() {
        Ok(key) => Some(engine::prompt_cache::DiskSettings { dir, budget, key }),
        Err(e) => {
            tracing::warn!(
                "the prompt cache stays in memory (no key for its blocks in {}: {e})",
                store.config_dir.display()
            );
            None
        }
    }
}

/// How `/v1/models/load` (the UI's Start buttons and profile choice) finds a model.
pub fn resolver() -> Resolver {
    std::sync::Arc::new(|name: &str, profile: ProfileName| spec(name, "auto", profile))
}

/// Judges a tuner's measurement against what was stored before for the same key, and stores
/// it when it may be (replacing the old result). Returns the verdict and the tuning file.
pub fn judge_and_store(
    config_dir: &Path,
    key: TuningKey,
    measurement: &engine::tune::Measurement,
    options: &engine::tune::TuneOptions,
) -> Result<(engine::tune::Verdict, std::path::PathBuf)> {
    use engine::tune::Verdict;
    let (mut file, warning) = TuningFile::load(config_dir);
    if let Some(w) = warning {
        tracing::warn!("{w}");
    }
    let previous = file.find(&key).map(|r| r.first_acceptance.clone());
    let verdict = engine::tune::decide(measurement, previous.as_deref(), options);
    if let Verdict::Store { choice, speedup, why, .. } = &verdict {
        let result = store::tuning::TunedResult {
            key,
            drafter: tuned_drafter(*choice),
            depth: choice.depth,
            speedup: *speedup,
            why: why.clone(),
            measured_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs())
                .unwrap_or(0),
            first_acceptance: measurement.first_acceptance(),
            measurement: serde_json::to_value(measurement)?,
            batch_gains: measurement.batch_gains.iter().map(|g| (g.sequences, g.gain)).collect(),
        };
        file.replace(result).map_err(|e| anyhow::anyhow!("{}: {e}", file.path.display()))?;
    }
    Ok((verdict, file.path))
}

/// A Unix time as its UTC date, `YYYY-MM-DD`.
pub fn date(unix_seconds: u64) -> String {
    chrono::DateTime::from_timestamp(unix_seconds as i64, 0)
        .map(|d| d.format("%Y-%m-%d").to_string())
        .unwrap_or_else(|| "an unknown date".into())
}

#[cfg(test)]
mod tests {
    use store::tuning::{TunedResult, TuningKey};

    fn result(machine: &str, model: &str, measured_at: u64) -> TunedResult {
        TunedResult {
            key: TuningKey { machine: machine.into(), model: model.into(), profile: "sustained".into(), class: None },
            drafter: store::tuning::TunedDrafter::Mtp,
            depth: 2,
            speedup: 1.4,
            why: "test".into(),
            measured_at,
            first_acceptance: vec![],
            measurement: serde_json::Value::Null,
            batch_gains: vec![],
        }
    }

    #[test]
    fn a_new_ferrite_or_more_memory_asks_for_a_re_tune_saying_what_changed() {
        let now = TuningKey {
            machine: "M4 Max (16 cores), 64 GiB, macOS 26, MLX 0.32.2 on gpu, ferrite 0.2.0".into(),
            model: "qwen@abc".into(),
            profile: "sustained".into(),
            class: None,
        };
        let results = [
            result("M4 Max (16 cores), 32 GiB, macOS 26, MLX 0.32.2 on gpu, ferrite 0.1.0", "qwen@abc", 1_796_083_200),
            result("M4 Max (16 cores), 64 GiB, macOS 26, MLX 0.32.2 on gpu, ferrite 0.1.9", "qwen@abc", 1_700_000_000),
            result("M4 Max (16 cores), 64 GiB, macOS 26, MLX 0.32.2 on gpu, ferrite 0.1.0", "other@def", 1_796_083_300),
        ];
        let what = super::machine_changed(&results, &now).unwrap();
        assert_eq!(what, "the last tune (2026-12-01): 32 GiB → 64 GiB; ferrite 0.1.0 → ferrite 0.2.0");
        // Another model's results, or none: nothing to re-tune.
        assert_eq!(super::machine_changed(&results[2..], &now), None);
        assert_eq!(super::machine_changed(&[], &now), None);
    }

    #[test]
    fn choices_of_a_drafter_that_is_gone_decode_plainly() {
        use engine::Speculation;
        let code = engine::workload::WorkloadClass::ALL[0];
        let plan = crate::depth_plan::DepthPlan {
            by_class: vec![(code, Speculation::block(4))],
            ..crate::depth_plan::DepthPlan::fixed(Speculation::mtp(2), "tuned")
        };
        let unchanged = crate::depth_plan::DepthPlan::mtp(2, "tuned");
        assert_eq!(super::without_block(unchanged.clone(), "gone"), unchanged);
        let gone = super::without_block(plan, "its block drafter is not installed");
        assert_eq!((gone.speculation, gone.for_class(code)), (Speculation::mtp(2), Speculation::PLAIN));
        assert!(gone.source.contains("not installed"), "{}", gone.source);
        let r = result("m", "x", 0);
        assert_eq!(super::stored_choice(&r), Speculation::mtp(2));
        assert_eq!(super::tuned_drafter(Speculation::block(3)), store::tuning::TunedDrafter::Block);
    }

    #[test]
    fn dates_are_utc_calendar_days() {
        assert_eq!(super::date(0), "1970-01-01");
        assert_eq!(super::date(951_782_400), "2000-02-29");
        assert_eq!(super::date(1_796_083_200), "2026-12-01");
        assert_eq!(super::date(1_796_083_199), "2026-11-30");
    }
}
