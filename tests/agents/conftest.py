"""`ferrite serve` on the embedded default model, as a user starts it for an agent, with the real
agent clients that scripts/setup.sh --tests installs from npm (third_party/agents)."""

import os
import re
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FERRITE = Path(os.environ.get("FERRITE", ROOT / "target" / "debug" / "ferrite"))
AGENTS = ROOT / "third_party" / "agents" / "node_modules" / ".bin"
# The embedded model rarely ends a turn by itself within a test's time: the server caps every
# answer (the clients then see an ended turn, and the response headers say it was capped).
MAX_OUTPUT_TOKENS = 48


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, base: str, log: Path):
        self.base, self.log = base, log

    def refused(self) -> list[str]:
        """The log's lines for requests answered with a 4xx or 5xx."""
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))
        return [line for line in text.splitlines() if re.search(r" -> [45]\d\d in ", line)]

    def generations(self) -> list[str]:
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace"))
        return [line.split("INFO ", 1)[-1] for line in text.splitlines() if "prompt tokens (" in line]


@pytest.fixture(scope="session")
def server():
    assert FERRITE.exists(), f"{FERRITE} is missing: build it first (cargo build -p ferrite-cli)"
    with tempfile.TemporaryDirectory() as tmp:
        port, log = free_port(), Path(tmp) / "serve.log"
        env = dict(os.environ, RUST_LOG="info", FERRITE_CONFIG_DIR=str(Path(tmp) / "config"))
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [FERRITE, "serve", "--model", "default", "--port", str(port), "--idle-minutes", "0",
                 "--max-output-tokens", str(MAX_OUTPUT_TOKENS)],
                stdout=out, stderr=subprocess.STDOUT, env=env,
            )
        base = f"http://127.0.0.1:{port}"
        try:
            for _ in range(600):
                try:
                    urllib.request.urlopen(base + "/health", timeout=1)
                    break
                except OSError:
                    if proc.poll() is not None:
                        raise RuntimeError(log.read_text())
                    time.sleep(0.1)
            else:
                raise RuntimeError("ferrite serve did not come up")
            yield Server(base, log)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture
def home(tmp_path):
    """A fresh home and working directory for one client run: no user settings leak in."""
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    return tmp_path


def client(name: str) -> Path:
    path = AGENTS / name
    if not path.exists():
        pytest.skip(f"{name} is not installed (scripts/setup.sh --tests installs the agent clients)")
    return path


def run_client(argv, home: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    full = dict(os.environ, HOME=str(home / "home"), **env)
    started = time.monotonic()
    done = subprocess.run(argv, cwd=home / "work", env=full, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    done.seconds = time.monotonic() - started
    return done
