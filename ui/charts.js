// The live window's charts (uPlot, vendored in vendor/uplot): speed, acceptance by draft
// position, memory, memory pressure with the thermal state, fans and temperatures — drawn from
// the samples the server keeps (one a second, the last 15 minutes, replayed on connect), over
// the window the person chooses (1, 5 or 15 minutes). app.js feeds it; nothing here fetches.
"use strict";

const Charts = (() => {
  const KEEP = 900;
  const samples = []; // the server's samples, oldest first
  let windowS = 300;
  let facts = { total: null, cacheLimit: null, fans: [], temps: [] };
  let acceptance = { rates: [], perCycle: null };
  const charts = {};
  const $ = (id) => document.getElementById(id);
  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  const colors = () => ["--accent", "--c2", "--c3", "--c4", "--c5", "--c6", "--c7", "--c8", "--c9"].map(css);
  const MiB = 1 << 20;
  // A size in MiB, as a person reads it.
  const sizeText = (mib) => (mib >= 1024 ? `${+(mib / 1024).toFixed(1)} GiB` : mib >= 1 ? `${+mib.toFixed(1)} MiB` : `${+(mib * 1024).toFixed(0)} KiB`);
  const size = (u, v) => (v == null ? "–" : sizeText(v));
  // A log scale's ticks: every power of sixteen in range (1 MiB, 16 MiB, 256 MiB, 4 GiB, 64 GiB).
  const powersOfSixteen = (u, axis, min, max) => {
    const out = [];
    for (let p = Math.floor(Math.log2(Math.max(min, 1e-3)) / 4); 16 ** p <= max; p++) if (16 ** p >= min) out.push(16 ** p);
    return out;
  };
  const STREAMS = 8; // lines for requests decoding together (the Turbo profile's most)
  // The thermal state as a band behind the pressure line: colour by how hot.
  const HEAT = { fair: "rgba(234, 179, 8, 0.25)", serious: "rgba(249, 115, 22, 0.35)", critical: "rgba(220, 38, 38, 0.45)" };

  function axis(label, extra) {
    return { label, stroke: css("--muted"), grid: { stroke: css("--line"), width: 1 }, ticks: { stroke: css("--line") },
      font: "12px system-ui, sans-serif", labelFont: "12px system-ui, sans-serif", size: 48, ...extra };
  }
  const timeAxis = () => ({ stroke: css("--muted"), grid: { stroke: css("--line"), width: 1 }, ticks: { stroke: css("--line") },
    font: "12px system-ui, sans-serif" });
  const line = (label, stroke, extra) => ({ label, stroke, width: 2, spanGaps: false, ...extra });
  const fixed = (digits, unit) => (u, v) => (v == null ? "–" : v.toFixed(digits) + unit);

  // What each chart shows: its series and the columns it takes from the samples.
  function specs() {
    const c = colors();
    return {
      speed: {
        title: "decode tok/s (all requests, each request) and each finished request's prefill tok/s",
        series: [
          line("all requests", c[0], { value: fixed(1, " tok/s") }),
          ...Array.from({ length: STREAMS }, (_, i) =>
            line(`request ${i + 1}`, c[(i % 8) + 1], { width: 1, show: i < 4, value: fixed(1, " tok/s") })),
          { label: "prefill", stroke: c[8], scale: "prefill", paths: () => null, points: { show: true, size: 7, fill: c[8] },
            value: fixed(0, " tok/s") },
        ],
        axes: [axis("tok/s"), axis("prefill tok/s", { side: 1, scale: "prefill", grid: { show: false } })],
        scales: { prefill: { range: (u, lo, hi) => [0, Math.max(1, hi || 1) * 1.1] }, y: { range: (u, lo, hi) => [0, Math.max(1, hi || 1) * 1.1] } },
        columns: (s) => [s.tokens_per_s, ...Array.from({ length: STREAMS }, (_, i) => (i < s.streams.length ? s.streams[i] : null)),
          s.prefill_tps == null ? null : s.prefill_tps],
      },
      memory: {
        // A log scale: MLX's few MiB and the machine's many GiB on one chart.
        title: "memory (log scale)",
        series: [
          line("MLX active", c[0], { value: size }),
          line("MLX cache", c[1], { value: size }),
          line("prompt cache", c[2], { value: size }),
          line("this process", c[3], { value: size }),
          line("system used", c[4], { value: size }),
          line("machine total", css("--muted"), { width: 1, dash: [6, 4], value: size }),
          line("MLX cache limit", c[1], { width: 1, dash: [2, 4], value: size }),
        ],
        axes: [axis("", { size: 64, splits: powersOfSixteen, filter: (u, splits) => splits,
          values: (u, ticks) => ticks.map((v) => (v == null ? null : sizeText(v))) })],
        scales: { y: { distr: 3, log: 2, range: (u, lo, hi) => [Math.max(1 / 16, (lo || 1) / 2), Math.max(1, hi || 1) * 2] } },
        columns: (s) => [s.mlx_active_bytes, s.mlx_cache_bytes, s.prompt_cache_bytes, s.process_bytes, s.system_used_bytes,
          facts.total, facts.cacheLimit].map((b) => (b ? b / MiB : null)),
      },
      pressure: {
        title: "memory pressure, with the thermal state as the band behind it",
        series: [line("memory pressure", c[0], { paths: uPlot.paths.stepped({ align: 1 }), fill: c[0] + "33",
          value: (u, v) => (v == null ? "–" : pressureText(v)) })],
        axes: [axis(pressureKind === "macos_level" ? "level" : "% stalled")],
        scales: { y: { range: (u, lo, hi) => [0, Math.max(pressureKind === "macos_level" ? 4 : 10, hi || 0)] } },
        columns: (s) => [s.pressure],
        hooks: { drawClear: [drawHeat] },
      },
      fans: {
        title: "fans, rpm, and temperatures, °C",
        series: [
          ...facts.fans.map((label, i) => line(label, c[i % 9], { value: fixed(0, " rpm") })),
          ...facts.temps.map((label, i) => line(label, c[(i + facts.fans.length) % 9], { scale: "°C", width: 1, value: fixed(1, " °C") })),
        ],
        axes: [axis("rpm"), axis("°C", { side: 1, scale: "°C", grid: { show: false } })],
        scales: { "°C": {} },
        columns: (s) => [...facts.fans.map((_, i) => (s.fans_rpm[i] ?? null)), ...facts.temps.map((_, i) => (s.temperatures_c[i] ?? null))],
      },
    };
  }

  let pressureKind = null;
  function pressureText(v) {
    if (pressureKind === "macos_level") return { 1: "normal", 2: "warning", 4: "critical" }[v] || String(v);
    return v.toFixed(1) + "% stalled";
  }

  // The thermal state's band: a rectangle behind each run of samples in a warm state.
  function drawHeat(u) {
    const [t] = u.data;
    const ctx = u.ctx, { top, height } = u.bbox;
    for (let i = 0; i < t.length; i++) {
      const state = u._states && u._states[i];
      if (!HEAT[state]) continue;
      const x0 = u.valToPos(t[i], "x", true), x1 = u.valToPos(i + 1 < t.length ? t[i + 1] : t[i] + 1, "x", true);
      ctx.fillStyle = HEAT[state];
      ctx.fillRect(x0, top, Math.max(1, x1 - x0), height);
    }
  }

  function data(spec) {
    const shown = samples;
    const t = shown.map((s) => s.t_ms / 1000);
    const rows = shown.map(spec.columns);
    const cols = spec.series.map((_, j) => rows.map((r) => r[j]));
    return [t, ...cols];
  }

  function build(name, spec) {
    const el = $(`chart-${name}`);
    if (!el) return;
    if (charts[name]) charts[name].destroy();
    el.replaceChildren();
    const opts = {
      title: spec.title,
      width: Math.max(200, el.clientWidth || 300),
      height: el.classList.contains("short") ? 110 : 160,
      series: [{ label: "time", value: (u, v) => (v == null ? "–" : new Date(v * 1000).toLocaleTimeString()) }, ...spec.series],
      axes: [timeAxis(), ...spec.axes],
      scales: { x: { time: true }, ...(spec.scales || {}) },
      legend: { live: true },
      cursor: { drag: { x: false, y: false } },
      hooks: spec.hooks || {},
    };
    charts[name] = new uPlot(opts, data(spec), el);
    charts[name]._spec = spec;
  }

  function buildAcceptance() {
    const el = $("chart-acceptance");
    if (!el) return;
    if (charts.acceptance) charts.acceptance.destroy();
    el.replaceChildren();
    const n = acceptance.rates.length;
    $("acceptance-none").hidden = n > 0;
    el.hidden = n === 0;
    if (!n) return;
    const opts = {
      title: `acceptance by draft position (${acceptance.perCycle == null ? "–" : acceptance.perCycle.toFixed(2)} tokens per cycle)`,
      width: Math.max(200, el.clientWidth || 300),
      height: 130,
      series: [{ label: "position", value: (u, v) => (v == null ? "–" : String(v)) },
        { label: "accepted", stroke: css("--accent"), fill: css("--accent") + "99", paths: uPlot.paths.bars({ size: [0.6, 60] }),
          points: { show: false }, value: fixed(0, "%") }],
      axes: [{ ...timeAxis(), values: (u, ticks) => ticks.map((v) => (Number.isInteger(v) ? `#${v}` : "")) }, axis("%")],
      scales: { x: { time: false, range: [0.5, n + 0.5] }, y: { range: [0, 100] } },
      legend: { live: true },
    };
    charts.acceptance = new uPlot(opts, [acceptance.rates.map((_, i) => i + 1), acceptance.rates.map((a) => a * 100)], el);
  }

  function rebuild() {
    const all = specs();
    for (const name of ["speed", "memory", "pressure", "fans"]) build(name, all[name]);
    buildAcceptance();
    redraw();
  }

  // New data into every chart, the x scale set to the chosen window ending now.
  function redraw() {
    const last = samples.length ? samples[samples.length - 1].t_ms / 1000 : Date.now() / 1000;
    for (const [name, u] of Object.entries(charts)) {
      if (name === "acceptance" || !u._spec) continue;
      const d = data(u._spec);
      if (name === "pressure") u._states = samples.map((s) => s.thermal_state);
      u.setData(d, false);
      u.setScale("x", { min: last - windowS, max: last });
    }
    const heat = samples.some((s) => s.pressure != null || s.thermal_state);
    $("pressure-none").hidden = heat;
    $("chart-pressure").hidden = !heat;
    const fans = facts.fans.length + facts.temps.length > 0;
    $("fans-none").hidden = fans;
    $("chart-fans").hidden = !fans;
  }

  // The figures that are not in the samples: lines and labels from the status.
  function setFacts(u) {
    const th = u.telemetry.thermal;
    const next = {
      total: u.telemetry.memory.system_total_bytes,
      cacheLimit: u.mlx_cache_limit_bytes,
      fans: th.fans.map((f) => f.label),
      temps: th.temperatures.map((s) => s.label),
    };
    const kind = u.telemetry.memory.pressure_kind;
    const changed = JSON.stringify([next.fans, next.temps, kind]) !== JSON.stringify([facts.fans, facts.temps, pressureKind]);
    facts = next;
    pressureKind = kind;
    const rates = u.last.acceptance || [];
    const again = JSON.stringify(rates) !== JSON.stringify(acceptance.rates);
    acceptance = { rates, perCycle: u.last.tokens_per_cycle };
    if (changed || !charts.speed) rebuild();
    else if (again) buildAcceptance();
  }

  return {
    /// Every sample the server kept (on connect).
    history(list) {
      samples.splice(0, samples.length, ...list);
      if (charts.speed) redraw();
    },
    /// A status update: its sample and the facts it carries.
    update(u) {
      setFacts(u);
      const s = u.sample;
      if (s && (!samples.length || s.t_ms > samples[samples.length - 1].t_ms)) {
        samples.push(s);
        while (samples.length > KEEP) samples.shift();
      }
      redraw();
    },
    setWindow(seconds) {
      windowS = seconds;
      redraw();
    },
    resize() {
      for (const [name, u] of Object.entries(charts)) {
        const el = $(`chart-${name}`);
        if (el && el.clientWidth) u.setSize({ width: el.clientWidth, height: u.height });
      }
    },
    rebuild,
    // For the browser tests: what each chart holds.
    state: () => ({ windowS, samples: samples.length, charts: Object.fromEntries(Object.entries(charts).map(([n, u]) =>
      [n, { series: u.series.map((s) => s.label), data: u.data, x: [u.scales.x.min, u.scales.x.max] }])) }),
  };
})();

window.ferriteCharts = Charts;
