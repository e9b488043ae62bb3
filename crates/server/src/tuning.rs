//! The app's Tune button: `POST /v1/tune` measures plain decoding and every draft depth of the
//! served model on the engine thread (the same measurement and rules as `ferrite tune`),
//! `GET /v1/tune` and the `/v1/events` stream report progress and, at the end, the table of
//! candidates and the verdict; `POST /v1/tune/cancel` stops it without storing anything. A
//! stored result takes effect at once: the served model uses the new depth.

use engine::workload::WorkloadClass;
use engine::Speculation;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use engine::tune::{Candidate, Progress, Speedup, TuneOptions, Verdict};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::job::TuneJob;
use crate::{AppState, Loaded};

/// What the UI shows about tuning: the run in progress, or the last one's outcome.
#[derive(Debug, Clone, Default, Serialize)]
pub struct TuneState {
    pub running: bool,
    pub model: Option<String>,
    pub profile: Option<String>,
    pub progress: Option<Progress>,
    pub candidates: Option<Vec<Candidate>>,
    /// Each depth's speed-up over plain decoding with its 95% interval, and the rounds measured.
    pub speedups: Option<Vec<Speedup>>,
    pub rounds: Option<usize>,
    /// Plain decoding of several requests together, total over one alone (the server's rule
    /// for a speculating request when others come).
    pub batch_gains: Option<Vec<engine::batch_rule::BatchGain>>,
    /// The workload class measured (`code/greedy`, …), or none: one depth for every request.
    pub class: Option<String>,
    pub verdict: Option<Verdict>,
    /// Why the last run ended without a verdict (cancelled, or an error).
    pub error: Option<String>,
    #[serde(skip)]
    cancel: Arc<AtomicBool>,
}

pub type Shared = Arc<Mutex<TuneState>>;

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct TuneRequest {
    /// New tokens per generation (default 96).
    tokens: Option<usize>,
    /// Paired rounds before any verdict (default 3).
    #[serde(alias = "reps")]
    rounds: Option<usize>,
    /// Prompts of the code suite (1 to 4, default 4).
    prompts: Option<usize>,
    /// Seconds the measuring may take before it gives up undecided (default 120).
    budget_s: Option<f64>,
    /// Another process above this share of a core makes the machine busy, percent (default 50).
    busy_percent: Option<f32>,
    /// One workload class (`code/greedy`, `prose/sampled`, `agent/greedy`, …): its suite at its
    /// temperature, stored for requests of that class. Default: one depth for every request.
    class: Option<String>,
}

pub async fn status(State(s): State<AppState>) -> Json<TuneState> {
    Json(snapshot(&s))
}

pub fn snapshot(s: &AppState) -> TuneState {
    s.tuning.lock().map(|t| t.clone()).unwrap_or_default()
}

pub async fn cancel(State(s): State<AppState>) -> Json<Value> {
    let t = s.tuning.lock().map(|t| (t.running, t.cancel.clone()));
    let cancelled = match t {
        Ok((true, flag)) => {
            flag.store(true, Ordering::SeqCst);
            true
        }
        _ => false,
    };
    Json(json!({ "cancelled": cancelled }))
}

pub async fn start(State(s): State<AppState>, body: Bytes) -> Result<(StatusCode, Json<Value>), ApiError> {
    let request: TuneRequest = if body.is_empty() { TuneRequest::default() } else { crate::error::parse(&body)? };
    let defaults = TuneOptions::default();
    let options = TuneOptions {
        gen_tokens: request.tokens.unwrap_or(defaults.gen_tokens).clamp(2, 1024),
        min_rounds: request.rounds.unwrap_or(defaults.min_rounds).clamp(2, 50),
        prompts: request.prompts.unwrap_or(defaults.prompts).clamp(1, engine::tune::CODE_PROMPTS.len()),
        budget: request
            .budget_s
            .filter(|b| b.is_finite())
            .map(|b| std::time::Duration::from_secs_f64(b.clamp(1.0, 3600.0)))
            .unwrap_or(defaults.budget),
        ..defaults
    };
    let class = request
        .class
        .as_deref()
        .map(WorkloadClass::parse)
        .transpose()
        .map_err(|e| ApiError::bad_request(format!("class: {e}")).with_param("class"))?;
    let options = match class {
        Some(c) => options.for_class(c),
        None => options,
    };
    let loaded = s.loaded();
    let info = loaded.worker.info.clone();
    let cancel = Arc::new(AtomicBool::new(false));
    {
        let mut t = s.tuning.lock().map_err(|_| ApiError::internal("tuning state poisoned"))?;
        if t.running {
            return Err(ApiError::conflict("a tune is running already (POST /v1/tune/cancel stops it)"));
        }
        *t = TuneState {
            running: true,
            model: Some(info.id.clone()),
            profile: Some(info.profile.name.to_string()),
            class: class.map(|c| c.to_string()),
            cancel: cancel.clone(),
            ..Default::default()
        };
    }
    let (reply, answer) = tokio::sync::oneshot::channel();
    let shared = s.tuning.clone();
    let progress = {
        let (shared, cancel) = (shared.clone(), cancel.clone());
        Box::new(move |p: &Progress| {
            if let Ok(mut t) = shared.lock() {
                t.progress = Some(p.clone());
            }
            !cancel.load(Ordering::SeqCst)
        })
    };
    let job = TuneJob {
        options: options.clone(),
        progress,
        busy_percent: request.busy_percent.unwrap_or(telemetry::machine::DEFAULT_BUSY_PERCENT),
        reply,
    };
    if let Err(e) = loaded.worker.tune(job) {
        let e = ApiError::from(e);
        finish(&shared, None, None, Some(e.message.clone()));
        return Err(e);
    }
    let state = s.clone();
    tokio::spawn(async move {
        let measured = answer.await.unwrap_or_else(|_| Err("the engine stopped during the tune".into()));
        let measurement = match measured {
            Ok(m) => m,
            Err(e) => return finish(&shared, None, None, Some(e)),
        };
        let (dir, profile) = (info.dir.clone(), info.profile.name);
        let config_dir = state.store.config_dir.clone().unwrap_or_else(store::config::config_dir);
        let candidates = measurement.candidates.clone();
        let gains = measurement.batch_gains.clone();
        if let Ok(mut t) = shared.lock() {
            t.speedups = Some(measurement.speedups.clone());
            t.batch_gains = Some(measurement.batch_gains.clone());
            t.rounds = Some(measurement.rounds);
        }
        let judged = tokio::task::spawn_blocking(move || {
            crate::launch::judge_and_store(
                &config_dir,
                match class {
                    Some(c) => crate::launch::class_tuning_key(&dir, profile, c),
                    None => crate::launch::tuning_key(&dir, profile),
                },
                &measurement,
                &options,
            )
        })
        .await;
        match judged {
            Ok(Ok((verdict, _))) => {
                if let Verdict::Store { choice, why, speedup, .. } = &verdict {
                    use_new_choice(&state, &loaded, class, *choice, why);
                    if class.is_none() && !gains.is_empty() {
                        loaded.worker.set_batch_rule(engine::batch_rule::BatchRule::new(gains, *speedup));
                    }
                }
                finish(&shared, Some(candidates), Some(verdict), None);
            }
            Ok(Err(e)) => finish(&shared, Some(candidates), None, Some(format!("{e:#}"))),
            Err(e) => finish(&shared, Some(candidates), None, Some(e.to_string())),
        }
    });
    Ok((StatusCode::ACCEPTED, Json(json!({ "started": true, "model": info.id, "profile": info.profile.name }))))
}

fn finish(shared: &Shared, candidates: Option<Vec<Candidate>>, verdict: Option<Verdict>, error: Option<String>) {
    if let Ok(mut t) = shared.lock() {
        t.running = false;
        t.candidates = candidates;
        t.verdict = verdict;
        t.error = error;
    }
}

/// The served model speculates as stored now (if it is still the one that was tuned).
fn use_new_choice(state: &AppState, tuned: &Arc<Loaded>, class: Option<WorkloadClass>, choice: Speculation, why: &str) {
    let now = state.loaded();
    if !Arc::ptr_eq(&now.worker, &tuned.worker) {
        return;
    }
    state.replace(Loaded {
        worker: now.worker.clone(),
        aliases: now.aliases.clone(),
        depth: now.depth.tuned(class, choice, why),
    });
}
