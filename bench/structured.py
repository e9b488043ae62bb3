"""Structured output on the embedded model: conformance over generated JSON schemas, and the
decode speed a grammar costs (bench/structured.sh runs it).

Schemas: N (default 200) made with a fixed seed, covering objects (nested, with required
fields), arrays (item and length bounds), enums, integers and numbers with bounds, booleans and
strings with lengths and patterns; every one bounded, so a whole document fits the answer's
token budget. For each draft depth (a server started with `--draft-depth`) and temperature,
every schema is asked for through `/v1/chat/completions` with `response_format` (strict
`json_schema`): the answer must parse (here) and validate (the server's check, the
`jsonschema` crate). Speed: for the first `--speed` schemas at temperature 0, the same prompt
without a grammar, as many tokens (`ignore_eos`), against the constrained answer: the engine's
decode tok/s (its `timings`), so HTTP and templating are left out.

    python bench/structured.py --ferrite target/release/ferrite [--schemas 200 --speed 40] [--model DIR]

`--model` runs another model (the GPU runs use a project-made 35B-A3B-shaped checkpoint: its
answers are random, so only the speed figures mean anything there).
Prints one JSON line per (depth, temperature) and one per depth for speed.
"""

import argparse
import json
import os
import random
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

WORDS = ["alpha", "beta", "gamma", "delta", "omega", "red", "green", "blue", "low", "high", "on", "off"]


def leaf(rng):
    kind = rng.choice(["string", "pattern", "enum", "integer", "number", "boolean"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 3), "maxLength": rng.randint(4, 16)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(["^[a-z]{1,8}$", "^[A-Z][a-z]{0,6}$", "^[0-9]{2,4}$",
                                                         "^[a-z]{1,8}-[0-9]{1,3}$"])}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(2, 4))}
    if kind == "integer":
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 1000)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 50)}
    return {"type": "boolean"}


def node(rng, depth):
    roll = rng.random()
    if depth < 2 and roll < 0.25:
        return obj(rng, depth + 1)
    if depth < 3 and roll < 0.45:
        return {"type": "array", "items": leaf(rng), "minItems": rng.randint(0, 2), "maxItems": rng.randint(2, 4)}
    return leaf(rng)


def obj(rng, depth=0):
    names = rng.sample(["id", "name", "kind", "size", "tags", "mode", "count", "ratio", "owner", "flags", "level",
                        "items"], rng.randint(1, 4))
    props = {n: node(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(n, seed):
    rng = random.Random(seed)
    return [obj(rng) for _ in range(n)]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(ferrite, depth, model):
    port = free_port()
    work = tempfile.mkdtemp(prefix="ferrite-structured-")
    env = dict(os.environ, FERRITE_CONFIG_DIR=work, RUST_LOG="warn", FERRITE_PROMPT_DISK_GB="0")
    proc = subprocess.Popen([ferrite, "serve", "--model", model, "--port", str(port), "--idle-minutes", "0",
                             "--draft-depth", str(depth)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("ferrite serve did not come up")


def post(base, body):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    return json.load(urllib.request.urlopen(req, timeout=600))


def ask(base, i, schema, temperature, grammar=True, tokens=256, ignore_eos=False):
    body = {"model": "default", "max_tokens": tokens, "temperature": temperature, "seed": i,
            "messages": [{"role": "user", "content": f"Describe item {i} as JSON."}]}
    if grammar:
        body["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": f"item{i}", "schema": schema, "strict": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    return post(base, body)


def conformance(base, all_schemas, temperature):
    parsed = valid = 0
    failures, acceptance, cycles = [], [], []
    for i, schema in enumerate(all_schemas):
        r = ask(base, i, schema, temperature)
        text = r["choices"][0]["message"]["content"]
        try:
            json.loads(text)
            parsed += 1
        except ValueError:
            pass
        if r.get("response_format_check", {}).get("valid"):
            valid += 1
        elif len(failures) < 3:
            failures.append({"schema": i, "answer": text[:200], "finish": r["choices"][0]["finish_reason"]})
        t = r.get("timings", {})
        if t.get("acceptance"):
            acceptance.append(t["acceptance"])
            cycles.append(t.get("tokens_per_cycle") or 0)
    by_position = [round(sum(a[k] for a in acceptance) / len(acceptance), 3) for k in range(len(acceptance[0]))] \
        if acceptance else []
    return {"schemas": len(all_schemas), "parsed": parsed, "valid": valid, "failures": failures,
            "acceptance": by_position, "tokens_per_cycle": round(sum(cycles) / len(cycles), 2) if cycles else None}


def speed(base, all_schemas):
    constrained, free = [], []
    for i, schema in enumerate(all_schemas):
        r = ask(base, i, schema, 0.0)
        n = r["usage"]["completion_tokens"]
        if n < 8:
            continue
        u = ask(base, i, schema, 0.0, grammar=False, tokens=n, ignore_eos=True)
        constrained.append((n, r["timings"]["decode_tps"]))
        free.append((n, u["timings"]["decode_tps"]))
    # Token-weighted means: time per token over the same tokens.
    rate = lambda rows: sum(n for n, _ in rows) / sum(n / tps for n, tps in rows)
    return {"answers": len(constrained), "tokens": sum(n for n, _ in constrained),
            "constrained_tps": round(rate(constrained), 1), "free_tps": round(rate(free), 1),
            "ratio": round(rate(constrained) / rate(free), 3)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--ferrite", required=True)
    p.add_argument("--schemas", type=int, default=200)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--speed", type=int, default=40)
    p.add_argument("--depths", default="0,2")
    p.add_argument("--temperatures", default="0,0.7", help="empty: speed only")
    p.add_argument("--model", default="default")
    args = p.parse_args()
    all_schemas = schemas(args.schemas, args.seed)
    for depth in [int(d) for d in args.depths.split(",")]:
        proc, base = serve(args.ferrite, depth, args.model)
        try:
            for t in [float(x) for x in args.temperatures.split(",") if x]:
                print(json.dumps({"depth": depth, "temperature": t, **conformance(base, all_schemas, t)}), flush=True)
            if args.speed:
                print(json.dumps({"depth": depth, "speed": speed(base, all_schemas[:args.speed])}), flush=True)
        finally:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
