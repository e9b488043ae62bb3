"""Concurrent streaming clients against one or more servers: each client a distinct prompt, all
sent at once; per stream its time to first token and decode tok/s ((tokens - 1) / (last token -
first token, from the chunks that carry text), tokens as the stream's usage counts them, else its
chunks), and the total tok/s of the run (every
token over the time from the first client's send to the last token). With several servers the
runs alternate server by server within each round (a noisy machine weighs on all alike).
bench/clients.sh runs `ferrite serve` and `mlx_lm.server` on the same model in one run.

    python bench/clients.py --server LABEL=URL=MODEL_ID [--server ...] [--clients 1,2,4,8
        --max-tokens 64 --rounds 1]

Prints one JSON line per server, client count and round. Standard library only (it runs on
GPU machines with nothing installed).
"""

import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse

PROMPTS = [
    "Write a Python function that reads a config file.",
    "Write a Rust function that sorts a vector of strings.",
    "Write a SQL query that lists users by signup date.",
    "Write a C function that reverses a string in place.",
    "Write a JavaScript function that debounces a callback.",
    "Write a Go HTTP handler that returns JSON.",
    "Write a Bash script that backs up a folder.",
    "Write a Python class for a stack.",
]


def stream(base, model, prompt, max_tokens, temperature, out, start):
    """One streaming chat completion; its send, first and last token times and token count."""
    url = urllib.parse.urlsplit(base)
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "temperature": temperature, "stream": True,
                       "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=900)
    start.wait()
    sent = time.perf_counter()
    first = last = end = None
    chunks = 0
    usage = None  # the server's count of tokens (a token may decode to no text of its own)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{base}: HTTP {r.status}: {r.read()[:300]!r}")
    for raw in r:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: "):
            continue
        end = time.perf_counter()
        if line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = (chunk.get("usage") or {}).get("completion_tokens") or usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                last = time.perf_counter()
                first = first or last
                chunks += 1
    conn.close()
    out.append({"sent": sent, "first": first, "last": last, "end": end, "tokens": usage or chunks})


def run(base, model, n, max_tokens, temperature):
    streams, start = [], threading.Event()
    threads = [threading.Thread(target=stream, args=(base, model, PROMPTS[i % len(PROMPTS)], max_tokens,
                                                      temperature, streams, start)) for i in range(n)]
    for t in threads:
        t.start()
    start.set()
    for t in threads:
        t.join()
    if len(streams) < n:
        raise RuntimeError(f"{base}: {n - len(streams)} of {n} streams failed")
    silent = sum(1 for s in streams if s["end"] is None)
    if silent:
        raise RuntimeError(f"{base}: {silent} of {n} streams ended without a single event")
    # The run ends with the last stream's last event: a random-weight checkpoint's tokens may
    # decode to no text (ids its small tokenizer lacks), so text chunks cannot time it.
    begin = min(s["sent"] for s in streams)
    end = max(s["end"] for s in streams)
    rates = [(s["tokens"] - 1) / (s["last"] - s["first"]) for s in streams if s["tokens"] > 1 and s["first"] and s["last"] > s["first"]]
    ttfts = [s["first"] - s["sent"] for s in streams if s["first"]]
    return {"clients": n, "tokens": sum(s["tokens"] for s in streams),
            "total_tps": round(sum(s["tokens"] for s in streams) / (end - begin), 1),
            "per_stream_tps_median": round(statistics.median(rates), 1) if rates else None,
            "ttft_s_median": round(statistics.median(ttfts), 3) if ttfts else None}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--server", action="append", required=True, help="LABEL=URL=MODEL_ID")
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warm-tokens", type=int, default=8,
                   help="tokens of the warm-up run at each client count first (0: none; then read round 1 as warm)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; a random-weight checkpoint may need sampling to say anything")
    a = p.parse_args()
    servers = [s.split("=", 2) for s in a.server]
    counts = [int(x) for x in a.clients.split(",")]
    for label, base, model in servers:
        for n in counts if a.warm_tokens else []:  # warm-up: every batch shape once
            run(base, model, n, a.warm_tokens, a.temperature)
    # A server that fails a run (mlx_lm.server's generation thread can die under a hybrid
    # model's batch) gets an error line and no more runs; the others go on.
    failed = set()
    for r in range(a.rounds):
        for n in counts:
            for label, base, model in servers:
                if label in failed:
                    continue
                line = {"server": label, "round": r + 1, "temperature": a.temperature}
                try:
                    line.update(run(base, model, n, a.max_tokens, a.temperature))
                except (RuntimeError, OSError) as e:
                    failed.add(label)
                    line.update({"clients": n, "error": str(e)})
                print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
