"""The peer side of `ferrite dev ops`: the MLX operations one greedy step of mlx-lm's
generate_step dispatches (forward pass for one token, log-softmax, argmax), by kind, after a
prompt of each --context length, read from MLX's graph export as Ferrite counts its own.
With --positions N (repeatable), a verify pass's step instead: N positions at once, all but
the first trimmed from the cache after each (where the cache can be trimmed), as
`ferrite dev ops --positions N` times its own.
"""

import argparse
import collections
import json
import re
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load_model


def step_ops(model, context, positions=1):
    vocab = model.args.vocab_size if hasattr(model, "args") else 512
    prompt = mx.array([[(i * 7919 + 1) % max(vocab, 2) for i in range(max(context, 1))]], dtype=mx.uint32)
    cache = make_prompt_cache(model)
    for start in range(0, prompt.shape[1], 2048):
        model(prompt[:, start:start + 2048], cache=cache)
        mx.eval([c.state for c in cache])

    def step():
        logits = model(mx.array([[1] * positions], dtype=mx.uint32), cache=cache)
        if positions == 1:
            logits = logits[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(logprobs, axis=-1), logprobs

    def rewind():
        if positions > 1 and can_trim_prompt_cache(cache):
            trim_prompt_cache(cache, positions - 1)

    y, logprobs = step()
    with tempfile.NamedTemporaryFile("w+", suffix=".dot") as f:
        mx.export_to_dot(f.name, y, logprobs)
        dot = Path(f.name).read_text()
    mx.eval(y, logprobs)
    rewind()
    # As `ferrite dev ops`: 2 untimed steps, then 16 built and run one at a time.
    build = total = 0.0
    for i in range(18):
        start = time.perf_counter()
        y, logprobs = step()
        built = time.perf_counter() - start
        mx.eval(y, logprobs)
        rewind()
        if i >= 2:
            build += built
            total += time.perf_counter() - start
    kinds = collections.Counter(re.findall(r'label ="([^"]+)", shape=rectangle', dot))
    return kinds, build * 1e3 / 16, total * 1e3 / 16


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--context", type=int, action="append")
    p.add_argument("--positions", type=int, action="append")
    a = p.parse_args()
    model, _ = load_model(Path(a.model), strict=False)
    for context in a.context or [128]:
        for positions in a.positions or [1]:
            kinds, build_ms, step_ms = step_ops(model, context, positions)
            print(json.dumps({"engine": "mlx-lm", "context": context, "positions": positions, "total": sum(kinds.values()),
                              "by_kind": dict(sorted(kinds.items())), "build_ms": build_ms, "step_ms": step_ms}))


if __name__ == "__main__":
    main()
