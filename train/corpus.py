#!/usr/bin/env python3
"""Builds the training corpus of Ferrite's embedded model from source code that is on every
machine that builds Ferrite and may be redistributed as training data:

* CPython 3.11's standard library as Debian ships it (/usr/lib/python3.11; PSF licence),
  without its test suites;
* the Rust crates in Ferrite's own Cargo.lock (cargo fetches them; only crates whose licence
  is MIT and/or Apache-2.0), `src/**/*.rs`, up to a byte budget.

Every file goes to train or held-out by a hash of its path (about 1% held out), so the split
is the same on every machine; a held-out file whose bytes equal a training file's (crates ship
the same generated file for several architectures) or that is a training file at another
version of its crate is left out of both, as "duplicate": it is no evidence of how the model
does on code it has not seen. A fraction of documents is wrapped in the chat template's turns
(a user asks for the file, the assistant writes it) so the model answers chat requests with
code. Writes DATA/train.jsonl, DATA/heldout.jsonl and the manifest (every file, its licence,
sha256, bytes and split) that train/README.md describes.
"""
import argparse
import hashlib
import json
import os
import random
import re
import sys
import tomllib
from pathlib import Path

PY_ROOT = Path("/usr/lib/python3.11")
PY_SKIP = re.compile(r"(/test/|/tests/|idle_test|site-packages|dist-packages|__pycache__)")
MAX_FILE = 64 << 10
RUST_BUDGET = 30 << 20
HELD_OUT_PERCENT = 1
CHAT_FRACTION = 0.2
OK_LICENCES = ("MIT", "Apache-2.0")


def split_of(key: str) -> str:
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return "heldout" if h % 100 < HELD_OUT_PERCENT else "train"


def same_file_any_version(name: str) -> tuple[str, str]:
    """A file's crate without its version, and its path in the crate: `darling-0.21.3/src/lib.rs`
    and `darling-0.20.11/src/lib.rs` are one file at two versions, mostly the same lines."""
    crate, _, rel = name.partition("/")
    versioned = re.match(r"(.+?)-\d+\.\d+", crate)
    return (versioned.group(1) if versioned else crate, rel)


def splits(files: list[tuple[str, str]]) -> list[str]:
    """The split of each (name, sha256) file: by its path's hash, except that a held-out file
    whose bytes are a training file's, or that is a training file at another version of its
    crate, is a "duplicate", in neither."""
    hashed = [split_of(name) for name, _ in files]
    trained = [file for file, split in zip(files, hashed) if split == "train"]
    bytes_seen = {sha for _, sha in trained}
    files_seen = {same_file_any_version(name) for name, _ in trained}
    seen = [sha in bytes_seen or same_file_any_version(name) in files_seen for name, sha in files]
    return ["duplicate" if split == "heldout" and was_seen else split for split, was_seen in zip(hashed, seen)]


def python_files():
    for path in sorted(PY_ROOT.rglob("*.py")):
        rel = path.relative_to(PY_ROOT).as_posix()
        if PY_SKIP.search("/" + rel) or path.stat().st_size > MAX_FILE:
            continue
        yield f"cpython-3.11/{rel}", path, "PSF-2.0", "python"


def licence_ok(expr: str) -> bool:
    # Every alternative we may pick must be one we accept: "MIT OR Apache-2.0" is fine,
    # "MIT AND Unicode-3.0" is not.
    expr = expr.replace("/", " OR ")
    if " AND " in expr:
        return False
    return any(part.strip().strip("()") in OK_LICENCES for part in expr.split(" OR "))


def rust_files(lock: Path):
    registry = sorted(Path.home().glob(".cargo/registry/src/*"))
    packages = tomllib.loads(lock.read_text())["package"]
    budget = RUST_BUDGET
    for pkg in sorted(packages, key=lambda p: (p["name"], p["version"])):
        if "source" not in pkg or pkg["name"].startswith("windows"):
            continue
        crate = next((r / f"{pkg['name']}-{pkg['version']}" for r in registry if (r / f"{pkg['name']}-{pkg['version']}").is_dir()), None)
        if crate is None:
            continue
        meta = tomllib.loads((crate / "Cargo.toml").read_text()).get("package", {})
        licence = meta.get("license", "")
        if not licence_ok(licence):
            continue
        for path in sorted((crate / "src").rglob("*.rs")):
            size = path.stat().st_size
            if size > MAX_FILE or size > budget:
                continue
            budget -= size
            yield f"{crate.name}/{path.relative_to(crate).as_posix()}", path, licence, "rust"


def document(name: str, text: str, lang: str, rng: random.Random) -> str:
    if rng.random() >= CHAT_FRACTION:
        return text
    return (f"<|im_start|>user\nWrite the {lang.capitalize()} file `{name}`.<|im_end|>\n"
            f"<|im_start|>assistant\n<think>\n\n</think>\n\n```{lang}\n{text.rstrip()}\n```<|im_end|>\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--lock", type=Path, default=Path(__file__).resolve().parent.parent / "Cargo.lock")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--manifest", type=Path, default=None)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    manifest = []
    outs = {s: open(args.out / f"{s}.jsonl", "w") for s in ("train", "heldout")}
    totals = {}
    files = []
    for name, path, licence, lang in [*python_files(), *rust_files(args.lock)]:
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append((name, licence, lang, text, hashlib.sha256(raw).hexdigest(), len(raw)))
    for (name, licence, lang, text, sha, size), split in zip(files, splits([(f[0], f[4]) for f in files])):
        doc = document(name, text, lang, rng)  # drawn for every file, so the wrapping stays put
        manifest.append({"file": name, "licence": licence, "sha256": sha, "bytes": size, "split": split})
        if split == "duplicate":
            continue
        outs[split].write(json.dumps({"text": doc}) + "\n")
        key = (lang, split)
        totals[key] = totals.get(key, 0) + size
    for f in outs.values():
        f.close()
    (args.manifest or args.out / "manifest.json").write_text(json.dumps(manifest, indent=0) + "\n")
    for (lang, split), n in sorted(totals.items()):
        print(f"{lang:6} {split:8} {n / 1e6:8.2f} MB", file=sys.stderr)
    print(f"{len(manifest)} files", file=sys.stderr)


if __name__ == "__main__":
    main()
