// Ferrite's web UI: one request for the fixed facts (/v1/status), then one server-sent-events
// stream (/v1/events) for everything live. No framework, no polling.
"use strict";

const $ = (id) => document.getElementById(id);
// In a browser the page comes from the server itself; in the app it is embedded and the app
// says where its in-process server listens.
const API = window.__FERRITE_API__ || "";
// The control token the server's store, model and tuning endpoints need: the app hands it over,
// the server writes it into the page it serves.
const TOKEN = window.__FERRITE_TOKEN__ || document.querySelector('meta[name="ferrite-token"]').content;
const JSON_POST = { "content-type": "application/json", "x-ferrite-token": TOKEN };
// Present only inside the app (Tauri), for what a browser cannot do: the native folder picker.
const tauri = window.__TAURI__ && window.__TAURI__.core;
function bytes(n) {
  if (n === null || n === undefined) return "not available";
  if (n >= 1 << 30) return (n / (1 << 30)).toFixed(2) + " GiB";
  return (n / (1 << 20)).toFixed(1) + " MiB";
}

// The prompt cache: what it holds of its budget, and how much of the prompts it served.
function promptCache(c) {
  if (!c || !c.budget_bytes) return "off";
  const share = c.lookup_tokens ? ` · ${(100 * c.hit_tokens / c.lookup_tokens).toFixed(0)}% of prompt tokens reused` : "";
  const disk = c.disk ? ` · disk ${bytes(c.disk.bytes)} of ${bytes(c.disk.budget_bytes)}` : "";
  return `${bytes(c.bytes)} of ${bytes(c.budget_bytes)} · ${c.entries} prompt${c.entries === 1 ? "" : "s"}${share}${disk}`;
}

function facts(el, rows) {
  el.replaceChildren(...rows.flatMap(([k, v]) => {
    const dt = document.createElement("dt"); dt.textContent = k;
    const dd = document.createElement("dd"); dd.textContent = v;
    return [dt, dd];
  }));
}

function pressure(m) {
  if (m.pressure === null) return "not available";
  if (m.pressure_kind === "macos_level") return { 1: "normal", 2: "warning", 4: "critical" }[m.pressure] || String(m.pressure);
  return `${m.pressure.toFixed(1)}% of the last 10 s stalled on memory`;
}

let currentModel = null;

function li(label, detail, button) {
  const item = document.createElement("li");
  const text = document.createElement("span");
  text.textContent = label + " ";
  const small = document.createElement("small");
  small.textContent = detail;
  text.append(small);
  item.append(text);
  if (button) item.append(button);
  return item;
}

async function post(path, body) {
  const r = await fetch(API + path, { method: "POST", headers: JSON_POST, body: JSON.stringify(body) });
  const v = await r.json();
  if (!r.ok) throw new Error(v.error ? v.error.message : r.statusText);
  return v;
}

function button(label, action) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.addEventListener("click", async () => {
    b.disabled = true;
    $("models-error").textContent = "";
    try { await action(); } catch (e) { $("models-error").textContent = e.message; }
    b.disabled = false;
    refreshModels();
  });
  return b;
}

let lastDownloads = "";

function showDownloads(downloads) {
  const key = JSON.stringify(downloads.map((d) => [d.repo, d.state.state]));
  if (key !== lastDownloads && lastDownloads) refreshModels(); // a download ended or began
  lastDownloads = key;
  $("downloads").replaceChildren(...downloads.map((d) => {
    const s = d.state.state;
    let detail = s;
    if (s === "downloading") {
      const eta = d.eta_s != null ? ` · ${Math.ceil(d.eta_s)} s left` : "";
      detail = `${bytes(d.done_bytes)} of ${bytes(d.total_bytes)} · ${bytes(d.bytes_per_s)}/s${eta}`;
    } else if (s === "failed") {
      detail = "failed: " + d.state.detail;
    }
    const item = li(d.repo, detail, s === "downloading" || s === "starting" ? button("Cancel", () => post("/v1/store/cancel", { model: d.repo })) : null);
    if (s === "downloading") {
      const bar = document.createElement("progress");
      bar.max = d.total_bytes || 1;
      bar.value = d.done_bytes;
      item.insertBefore(bar, item.lastChild);
    }
    return item;
  }));
}

async function loadModel(id, button) {
  button.disabled = true;
  $("models-error").textContent = "";
  $("state").textContent = `loading ${id}`;
  try {
    const r = await fetch(API + "/v1/models/load", { method: "POST", headers: JSON_POST, body: JSON.stringify({ model: id }) });
    const v = await r.json();
    if (!r.ok) throw new Error(v.error ? v.error.message : r.statusText);
  } catch (e) {
    $("models-error").textContent = e.message;
  }
  refreshModels();
}

async function refreshModels() {
  try {
    const r = await fetch(API + "/v1/store");
    const v = await r.json();
    if (!r.ok) throw new Error(v.error ? v.error.message : r.statusText);
    $("models-dir").textContent = `Stored in ${v.models_dir}` + (v.free_bytes != null ? ` (${bytes(v.free_bytes)} free)` : "");
    const installed = new Set(v.installed.map((m) => m.catalog_id || m.id));
    $("folder").value = v.models_dir;
    showDownloads(v.downloads);
    $("installed").replaceChildren(...v.installed.map((m) => {
      const b = document.createElement("button");
      b.type = "button";
      const running = m.id === currentModel;
      b.textContent = running ? "Running" : "Start";
      b.disabled = running;
      b.addEventListener("click", () => loadModel(m.id, b));
      const item = li(m.id, `${bytes(m.bytes)} · ${m.model_type}${m.has_mtp ? " · MTP" : ""}${m.sees ? " · sees images" : ""} · ${m.dir}`, b);
      if (!running && m.source !== "embedded") item.append(button("Delete", async () => {
        // Deleting frees disk for good: the user says so, not a stray click.
        if (!window.confirm(`Delete ${m.id} (${bytes(m.bytes)}) from ${m.dir}?`)) return;
        const r = await post("/v1/store/delete", { model: m.id });
        $("models-error").textContent = `${m.id}: ${bytes(r.freed_bytes)} freed`;
      }));
      return item;
    }));
    $("catalog").replaceChildren(...v.catalog.filter((e) => !installed.has(e.id)).map((e) => {
      const size = typeof e.size_bytes === "number" ? bytes(e.size_bytes) : "size unknown";
      const sees = e.sees === true ? " · sees images" : "";
      return li(e.id, `${e.architecture}${e.mtp ? " · MTP" : ""}${sees} · ${size} · ${e.description}`, button("Download", () => post("/v1/store/pull", { model: e.id })));
    }));
  } catch (e) {
    $("models-error").textContent = "model store: " + e.message;
  }
}

function stateText(u) {
  if (u.loading) return [`loading ${u.loading}`, "generating"];
  if (!u.loaded) return ["unloaded (the next request loads it)", ""];
  if (u.generating) return ["generating", "generating"];
  if (u.tuning && u.tuning.running) return ["tuning (requests wait)", "generating"];
  if (u.idle_unload_after_s) {
    const left = Math.max(0, u.idle_unload_after_s - u.idle_s);
    return [`ready · unloads in ${Math.floor(left / 60)}:${String(left % 60).padStart(2, "0")}`, ""];
  }
  return ["ready", ""];
}

// Requests generating together: each one's rate, and who waits.
function showStreams(streams, batching) {
  const waiting = batching ? batching.waiting : 0;
  const el = $("streams");
  el.hidden = streams.length < 2 && !waiting;
  const rates = streams.map((s) => `${s.tokens_per_s.toFixed(1)}`).join(" · ");
  const parts = [];
  if (streams.length > 1) parts.push(`${streams.length} requests together: ${rates} tok/s each`);
  if (batching && batching.prefilling) parts.push(`${batching.prefilling} reading their prompts`);
  const why = batching && batching.waiting_for_memory ? " (for memory)"
    : batching && batching.waiting_for_speculation
      ? ` (behind a speculating request, at most ${batching.speculation_or_batch.hold_s} s)` : "";
  if (waiting) parts.push(`${waiting} waiting${why}`);
  el.textContent = parts.join(" · ");
}

// The runtime depth controller: the drafter and depth it runs at now, what that promises over
// plain decoding and what the request's cycles achieved, and how often it changed its mind
// (switches: between the MTP head and the block drafter, where the model has both).
function showDepthControl(c) {
  const el = $("depth-control");
  el.hidden = !c;
  if (!c) return;
  const depth = c.depth_now === 0 ? "plain (drafts do not pay now)" : choiceName(c.drafter_now, c.depth_now);
  const ch = c.changes;
  const switches = c.switches ? `, ${c.switches} drafter switch${c.switches === 1 ? "" : "es"}` : "";
  el.textContent = `Drafting: ${depth} · expected ${c.expected_speedup.toFixed(2)}x, measured ${c.measured_speedup.toFixed(2)}x over plain · ` +
    `changes: ${ch.deeper} deeper, ${ch.shallower} shallower, ${ch.to_plain} to plain, ${ch.from_plain} back${switches}`;
}

// A model split across ranks (`--hosts`): each rank's host and the memory it holds, or why the
// group is down (a rank was lost: nothing answers until the server restarts).
function showRanks(r) {
  const el = $("ranks");
  el.hidden = !r;
  if (!r) return;
  const each = r.hosts.map((host, i) => `rank ${i} ${host} ${r.memory_bytes[i] === undefined ? "?" : bytes(r.memory_bytes[i])}`);
  el.textContent = r.state === "down"
    ? `Split across ${r.count} ranks (${r.backend}): down — ${r.error}`
    : `Split across ${r.count} ranks (${r.backend}): ${each.join(" · ")}`;
  el.className = r.state === "down" ? "error" : "";
}

function onUpdate(u) {
  if (u.model !== currentModel) {
    currentModel = u.model;
    refreshModels();
    refreshStatus();
  }
  $("model").textContent = u.model;
  // What the app could not do at launch (its model would not start), until another starts.
  $("notice").textContent = u.notice || "";
  $("notice").hidden = !u.notice;
  showDownloads(u.downloads);
  const [text, cls] = stateText(u);
  $("state").textContent = u.queue_depth ? `${text} · ${u.queue_depth} queued` : text;
  $("state").className = "badge " + cls;
  if (document.activeElement !== $("profile")) $("profile").value = u.profile;
  const drafters = u.class_drafters || {};
  const classes = Object.entries(u.class_depths || {}).map(([c, d]) => `${c} ${choiceName(drafters[c], d)}`);
  $("draft").textContent = `${choiceName(u.draft_with, u.draft_depth)} (${u.draft_depth_source})` + (classes.length ? ` · tuned per class: ${classes.join(", ")}` : "");
  showTuning(u.tuning, u);
  $("tps-now").textContent = u.tokens_per_s_now.toFixed(1);
  showStreams(u.streams || [], u.batching);
  showDepthControl(u.last.depth_control);
  showRanks(u.ranks);
  Charts.update(u);
  const last = u.last;
  if (last.last_decode_tps > 0) {
    $("last").textContent = `decode ${last.last_decode_tps.toFixed(1)} tok/s · prefill ${last.last_prompt_tps.toFixed(1)} tok/s · first token ${last.last_ttft_ms.toFixed(0)} ms`;
  }
  const m = u.telemetry.memory;
  facts($("memory"), [
    ["This process", bytes(m.process_resident_bytes)],
    ["MLX active / peak / cache", `${bytes(m.mlx_active_bytes)} / ${bytes(m.mlx_peak_bytes)} / ${bytes(m.mlx_cache_bytes)}`],
    ["System used / total", `${bytes(m.system_used_bytes)} / ${bytes(m.system_total_bytes)}`],
    ["Pressure", pressure(m)],
    ["Prompt cache", promptCache(u.prompt_cache)],
  ]);
  const th = u.telemetry.thermal;
  const rows = [
    ...th.fans.map((f) => [f.label, `${f.rpm} rpm`]),
    ...th.temperatures.map((s) => [s.label, `${s.celsius.toFixed(1)} °C`]),
  ];
  if (th.state) rows.push(["Thermal state", th.state]);
  facts($("thermal"), rows.length ? rows : [["Fans and sensors", "not available on this machine"]]);
}

// The facts that change only with the model.
async function refreshStatus() {
  try {
    const s = await (await fetch(API + "/v1/status")).json();
    $("reasoning").textContent = s.reasoning_default;
    const k = s.profile_knobs || {};
    $("profile-knobs").textContent = `prefill chunks of ${k.prefill_chunk}${k.warmup ? ", warm-up at load" : ""}`;
    // The drafter speculating requests draft with: a block drafter beside the model, else its MTP head.
    const d = s.drafter;
    const drafter = d ? `, block drafter ${d.dir.split(/[\\/]/).filter(Boolean).pop()} (blocks of ${d.block_size})` : "";
    $("device").textContent = `${s.device}, context ${s.context} tokens${s.mtp_head ? ", MTP head" : ""}${s.sees ? ", sees images" : ""}${drafter}`;
    $("compute").textContent = `${s.blas}; weights ${s.weights}`;
  } catch (e) {
    $("state").textContent = "error: " + e.message;
  }
}

async function start() {
  const base = API || location.origin;
  $("openai-url").textContent = base + "/v1";
  $("anthropic-url").textContent = base;
  window.__showStatus = onUpdate;
  const events = new EventSource(API + "/v1/events");
  events.addEventListener("history", (e) => Charts.history(JSON.parse(e.data).samples));
  events.addEventListener("status", (e) => {
    const u = JSON.parse(e.data);
    window.__lastStatus = u; // the last status, and a way to show one, for the browser tests
    onUpdate(u);
  });
  events.onerror = () => { $("state").textContent = "disconnected: retrying"; $("state").className = "badge"; };
}

$("refresh-models").addEventListener("click", refreshModels);
// The charts' window: the last 1, 5 or 15 minutes.
document.querySelectorAll("[data-window]").forEach((b) => b.addEventListener("click", () => {
  document.querySelectorAll("[data-window]").forEach((o) => o.setAttribute("aria-pressed", String(o === b)));
  Charts.setWindow(Number(b.dataset.window));
}));
new ResizeObserver(() => Charts.resize()).observe(document.querySelector("main"));
matchMedia("(prefers-color-scheme: dark)").addEventListener("change", () => Charts.rebuild());
$("profile").addEventListener("change", async (e) => {
  const profile = e.target.value;
  $("state").textContent = `reloading with the ${profile} profile`;
  try { await post("/v1/models/load", { profile }); } catch (err) { $("models-error").textContent = err.message; }
  refreshStatus();
});
$("folder-form").addEventListener("submit", async (e) => {
  e.preventDefault();
  $("models-error").textContent = "";
  try { await post("/v1/store/folder", { dir: $("folder").value }); } catch (err) { $("models-error").textContent = err.message; }
  refreshModels();
});

// How requests speculate, as the server names its choices: plain decoding, or a drafter
// ("mtp": the model's own head, "block": the block drafter beside it) at a depth.
function choiceName(drafter, depth) {
  if (!depth) return "plain decoding";
  return drafter === "block" ? `block depth ${depth}` : `MTP depth ${depth}`;
}

// The tuner: offered while this machine has no result for the model, progress while it runs,
// the table of candidates and the verdict when it is done.
function showTuning(t, u) {
  const box = $("tuning"), untuned = u.mtp_head && String(u.draft_depth_source).startsWith("untuned");
  const hasRun = t && (t.running || t.verdict || t.error);
  box.hidden = !(hasRun || untuned);
  $("tune-offer").hidden = !untuned || (t && t.running);
  // Tuned before under another fingerprint (a new Ferrite, more memory): say what changed.
  const since = String(u.draft_depth_source).match(/^untuned since (.*): plain decoding/);
  $("tune-offer-why").textContent = since
    ? `Re-tune: ${since[1]}.`
    : "This machine has no tuned draft depth for this model yet:";
  $("tune").disabled = !!(t && t.running);
  $("tune-cancel").hidden = !(t && t.running);
  $("tune-progress").hidden = !(t && t.running);
  if (!t) return;
  const p = t.progress;
  if (t.running && p) {
    // The warm-up counts its runs; the paired rounds count seconds of the time budget (the
    // batching measurement after them shows where they ended).
    const measuring = p.phase !== "warm-up";
    $("tune-progress").max = measuring ? p.budget_s : p.steps;
    $("tune-progress").value = measuring ? p.elapsed_s : p.step;
    const rep = p.repetition ? `, round ${p.repetition} (${Math.round(p.elapsed_s)} of at most ${Math.round(p.budget_s)} s)` : "";
    const last = p.last_tps ? ` — last ${p.last_tps.toFixed(1)} tok/s` : "";
    const forClass = t.class ? ` for ${t.class}` : "";
    $("tune-status").textContent = p.phase === "batching"
      ? `Tuning ${t.model}${forClass}: several requests decoding together against one`
      : `Tuning ${t.model}${forClass} (${p.phase}): ${choiceName(p.drafter, p.depth)}, temperature ${p.temperature}${rep}${last}`;
  } else if (t.running) {
    $("tune-status").textContent = `Tuning ${t.model}: starting`;
  } else if (t.verdict) {
    const v = t.verdict;
    const forClass = t.class ? ` for ${t.class}` : "";
    $("tune-status").textContent = v.verdict === "store" ? `Stored ${choiceName(v.drafter, v.depth)}${forClass}: ${v.why}` : `Not stored${forClass}: ${v.why}`;
  } else if (t.error) {
    $("tune-status").textContent = `Tuning ended: ${t.error}`;
  } else {
    $("tune-status").textContent = "";
  }
  // Each depth's speed-up over plain decoding with its 95% interval, from the paired rounds.
  $("tune-speedups").textContent = (t.speedups || []).length
    ? `Speed-up over plain decoding (${t.rounds} paired rounds, 95% interval): ` +
      t.speedups.map((s) => `${choiceName(s.drafter, s.depth)} ${s.speedup.toFixed(2)}x [${s.interval[0].toFixed(2)}–${s.interval[1].toFixed(2)}]`).join(" · ") +
      ((t.batch_gains || []).length
        ? ". Requests decoding together, total over one alone: " + t.batch_gains.map((g) => `${g.sequences} ${g.gain.toFixed(2)}x`).join(" · ")
        : "")
    : "";
  const rows = t.candidates || [];
  $("tune-table").hidden = rows.length === 0;
  $("tune-table").tBodies[0].replaceChildren(...rows.map((c) => {
    const plain = rows.find((r) => r.depth === 0 && r.temperature === c.temperature);
    const tr = document.createElement("tr");
    for (const v of [choiceName(c.drafter, c.depth), c.temperature, c.median_tps.toFixed(1), (c.spread * 100).toFixed(1) + "%",
      c.acceptance.map((a) => (a * 100).toFixed(0) + "%").join(" ") || "–",
      plain ? (c.median_tps / plain.median_tps).toFixed(2) + "x" : "–"]) {
      const td = document.createElement("td"); td.textContent = v; tr.append(td);
    }
    return tr;
  }));
}

$("tune").addEventListener("click", async () => {
  $("tune-status").textContent = "Tuning: starting";
  $("tuning").hidden = false;
  // One workload class (its own prompts, at its temperature), or one depth for every request.
  const cls = $("tune-class").value;
  try { await post("/v1/tune", cls ? { class: cls } : {}); } catch (err) { $("tune-status").textContent = "Cannot tune: " + err.message; }
});
$("tune-cancel").addEventListener("click", () => post("/v1/tune/cancel", {}).catch(() => {}));

if (tauri) {
  const choose = $("choose-folder");
  choose.hidden = false;
  choose.addEventListener("click", async () => {
    $("models-error").textContent = "";
    try {
      const dir = await tauri.invoke("choose_models_folder");
      if (dir) $("folder").value = dir;
    } catch (err) { $("models-error").textContent = String(err); }
    refreshModels();
  });
}

document.addEventListener("click", (e) => {
  const id = e.target.dataset && e.target.dataset.copy;
  if (id) navigator.clipboard.writeText($(id).textContent).then(() => { e.target.textContent = "Copied"; setTimeout(() => (e.target.textContent = "Copy"), 1200); });
});

start();
