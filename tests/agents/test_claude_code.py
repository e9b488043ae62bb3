"""Claude Code's own ways of growing a session, against `ferrite serve` with scripted replies
(see test_tool_sessions.py): tool search, where a deferred tool is loaded mid-session by a
`tool_reference` and the prompt cache must keep hitting; and a session that outgrows the
context, where Claude Code must recognise the refusal and compact."""

import json
import tempfile
from pathlib import Path

import pytest

from conftest import client, run_client, start_server
from test_tool_sessions import tool_call

ASK = "Find the notebook tool"


def scripted_server(root: Path, rules: list):
    """`ferrite serve` answering by `rules`, with a home and working folder for Claude Code in
    `root`; yields the server."""
    (root / "home").mkdir(exist_ok=True)
    (root / "work").mkdir(exist_ok=True)
    (root / "rules.json").write_text(json.dumps(rules))
    yield from start_server(root, "--max-output-tokens", "160", "--scripted-replies", str(root / "rules.json"))


def claude(s, root: Path, prompt: str) -> tuple:
    """One non-interactive Claude Code turn against `s`: the run, and a description of it."""
    done = run_client([client("claude"), "-p", prompt], root,
                      {"ANTHROPIC_BASE_URL": s.base, "ANTHROPIC_API_KEY": "sk-local"})
    return done, f"claude exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def server():
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rules = [
            # ToolSearch answered: the loaded tool's definition is in its result.
            {"when": [ASK, "<functions>", '"name": "NotebookEdit"'], "reply": "NotebookEdit is loaded."},
            # Claude Code lists NotebookEdit as deferred: load it.
            {"when": [ASK, "NotebookEdit"], "reply": tool_call("ToolSearch", {"query": "select:NotebookEdit"})},
        ]
        for s in scripted_server(root, rules):
            yield s, root


def test_tool_search_loads_a_deferred_tool_and_the_cache_keeps_hitting(server):
    s, root = server
    mark = s.mark()
    done, out = claude(s, root, ASK)
    assert done.returncode == 0, out
    assert "NotebookEdit is loaded." in done.stdout, out
    assert not s.refused(), "requests refused:\n" + "\n".join(s.refused())
    turns = s.cached_since(mark)
    assert len(turns) >= 2, turns
    # The turn after ToolSearch reuses all of the one before but its generation prompt (the
    # assistant's header and empty think block, rendered otherwise in the history): the tool
    # list did not change when NotebookEdit was loaded.
    (first, _), (second, cached) = turns[0], turns[1]
    assert second > first and cached + 8 >= first, f"the turn after ToolSearch missed the cache: {turns}"
    print("\nclaude with tool search:\n  " + "\n  ".join(s.generations_since(mark)))



ASK_PARTS = "Read part1.txt, part2.txt and part3.txt"
SUMMARY = "The user asked to read three long files of numbered filler lines."


def filler(marker: str, lines: int) -> str:
    """`lines` lines of words and numbers (about 31 tokens each in the embedded model's
    tokenizer), each starting with `marker`."""
    words = ["amber", "basalt", "cobalt", "delta", "ember", "fjord", "granite", "harbor", "indigo", "juniper"]
    return "".join(f"{marker} " + " ".join(words[(i * 7 + k) % 10] + str(i * k % 97) for k in range(8)) + "\n"
                   for i in range(lines))


@pytest.fixture(scope="module")
def growing_session_server():
    """Claude Code's first prompt is about half the embedded model's 32K context; three files of
    about 7K tokens each, read one per turn, overflow it at the third."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "work").mkdir()
        parts = [root / "work" / f"part{n}.txt" for n in (1, 2, 3)]
        for n, part in enumerate(parts, 1):
            part.write_text(filler(f"PART{n}-", 200))
        read = lambda part: tool_call("Read", {"file_path": str(part)})
        rules = [
            # Claude Code's compaction: a summary; after it, the turn ends.
            {"when": ["Your task is to create a detailed summary"], "reply": f"<summary>{SUMMARY}</summary>"},
            {"when": [SUMMARY], "reply": "The three files are read."},
            # One file a turn, by what the prompt holds of them already.
            {"when": [ASK_PARTS, "PART3-"], "reply": "The three files are read."},
            {"when": [ASK_PARTS, "PART2-"], "reply": read(parts[2])},
            {"when": [ASK_PARTS, "PART1-"], "reply": read(parts[1])},
            {"when": [ASK_PARTS, '"name": "Read"'], "reply": read(parts[0])},
        ]
        for s in scripted_server(root, rules):
            yield s, root


def test_an_overflowing_session_compacts_and_goes_on(growing_session_server):
    s, root = growing_session_server
    mark = s.mark()
    done, out = claude(s, root, ASK_PARTS)
    turns = s.generations_since(mark)
    out += "\n" + "\n".join(turns)
    assert done.returncode == 0, out
    assert "The three files are read." in done.stdout, out
    # The third file overflowed the context: one refusal, in Anthropic's words (the client
    # recognised it), then Claude Code's compaction, then the turn went on from its summary.
    assert len(s.refused()) == 1, "\n".join(s.refused())
    log = s.log.read_text(errors="replace")[mark:]
    assert "prompt is too long: " in log and " maximum" in log, out
    assert f"<summary>{SUMMARY}</summary>" in log, f"no compaction:\n{out}"
    prompts = [p for p, _ in s.cached_since(mark)]
    assert prompts[-1] < max(prompts), f"the turn after the compaction is shorter: {prompts}"
    print("\nclaude, overflowing and compacting:\n  " + "\n  ".join(turns))
