"""A whole tool session per real agent client: the client asks for a file, the model calls the
client's own file-writing tool, the client writes the file and sends the result back, and the
model ends the turn.

The embedded model is far too small to choose tools by itself, so the server runs with
`--scripted-replies`: for prompts that match a rule, the reply is fixed in advance and enforced
token by token on the model's logits. Everything else is real: the client's own requests and
tools, the prompt rendered by the chat template, the engine's forward passes and sampler, the
tool-call parser, each protocol's stream, and the client running its tool."""

import json
import tempfile
from pathlib import Path

import pytest

from conftest import client, codex_home, opencode_config, run_client, start_server

CONTENT = "hello from ferrite\n"
# Room for the scripted replies (Codex's is ~70 tokens); unscripted requests (titles) stop here.
MAX_OUTPUT_TOKENS = 160


def tool_call(name: str, arguments: dict) -> str:
    """A call in the embedded model's format (its chat template's `<tool_call>` JSON form)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


# Each client's file-writing tool, and the call that writes `<client>.txt` in `work`.
CALLS = {
    "claude": lambda work: ("Write", {"file_path": str(work / "claude.txt"), "content": CONTENT}),
    "opencode": lambda work: ("write", {"filePath": str(work / "opencode.txt"), "content": CONTENT}),
    # Codex 0.169 acts through `exec`, a custom (free-form) tool that runs JavaScript calling its
    # nested tools; `apply_patch` takes a patch as text.
    "codex": lambda work: ("exec", {"input": "await tools.apply_patch(" + json.dumps(
        "*** Begin Patch\n*** Add File: codex.txt\n+" + CONTENT + "*** End Patch\n") + ");"}),
}


@pytest.fixture(scope="module")
def session():
    """The server with a rule pair per client, and each client's home and working folder."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rules = []
        for name, call in CALLS.items():
            (root / name / "home").mkdir(parents=True)
            (root / name / "work").mkdir()
            tool, arguments = call(root / name / "work")
            ask = f"Create {name}.txt"
            # The result is back (the tool's answer is in the prompt): end the turn.
            rules.append({"when": ["<tool_response>", ask], "reply": f"{name}.txt is written."})
            # The user's request, with the client's tools offered: call the tool.
            rules.append({"when": [ask, json.dumps({"name": tool})[1:-1]], "reply": tool_call(tool, arguments)})
        (root / "rules.json").write_text(json.dumps(rules, indent=1))
        for server in start_server(root, "--max-output-tokens", str(MAX_OUTPUT_TOKENS),
                                   "--scripted-replies", str(root / "rules.json")):
            yield server, root


def check_session(done, server, mark, root: Path, name: str):
    out = f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, out
    written = root / name / "work" / f"{name}.txt"
    assert written.exists(), f"the tool call did not write {written}:\n{out}"
    assert written.read_text() == CONTENT
    assert f"{name}.txt is written." in done.stdout, f"the final turn's text is not on stdout:\n{out}"
    assert not server.refused(), "requests refused:\n" + "\n".join(server.refused())
    turns = server.generations_since(mark)
    print(f"\n{name} tool session: {done.seconds:.0f} s, {len(turns)} generations:\n  " + "\n  ".join(turns))


def home_of(root: Path, name: str) -> Path:
    """run_client's layout: `home` and `work` under one folder."""
    return root / name


def test_claude_code_writes_a_file_with_its_write_tool(session):
    server, root = session
    claude, mark = client("claude"), server.mark()
    # -p: one prompt, non-interactive; acceptEdits: file writes need no confirmation.
    done = run_client([claude, "-p", "Create claude.txt", "--permission-mode", "acceptEdits"], home_of(root, "claude"),
                      {"ANTHROPIC_BASE_URL": server.base, "ANTHROPIC_API_KEY": "sk-local"})
    check_session(done, server, mark, root, "claude")


def test_opencode_writes_a_file_with_its_write_tool(session):
    server, root = session
    opencode, mark = client("opencode"), server.mark()
    path = opencode_config(server.base, root / "opencode" / "work")
    done = run_client([opencode, "run", "Create opencode.txt"], home_of(root, "opencode"), {"OPENCODE_CONFIG": str(path)})
    check_session(done, server, mark, root, "opencode")


def test_codex_writes_a_file_with_apply_patch(session):
    server, root = session
    codex, mark = client("codex"), server.mark()
    config = codex_home(server.base, root / "codex" / "home")
    # Codex's Linux sandbox (Landlock) cannot write in this container: the test's own temporary
    # folder is the sandbox.
    done = run_client([codex, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                       "Create codex.txt"], home_of(root, "codex"), {"CODEX_HOME": str(config)})
    check_session(done, server, mark, root, "codex")
