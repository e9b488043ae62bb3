"""The table of bench/compare.sh: one row per (case, prompt size) with Ferrite's and mlx-lm's
decode tok/s, time to first token and peak memory, the ratios (> 1 = Ferrite better), and
decode as a fraction of the memory-bandwidth bound.

Bytes read per decode token, from the checkpoint's safetensors headers and config: every
weight the trunk reads for one token (routed experts scaled by top-k / experts; the input
embedding counts only when tied to the output head; the MTP head is not read by plain
decoding), plus the KV cache of the full-attention layers at the mean context of the decode
(prompt + half the new tokens), plus the recurrent state of the linear-attention layers
(read and written, f32).

With several rows per engine and prompt (`PROCESSES=N`: each engine run in N fresh processes,
alternating), decode and TTFT are medians, decode also shows its range, and peak memory is the
highest.
"""

import argparse
import json
import os
import statistics
import struct
import sys
from pathlib import Path


def tensor_bytes(folder):
    sizes = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                start, end = meta["data_offsets"]
                sizes[name] = end - start
    return sizes


def bytes_per_token(folder, context, act_bytes):
    cfg = json.loads((Path(folder) / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    tied = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    experts = text.get("num_experts", 0)
    top_k = text.get("num_experts_per_tok", 0)
    total = 0.0
    for name, n in tensor_bytes(folder).items():
        if name.startswith("mtp.") or ".mtp." in name:
            continue
        if "embed_tokens" in name and not tied:
            continue
        if experts and ("switch_mlp" in name or ".experts." in name):
            n = n * top_k / experts
        total += n
    layers = text["num_hidden_layers"]
    if "layer_types" in text:
        full = sum(t == "full_attention" for t in text["layer_types"])
    elif "full_attention_interval" in text:
        full = layers // text["full_attention_interval"]
    else:
        full = layers
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    total += full * 2 * text["num_key_value_heads"] * head_dim * context * act_bytes
    linear = layers - full
    if linear and "linear_num_value_heads" in text:
        state = text["linear_num_value_heads"] * text["linear_key_head_dim"] * text["linear_value_head_dim"] * 4
        total += linear * 2 * state
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", required=True, help="JSON lines from ferrite bench and mlx_lm_decode.py, with 'case'")
    p.add_argument("--checkpoints", required=True, help="folder holding <case>-<dtype> checkpoints")
    p.add_argument("--dtype", default="bf16")
    a = p.parse_args()

    rows = [json.loads(l) for l in Path(a.rows).read_text().splitlines() if l.strip()]
    runs = {}
    for r in rows:
        runs.setdefault((r["case"], r["prompt_tokens"]), {}).setdefault(r["engine"], []).append(r)
    pairs = {key: {engine: merged(rs) for engine, rs in by_engine.items()} for key, by_engine in runs.items()}
    bandwidth = float(os.environ.get("BANDWIDTH_GBS") or 0) * 1e9
    act_bytes = 4 if a.dtype == "f32" else 2
    backend = next((r["backend"] for r in rows if r["engine"] == "ferrite"), "?")
    paths = sorted({r.get("delta_path", "?") for r in rows if r["engine"] == "ferrite"})
    gen = rows[0]["gen_tokens"] if rows else 0
    bw_note = f", bandwidth bound at {bandwidth / 1e9:.0f} GB/s" if bandwidth else " (no bandwidth figure for this device: BANDWIDTH_GBS)"
    print(f"\nbackend {backend}, {gen} new tokens, checkpoints {a.dtype}{bw_note}; ferrite's gated delta path: {', '.join(paths)}")
    peers = sorted({r["engine"] for r in rows} - {"ferrite"})
    for peer in peers:
        print(f"\nagainst {peer}{PEER_NOTES.get(peer, '')}\n")
        table(pairs, peer, a, bandwidth, act_bytes)
    print("\nratio: ferrite / peer for decode, peer / ferrite for TTFT (> 1 = ferrite better).")


PEER_NOTES = {
    "mlx-lm": " (its gated delta recurrence as operations, as it runs off a Mac)",
    "mlx-lm-mac-like": " (its Metal gated-delta kernel ported to CUDA, as it runs on a Mac: bench/mlx_lm_mac_like.py)",
}


def table(pairs, peer, a, bandwidth, act_bytes):
    print(f"| case | prompt | decode tok/s ferrite | {peer} | ratio | TTFT s ferrite | {peer} | ratio | peak MB ferrite | {peer} | MB read/token | % of bound ferrite | {peer} |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (case, n), pair in pairs.items():
        f, m = pair.get("ferrite"), pair.get(peer)
        if not f or not m:
            print(f"| {case} | {n} | (one side missing) |", file=sys.stdout)
            continue
        per_token = bytes_per_token(Path(a.checkpoints) / f"{case}-{a.dtype}", n + f["gen_tokens"] / 2, act_bytes)
        bound = lambda tps: f"{100 * tps * per_token / bandwidth:.1f}" if bandwidth else "n/a"
        print(
            f"| {case} | {n} | {decode(f)} | {decode(m)} | {f['decode_tps'] / m['decode_tps']:.2f} "
            f"| {f['ttft_s']:.3f} | {m['ttft_s']:.3f} | {m['ttft_s'] / f['ttft_s']:.2f} "
            f"| {f['peak_memory_bytes'] / 1e6:.1f} | {m['peak_memory_bytes'] / 1e6:.1f} | {per_token / 1e6:.1f} "
            f"| {bound(f['decode_tps'])} | {bound(m['decode_tps'])} |"
        )


def merged(rs):
    """One engine's runs at one prompt size as one row: medians, the decode range, the highest peak."""
    row = dict(rs[0])
    row["decode_tps"] = statistics.median(r["decode_tps"] for r in rs)
    row["ttft_s"] = statistics.median(r["ttft_s"] for r in rs)
    row["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in rs)
    row["decode_range"] = (min(r["decode_tps"] for r in rs), max(r["decode_tps"] for r in rs)) if len(rs) > 1 else None
    return row


def decode(row):
    text = f"{row['decode_tps']:.1f}"
    if row["decode_range"]:
        low, high = row["decode_range"]
        text += f" ({low:.1f}–{high:.1f})"
    return text


if __name__ == "__main__":
    main()
