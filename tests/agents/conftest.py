"""`ferrite serve` on the embedded default model, as a user starts it for an agent, with the real
agent clients that scripts/setup.sh --tests installs from npm (third_party/agents)."""

import json
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

    def mark(self) -> int:
        """Where the log ends now: `generations_since(mark)` reads what came after."""
        return len(self.log.read_text(errors="replace"))

    def generations_since(self, mark: int) -> list[str]:
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace")[mark:])
        return [line.split("INFO ", 1)[-1] for line in text.splitlines() if "prompt tokens (" in line]


def start_server(tmp: Path, *extra: str):
    """`ferrite serve --model default` on a free port, its log in `tmp`; yields a Server."""
    assert FERRITE.exists(), f"{FERRITE} is missing: build it first (cargo build -p ferrite-cli)"
    port, log = free_port(), tmp / "serve.log"
    # The prompt cache's disk tier off: one test's blocks must not serve another's turns.
    env = dict(os.environ, RUST_LOG="info", FERRITE_CONFIG_DIR=str(tmp / "config"), FERRITE_PROMPT_DISK_GB="0")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [FERRITE, "serve", "--model", "default", "--port", str(port), "--idle-minutes", "0", *extra],
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


@pytest.fixture(scope="session")
def server():
    with tempfile.TemporaryDirectory() as tmp:
        yield from start_server(Path(tmp), "--max-output-tokens", str(MAX_OUTPUT_TOKENS))


@pytest.fixture
def home(tmp_path):
    """A fresh home and working directory for one client run: no user settings leak in."""
    (tmp_path / "home").mkdir()
    (tmp_path / "work").mkdir()
    return tmp_path


def opencode_config(base: str, work: Path) -> Path:
    """An opencode config with Ferrite as an `@ai-sdk/openai-compatible` provider, in `work`."""
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"ferrite": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "Ferrite",
            "options": {"baseURL": base + "/v1"},
            "models": {"default": {"name": "Ferrite default"}},
        }},
        "model": "ferrite/default",
    }
    path = work / "opencode.json"
    path.write_text(json.dumps(config))
    return path


def codex_home(base: str, home: Path) -> Path:
    """A CODEX_HOME whose config adds Ferrite as a model provider (Responses is the only wire
    API Codex speaks): the one setting a Codex user adds."""
    config = home / ".codex"
    config.mkdir()
    (config / "config.toml").write_text(
        'model_provider = "ferrite"\n\n[model_providers.ferrite]\nname = "Ferrite"\n'
        f'base_url = "{base}/v1"\nwire_api = "responses"\n'
    )
    return config


def client(name: str) -> Path:
    path = AGENTS / name
    if not path.exists():
        pytest.skip(f"{name} is not installed (scripts/setup.sh --tests installs the agent clients)")
    return path


def run_client(argv, home: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    # PWD as a shell sets it: opencode takes its project folder from it, not from getcwd().
    full = dict(os.environ, HOME=str(home / "home"), PWD=str(home / "work"), **env)
    started = time.monotonic()
    done = subprocess.run(argv, cwd=home / "work", env=full, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    done.seconds = time.monotonic() - started
    return done
