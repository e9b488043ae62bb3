"""A whole tool session per real agent client, then a resumed turn after a server restart.

The client asks for a file, the model calls the client's own file-writing tool, the client
writes the file and sends the result back, and the model ends the turn. The test then deletes
the file and restarts the server (its prompt cache's disk tier kept), and the client resumes
its session with one more turn. That turn must hit the prompt cache (from disk: the memory went
with the restart), no request may be refused, and the tool must not run again: a file that
comes back would mean the client re-ran a call it took for interrupted (the ids of a restarted
server once collided with the session's own).

The embedded model is far too small to choose tools by itself, so the server runs with
`--scripted-replies`: for prompts that match a rule, the reply is fixed in advance and enforced
token by token on the model's logits. Everything else is real: the client's own requests and
tools, the prompt rendered by the chat template, the engine's forward passes and sampler, the
tool-call parser, each protocol's stream, and the client running its tool."""

import json
import tempfile
from pathlib import Path

import pytest

from conftest import client, codex_home, opencode_config, pi_home, qwen_args, run_client, start_server

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
    # Codex acts through `exec`, a custom (free-form) tool that runs JavaScript calling its
    # nested tools; `apply_patch` takes a patch as text.
    "codex": lambda work: ("exec", {"input": "await tools.apply_patch(" + json.dumps(
        "*** Begin Patch\n*** Add File: codex.txt\n+" + CONTENT + "*** End Patch\n") + ");"}),
    "qwen": lambda work: ("write_file", {"file_path": str(work / "qwen.txt"), "content": CONTENT}),
    "pi": lambda work: ("write", {"path": str(work / "pi.txt"), "content": CONTENT}),
}


def argv(name: str, root: Path, base: str, prompt: str, resume: bool) -> tuple[list, dict]:
    """The command line and environment that run one turn of `name`, a resumed one or not:
    each client's own non-interactive mode, with the settings a user adds for a local server."""
    work, home = root / name / "work", root / name / "home"
    if name == "claude":
        # acceptEdits: file writes need no confirmation.
        flags = ["-c"] if resume else []
        return ([client("claude"), *flags, "-p", prompt, "--permission-mode", "acceptEdits"],
                {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "sk-local"})
    if name == "opencode":
        flags = ["-c"] if resume else []
        return [client("opencode"), "run", *flags, prompt], {"OPENCODE_CONFIG": str(opencode_config(base, work))}
    if name == "codex":
        # Codex's Linux sandbox (Landlock) cannot write in this container: the test's own
        # temporary folder is the sandbox.
        flags = ["resume", "--last"] if resume else []
        return ([client("codex"), "exec", *flags, "--skip-git-repo-check",
                 "--dangerously-bypass-approvals-and-sandbox", prompt],
                {"CODEX_HOME": str(home / ".codex")})
    if name == "qwen":
        flags = ["-c"] if resume else []
        return [client("qwen"), *qwen_args(base), "--approval-mode", "yolo", *flags, prompt], {}
    if name == "pi":
        flags = ["-c"] if resume else []
        return [client("pi"), *flags, "-p", "--provider", "ferrite", "--model", "default", prompt], {}
    raise ValueError(name)


@pytest.fixture(scope="module")
def session():
    """The server with a rule set per client, and each client's home and working folder."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rules = []
        for name, call in CALLS.items():
            (root / name / "home").mkdir(parents=True)
            (root / name / "work").mkdir()
            tool, arguments = call(root / name / "work")
            ask = f"Create {name}.txt"
            # The resumed turn (its prompt holds the whole session before it): a plain answer.
            rules.append({"when": [f"Resume {name}"], "reply": f"{name} resumed."})
            # The result is back (the tool's answer is in the prompt): end the turn.
            rules.append({"when": ["<tool_response>", ask], "reply": f"{name}.txt is written."})
            # The user's request, with the client's tools offered: call the tool.
            rules.append({"when": [ask, json.dumps({"name": tool})[1:-1]], "reply": tool_call(tool, arguments)})
        (root / "rules.json").write_text(json.dumps(rules, indent=1))
        for server in start_server(root, "--max-output-tokens", str(MAX_OUTPUT_TOKENS),
                                   "--scripted-replies", str(root / "rules.json"), disk_cache=True):
            codex_home(server.base, root / "codex" / "home")
            pi_home(server.base, root / "pi" / "home")
            yield server, root


def ran(done, name: str) -> str:
    out = f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode == 0, out
    return out


@pytest.mark.parametrize("name", list(CALLS))
def test_a_tool_session_survives_a_server_restart(session, name):
    server, root = session
    work = root / name / "work"
    mark = server.mark()
    command, env = argv(name, root, server.base, f"Create {name}.txt", resume=False)
    done = run_client(command, root / name, env)
    out = ran(done, name)
    written = work / f"{name}.txt"
    assert written.exists(), f"the tool call did not write {written}:\n{out}"
    assert written.read_text() == CONTENT
    assert f"{name}.txt is written." in done.stdout, f"the final turn's text is not on stdout:\n{out}"
    first = server.generations_since(mark)

    # The tool ran; a second run would write the file again.
    written.unlink()
    server.restart()
    mark = server.mark()
    command, env = argv(name, root, server.base, f"Resume {name}", resume=True)
    resumed = run_client(command, root / name, env)
    out = ran(resumed, name)
    assert f"{name} resumed." in resumed.stdout, f"the resumed turn's text is not on stdout:\n{out}"
    assert not written.exists(), f"the tool ran again after the restart:\n{out}"
    assert not server.refused(), "requests refused:\n" + "\n".join(server.refused())
    # The resumed turn's prompt is the session so far: most of it comes from the disk tier.
    turn = [(p, c) for p, c in server.cached_since(mark) if p > 1000]
    assert turn and max(c / p for p, c in turn) >= 0.5, f"the resumed turn missed the prompt cache: {turn}"
    print(f"\n{name}: session {done.seconds:.0f} s, resumed turn {resumed.seconds:.0f} s\n  "
          + "\n  ".join(first + server.generations_since(mark)))
