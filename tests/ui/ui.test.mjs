// Ferrite's web UI in a real browser: playwright-core drives Debian's chromium against a
// `ferrite serve` on loopback with project-made models. Start a model with a click, see tok/s
// move while a request streams, see the live charts fill, switch their window, reload and
// keep their history (screenshots wide and narrow, light and dark), see memory, download a catalog model with progress from the
// store tests' local hub (`test_hub`), see an error shown. Screenshots go to
// target/ui-screenshots for a person to look at.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { spawn, execFileSync } from "node:child_process";
import { existsSync, mkdtempSync, mkdirSync, rmSync, writeFileSync } from "node:fs";
import { createInterface } from "node:readline";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { chromium } from "playwright-core";

const root = fileURLToPath(new URL("../..", import.meta.url));
const ferrite = process.env.FERRITE ?? join(root, "target/debug/ferrite");
const testHub = process.env.TEST_HUB ?? join(root, "target/debug/examples/test_hub");
const shots = join(root, "target/ui-screenshots");
const work = mkdtempSync(join(tmpdir(), "ferrite-ui-"));
const env = { ...process.env, FERRITE_CONFIG_DIR: join(work, "config"), RUST_LOG: "warn" };
const port = 21000 + (process.pid % 20000);
const base = `http://127.0.0.1:${port}`;
let server, hub, browser, page;

// The local hub: publishes a project-made hybrid as `ferrite-test/tiny-hybrid`, 16 KiB every
// 120 ms (so the page has progress to show: the live stream, idle, updates every 3 s, and a
// download shorter than that could end between two updates); its first line is its address.
async function startHub() {
  if (!existsSync(testHub)) throw new Error(`no ${testHub}: cargo build -p ferrite-store --example test_hub (make test does)`);
  // Run outside cargo, the example finds the MLX wheel's libmlx.so (Linux) through this path.
  const libs = [join(root, "third_party/mlx-cpu/mlx/lib"), process.env.LD_LIBRARY_PATH].filter(Boolean).join(":");
  hub = spawn(testHub, ["ferrite-test/tiny-hybrid", "120"], { stdio: ["ignore", "pipe", "inherit"], env: { ...process.env, LD_LIBRARY_PATH: libs } });
  const lines = createInterface({ input: hub.stdout });
  for await (const line of lines) return line.trim();
  throw new Error("test_hub printed no address");
}

function make(arch, out) {
  execFileSync(ferrite, ["dev", "make-checkpoint", "--arch", arch, "--bits", "4", "--group-size", "32", ...(arch === "qwen3_5" ? ["--mtp"] : []), "--out", out], { env });
}

before(async () => {
  mkdirSync(shots, { recursive: true });
  make("qwen3", join(work, "first"));
  make("qwen3_5", join(work, "second"));
  execFileSync(ferrite, ["store", "set", join(work, "models")], { env });
  execFileSync(ferrite, ["store", "add", "second-model", join(work, "second")], { env });
  // A catalog entry of the user's own models.toml, served by the local hub.
  writeFileSync(join(work, "config", "models.toml"), [
    "[[model]]", 'id = "tiny-download"', 'repo = "ferrite-test/tiny-hybrid"', 'architecture = "qwen3_5"',
    'quantization = "8-bit"', 'size_bytes = "unknown"', 'params_b = "unknown"', 'active_params_b = "unknown"',
    "mtp = true", 'memory_bytes = "unknown"', 'description = "a project-made test model"', "",
  ].join("\n"));
  env.HF_ENDPOINT = await startHub();
  server = spawn(ferrite, ["serve", "--model", join(work, "first"), "--id", "first-model", "--port", String(port), "--idle-minutes", "0"], { env, stdio: "inherit" });
  for (let i = 0; i < 300; i++) {
    try { if ((await fetch(`${base}/health`)).ok) break; } catch { /* not up yet */ }
    await new Promise((r) => setTimeout(r, 100));
  }
  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run"],
  });
  page = await browser.newPage({ viewport: { width: 1200, height: 1000 } });
});

after(async () => {
  await browser?.close();
  server?.kill();
  hub?.kill();
  rmSync(work, { recursive: true, force: true });
});

test("the page shows the running model, its API URLs and memory", async () => {
  await page.goto(base);
  await page.waitForFunction(() => document.getElementById("model").textContent === "first-model");
  assert.equal(await page.textContent("#openai-url"), `${base}/v1`);
  await page.waitForSelector("#memory dt");
  assert.match(await page.textContent("#memory"), /This process\d/);
  assert.match(await page.textContent("#memory"), /Prompt cache\d.* of /);
  assert.match(await page.textContent("#thermal"), /not available|rpm|°C/);
  assert.equal(await page.isHidden("#notice"), true, "no notice without one from the server");
  await page.waitForFunction(() => document.getElementById("compute").textContent.includes("weights"));
  await page.screenshot({ path: join(shots, "ready.png"), fullPage: true });
  // Long words (the BLAS library's path, the models folder) wrap inside their card: content
  // that spills out lies under the next card, which then takes its clicks.
  const spills = await page.$$eval("main > section", (cards) => cards
    .filter((card) => card.scrollWidth > card.clientWidth + 1)
    .map((card) => `${card.querySelector("h2").textContent}: ${card.scrollWidth} > ${card.clientWidth}`));
  assert.deepEqual(spills, [], "no card's content is wider than the card");
});

test("a click starts another model", async () => {
  const start = page.locator("#installed li", { hasText: "second-model" }).getByRole("button", { name: "Start" });
  await start.click();
  await page.waitForFunction(() => document.getElementById("model").textContent === "second-model", null, { timeout: 30000 });
  const status = await (await fetch(`${base}/v1/status`)).json();
  assert.equal(status.model, "second-model");
  assert.equal(status.mtp_head, true);
  await page.waitForFunction(() => document.getElementById("device").textContent.includes("MTP head"));
});

test("the window names the block drafter beside the model", async () => {
  // This server's models have no drafter: the real status with one added, as `ferrite serve
  // --drafter DIR` reports it (the server test http.rs checks the real one).
  const real = await (await fetch(`${base}/v1/status`)).json();
  const drafter = { dir: "/models/ferrite-code-20m-dflash", block_size: 8, target_layers: [1, 3, 5, 7] };
  await page.route("**/v1/status", (route) => route.fulfill({ json: { ...real, drafter } }));
  await page.evaluate(() => refreshStatus());
  await page.waitForFunction(() =>
    document.getElementById("device").textContent.includes("block drafter ferrite-code-20m-dflash (blocks of 8)"));
  await page.unroute("**/v1/status");
  await page.evaluate(() => refreshStatus());
  await page.waitForFunction(() => !document.getElementById("device").textContent.includes("block drafter"));
});

test("the profile is chosen in the page and the server reports it", async () => {
  await page.selectOption("#profile", "turbo");
  for (let i = 0; i < 300; i++) {
    const s = await (await fetch(`${base}/v1/status`)).json();
    if (s.profile === "turbo") break;
    await new Promise((r) => setTimeout(r, 100));
  }
  const status = await (await fetch(`${base}/v1/status`)).json();
  assert.equal(status.profile, "turbo");
  assert.equal(status.model, "second-model");
  await page.waitForFunction(() => document.getElementById("profile-knobs").textContent.includes("8192"));
});

test("tok/s moves while a request streams", async () => {
  const request = fetch(`${base}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: "second-model", prompt: "fn main() {", max_tokens: 4000, ignore_eos: true, stream: true }),
  });
  await page.waitForFunction(() => parseFloat(document.getElementById("tps-now").textContent) > 0, null, { timeout: 30000 });
  assert.match(await page.textContent("#state"), /generating/);
  await page.screenshot({ path: join(shots, "generating.png"), fullPage: true });
  const body = (await request).body;
  await body.cancel(); // the client goes: the server cancels the generation
});

test("requests decoding together show each one's rate", async () => {
  const ask = () => fetch(`${base}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: "second-model", prompt: "fn main() {", max_tokens: 4000, ignore_eos: true, stream: true }),
  });
  const requests = [ask(), ask()];
  await page.waitForFunction(
    () => /2 requests together: [\d.]+ · [\d.]+ tok\/s each/.test(document.getElementById("streams").textContent),
    null,
    { timeout: 30000 },
  );
  await page.screenshot({ path: join(shots, "together.png"), fullPage: true });
  for (const request of requests) await (await request).body.cancel();
  await page.waitForFunction(() => document.getElementById("streams").hidden, null, { timeout: 30000 });
});

// The live charts: what each holds, read from the page's chart module.
const charts = () => page.evaluate(() => window.ferriteCharts.state());

test("the charts fill with time-ordered samples while requests stream", async () => {
  const request = fetch(`${base}/v1/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ model: "second-model", prompt: "fn main() {", max_tokens: 4000, ignore_eos: true, stream: true }),
  });
  await page.waitForFunction(() => {
    const s = window.ferriteCharts.state().charts.speed;
    return s && s.data[0].length >= 3 && s.data[1].some((v) => v > 0);
  }, null, { timeout: 30000 });
  (await request).body.cancel();
  const c = await charts();
  for (const [name, series] of Object.entries({
    speed: ["all requests", "request 1", "request 8", "prefill"],
    memory: ["MLX active", "MLX cache", "prompt cache", "this process", "system used", "machine total", "MLX cache limit"],
    pressure: ["memory pressure"],
  })) {
    for (const label of series) assert.ok(c.charts[name].series.includes(label), `${name} has no ${label}: ${c.charts[name].series}`);
    const t = c.charts[name].data[0];
    assert.ok(t.length >= 3, `${name}: ${t.length} samples`);
    assert.ok(t.every((v, i) => i === 0 || v > t[i - 1]), `${name}: times must increase: ${t}`);
  }
  assert.ok(c.charts.memory.data[1].every((v) => v > 0), "MLX active memory is plotted");
  assert.ok(c.charts.memory.data[6].every((v) => v > 1024), "the machine's total is a line");
  // This VM has no fans or sensors: the page says so rather than drawing an empty chart.
  assert.equal(await page.isVisible("#fans-none"), true);
});

test("the window switches between 1, 5 and 15 minutes", async () => {
  for (const [label, seconds] of [["1 min", 60], ["15 min", 900], ["5 min", 300]]) {
    await page.click(`text=${label}`);
    const x = (await charts()).charts.speed.x;
    assert.equal(Math.round(x[1] - x[0]), seconds, label);
    assert.equal(await page.getAttribute(`text=${label}`, "aria-pressed"), "true");
  }
});

test("a reload keeps the history: the server replays it on connect", async () => {
  const before = await charts();
  const loaded = Date.now();
  await page.reload();
  await page.waitForFunction((n) => window.ferriteCharts.state().samples >= n, before.samples, { timeout: 10000 });
  const after = await charts();
  assert.ok(after.charts.speed.data[0][0] * 1000 < loaded - 2000, "the first sample is from before the reload");
  assert.ok(after.charts.speed.data[1].some((v) => v > 0), "the speed of the requests before the reload is there");
});

test("acceptance by draft position is drawn as bars, one per position", async () => {
  // The figures of a speculating request (this test's models have random weights and no tuned
  // depth, so none speculates here): the chart module is fed a status that carries them.
  const bars = await page.evaluate(() => {
    const u = window.__lastStatus;
    window.ferriteCharts.update({ ...u, last: { ...u.last, acceptance: [0.8, 0.55, 0.3], tokens_per_cycle: 2.65 } });
    const c = window.ferriteCharts.state().charts.acceptance;
    return { data: c.data, title: document.querySelector("#chart-acceptance .u-title").textContent };
  });
  assert.deepEqual(bars.data[0], [1, 2, 3]);
  assert.deepEqual(bars.data[1].map((v) => Math.round(v)), [80, 55, 30]);
  assert.match(bars.title, /2\.65 tokens per cycle/);
  assert.equal(await page.isVisible("#acceptance-none"), false);
  await page.screenshot({ path: join(shots, "acceptance.png"), fullPage: true });
});

test("the depth controller's state is shown while a request speculates", async () => {
  // As the acceptance bars: this test's models do not speculate, so the page is shown a status
  // that carries the controller's figures (the server test depth_control.rs checks the real ones).
  const text = await page.evaluate(() => {
    const u = window.__lastStatus;
    const control = { drafter_now: "mtp", switches: 0, depth_now: 0, expected_speedup: 1, measured_speedup: 0.97, changes: { deeper: 1, shallower: 0, to_plain: 2, from_plain: 1 } };
    window.__showStatus({ ...u, last: { ...u.last, depth_control: control } });
    const plain = document.getElementById("depth-control").textContent;
    window.__showStatus({ ...u, last: { ...u.last, depth_control: { ...control, depth_now: 3, expected_speedup: 1.84 } } });
    const mtp = document.getElementById("depth-control").textContent;
    window.__showStatus({ ...u, last: { ...u.last, depth_control: { ...control, drafter_now: "block", switches: 2, depth_now: 7 } } });
    const el = document.getElementById("depth-control");
    return [plain, mtp, el.textContent, el.hidden];
  });
  assert.match(text[0], /Drafting: plain .* expected 1\.00x, measured 0\.97x .* 1 deeper, 0 shallower, 2 to plain, 1 back$/);
  assert.match(text[1], /Drafting: MTP depth 3 · expected 1\.84x/);
  assert.match(text[2], /Drafting: block depth 7 · .* 1 back, 2 drafter switches$/);
  assert.equal(text[3], false, "shown");
});

test("a model split across ranks shows each rank's host and memory, and a lost one", async () => {
  // This test's server runs the model whole (no `ranks`): the line stays hidden; the page is then
  // shown statuses of a split model (crates/cli/tests/distributed.rs checks the real ones).
  const text = await page.evaluate(() => {
    const u = window.__lastStatus;
    const whole = document.getElementById("ranks").hidden;
    const ranks = { count: 2, backend: "ring", hosts: ["127.0.0.1", "mac-studio"], memory_bytes: [3 * 2 ** 30, 2.5 * 2 ** 30], state: "up", error: null };
    window.__showStatus({ ...u, ranks });
    const up = document.getElementById("ranks").textContent;
    window.__showStatus({ ...u, ranks: { ...ranks, state: "down", error: "[ring] connection to a peer was lost" } });
    const el = document.getElementById("ranks");
    return [whole, up, el.textContent, el.className];
  });
  assert.equal(text[0], true, "hidden for a whole model");
  assert.match(text[1], /Split across 2 ranks \(ring\): rank 0 127\.0\.0\.1 3\.00 GiB · rank 1 mac-studio 2\.50 GiB/);
  assert.match(text[2], /down — \[ring\] connection to a peer was lost/);
  assert.equal(text[3], "error");
});

test("screenshots of the live window, wide and narrow, light and dark", async () => {
  for (const scheme of ["light", "dark"]) {
    await page.emulateMedia({ colorScheme: scheme });
    for (const [size, viewport] of [["wide", { width: 1280, height: 1000 }], ["narrow", { width: 380, height: 900 }]]) {
      await page.setViewportSize(viewport);
      await page.waitForTimeout(300); // the charts follow the new width
      const width = await page.evaluate(() => document.querySelector("#chart-speed .uplot").getBoundingClientRect().width);
      assert.ok(width <= viewport.width, `${size}: the chart (${width}px) fits the window`);
      await page.screenshot({ path: join(shots, `live-${size}-${scheme}.png`), fullPage: true });
    }
  }
  await page.emulateMedia({ colorScheme: "light" });
  await page.setViewportSize({ width: 1200, height: 1000 });
});

test("tuning is offered, shows progress and can be cancelled", async () => {
  // The hybrid model has an MTP head and no tuned depth on this machine: the page offers it.
  await page.waitForFunction(() => !document.getElementById("tune-offer").hidden, null, { timeout: 30000 });
  await page.click("#tune");
  await page.waitForFunction(() => document.getElementById("tune-status").textContent.includes("depth"), null, { timeout: 30000 });
  assert.match(await page.textContent("#tune-status"), /Tuning second-model \((warm-up|measuring)\)/);
  assert.equal(await page.isVisible("#tune-progress"), true);
  await page.screenshot({ path: join(shots, "tuning.png"), fullPage: true });
  await page.click("#tune-cancel");
  await page.waitForFunction(() => document.getElementById("tune-status").textContent.includes("cancelled"), null, { timeout: 60000 });
  const status = await (await fetch(`${base}/v1/status`)).json();
  assert.match(status.draft_depth_source, /^untuned/, "a cancelled tune stores nothing");
  // A tune for one workload class: the page says which, and cancelling it stores nothing too.
  await page.selectOption("#tune-class", "prose/sampled");
  await page.click("#tune");
  await page.waitForFunction(() => document.getElementById("tune-status").textContent.includes("for prose/sampled"), null, { timeout: 30000 });
  await page.click("#tune-cancel");
  await page.waitForFunction(() => document.getElementById("tune-status").textContent.includes("cancelled"), null, { timeout: 60000 });
  assert.deepEqual((await (await fetch(`${base}/v1/status`)).json()).class_depths, {});
});

test("a catalog model downloads with progress and is then installed", async () => {
  await page.click("#refresh-models");
  await page.click("details summary");
  const download = page.locator("#catalog li", { hasText: "tiny-download" }).getByRole("button", { name: "Download" });
  await download.click();
  // Progress: bytes of bytes, a rate, a progress bar.
  await page.waitForFunction(() => /of .* · .*\/s/.test(document.getElementById("downloads").textContent), null, { timeout: 30000 });
  assert.equal(await page.isVisible("#downloads progress"), true);
  await page.screenshot({ path: join(shots, "downloading.png"), fullPage: true });
  await page.waitForFunction(() => [...document.querySelectorAll("#installed li")].some((li) => li.textContent.includes("ferrite-test/tiny-hybrid") || li.textContent.includes("tiny-download")), null, { timeout: 60000 });
  assert.match(await page.textContent("#downloads"), /done/);
});

test("errors are shown, not swallowed", async () => {
  await page.fill("#folder", "/proc/version/not-a-folder");
  await page.click("#folder-form button[type=submit]");
  await page.waitForFunction(() => document.getElementById("models-error").textContent.length > 0);
  assert.match(await page.textContent("#models-error"), /not-a-folder/);
  await page.screenshot({ path: join(shots, "error.png"), fullPage: true });
});

test("a notice from the app (its launch model could not start) is shown", async () => {
  // A real status update from this server, with the notice the app adds when the model it
  // was to start could not (tests/app/window.sh sees the app set it).
  const stream = (await fetch(`${base}/v1/events`)).body.getReader();
  let text = "";
  while (!text.includes("\n\n")) text += new TextDecoder().decode((await stream.read()).value);
  await stream.cancel();
  const update = JSON.parse(text.split("\n").find((l) => l.startsWith("data: ")).slice(6));
  update.notice = "Ferrite could not start `gone-model`: no such model. It started the default model instead.";
  const other = await browser.newPage({ viewport: { width: 1200, height: 1000 } });
  await other.route("**/v1/events", (route) => route.fulfill({
    status: 200, headers: { "content-type": "text/event-stream" }, body: `event: status\ndata: ${JSON.stringify(update)}\n\n`,
  }));
  await other.goto(base);
  await other.waitForSelector("#notice:not([hidden])");
  assert.match(await other.textContent("#notice"), /could not start `gone-model`/);
  await other.screenshot({ path: join(shots, "notice.png") });
  await other.close();
});
