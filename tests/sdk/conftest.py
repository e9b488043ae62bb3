"""A running `ferrite serve` on loopback with a project-made checkpoint, for the SDK tests."""

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FERRITE = Path(os.environ.get("FERRITE", ROOT / "target" / "debug" / "ferrite"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp: Path, *extra, env=None):
    """`ferrite serve` on a made tiny Qwen3 checkpoint (id `tiny`); yields its base URL. The
    prompt cache's disk tier is off unless `env` turns it on (tests must not hit each other's
    blocks); `env` adds to the server's environment."""
    assert FERRITE.exists(), f"{FERRITE} is missing: build it first (cargo build -p ferrite-cli)"
    model = tmp / "tiny"
    if not model.exists():
        subprocess.run(
            [FERRITE, "dev", "make-checkpoint", "--arch", "qwen3", "--preset", "tiny", "--bits", "4",
             "--group-size", "32", "--out", model],
            check=True, capture_output=True,
        )
    port = free_port()
    proc = subprocess.Popen(
        [FERRITE, "serve", "--model", model, "--port", str(port), "--alias", "ferrite-tiny", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, "FERRITE_PROMPT_DISK_GB": "0", **(env or {})},
    )
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(base + "/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(proc.stderr.read().decode())
                time.sleep(0.1)
        else:
            raise RuntimeError("ferrite serve did not come up")
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="session")
def server():
    with tempfile.TemporaryDirectory() as tmp:
        yield from start_server(Path(tmp))


# Scripted replies (`ferrite serve --scripted-replies`, a test device): the tiny model's answer
# to a matching prompt is fixed in advance and enforced token by token on its logits, so a tool
# call goes through the real decoding path, tool-call parser and streams.
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
WRITE_ARGS = {"path": "src/main.rs", "content": "fn main() {\n    println!(\"hi\");\n}\n"}


def tool_call(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


@pytest.fixture(scope="session")
def scripted():
    rules = [
        {"when": ["<tool_response>", "Patch a.txt"], "reply": "Patched."},
        {"when": ["Patch a.txt", '"name": "apply_patch"'], "reply": tool_call("apply_patch", {"input": PATCH})},
        {"when": ["Write main.rs", '"name": "write_file"'],
         "reply": "Writing it.\n" + tool_call("write_file", WRITE_ARGS) + "\n" + tool_call("read_file", {"path": "a.rs"})},
    ]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "rules.json").write_text(json.dumps(rules))
        yield from start_server(Path(tmp), "--scripted-replies", str(Path(tmp) / "rules.json"))
