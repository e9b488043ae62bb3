"""A running `ferrite serve` on loopback with a project-made checkpoint, for the SDK tests."""

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


def start_server(tmp: Path, *extra):
    """`ferrite serve` on a made tiny Qwen3 checkpoint (id `tiny`); yields its base URL."""
    assert FERRITE.exists(), f"{FERRITE} is missing: build it first (cargo build -p ferrite-cli)"
    model = tmp / "tiny"
    subprocess.run(
        [FERRITE, "dev", "make-checkpoint", "--arch", "qwen3", "--preset", "tiny", "--bits", "4",
         "--group-size", "32", "--out", model],
        check=True, capture_output=True,
    )
    port = free_port()
    proc = subprocess.Popen(
        [FERRITE, "serve", "--model", model, "--port", str(port), "--alias", "ferrite-tiny", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
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
