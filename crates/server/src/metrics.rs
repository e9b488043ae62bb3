//! `GET /metrics` in Prometheus text format: requests, tokens, time to first token, prompt
//! and decode speed, MTP acceptance by draft position, queue depth, model state and memory.

use std::sync::atomic::AtomicU64;

use engine::Summary;
use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

type Position = Vec<(String, String)>;

/// What the app's live view shows between requests.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct Live {
    pub last_decode_tps: f64,
    pub last_prompt_tps: f64,
    pub last_ttft_ms: f64,
    /// Per draft position, over every request served.
    pub acceptance: Vec<f64>,
    pub tokens_per_cycle: f64,
    /// The runtime depth controller: the speculating request's state now (or the last one's).
    pub depth_control: Option<engine::speculative::ControlStats>,
    #[serde(skip)]
    spec: engine::speculative::SpecStats,
}

/// A request generating now.
struct Stream {
    id: u64,
    tokens: u64,
    /// When its last [`RECENT_TOKENS`] tokens came.
    recent: std::collections::VecDeque<std::time::Instant>,
}

/// A stream's rate is taken over this many of its last tokens.
const RECENT_TOKENS: usize = 32;

/// What the live view shows of a request generating now.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StreamFigures {
    pub tokens: u64,
    pub tokens_per_s: f64,
}

/// A split model's ranks as the worker last saw them.
#[derive(Debug, Clone, Default)]
pub struct RanksSeen {
    /// MLX memory in use on each rank, in rank order.
    pub memory_bytes: Vec<u64>,
    /// Why the group is down, once it is.
    pub down: Option<String>,
    pub checked: Option<std::time::Instant>,
}

pub struct Metrics {
    /// Tokens generated so far (the live view's rate is its change per second).
    pub tokens: std::sync::atomic::AtomicU64,
    /// The requests generating now, each with its recent token times.
    streams: std::sync::Mutex<Vec<Stream>>,
    /// Requests finished so far (the history marks each one's prefill speed).
    pub finished: AtomicU64,
    /// True while the engine runs a generation.
    pub generating: std::sync::atomic::AtomicBool,
    /// Requests decoding together in the running batch (0 when none is).
    pub batch_size: std::sync::atomic::AtomicUsize,
    /// Of those, requests whose prompts are still being prefilled (a chunk per step).
    pub prefilling: std::sync::atomic::AtomicUsize,
    /// True while the next request waits for the batch's KV memory to free up.
    pub waiting_for_memory: std::sync::atomic::AtomicBool,
    /// True while the waiting requests wait for a speculating one (`engine::batch_rule`: its
    /// speculation gains more than batching them, for the profile's hold at most).
    pub waiting_for_speculation: std::sync::atomic::AtomicBool,
    /// Requests whose max_tokens was lowered to what the context (or the server's cap) left.
    pub max_tokens_clamped: std::sync::atomic::AtomicU64,
    live: std::sync::Mutex<Live>,
    /// The engine's prompt cache, as of its last request.
    prompt_cache: std::sync::Mutex<engine::prompt_cache::CacheStats>,
    /// A split model's ranks, as of the last check.
    ranks: std::sync::Mutex<RanksSeen>,
    registry: Registry,
    requests: Counter,
    prompt_tokens: Counter,
    completion_tokens: Counter,
    ttft: Histogram,
    decode_tps: Gauge<f64, AtomicU64>,
    prompt_tps: Gauge<f64, AtomicU64>,
    drafted: Family<Position, Counter>,
    accepted: Family<Position, Counter>,
    depth_changes: Family<Vec<(String, String)>, Counter>,
    depth_now: Gauge,
    queue_depth: Gauge,
    loaded: Gauge,
    memory: Family<Vec<(String, String)>, Gauge<f64, AtomicU64>>,
    cached_tokens: Counter,
    cache_lookups: Family<Vec<(String, String)>, Gauge>,
    cache_bytes: Family<Vec<(String, String)>, Gauge>,
    /// A split model: each rank's memory, and whether all ranks are there.
    rank_memory: Family<Vec<(String, String)>, Gauge>,
    ranks_up: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut r = Registry::with_prefix("ferrite");
        let m = Metrics {
            tokens: Default::default(),
            streams: Default::default(),
            finished: Default::default(),
            generating: Default::default(),
            batch_size: Default::default(),
            prefilling: Default::default(),
            waiting_for_memory: Default::default(),
            waiting_for_speculation: Default::default(),
            max_tokens_clamped: Default::default(),
            live: Default::default(),
            prompt_cache: Default::default(),
            ranks: Default::default(),
            requests: Counter::default(),
            prompt_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            ttft: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            decode_tps: Gauge::default(),
            prompt_tps: Gauge::default(),
            drafted: Family::default(),
            accepted: Family::default(),
            depth_changes: Family::default(),
            depth_now: Gauge::default(),
            queue_depth: Gauge::default(),
            loaded: Gauge::default(),
            memory: Family::default(),
            cached_tokens: Counter::default(),
            cache_lookups: Family::default(),
            cache_bytes: Family::default(),
            rank_memory: Family::default(),
            ranks_up: {
                // A whole model has all its ranks: the one.
                let up = Gauge::default();
                up.set(1);
                up
            },
            registry: Registry::default(),
        };
        r.register("requests", "Generations finished", m.requests.clone());
        r.register("prompt_tokens", "Prompt tokens processed", m.prompt_tokens.clone());
        r.register("completion_tokens", "Tokens generated", m.completion_tokens.clone());
        r.register("ttft_seconds", "Time to first token", m.ttft.clone());
        r.register("decode_tokens_per_second", "Decode speed of the last generation", m.decode_tps.clone());
        r.register("prompt_tokens_per_second", "Prefill speed of the last generation", m.prompt_tps.clone());
        r.register("mtp_drafted", "MTP drafts made, by draft position", m.drafted.clone());
        r.register("mtp_accepted", "MTP drafts accepted, by draft position", m.accepted.clone());
        r.register(
            "draft_depth_changes",
            "The runtime depth controller's changes, by kind (deeper, shallower, to_plain, from_plain; drafter_switch: between the MTP head and the block drafter)",
            m.depth_changes.clone(),
        );
        r.register("draft_depth", "The draft depth the depth controller runs at now (0: plain)", m.depth_now.clone());
        r.register("queue_depth", "Requests waiting for the engine", m.queue_depth.clone());
        r.register("model_loaded", "1 while the model is in memory", m.loaded.clone());
        r.register("mlx_memory_bytes", "MLX memory: active, peak, cache", m.memory.clone());
        r.register("prompt_cached_tokens", "Prompt tokens restored from the prompt cache", m.cached_tokens.clone());
        r.register("prompt_cache_lookups", "Prompt cache lookups, by result (hit, miss)", m.cache_lookups.clone());
        r.register("prompt_cache_bytes", "Prompt cache: bytes held and the budget, by tier", m.cache_bytes.clone());
        r.register("rank_memory_bytes", "A split model: MLX memory in use on each rank", m.rank_memory.clone());
        r.register(
            "ranks_up",
            "1 while every rank of the model answers (a whole model: 1), 0 once a split model lost one",
            m.ranks_up.clone(),
        );
        Metrics { registry: r, ..m }
    }

    /// A request starts generating: it is shown as a stream from now on.
    pub fn stream_started(&self, id: u64) {
        if let Ok(mut streams) = self.streams.lock() {
            streams.push(Stream { id, tokens: 0, recent: std::collections::VecDeque::new() });
        }
    }

    /// A token of the stream `id`.
    pub fn stream_token(&self, id: u64) {
        if let Ok(mut streams) = self.streams.lock() {
            if let Some(s) = streams.iter_mut().find(|s| s.id == id) {
                s.tokens += 1;
                s.recent.push_back(std::time::Instant::now());
                if s.recent.len() > RECENT_TOKENS {
                    s.recent.pop_front();
                }
            }
        }
    }

    pub fn stream_ended(&self, id: u64) {
        if let Ok(mut streams) = self.streams.lock() {
            streams.retain(|s| s.id != id);
        }
    }

    /// Each request generating now: its tokens so far and its rate over its last tokens (0 when
    /// it has none in the last two seconds: prefilling or waiting).
    pub fn streams(&self) -> Vec<StreamFigures> {
        let now = std::time::Instant::now();
        let Ok(streams) = self.streams.lock() else { return vec![] };
        streams
            .iter()
            .map(|s| {
                let rate = match (s.recent.front(), s.recent.back()) {
                    (Some(first), Some(last))
                        if s.recent.len() > 1 && now.duration_since(*last).as_secs_f64() < 2.0 =>
                    {
                        (s.recent.len() - 1) as f64 / last.duration_since(*first).as_secs_f64().max(1e-6)
                    }
                    _ => 0.0,
                };
                StreamFigures { tokens: s.tokens, tokens_per_s: (rate * 10.0).round() / 10.0 }
            })
            .collect()
    }

    /// Figures for the live view: the last request's rates and the acceptance so far.
    pub fn live(&self) -> Live {
        self.live.lock().map(|l| l.clone()).unwrap_or_default()
    }

    /// Records a finished generation (called on the engine thread).
    pub fn record(&self, s: &Summary) {
        self.finished.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut live) = self.live.lock() {
            live.last_decode_tps = s.timings.decode_tps;
            live.last_prompt_tps = s.timings.prompt_tps;
            live.last_ttft_ms = s.timings.ttft.as_secs_f64() * 1e3;
            if let Some(spec) = &s.speculative {
                live.spec.merge(spec);
                live.acceptance = live.spec.acceptance();
                live.tokens_per_cycle = live.spec.tokens_per_cycle();
            }
        }
        self.requests.inc();
        self.prompt_tokens.inc_by(s.usage.prompt_tokens as u64);
        self.cached_tokens.inc_by(s.usage.cached_tokens as u64);
        self.completion_tokens.inc_by(s.usage.completion_tokens as u64);
        self.ttft.observe(s.timings.ttft.as_secs_f64());
        self.decode_tps.set(s.timings.decode_tps);
        self.prompt_tps.set(s.timings.prompt_tps);
        if let Some(control) = s.speculative.as_ref().and_then(|spec| spec.control.as_deref()) {
            let c = &control.changes;
            for (kind, n) in [
                ("deeper", c.deeper),
                ("shallower", c.shallower),
                ("to_plain", c.to_plain),
                ("from_plain", c.from_plain),
                ("drafter_switch", control.switches),
            ] {
                self.depth_changes.get_or_create(&vec![("change".to_string(), kind.to_string())]).inc_by(n as u64);
            }
            self.set_depth_control(Some(control.clone()));
        }
        if let Some(spec) = &s.speculative {
            for (i, (&d, &a)) in spec.drafted.iter().zip(&spec.accepted).enumerate() {
                let label = vec![("position".to_string(), (i + 1).to_string())];
                self.drafted.get_or_create(&label).inc_by(d as u64);
                self.accepted.get_or_create(&label).inc_by(a as u64);
            }
        }
    }

    /// The depth controller's state of the request decoding now (kept when it ends).
    pub fn set_depth_control(&self, control: Option<engine::speculative::ControlStats>) {
        let Some(control) = control else { return };
        self.depth_now.set(control.depth_now as i64);
        if let Ok(mut live) = self.live.lock() {
            live.depth_control = Some(control);
        }
    }

    /// The prompt cache's counters, as the engine thread last saw them.
    pub fn set_prompt_cache(&self, stats: engine::prompt_cache::CacheStats) {
        if let Ok(mut c) = self.prompt_cache.lock() {
            *c = stats;
        }
    }

    pub fn prompt_cache(&self) -> engine::prompt_cache::CacheStats {
        self.prompt_cache.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// What the last check of a split model's ranks found: each rank's memory, or why the
    /// group is down (kept once down: a group does not come back).
    pub fn set_ranks(&self, seen: engine::Result<Vec<u64>>) {
        if let Ok(mut ranks) = self.ranks.lock() {
            match seen {
                Ok(memory) if ranks.down.is_none() => ranks.memory_bytes = memory,
                Ok(_) => {}
                Err(e) => {
                    if ranks.down.is_none() {
                        tracing::error!("the model's other ranks are gone: {e}");
                    }
                    ranks.down.get_or_insert(e.to_string());
                }
            }
            ranks.checked = Some(std::time::Instant::now());
            self.ranks_up.set(i64::from(ranks.down.is_none()));
            for (rank, bytes) in ranks.memory_bytes.iter().enumerate() {
                self.rank_memory.get_or_create(&vec![("rank".to_string(), rank.to_string())]).set(*bytes as i64);
            }
        }
    }

    pub fn ranks(&self) -> RanksSeen {
        self.ranks.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// The text exposition, with the gauges read now.
    pub fn render(&self, queue_depth: usize, loaded: bool) -> String {
        self.queue_depth.set(queue_depth as i64);
        self.loaded.set(i64::from(loaded));
        let mlx = engine::memory::mlx_memory();
        for (kind, bytes) in [("active", mlx.active), ("peak", mlx.peak), ("cache", mlx.cache)] {
            self.memory.get_or_create(&vec![("kind".to_string(), kind.to_string())]).set(bytes as f64);
        }
        let cache = self.prompt_cache();
        let label = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        self.cache_lookups.get_or_create(&label("result", "hit")).set(cache.hits as i64);
        self.cache_lookups.get_or_create(&label("result", "miss")).set(cache.misses as i64);
        self.cache_bytes.get_or_create(&label("tier", "memory")).set(cache.bytes as i64);
        self.cache_bytes.get_or_create(&label("tier", "memory_budget")).set(cache.budget_bytes as i64);
        if let Some(disk) = &cache.disk {
            self.cache_bytes.get_or_create(&label("tier", "disk")).set(disk.bytes as i64);
            self.cache_bytes.get_or_create(&label("tier", "disk_budget")).set(disk.budget_bytes as i64);
        }
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }
}
