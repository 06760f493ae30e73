"""Responses API translation: requests (+ a stored conversation) -> ChatSpec, refusals naming the field, the
response store, and response objects / typed SSE events checked by the `openai` SDK itself (its pydantic types,
and its client reading our bytes through an in-memory HTTP transport). Also ChatSpec's own checks."""

from __future__ import annotations


import httpx2
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from cortexstream.engine.finish_reason import FinishReason
from cortexstream.server.chat_spec import ChatSpec
from cortexstream.server.errors import APIError
from cortexstream.server.openai_responses_events import (
    ResponsesStatus, request_echo, responses_body, responses_status,
)
from cortexstream.server.openai_responses_protocol import ResponsesRequest
from cortexstream.server.openai_responses_stream import ResponsesStreamEncoder
from cortexstream.server.openai_responses_translate import responses_conversation, responses_to_chat
from cortexstream.server.response_store import ResponseStore
from cortexstream.server.tool_types import (
    FunctionTool, TextDelta, ToolCall, ToolCallArguments, ToolCallStart, ToolChoice, ToolChoiceMode,
)
from sse_events import parse_sse

WEATHER = {"type": "function", "name": "weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def parse(**body) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", **body})


def refusal(previous=None, **body) -> APIError:
    with pytest.raises(APIError) as caught:
        responses_to_chat(parse(**body), previous)
    assert caught.value.status == 400
    return caught.value


def test_input_items_become_chat_template_messages():
    spec = responses_to_chat(parse(
        instructions="Be brief.", tools=[WEATHER], max_output_tokens=20, temperature=0.3, top_p=0.9, seed=4,
        input=[{"role": "developer", "content": "Use tools."},
               {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                               {"type": "input_text", "text": "in Paris?"}]},
               {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
               {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "weather",
                "arguments": '{"city": "Paris"}'},
               {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city": "Oslo"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
               {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]}]))
    call = lambda i, city: {"id": i, "type": "function", "function": {"name": "weather", "arguments": {"city": city}}}
    assert spec.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call("c1", "Paris"), call("c2", "Oslo")]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"}]
    assert spec.tools == (FunctionTool("weather", WEATHER["description"], WEATHER["parameters"], strict=True),)
    assert (spec.max_tokens, spec.temperature, spec.top_p, spec.seed) == (20, 0.3, 0.9, 4)
    assert spec.tool_choice == ToolChoice() and spec.parallel_tool_calls and not spec.stream


@pytest.mark.parametrize("choice, expected", [
    ("auto", ToolChoice()), ("none", ToolChoice(ToolChoiceMode.NONE)),
    ("required", ToolChoice(ToolChoiceMode.REQUIRED)),
    ({"type": "function", "name": "weather"}, ToolChoice(ToolChoiceMode.NAMED, "weather"))])
def test_tool_choice(choice, expected):
    assert responses_to_chat(parse(input="hi", tools=[WEATHER], tool_choice=choice)).tool_choice == expected


def test_text_formats():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    spec = responses_to_chat(parse(input="x", text={"format": {"type": "json_schema", "name": "a", "schema": schema,
                                                               "strict": True}, "verbosity": "medium"}))
    assert (spec.json_schema, spec.json_schema_strict, spec.json_object) == (schema, True, False)
    assert responses_to_chat(parse(input="x", text={"format": {"type": "json_object"}})).json_object
    plain = responses_to_chat(parse(input="x", text={"format": {"type": "text"}}))
    assert plain.json_schema is None and not plain.json_object


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{**WEATHER, "defer_loading": True}]}, "tools[0].defer_loading"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "reasoning", "summary": []}]}, "input[1].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "call_id": "zz", "output": "x"}]}, "input[0].call_id"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "text": {"verbosity": "low"}}, "text.verbosity"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format.schema"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "x", "max_tool_calls": 2}, "max_tool_calls"),
    ({"input": [{"role": "user", "content": "x", "weight": 2}]}, "input[0].weight"),
    ({"input": []}, "input"),
])
def test_refusals_name_the_field(body, param):
    assert refusal(**body).param == param


def test_harmless_and_null_fields_are_accepted():
    spec = responses_to_chat(parse(input=[{"role": "user", "content": "hi", "id": "m1", "status": "completed"}],
                                   user="u", metadata={"k": "v"}, store=False, service_tier="auto",
                                   prompt_cache_key="p", safety_identifier="s", stream_options={
                                       "include_obfuscation": False}, reasoning=None, include=[]))
    assert spec.messages == [{"role": "user", "content": "hi"}]


def test_previous_response_continues_a_stored_conversation():
    store = ResponseStore(capacity=4)
    first = parse(instructions="Old rules.", tools=[WEATHER], input="Weather in Paris?")
    conversation = responses_conversation(first)
    store.record("resp_1", conversation, "", [ToolCall("c1", "weather", '{"city": "Paris"}')])
    second = parse(instructions="New rules.", previous_response_id="resp_1",
                   input=[{"type": "function_call_output", "call_id": "c1", "output": "sunny"}])
    spec = responses_to_chat(second, store.get("resp_1"))
    assert spec.messages == [
        {"role": "system", "content": "New rules."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    missing = refusal(previous_response_id="resp_gone", input="x")
    assert (missing.param, missing.code) == ("previous_response_id", "previous_response_not_found")


def test_store_is_a_bounded_lru_of_copies():
    store = ResponseStore(capacity=2)
    store.put("a", [{"role": "user", "content": "1"}])
    store.put("b", [{"role": "user", "content": "2"}])
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", [{"role": "user", "content": "3"}])
    assert ("a" in store, "b" in store, "c" in store, len(store)) == (True, False, True, 2)
    got = store.get("a")
    got[0]["content"] = "changed"
    assert store.get("a") == [{"role": "user", "content": "1"}] and store.get("b") is None
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(0)


def test_chat_spec_checks_itself():
    hi = [{"role": "user", "content": "hi"}]
    tool = FunctionTool("f")
    for bad, field in [({"messages": []}, "messages"), ({"messages": [{"role": "robot", "content": ""}]}, "messages"),
                       ({"messages": hi, "tools": (tool, tool)}, "tools"),
                       ({"messages": hi, "tool_choice": ToolChoice(ToolChoiceMode.REQUIRED)}, "tool_choice"),
                       ({"messages": hi, "json_schema": {}, "json_object": True}, "json_schema"),
                       ({"messages": hi, "continue_final_message": True}, "continue_final_message")]:
        with pytest.raises(ValueError, match=field):
            ChatSpec(**bad)


CALL = ToolCall("c1", "weather", '{"city": "Paris"}')


def test_response_bodies_parse_as_the_sdks_response():
    echo = request_echo(parse(input="x", tools=[WEATHER], tool_choice={"type": "function", "name": "weather"},
                              text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}}))
    body = responses_body("resp_1", "m", echo, "Checking.", [CALL], ResponsesStatus.COMPLETED, 10, 5, cached_tokens=4)
    response = Response.model_validate(body)
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Checking." and response.output[1].arguments == CALL.arguments
    assert (response.usage.total_tokens, response.usage.input_tokens_details.cached_tokens) == (15, 4)
    assert response.tool_choice.name == "weather" and response.tools[0].name == "weather"
    cut = Response.model_validate(responses_body("r", "m", echo, "Par", [], ResponsesStatus.INCOMPLETE, 1, 9))
    assert (cut.status, cut.incomplete_details.reason, cut.output[0].status) == \
        ("incomplete", "max_output_tokens", "incomplete")
    assert responses_status(FinishReason.LENGTH) is ResponsesStatus.INCOMPLETE
    assert responses_status(FinishReason.STOP) is ResponsesStatus.COMPLETED


DELTAS = [TextDelta("Let me "), TextDelta("check."), ToolCallStart(0, "c1", "weather"),
          ToolCallArguments(0, '{"city": '), ToolCallArguments(0, '"Paris"}')]


def encode(status=ResponsesStatus.COMPLETED) -> tuple[ResponsesStreamEncoder, bytes]:
    encoder = ResponsesStreamEncoder("resp_1", "m", request_echo(parse(input="x", tools=[WEATHER])))
    raw = b"".join(encoder.feed(d) for d in DELTAS) + encoder.finish(status, 8, 6)
    return encoder, raw


def test_stream_events_are_the_responses_sequence():
    encoder, raw = encode()
    events = parse_sse(raw)
    adapter = TypeAdapter(ResponseStreamEvent)
    for name, data in events:
        assert name == data["type"]
        adapter.validate_python(data)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    assert [d["type"].removeprefix("response.") for _, d in events] == [
        "created", "in_progress", "output_item.added", "content_part.added", "output_text.delta",
        "output_text.delta", "output_text.done", "content_part.done", "output_item.done", "output_item.added",
        "function_call_arguments.delta", "function_call_arguments.delta", "function_call_arguments.done",
        "output_item.done", "completed"]
    final = Response.model_validate(events[-1][1]["response"])
    assert final.output_text == "Let me check." and final.output[1].arguments == '{"city": "Paris"}'
    assert (encoder.text, encoder.tool_calls) == ("Let me check.", [CALL])
    _, cut = encode(ResponsesStatus.INCOMPLETE)
    last = parse_sse(cut)[-1][1]
    assert last["type"] == "response.incomplete" and last["response"]["output"][-1]["status"] == "incomplete"


def sdk_client(handler) -> openai.OpenAI:
    return openai.OpenAI(api_key="k", base_url="http://test/v1", max_retries=0,
                         http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def test_the_sdk_reads_our_stream_and_body_and_its_requests_translate():
    seen = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        parsed = ResponsesRequest.model_validate_json(request.content)
        seen.append(responses_to_chat(parsed))
        if parsed.stream:
            return httpx2.Response(200, content=encode()[1], headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json=responses_body("resp_2", "m", request_echo(parsed), "Hi.", [],
                                                        ResponsesStatus.COMPLETED, 3, 2))

    client = sdk_client(handler)
    with client.responses.stream(model="m", input="Weather?", tools=[WEATHER], instructions="sys") as stream:
        final = stream.get_final_response()
    assert final.output_text == "Let me check." and final.output[1].call_id == "c1"
    assert seen[0].stream and seen[0].messages[0] == {"role": "system", "content": "sys"}
    plain = client.responses.create(model="m", input=[{"role": "user", "content": "hi"}], max_output_tokens=9)
    assert plain.output_text == "Hi." and seen[1].max_tokens == 9 and not seen[1].stream


def test_error_event_parses():
    encoder, _ = encode()
    event = parse_sse(encoder.error(APIError(500, "engine failed", code="engine_error")))[0][1]
    parsed = TypeAdapter(ResponseStreamEvent).validate_python(event)
    assert (parsed.type, parsed.message, parsed.code) == ("error", "engine failed", "engine_error")
