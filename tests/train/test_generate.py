"""train/generate.py: rows of corpus text continued by the target, greedily, as its own full pass would."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "assets" / "models" / "ferrite-code-20m"


def test_rows_are_corpus_prompts_continued_by_the_targets_own_choices(tmp_path: Path, monkeypatch) -> None:
    # MLX's CPU backend compiles kernels into $TMPDIR with no lock between processes: this
    # test's processes keep theirs apart from any other test's (crates/engine/src/kernel_cache.rs).
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    source = np.arange(1000, 1400, dtype="<u2")  # ids the model knows (vocabulary 8192)
    source.tofile(tmp_path / "source.bin")
    out = tmp_path / "rows.bin"
    subprocess.run([sys.executable, ROOT / "train" / "generate.py", "--target", TARGET, "--source",
                    tmp_path / "source.bin", "--out", out, "--rows", "3", "--batch", "2", "--seq", "20",
                    "--prompt", "8"], check=True, cwd=ROOT, capture_output=True, env=dict(os.environ))
    rows = np.fromfile(out, dtype="<u2").reshape(-1, 20)
    assert rows.shape == (3, 20)
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == 3
    for row in rows:
        start = int(row[0]) - 1000
        assert (row[:8] == source[start:start + 8]).all(), "a row's prompt is a window of the source"

    import mlx.core as mx
    from mlx_lm import load

    model, _ = load(str(TARGET))
    logits = model(mx.array(rows.astype(np.int32)))
    chosen = np.array(mx.argmax(logits, axis=-1))
    # Each continued token is the target's argmax after the row so far (the decode with
    # caches agrees with one pass over the whole row).
    assert (rows[:, 8:] == chosen[:, 7:-1]).all(), (rows[:, 8:], chosen[:, 7:-1])
