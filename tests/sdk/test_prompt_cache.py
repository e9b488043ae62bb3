"""The prompt cache as each official SDK reports it: a request that repeats (or extends) an
earlier prompt is served mostly from the cache, and says so in its API's own usage field
(OpenAI `prompt_tokens_details.cached_tokens`, Responses `input_tokens_details.cached_tokens`,
Anthropic `cache_read_input_tokens`). Claude Code's per-build billing line does not break it."""

import tempfile
from pathlib import Path

import anthropic
import openai

from conftest import start_server

# Long enough that the shared part dominates; unique per test so earlier tests do not hit it.
LONG = " ".join(f"line {i}: fn f{i}(x: u32) -> u32 {{ x + {i} }}" for i in range(60))


def test_openai_chat_reports_cached_tokens(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "system", "content": "chat " + LONG}, {"role": "user", "content": "Sum them."}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
    grown = client.chat.completions.create(model="tiny", max_tokens=4, messages=messages + [
        {"role": "assistant", "content": "Done."}, {"role": "user", "content": "And now?"}])
    cached = lambda r: r.usage.prompt_tokens_details.cached_tokens
    assert cached(first) < first.usage.prompt_tokens // 4, "a new prompt is mostly computed"
    assert cached(again) == again.usage.prompt_tokens - 1, "all but the last token come from the cache"
    assert cached(grown) >= first.usage.prompt_tokens - 1, "the next turn reuses the whole earlier prompt"


def test_responses_reports_cached_tokens(server):
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    for _ in range(2):
        r = client.responses.create(model="tiny", instructions="responses " + LONG, input="Sum them.", max_output_tokens=4)
    assert r.usage.input_tokens_details.cached_tokens == r.usage.input_tokens - 1


def test_anthropic_reports_cache_reads_and_ignores_the_billing_line(server):
    client = anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)
    def ask(build):
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.328.{build}; cc_entrypoint=cli;"},
                  {"type": "text", "text": "anthropic " + LONG, "cache_control": {"type": "ephemeral"}}]
        return client.messages.create(model="tiny", max_tokens=4, system=system,
                                      messages=[{"role": "user", "content": "Sum them."}])
    first, second = ask("a1f"), ask("b2e")  # another build's billing line
    u = second.usage
    assert u.cache_read_input_tokens > 0 and u.input_tokens == 1, u
    assert u.cache_creation_input_tokens == 0
    assert u.input_tokens + u.cache_read_input_tokens == first.usage.input_tokens + first.usage.cache_read_input_tokens


def test_a_restarted_server_serves_the_next_turn_from_disk():
    """The disk tier (config.toml's [prompt_cache]): a server stopped after a turn and started
    again serves the next turn's shared prefix from the blocks the first one wrote."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        (tmp / "config").mkdir()
        (tmp / "config" / "config.toml").write_text(
            f'[prompt_cache]\ndir = "{tmp / "blocks"}"\ndisk_gb = 1.0\n')
        env = {"FERRITE_CONFIG_DIR": str(tmp / "config"), "FERRITE_PROMPT_DISK_GB": ""}
        messages = [{"role": "system", "content": "disk " + LONG}, {"role": "user", "content": "Sum them."}]
        def turn(server, messages):
            client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
            return client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
        for server in start_server(tmp, env=env):
            first = turn(server, messages)
        assert list((tmp / "blocks").rglob("*.safetensors")), "the first server wrote its blocks"
        for server in start_server(tmp, env=env):
            grown = turn(server, messages + [{"role": "assistant", "content": "Done."},
                                             {"role": "user", "content": "And now?"}])
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert grown.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
