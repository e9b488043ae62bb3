"""Concurrent streaming clients against one server: each client a distinct prompt, all sent
at once; per stream its time to first token and decode tok/s ((tokens - 1) / (last token -
first token), tokens counted from the stream's chunks), and the total tok/s of the run (every
token over the time from the first client's send to the last token). bench/clients.sh runs
`ferrite serve` and `mlx_lm.server` on the same model in one run.

    python bench/clients.py --base http://127.0.0.1:PORT --model ID [--clients 1,2,4,8 --max-tokens 64]
Prints one JSON line per client count.
"""

import argparse
import asyncio
import json
import statistics
import time

import httpx

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


async def stream(client, base, model, prompt, max_tokens):
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    sent = time.perf_counter()
    first = last = None
    chunks = 0
    async with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"):
                    last = time.perf_counter()
                    first = first or last
                    chunks += 1
    return {"sent": sent, "first": first, "last": last, "tokens": chunks}


async def run(base, model, n, max_tokens):
    async with httpx.AsyncClient(timeout=600) as client:
        streams = await asyncio.gather(*(stream(client, base, model, PROMPTS[i % len(PROMPTS)], max_tokens)
                                         for i in range(n)))
    start = min(s["sent"] for s in streams)
    end = max(s["last"] for s in streams if s["last"])
    rates = [(s["tokens"] - 1) / (s["last"] - s["first"]) for s in streams if s["tokens"] > 1 and s["last"] > s["first"]]
    return {"clients": n, "tokens": sum(s["tokens"] for s in streams),
            "total_tps": round(sum(s["tokens"] for s in streams) / (end - start), 1),
            "per_stream_tps_median": round(statistics.median(rates), 1) if rates else None,
            "ttft_s_median": round(statistics.median(s["first"] - s["sent"] for s in streams if s["first"]), 3)}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--clients", default="1,2,4,8")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--label", default="")
    a = p.parse_args()
    asyncio.run(run(a.base, a.model, 1, 8))  # warm-up
    for n in [int(x) for x in a.clients.split(",")]:
        print(json.dumps({"server": a.label, **asyncio.run(run(a.base, a.model, n, a.max_tokens))}), flush=True)


if __name__ == "__main__":
    main()
