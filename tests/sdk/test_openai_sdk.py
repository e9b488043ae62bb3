"""The official `openai` Python SDK against `ferrite serve`: chat, streaming, text
completions, thinking off, and errors as the SDK's own exception types."""

import openai
import pytest


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


def ask(client, **kw):
    args = dict(model="tiny", messages=[{"role": "user", "content": "Write a function."}], max_tokens=12)
    args.update(kw)
    return client.chat.completions.create(**args)


def test_models_lists_id_and_alias(client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny", "ferrite-tiny"]


def test_chat_completion(client):
    r = ask(client)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_streaming_equals_whole(client):
    whole = ask(client).choices[0].message.content
    stream = ask(client, stream=True, stream_options={"include_usage": True})
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert text == whole
    assert finish == "length"
    assert usage.completion_tokens == 12


def test_alias_seed_and_thinking_off(client):
    a = ask(client, model="ferrite-tiny", temperature=0.8, seed=7)
    b = ask(client, model="ferrite-tiny", temperature=0.8, seed=7)
    assert a.choices[0].message.content == b.choices[0].message.content
    off = ask(client, reasoning_effort="none")
    assert off.usage.prompt_tokens > a.usage.prompt_tokens  # the template closed the think block


def test_penalties_and_refused_options(client):
    plain = ask(client, max_tokens=24).choices[0].message.content
    # OpenAI's two penalties as the SDK sends them; mlx-lm's repetition penalty as an extra.
    penalised = ask(client, max_tokens=24, presence_penalty=2, frequency_penalty=1, extra_body={"repetition_penalty": 1.5})
    assert penalised.choices[0].message.content != plain
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, n=2)
    assert "n:" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, logprobs=True, top_logprobs=2)
    assert "logprobs" in str(e.value)


def test_text_completion(client):
    r = client.completions.create(model="tiny", prompt="fn main() {", max_tokens=5)
    assert r.usage.completion_tokens == 5
    assert isinstance(r.choices[0].text, str)


def test_errors_are_sdk_exceptions(client):
    # Another model's name is answered by the loaded one, which the reply names.
    assert ask(client, model="gpt-9").model == "tiny"
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, messages=[])
    assert "messages" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, max_tokens=0)
    assert "max_tokens" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        ask(client, temperature=-1)


TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]


def test_tool_round_trip_is_rendered(client):
    history = [
        {"role": "user", "content": "Show a.rs"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.rs"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "fn main() {}"},
    ]
    plain = ask(client, messages=history)
    with_tools = ask(client, messages=history, tools=TOOLS)
    hidden = ask(client, messages=history, tools=TOOLS, tool_choice="none")
    # The tool definitions reach the prompt, unless tool_choice is none.
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens
    assert with_tools.choices[0].finish_reason in ("length", "stop", "tool_calls")
    with pytest.raises(openai.BadRequestError):
        ask(client, tools=[{"type": "retrieval"}])


def test_structured_output_parses(client):
    """`chat.completions.parse` with a pydantic model: the SDK sends a strict JSON schema, the
    grammar holds even a random model to it, and the SDK parses the answer into the model."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        level: Literal["low", "high"]
        count: int = Field(ge=0, le=9)

    for seed in (0, 1):
        r = client.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "Report the reading."}],
            response_format=Reading, max_tokens=60, temperature=0.8, seed=seed,
        )
        assert r.choices[0].finish_reason == "stop"
        reading = r.choices[0].message.parsed
        assert isinstance(reading, Reading), r.choices[0].message.content
        assert reading.level in ("low", "high") and 0 <= reading.count <= 9


def test_forced_tool_call_parses(client):
    """`tool_choice` naming a function, with a strict tool made by the SDK from a pydantic model:
    the grammar holds even a random model to a call of that tool, and the SDK parses its
    arguments into the model. Thinking is off: a random model need not close a think block."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Count(BaseModel):
        n: int = Field(ge=0, le=99)
        mode: Literal["fast", "slow"]

    tool = openai.pydantic_function_tool(Count, name="count")
    for choice in ({"type": "function", "function": {"name": "count"}}, "required"):
        r = client.chat.completions.parse(
            model="tiny", messages=[{"role": "user", "content": "Count."}], tools=[tool], tool_choice=choice,
            parallel_tool_calls=False, max_tokens=80, extra_body={"reasoning_effort": "none"},
        )
        assert r.choices[0].finish_reason == "tool_calls"
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "count"
        assert isinstance(call.function.parsed_arguments, Count), call.function.arguments
