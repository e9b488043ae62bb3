"""The official `anthropic` Python SDK against `ferrite serve`: messages, streaming events,
system prompts, thinking on and off, token counting, and errors as the SDK's exceptions."""

import anthropic
import pytest


@pytest.fixture()
def client(server):
    return anthropic.Anthropic(base_url=server, api_key="unused", max_retries=0)


def ask(client, **kw):
    args = dict(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "Write a function."}])
    args.update(kw)
    return client.messages.create(**args)


def test_message(client):
    m = ask(client, system="Be brief.")
    assert m.type == "message" and m.role == "assistant"
    assert m.content[-1].type == "text" and m.content[-1].text
    assert m.stop_reason == "max_tokens"
    assert m.usage.output_tokens == 12
    assert m.usage.input_tokens > 0


def test_streaming_events_build_the_same_message(client):
    whole = ask(client).content[-1].text
    kinds, text = [], ""
    with client.messages.stream(model="tiny", max_tokens=12, messages=[{"role": "user", "content": "Write a function."}]) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text += event.delta.text
        final = stream.get_final_message()
    assert text == whole
    assert final.content[-1].text == whole
    assert final.stop_reason == "max_tokens"
    assert kinds[0] == "message_start"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert kinds[-1] == "message_stop"


def test_thinking_switch_and_token_count(client):
    on = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Write a function."}],
                                      thinking={"type": "enabled", "budget_tokens": 1024})
    off = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Write a function."}],
                                       thinking={"type": "disabled"})
    assert off.input_tokens > on.input_tokens > 0  # the template closed the think block
    # Without `thinking` the model does not think, as with Anthropic's API.
    plain = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "Write a function."}])
    assert plain.input_tokens == off.input_tokens
    m = ask(client, thinking={"type": "disabled"})
    # Anthropic's accounting: the prompt is what was computed plus what came from the cache.
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == off.input_tokens


def test_tool_results_and_stop_sequences(client):
    msgs = [
        {"role": "user", "content": "Read the file."},
        {"role": "assistant", "content": [{"type": "text", "text": "Reading."}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "fn main() {}"}]},
    ]
    m = ask(client, messages=msgs, max_tokens=30)
    text = m.content[-1].text
    assert len(text) > 3
    stop = text[2:4]
    s = ask(client, messages=msgs, max_tokens=30, stop_sequences=[stop])
    assert s.stop_reason == "stop_sequence" and s.stop_sequence == stop
    assert s.content[-1].text == text[: text.find(stop)]


def test_errors_are_sdk_exceptions(client):
    # Another model's name is answered by the loaded one, which the reply names.
    assert ask(client, model="claude-9").model == "tiny"
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, messages=[])
    assert "messages" in str(e.value)
    with pytest.raises(anthropic.BadRequestError) as e:
        ask(client, max_tokens=0)
    assert "max_tokens" in str(e.value)


def test_tools_and_tool_use_history(client):
    tools = [{"name": "read_file", "description": "Read a file",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    history = [
        {"role": "user", "content": "Show a.rs"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "read_file", "input": {"path": "a.rs"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "fn main() {}"}]},
    ]
    bare = client.messages.count_tokens(model="tiny", messages=history)
    with_tools = client.messages.count_tokens(model="tiny", messages=history, tools=tools)
    assert with_tools.input_tokens > bare.input_tokens
    m = ask(client, messages=history, tools=tools)
    assert m.stop_reason in ("max_tokens", "end_turn", "tool_use")


def test_forced_tool_use(client):
    """`tool_choice` naming a tool: the grammar holds even a random model to a tool_use block
    whose input validates against the tool's schema."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
              "mode": {"enum": ["fast", "slow"]}}, "required": ["n", "mode"], "additionalProperties": False}
    for choice in ({"type": "tool", "name": "count"}, {"type": "any", "disable_parallel_tool_use": True}):
        m = ask(client, max_tokens=80, tools=[{"name": "count", "input_schema": schema}], tool_choice=choice,
                thinking={"type": "disabled"})
        assert m.stop_reason == "tool_use"
        (use,) = [b for b in m.content if b.type == "tool_use"]
        assert use.name == "count"
        assert 0 <= use.input["n"] <= 99 and use.input["mode"] in ("fast", "slow"), use.input
