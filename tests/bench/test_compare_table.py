"""bench/compare_table.py: one row per engine and prompt size, from one run or several processes."""

import json
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def checkpoint(folder: Path) -> None:
    """A dense config and a safetensors header (the table reads sizes from headers only)."""
    folder.mkdir(parents=True)
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "tie_word_embeddings": True}
    (folder / "config.json").write_text(json.dumps(config))
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [500, 1000], "data_offsets": [0, 1_000_000]}}).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(1_000_000))


def row(engine: str, decode: float, ttft: float, peak_mb: float) -> dict:
    return {"engine": engine, "backend": "cpu", "case": "tiny", "prompt_tokens": 128, "gen_tokens": 256,
            "decode_tps": decode, "ttft_s": ttft, "peak_memory_bytes": int(peak_mb * 1e6)}


def table(tmp_path: Path, rows: list) -> str:
    checkpoint(tmp_path / "tiny-bf16")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, ROOT / "bench" / "compare_table.py", "--rows", tmp_path / "rows.jsonl",
                          "--checkpoints", tmp_path], capture_output=True, text=True, check=True)
    return next(l for l in out.stdout.splitlines() if l.startswith("| tiny |"))


def cells(line: str) -> list:
    return [c.strip() for c in line.strip("|").split("|")]


def test_one_run_per_engine_gives_its_figures_and_ratios(tmp_path):
    c = cells(table(tmp_path, [row("ferrite", 90.0, 0.1, 20.0), row("mlx-lm", 60.0, 0.5, 21.0)]))
    assert c[:8] == ["tiny", "128", "90.0", "60.0", "1.50", "0.100", "0.500", "5.00"]
    assert c[8:10] == ["20.0", "21.0"]
    # MB read per token: the tied embedding (1,000,000 bytes) and both layers' bf16 keys and
    # values at the decode's mean context (128 + 256 / 2): 2 * 2 * 2 heads * 16 * 256 * 2 bytes.
    assert c[10] == f"{(1_000_000 + 2 * 2 * 2 * 16 * 256 * 2) / 1e6:.1f}" == "1.1"

def test_several_processes_give_medians_the_decode_range_and_the_highest_peak(tmp_path):
    rows = [row("ferrite", 75.3, 0.10, 20.0), row("mlx-lm", 40.0, 0.6, 21.0),
            row("ferrite", 82.7, 0.12, 22.0), row("mlx-lm", 41.0, 0.5, 21.5),
            row("ferrite", 59.2, 0.13, 21.0), row("mlx-lm", 42.0, 0.7, 21.2)]
    c = cells(table(tmp_path, rows))
    assert c[2:8] == ["75.3 (59.2–82.7)", "41.0 (40.0–42.0)", "1.84", "0.120", "0.600", "5.00"]
    assert c[8:10] == ["22.0", "21.5"]


def test_each_peer_gets_its_own_table(tmp_path):
    checkpoint(tmp_path / "tiny-bf16")
    rows = [row("ferrite", 90.0, 0.1, 20.0), row("mlx-lm", 30.0, 0.5, 21.0), row("mlx-lm-mac-like", 60.0, 0.2, 21.0)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run([sys.executable, ROOT / "bench" / "compare_table.py", "--rows", tmp_path / "rows.jsonl",
                          "--checkpoints", tmp_path], capture_output=True, text=True, check=True).stdout
    assert "against mlx-lm (its gated delta recurrence as operations" in out
    assert "against mlx-lm-mac-like (its Metal gated-delta kernel ported to CUDA" in out
    lines = [cells(l) for l in out.splitlines() if l.startswith("| tiny |")]
    assert [l[3:5] for l in lines] == [["30.0", "3.00"], ["60.0", "1.50"]]
