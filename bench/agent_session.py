"""An agent session with and without the prompt cache (bench/prompt_cache.sh runs it).

record: Claude Code runs a ten-step session against `ferrite serve --model default`, each step a
Bash tool call (`echo step-NN`) and its result; the answers are scripted (`--scripted-replies`,
enforced on the logits) because the embedded model cannot hold such a session by itself. A
proxy in front of the server keeps every request Claude Code sends, as it sent it.

replay: the recorded requests, in order, against a fresh `ferrite serve` with the cache off,
then with it on (each streamed as recorded): time to the first content event, prompt tokens,
tokens served from the cache. Prints one JSON object per request. `--cache disk` is `on` with
the disk tier in a fresh folder, and `--restart-at N` stops the server before request N and
starts a new one (nothing in memory: what it reuses comes from disk).
"""

import argparse
import http.server
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

STEPS = 10


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def rules():
    """Step k's result in the prompt -> call step k+1; after the last, end the turn."""
    out = [{"when": [f"step-{STEPS:02d}"], "reply": f"All {STEPS} steps ran."}]
    for k in range(STEPS - 1, 0, -1):
        out.append({"when": [f"step-{k:02d}"],
                    "reply": call("Bash", {"command": f"echo step-{k + 1:02d}", "description": f"Step {k + 1}"})})
    out.append({"when": ["Run the ten steps", '"name": "Bash"'],
                "reply": call("Bash", {"command": "echo step-01", "description": "Step 1"})})
    return out


def serve(ferrite, port, env, *extra, model="default", log=None):
    proc = subprocess.Popen([ferrite, "serve", "--model", model, "--port", str(port), "--idle-minutes", "0",
                             "--max-output-tokens", "160", *extra],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(log, "a") if log else subprocess.DEVNULL)
    for _ in range(6000):  # a big checkpoint takes a while to load
        if proc.poll() is not None:
            tail = Path(log).read_text()[-2000:] if log else ""
            raise RuntimeError(f"ferrite serve exited with {proc.returncode}\n{tail}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("ferrite serve did not come up")


def record(args):
    work = Path(tempfile.mkdtemp(prefix="ferrite-session-"))
    (work / "home").mkdir()
    (work / "cwd").mkdir()
    (work / "rules.json").write_text(json.dumps(rules()))
    env = dict(os.environ, FERRITE_CONFIG_DIR=str(work / "config"), RUST_LOG="warn")
    port, proxy_port = free_port(), free_port()
    server = serve(args.ferrite, port, env, "--scripted-replies", str(work / "rules.json"))
    recorded = []

    class Proxy(http.server.BaseHTTPRequestHandler):
        def forward(self, body=None):
            req = urllib.request.Request(f"http://127.0.0.1:{port}{self.path}", data=body, method=self.command)
            for k, v in self.headers.items():
                if k.lower() not in ("host", "content-length", "connection"):
                    req.add_header(k, v)
            try:
                res = urllib.request.urlopen(req, timeout=600)
            except urllib.error.HTTPError as e:
                res = e
            self.send_response(res.status)
            for k, v in res.headers.items():
                if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                    self.send_header(k, v)
            self.send_header("connection", "close")
            self.end_headers()
            while chunk := res.read1(65536) if hasattr(res, "read1") else res.read():
                self.wfile.write(chunk)
                self.wfile.flush()

        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.path.startswith("/v1/messages") and "count_tokens" not in self.path:
                recorded.append(json.loads(body))
            self.forward(body)

        def do_GET(self):
            self.forward()

        do_HEAD = do_GET

        def log_message(self, *a):
            pass

    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", proxy_port), Proxy)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        done = subprocess.run(
            [args.claude, "-p", "Run the ten steps", "--allowedTools", "Bash"],
            cwd=work / "cwd", capture_output=True, text=True, timeout=3600, stdin=subprocess.DEVNULL,
            env=dict(os.environ, HOME=str(work / "home"), PWD=str(work / "cwd"),
                     ANTHROPIC_BASE_URL=f"http://127.0.0.1:{proxy_port}", ANTHROPIC_API_KEY="sk-local"))
    finally:
        proxy.shutdown()
        server.terminate()
        server.wait()
    if done.returncode != 0 or f"All {STEPS} steps ran." not in done.stdout:
        sys.exit(f"claude did not finish the session ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    Path(args.out).write_text(json.dumps(recorded))
    print(f"recorded {len(recorded)} requests to {args.out}", file=sys.stderr)


def replay(args):
    requests = json.loads(Path(args.session).read_text())
    work = Path(tempfile.mkdtemp(prefix="ferrite-replay-"))
    (work / "rules.json").write_text(json.dumps(rules()))
    env = dict(os.environ, FERRITE_CONFIG_DIR=str(work / "config"), RUST_LOG="warn", FERRITE_PROMPT_DISK_GB="0")
    if args.cache == "off":
        env["FERRITE_PROMPT_CACHE_MB"] = "0"
    if args.cache == "disk":
        (work / "config").mkdir()
        (work / "config" / "config.toml").write_text(f'[prompt_cache]\ndir = "{work / "blocks"}"\ndisk_gb = 20.0\n')
        env["FERRITE_PROMPT_DISK_GB"] = ""
    port = free_port()
    start = lambda: serve(args.ferrite, port, env, "--scripted-replies", str(work / "rules.json"), model=args.model,
                          log=work / "serve.log")
    server = start()
    try:
        for i, body in enumerate(requests):
            if i == args.restart_at:
                server.terminate()
                server.wait()
                server = start()
            body["stream"] = True
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/messages", data=json.dumps(body).encode(),
                                         headers={"content-type": "application/json", "anthropic-version": "2023-06-01"})
            started = time.monotonic()
            first, usage = None, {}
            with urllib.request.urlopen(req, timeout=900) as res:
                for line in res:
                    line = line.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    event = json.loads(line[6:])
                    if first is None and event["type"] in ("content_block_start", "content_block_delta"):
                        first = time.monotonic() - started
                    if event["type"] == "message_delta":
                        usage = event["usage"]
            prompt = usage.get("input_tokens", 0) + usage.get("cache_read_input_tokens", 0)
            status = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/status", timeout=30))
            cache = status.get("prompt_cache") or {}
            print(json.dumps({"cache": args.cache, "request": i, "restarted": i == args.restart_at,
                              "cache_bytes": cache.get("bytes"), "cache_budget_bytes": cache.get("budget_bytes"),
                              "disk_bytes": (cache.get("disk") or {}).get("bytes"),
                              "mlx_active_bytes": status.get("mlx_active_memory_bytes"),
                              "tools": len(body.get("tools", [])),
                              "prompt_tokens": prompt, "cached_tokens": usage.get("cache_read_input_tokens", 0),
                              "ttft_s": first}), flush=True)
    finally:
        server.terminate()
        server.wait()


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record")
    r.add_argument("--ferrite", required=True)
    r.add_argument("--claude", required=True)
    r.add_argument("--out", required=True)
    r.set_defaults(run=record)
    q = sub.add_parser("replay")
    q.add_argument("--ferrite", required=True)
    q.add_argument("--session", required=True)
    q.add_argument("--model", default="default", help="a model name or folder (the recording's server ran the default)")
    q.add_argument("--cache", choices=["off", "on", "disk"], required=True)
    q.add_argument("--restart-at", type=int, default=-1, help="restart the server before this request")
    q.set_defaults(run=replay)
    args = p.parse_args()
    for name in ("ferrite", "claude"):
        if getattr(args, name, None):
            setattr(args, name, str(Path(getattr(args, name)).resolve()))
    args.run(args)


if __name__ == "__main__":
    main()
