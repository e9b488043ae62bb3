"""Claude Code and qwen-code read a PNG with their file tools and the image reaches the
model: on a Qwen3.5 checkpoint that sees (Ferrite's maker writes the text model, mlx-vlm adds
a random vision tower), the scripted model calls the client's read tool on a screenshot; the
client answers the call with the image (Claude Code an image block inside its tool_result,
qwen-code an `image_url` in a user message after the tool's), and the next turn's prompt
holds the image's markup (the rule that ends the session matches only then) and is
prefilled from where the last turn's ended (the prompt cache). Codex and opencode attach a
picture to their first turn."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import FERRITE, ROOT, client, codex_home, opencode_config, qwen_args, run_client, start_server
from test_tool_sessions import tool_call

ASK = "Read shot.png and say what it shows"
# qwen-code's turn: another question, so its rules do not answer Claude Code's.
QWEN_ASK = "Look at shot.png with read_file and describe it"
ATTACHED = "What does the attached picture show"
SEEN = "I see the screenshot."
MARKUP = "<|vision_start|><|image_pad|><|vision_end|>"


def seeing_checkpoint(directory: Path):
    """A project-made Qwen3.5 checkpoint that sees: Qwen's vision tokens in its tokenizer, small
    image bounds, a tower by mlx-vlm (tests/reference/mlx_vlm_vision_model.py)."""
    subprocess.run([FERRITE, "dev", "make-checkpoint", "--arch", "qwen3_5", "--preset", "small", "--dtype", "f32",
                    "--layout", "transformers", "--out", directory], check=True, capture_output=True)
    tokenizer = json.loads((directory / "tokenizer.json").read_text())
    first = max(a["id"] for a in tokenizer["added_tokens"]) + 1
    for i, content in enumerate(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]):
        tokenizer["added_tokens"].append({"id": first + i, "content": content, "single_word": False, "lstrip": False,
                                          "rstrip": False, "normalized": False, "special": True})
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer))
    (directory / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 4096, "max_pixels": 65536}))
    vision = {"depth": 1, "hidden_size": 64, "intermediate_size": 96, "num_heads": 4, "in_channels": 3,
              "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 256,
              "num_position_embeddings": 36, "deepstack_visual_indexes": []}
    subprocess.run([sys.executable, ROOT / "tests/reference/mlx_vlm_vision_model.py", "--dir", directory,
                    "--vision", json.dumps(vision), "--tower-only", "--vision-start", str(first),
                    "--vision-end", str(first + 1), "--image-token", str(first + 2)], check=True, capture_output=True)


def png(path: Path, width: int, height: int):
    from PIL import Image
    Image.new("RGB", (width, height), (40, 120, 200)).save(path)


@pytest.fixture(scope="module")
def seeing_server():
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "home").mkdir()
        (root / "work").mkdir()
        png(root / "work" / "shot.png", 160, 96)
        seeing_checkpoint(root / "model")
        rules = [
            {"when": [ATTACHED, MARKUP], "reply": SEEN},
            {"when": [ASK, MARKUP], "reply": SEEN},
            {"when": [ASK, '"name": "Read"'], "reply": tool_call("Read", {"file_path": str(root / "work" / "shot.png")})},
            {"when": [QWEN_ASK, MARKUP], "reply": SEEN},
            {"when": [QWEN_ASK, '"name": "read_file"'],
             "reply": tool_call("read_file", {"file_path": str(root / "work" / "shot.png")})},
        ]
        (root / "rules.json").write_text(json.dumps(rules))
        for s in start_server(root, "--max-output-tokens", "160", "--scripted-replies", str(root / "rules.json"),
                              model=str(root / "model")):
            codex_home(s.base, root / "home")
            yield s, root


def the_model_saw_it(s, root, name: str, argv: list, env: dict) -> tuple[int, str]:
    """Runs a client whose request carries the picture; it must answer with the scripted reply
    (the rule matches only when the image's markup is in the prompt), nothing refused. Returns
    where the server log stood before, and what to print on a failure."""
    mark = s.mark()
    done = run_client(argv, root, env)
    turns = s.generations_since(mark)
    out = f"{name} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}\n" + "\n".join(turns)
    out += "\nserver log:\n" + s.log.read_text(errors="replace")[-4000:]
    assert done.returncode == 0, out
    assert SEEN in done.stdout, out
    assert not s.refused(), "requests refused:\n" + "\n".join(s.refused())
    print(f"\n{name} and a PNG:\n  " + "\n  ".join(turns))
    return mark, out


def resumed_after_the_question(s, mark: int, out: str):
    """The turn with the screenshot resumes after the turn that asked for it: the prompt cache
    knows images by their content, and a prompt with one is not prefilled whole again."""
    big = [(prompt, cached) for prompt, cached in s.cached_since(mark) if prompt > 10000]
    assert len(big) >= 2, out
    (before, _), (with_image, cached) = big[-2], big[-1]
    assert with_image > before and cached >= before * 0.9, f"{big}\n{out}"


def test_claude_code_reads_a_png_and_the_model_gets_it(seeing_server):
    s, root = seeing_server
    mark, out = the_model_saw_it(s, root, "claude", [client("claude"), "-p", ASK],
                                 {"ANTHROPIC_BASE_URL": s.base, "ANTHROPIC_API_KEY": "sk-local"})
    resumed_after_the_question(s, mark, out)


def test_codex_attaches_a_png_and_the_model_gets_it(seeing_server):
    """Codex's `exec --image`: the picture goes out as a Responses `input_image`."""
    s, root = seeing_server
    # The prompt before `--image`, which takes every file name after it.
    the_model_saw_it(s, root, "codex", [client("codex"), "exec", "--skip-git-repo-check",
                                        "--dangerously-bypass-approvals-and-sandbox", ATTACHED,
                                        "--image", str(root / "work" / "shot.png")],
                     {"CODEX_HOME": str(root / "home" / ".codex")})


def test_opencode_attaches_a_png_and_the_model_gets_it(seeing_server):
    """opencode's `run --file`: the picture goes out as an OpenAI `image_url` data URL, for a
    model its config says takes images."""
    s, root = seeing_server
    config = opencode_config(s.base, root / "work", sees=True)
    the_model_saw_it(s, root, "opencode", [client("opencode"), "run", ATTACHED, "--file", str(root / "work" / "shot.png")],
                     {"OPENCODE_CONFIG": str(config)})


def test_qwen_code_reads_a_png_and_the_model_gets_it(seeing_server):
    """qwen-code's read_file answers with the picture for a model its settings say takes
    images; its OpenAI requests move a tool's media into a user message after the tool's
    (`splitToolMedia`, on by default), as an `image_url` data URL. Its tools are cut to
    read_file: with all of them its first prompt is longer than this checkpoint's context in
    the project's small tokenizer."""
    s, root = seeing_server
    settings = root / "home" / ".qwen" / "settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"model": {"generationConfig": {"modalities": {"image": True}}},
                                    "tools": {"core": ["read_file"]}}))
    argv = [client("qwen"), *qwen_args(s.base), "--approval-mode", "yolo", QWEN_ASK]
    mark, out = the_model_saw_it(s, root, "qwen-code", argv, {})
    resumed_after_the_question(s, mark, out)
