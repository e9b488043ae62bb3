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

    def cached_since(self, mark: int) -> list[tuple[int, int]]:
        """(prompt tokens, of them from the prompt cache) of each generation after `mark`."""
        found = [re.search(r"(\d+) prompt tokens \((\d+) from the prompt cache", g) for g in self.generations_since(mark)]
        return [(int(m[1]), int(m[2])) for m in found if m]

    def generations_since(self, mark: int) -> list[str]:
        text = re.sub(r"\x1b\[[0-9;]*m", "", self.log.read_text(errors="replace")[mark:])
        return [line.split("INFO ", 1)[-1] for line in text.splitlines() if "prompt tokens (" in line]


class Process:
    """`ferrite serve --model default` on one port, started and restarted there (so a client's
    settings stay right), its log appended to `tmp/serve.log`. With `disk_cache` the prompt
    cache keeps its blocks in `tmp/blocks`, and a restarted server finds them; without, the
    disk tier is off (one test's blocks must not serve another's turns)."""

    def __init__(self, tmp: Path, extra: tuple, disk_cache: bool, model: str = "default"):
        assert FERRITE.exists(), f"{FERRITE} is missing: build it first (cargo build -p ferrite-cli)"
        self.port, self.log, self.extra, self.proc = free_port(), tmp / "serve.log", extra, None
        self.model = model
        self.log.write_text("")
        config = tmp / "config"
        config.mkdir(exist_ok=True)
        self.env = dict(os.environ, RUST_LOG="info", FERRITE_CONFIG_DIR=str(config), FERRITE_PROMPT_DISK_GB="0")
        if disk_cache:
            (config / "config.toml").write_text(f'[prompt_cache]\ndir = "{tmp / "blocks"}"\ndisk_gb = 2.0\n')
            self.env["FERRITE_PROMPT_DISK_GB"] = ""
        self.base = f"http://127.0.0.1:{self.port}"

    def start(self):
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                [FERRITE, "serve", "--model", self.model, "--port", str(self.port), "--idle-minutes", "0", *self.extra],
                stdout=out, stderr=subprocess.STDOUT, env=self.env,
            )
        for _ in range(600):
            try:
                urllib.request.urlopen(self.base + "/health", timeout=1)
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(self.log.read_text())
                time.sleep(0.1)
        raise RuntimeError("ferrite serve did not come up")

    def stop(self):
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
            self.proc = None

    def restart(self):
        self.stop()
        self.start()


def start_server(tmp: Path, *extra: str, disk_cache: bool = False, model: str = "default"):
    """`ferrite serve --model MODEL` (the embedded default unless given) on a free port, its log
    in `tmp`; yields a Server whose `restart()` stops it and starts it again on the same port."""
    process = Process(tmp, extra, disk_cache, model)
    process.start()
    try:
        server = Server(process.base, process.log)
        server.restart = process.restart
        yield server
    finally:
        process.stop()


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


def opencode_config(base: str, work: Path, sees: bool = False) -> Path:
    """An opencode config with Ferrite as an `@ai-sdk/openai-compatible` provider, in `work`
    (`sees`: the model takes images, as a user serving one says)."""
    model = {"name": "Ferrite default"}
    if sees:
        model |= {"attachment": True, "modalities": {"input": ["text", "image"], "output": ["text"]}}
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {"ferrite": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "Ferrite",
            "options": {"baseURL": base + "/v1"},
            "models": {"default": model},
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


def pi_home(base: str, home: Path):
    """pi's models.json with Ferrite as an OpenAI-compatible provider (`--provider ferrite
    --model default`), in `home`'s `.pi/agent`."""
    agent = home / ".pi" / "agent"
    agent.mkdir(parents=True, exist_ok=True)
    models = {"providers": {"ferrite": {"baseUrl": base + "/v1", "api": "openai-completions", "apiKey": "sk-local",
                                        "models": [{"id": "default"}]}}}
    (agent / "models.json").write_text(json.dumps(models))


def qwen_args(base: str) -> list[str]:
    """qwen-code's flags for an OpenAI-compatible endpoint."""
    return ["--auth-type", "openai", "--openai-base-url", base + "/v1", "--openai-api-key", "sk-local", "-m", "default"]


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
