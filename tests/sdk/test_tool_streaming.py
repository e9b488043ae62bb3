"""Tool calls stream as the model writes them, through each official SDK's own stream parser:
OpenAI chat `tool_calls` deltas, Responses `function_call_arguments.delta`, Anthropic
`input_json_delta`. The arguments arrive in many fragments that join to the call's arguments;
two calls in one turn each keep their own. The answer is scripted (conftest.py `scripted`)."""

import json

import anthropic
import openai

from conftest import WRITE_ARGS

TOOLS = [{"type": "function", "function": {"name": name, "description": "A file tool", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}}, "required": ["path"]}}}
    for name in ("write_file", "read_file")]
ASK = "Write main.rs"


def test_openai_chat_streams_arguments_in_fragments(scripted):
    client = openai.OpenAI(base_url=scripted + "/v1", api_key="unused", max_retries=0)
    fragments = 0
    with client.chat.completions.stream(model="tiny", messages=[{"role": "user", "content": ASK}], tools=TOOLS,
                                        max_tokens=400) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments += 1
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Writing it.\n\n"
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("write_file", WRITE_ARGS), ("read_file", {"path": "a.rs"})]
    assert fragments > 10, f"{fragments} argument fragments"


def test_responses_streams_arguments_in_fragments(scripted):
    client = openai.OpenAI(base_url=scripted + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", **t["function"]} for t in TOOLS]
    deltas = {}
    with client.responses.stream(model="tiny", input=ASK, tools=tools, max_output_tokens=400) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                deltas.setdefault(event.item_id, []).append(event.delta)
        final = stream.get_final_response()
    calls = [i for i in final.output if i.type == "function_call"]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("write_file", WRITE_ARGS), ("read_file", {"path": "a.rs"})]
    assert len(deltas[calls[0].id]) > 10
    assert "".join(deltas[calls[0].id]) == calls[0].arguments


def test_anthropic_streams_input_json_in_fragments(scripted):
    client = anthropic.Anthropic(base_url=scripted, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": "A file tool", "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    fragments = 0
    with client.messages.stream(model="tiny", max_tokens=400, tools=tools,
                                messages=[{"role": "user", "content": ASK}]) as stream:
        for event in stream:
            if event.type == "input_json":
                fragments += 1
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    uses = [(b.name, b.input) for b in final.content if b.type == "tool_use"]
    assert uses == [("write_file", WRITE_ARGS), ("read_file", {"path": "a.rs"})]
    assert fragments > 10, f"{fragments} input_json events"
