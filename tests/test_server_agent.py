"""The agent API through the official clients, unmodified, on a live server: tool calls on /v1/chat/completions
(plain and streamed), structured output (`chat.completions.parse` with a pydantic model), `/v1/responses` (with its
stream and `previous_response_id`) and `/v1/messages` (with tools, `messages.stream` and count_tokens).

The tiny random-weight model gets a Hermes/Qwen-style chat template (tools rendered, `<tool_call>` calls), so
its outputs are noise unless a grammar constrains them: a well-formed call under `tool_choice="required"` or a
named function, and valid JSON under a schema, can only come from the enforcement under test.
"""

from __future__ import annotations

import copy
import json

import anthropic
import jsonschema
import pytest
from pydantic import BaseModel, Field

from server_harness import LiveServer

HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions.\n<tools>\n"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n"
    "Return calls as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{%- for call in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Time in a zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def hermes_tokenizer(tokenizer):
    """A copy of `tokenizer` with HERMES_TEMPLATE (the wrapper and the HF tokenizer copied: the session's tokenizer
    keeps its own template)."""
    hermes = copy.copy(tokenizer)
    hermes._tokenizer = copy.copy(tokenizer._tokenizer)
    hermes._tokenizer.chat_template = HERMES_TEMPLATE
    return hermes


@pytest.fixture(scope="module")
def server(tiny):
    model, tokenizer = tiny
    with LiveServer(model, hermes_tokenizer(tokenizer), kv_tokens=8192) as live:
        yield live


def _check_call(call) -> None:
    assert call.type == "function" and call.id
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_and_named_tool_calls_are_well_formed(server):
    client = server.client()
    messages = [{"role": "user", "content": "weather in Oslo?"}]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                         tool_choice="required", max_tokens=160, temperature=0.8, seed=1)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call)
    named = client.chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER, TIME], max_tokens=120, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, n=3, temperature=1.0, seed=2)
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls" and [c.function.name for c in choice.message.tool_calls] == [
            "get_time"]
        _check_call(choice.message.tool_calls[0])


def test_streamed_tool_calls_reassemble_to_the_whole_response(server):
    client = server.client()
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "time?"}], tools=[WEATHER, TIME],
                  tool_choice="required", max_tokens=120, temperature=0.0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] = (delta.function.name if delta.function and delta.function.name else entry["name"])
                entry["arguments"] += delta.function.arguments or "" if delta.function else ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_a_tool_round_trip_renders_through_the_template(server):
    client = server.client()
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
    ]
    out = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER], max_tokens=5)
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > 40  # the tools, the call and its result are in the prompt


class City(BaseModel):
    name: str = Field(max_length=6)
    rank: int = Field(ge=1, le=9)
    coastal: bool


def test_parse_with_a_pydantic_model_and_json_object(server):
    client = server.client()
    out = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "a city"}],
                                        response_format=City, max_tokens=80, temperature=0.7, seed=3)
    assert isinstance(out.choices[0].message.parsed, City)
    # Greedy: a sampled reply (the server's default temperature is 1) could by chance be valid JSON, e.g. "7".
    free = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a city"}],
                                          max_tokens=20, temperature=0)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].message.content)


def test_responses_create_stream_and_previous_response_id(server):
    client = server.client()
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    first = client.responses.create(model="tiny", input="Is it cold?", instructions="Answer in JSON.",
                                    max_output_tokens=40,
                                    text={"format": {"type": "json_schema", "name": "a", "schema": schema,
                                                     "strict": True}})
    assert first.status == "completed"
    jsonschema.validate(json.loads(first.output_text), schema)
    # Instructions do not carry over to a continuation (as in OpenAI's API): sent again, the prompt's head is the
    # same tokens as the first request's, so its blocks come from the prefix cache.
    second = client.responses.create(model="tiny", input="And tomorrow?", previous_response_id=first.id,
                                     instructions="Answer in JSON.", max_output_tokens=8)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0  # the earlier turns came from the prefix cache
    events = list(client.responses.create(model="tiny", input="hi", max_output_tokens=6, stream=True))
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in types
    call = client.responses.create(model="tiny", input="time?", tool_choice="required", max_output_tokens=120,
                                   parallel_tool_calls=False, temperature=0.0,
                                   tools=[{"type": "function", **TIME["function"]}])
    calls = [item for item in call.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_time"
    jsonschema.validate(json.loads(calls[0].arguments), SCHEMAS["get_time"])


def test_anthropic_messages_with_tools_stream_and_count_tokens(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=60)
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": SCHEMAS["get_weather"]}]
    # One call: with parallel calls allowed, a random model may go on calling until max_tokens.
    out = client.messages.create(model="tiny", max_tokens=120, tools=tools, extra_body={"temperature": 0.0},
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 messages=[{"role": "user", "content": "weather?"}])
    assert out.stop_reason == "tool_use"
    uses = [b for b in out.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, SCHEMAS["get_weather"])
    # Greedy: a sampled answer of the random model may be empty (end of sequence first), which has no text block.
    with client.messages.stream(model="tiny", max_tokens=8, system="Be brief.", extra_body={"temperature": 0.0},
                                messages=[{"role": "user", "content": "hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason in ("end_turn", "max_tokens")
    count = client.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hello"}])
    assert count.input_tokens > 0
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}])


@pytest.mark.parametrize("field, value", [
    ("logit_bias", {"5": 10}),
    ("functions", [{"name": "f", "parameters": {}}]),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("response_format", {"type": "grammar"}),
    ("tools", [{"type": "web_search"}]),
])
def test_unsupported_fields_are_a_400_naming_them(server, field, value):
    import openai

    client = server.client()
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       extra_body={field: value})
    assert field in str(info.value)


def test_a_schema_that_cannot_be_enforced_is_a_400_before_generation(server):
    import openai

    client = server.client()
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}
    with pytest.raises(openai.BadRequestError, match="response_format.*look-around"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "b", "schema": bad}})
    assert server.wait_idle()["sequences"] == []



def test_stop_sequence_is_the_stop_string_the_engine_matched(tiny):
    """The engine reports which stop string ended a request (RequestOutput.stop_string); /v1/messages' TurnState
    passes it on as Anthropic's stop_sequence."""
    from cortexstream.engine.engine import Engine
    from cortexstream.server.agent_turn import TurnState
    from cortexstream.server.jobs import EngineJob, RequestHandle, TokenEvent
    from test_engine import random_prompts

    model, tokenizer = tiny
    prompt = random_prompts(6, seed=5, low=2, high=30)[2]  # seed 5: an output with printable text

    def run(**kwargs):
        engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4)
        rid = engine.add_request(prompt, max_tokens=25, **kwargs)
        outs = []
        while engine.has_unfinished:
            outs += [o for o in engine.step() if o.request_id == rid]
        return "".join(o.text for o in outs), outs[-1]

    text, last = run()
    assert last.stop_string is None
    stop = text[4:7]
    cut, last = run(stop=["never-written", stop, "neither"])
    assert (last.finish_reason, last.stop_string, cut) == ("stop", stop, text[:text.index(stop)])

    turn = TurnState(RequestHandle(EngineJob(["r"], [1], None), 0.0), 1, None)
    turn.add(TokenEvent(0, 5, cut, None, None, 0.0))
    turn.add(TokenEvent(0, 6, "", last.finish_reason, None, 0.0, stop_string=last.stop_string))
    assert (turn.text, turn.stop_sequence) == (cut, stop)


def test_a_request_that_finished_before_its_reader_started_is_read_whole():
    """The engine may deliver every event of a request (so `RequestHandle.finished`) before the handler starts
    reading them: the reader runs until it has taken the final events, so no answer loses its end (a 500 from
    /v1/responses, or a chat body without its finish, before)."""
    import asyncio
    from types import SimpleNamespace

    from cortexstream.engine.finish_reason import FinishReason
    from cortexstream.server.jobs import EngineJob, RequestHandle, TokenEvent
    from cortexstream.server.routes import collect

    async def never_disconnects():
        await asyncio.Event().wait()

    async def main():
        handle = RequestHandle(EngineJob(["a", "b"], [1], None), 0.0)
        events = [TokenEvent(0, 5, "x", None, None, 0.0), TokenEvent(0, 6, "y", FinishReason.LENGTH, None, 0.0),
                  TokenEvent(1, 7, "z", FinishReason.STOP, None, 0.0)]
        for event in events:  # as the bridge delivers them
            if event.finish_reason is not None:
                handle.unfinished.discard(event.index)
            handle.events.put_nowait(event)
        assert handle.finished and not handle.all_read
        seen = []
        await collect(SimpleNamespace(receive=never_disconnects), handle, seen.append)
        return handle, seen, events

    handle, seen, events = asyncio.run(main())
    assert seen == events and handle.all_read
