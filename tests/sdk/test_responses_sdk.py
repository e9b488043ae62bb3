"""The official `openai` Python SDK's Responses client against `ferrite serve`: a response
object, a stream through the SDK's typed event parser, a tool round trip in the history, tool
types the server cannot run left out and named, and the stateless refusal."""

import openai
import pytest


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)


TOOLS = [{"type": "function", "name": "read_file", "description": "Read a file",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]


def test_a_response_object(client):
    r = client.responses.create(model="gpt-5.5-codex", instructions="You write code.", input="Write a function.",
                                max_output_tokens=8)
    assert r.object == "response" and r.model == "tiny"
    assert r.status in ("completed", "incomplete")
    assert r.usage.output_tokens <= 8 and r.usage.input_tokens > 0
    assert isinstance(r.output_text, str)


def test_a_stream_through_the_sdks_parser(client):
    kinds, deltas, final = [], [], None
    with client.responses.stream(model="tiny", input=[{"role": "user", "content": "Write a function."}],
                                 max_output_tokens=8) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
    # Out of tokens is incomplete, and the stream says so in its last event, as OpenAI's does
    # (the SDK's get_final_response() waits for `response.completed` only: openai-python#3538).
    last = "response.incomplete" if final.status == "incomplete" else "response.completed"
    assert kinds[0] == "response.created" and kinds[-1] == last, kinds
    if final.status == "incomplete":
        assert final.incomplete_details.reason == "max_output_tokens", final
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds, kinds
    assert final.output_text == "".join(deltas)
    assert final.usage.output_tokens <= 8


def test_a_tool_round_trip_is_rendered_and_unrunnable_tools_are_named(client):
    history = [
        {"role": "developer", "content": "Use the tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "Show a.rs"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Read it."}]},
        {"type": "function_call", "call_id": "call_1", "name": "read_file", "arguments": '{"path": "a.rs"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "fn main() {}"},
    ]
    tools = TOOLS + [{"type": "web_search"}]
    raw = client.responses.with_raw_response.create(model="tiny", input=history, tools=tools, max_output_tokens=4,
                                                   parallel_tool_calls=False, store=False,
                                                   include=["reasoning.encrypted_content"], prompt_cache_key="k")
    assert raw.headers["x-ferrite-tools-ignored"] == "web_search"
    with_result = raw.parse().usage.input_tokens
    without = client.responses.create(model="tiny", input=history[:-1], tools=TOOLS, max_output_tokens=4)
    assert with_result > without.usage.input_tokens


def test_stateless_and_refusals_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="hi", previous_response_id="resp_1")
    assert "previous_response_id" in str(e.value) and "history" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    assert "input[0].content[0]" in str(e.value)


# Custom (free-form) tools, as Codex sends its `exec` and `apply_patch`: the model sees a
# function with one string argument, `input`, and its call comes back as a custom_tool_call.
# The tiny model cannot choose a tool itself: the server's scripted replies (a test device,
# conftest.py's `scripted`) fix its answer token by token on the logits.
from conftest import PATCH
CUSTOM = [{"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
           "format": {"type": "grammar", "syntax": "lark", "definition": "start: /[\\s\\S]+/"}}]


def test_a_custom_tool_call_streams_and_round_trips(scripted):
    client = openai.OpenAI(base_url=scripted + "/v1", api_key="unused", max_retries=0)
    kinds, deltas = [], []
    with client.responses.stream(model="tiny", input="Patch a.txt", tools=CUSTOM, max_output_tokens=400) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.custom_tool_call_input.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert "response.custom_tool_call_input.done" in kinds, kinds
    (call,) = [item for item in final.output if item.type == "custom_tool_call"]
    assert call.name == "apply_patch" and call.input == PATCH and "".join(deltas) == PATCH
    # Not streamed: the same item.
    once = client.responses.create(model="tiny", input="Patch a.txt", tools=CUSTOM, max_output_tokens=400)
    assert [(i.type, i.input) for i in once.output if i.type == "custom_tool_call"] == [("custom_tool_call", PATCH)]
    # The client runs it and sends the call and its output back: the turn ends.
    history = [{"role": "user", "content": "Patch a.txt"},
               {"type": "custom_tool_call", "call_id": call.call_id, "name": "apply_patch", "input": PATCH},
               {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "Done!"}]
    after = client.responses.create(model="tiny", input=history, tools=CUSTOM, max_output_tokens=400)
    assert after.output_text == "Patched." and after.status == "completed"


def test_structured_output_parses(client):
    """`responses.parse` with a pydantic model: `text.format` is a strict JSON schema the grammar
    holds the answer to, and the SDK parses `output_parsed`. Thinking is off: sampled with no seed
    (the Responses API has none), a random model may think past the token budget."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        level: Literal["low", "high"]
        count: int = Field(ge=0, le=9)

    r = client.responses.parse(model="tiny", input="Report the reading.", text_format=Reading,
                               max_output_tokens=60, temperature=0.8,
                               reasoning={"effort": "none"})
    assert r.status == "completed", r.output_text
    assert isinstance(r.output_parsed, Reading), r.output_text
    with pytest.raises(openai.BadRequestError, match="text.format.schema"):
        client.responses.create(model="tiny", input="x", max_output_tokens=4,
                                text={"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}})
