"""Streams chat completions from a running `ferrite serve` and compares the decode rate a
client sees at the HTTP boundary with the engine's own decode rate for the same request
(the `timings` the server returns). Both use (tokens - 1) / (last token - first token).
Also end to end: the engine's time to first token plus decode time, over the client's time
from sending the request to the last token (HTTP, templating, tokenizing and queueing included).

    python bench/http_client.py --base http://127.0.0.1:PORT --model ID [--requests 5 --max-tokens 256]
"""

import argparse
import json
import statistics
import time

import httpx


def one(client, base, model, max_tokens):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Write a function that adds two numbers."}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # random weights: a fixed length, as in decode.sh
    }
    first = last = None
    tokens = timings = None
    sent = time.perf_counter()
    with client.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if delta.get("content") or delta.get("reasoning_content"):
                    last = time.perf_counter()
                    first = first or last
            timings = chunk.get("timings") or timings
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None or first == last:
        raise SystemExit("the model streamed no text to time (random weights whose ids fall outside "
                         "the project tokenizer, as in the 0.6b preset): use a case with a matching vocabulary")
    client_tps = (tokens - 1) / (last - first)
    # End to end: request sent to last token, against the engine's time to first token plus
    # its decode time for the same tokens.
    engine_s = timings["ttft_ms"] / 1e3 + (tokens - 1) / timings["decode_tps"]
    return client_tps, timings["decode_tps"], tokens, engine_s / (last - sent)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--requests", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=256)
    a = p.parse_args()
    with httpx.Client(timeout=600) as client:
        one(client, a.base, a.model, a.max_tokens)  # warm-up
        runs = [one(client, a.base, a.model, a.max_tokens) for _ in range(a.requests)]
    ratios = [r[0] / r[1] for r in runs]
    print(json.dumps({
        "end_to_end_ratio": statistics.median(r[3] for r in runs),
        "client_tps": statistics.median(r[0] for r in runs),
        "engine_tps": statistics.median(r[1] for r in runs),
        "tokens": statistics.median(r[2] for r in runs),
        "ratio": statistics.median(ratios),
    }))


if __name__ == "__main__":
    main()
