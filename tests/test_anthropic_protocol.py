"""Anthropic Messages translation: requests -> ChatSpec, refusals naming the field, and response bodies / SSE
streams / error bodies checked by the `anthropic` SDK itself (its pydantic types, and its client reading our bytes
through an in-memory HTTP transport)."""

from __future__ import annotations


import anthropic
import httpx2
import pytest
from anthropic.types import Message, MessageTokensCount, RawMessageStreamEvent
from anthropic.types.shared import ErrorResponse
from pydantic import TypeAdapter

from cortexstream.engine.finish_reason import FinishReason
from cortexstream.server.anthropic_events import (
    AnthropicStopReason, AnthropicStreamEncoder, anthropic_error_body, anthropic_message, anthropic_stop_reason,
    anthropic_token_count,
)
from cortexstream.server.anthropic_protocol import AnthropicCountTokensRequest, AnthropicMessagesRequest
from cortexstream.server.anthropic_translate import anthropic_to_chat
from cortexstream.server.errors import APIError
from cortexstream.server.tool_types import TextDelta, ToolCall, ToolCallArguments, ToolCallStart, ToolChoiceMode
from sse_events import parse_sse

WEATHER = {"name": "weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def spec_of(**body):
    return anthropic_to_chat(AnthropicMessagesRequest.model_validate({"model": "m", "max_tokens": 32, **body}))


def refusal(**body) -> APIError:
    with pytest.raises(APIError) as caught:
        spec_of(**body)
    assert caught.value.status == 400
    return caught.value


def test_a_tool_conversation_becomes_chat_template_messages():
    spec = spec_of(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
                   tools=[WEATHER], stop_sequences=["END"], temperature=0.5, top_k=4, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Weather?", "cache_control": {"type": "ephemeral"}},
                                     {"type": "text", "text": "In Paris."}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "tu1", "name": "weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "tu1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ])
    assert spec.messages == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "Weather?\n\nIn Paris."},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "tu1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "tu1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert [t.name for t in spec.tools] == ["weather"] and spec.tools[0].parameters == WEATHER["input_schema"]
    assert spec.tool_choice.mode is ToolChoiceMode.AUTO and spec.parallel_tool_calls
    assert (spec.max_tokens, spec.temperature, spec.top_k, spec.stop) == (32, 0.5, 4, ("END",))
    assert not spec.continue_final_message and spec.json_schema is None


def test_error_results_prefill_and_structured_output():
    spec = spec_of(messages=[
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "timeout",
                                      "is_error": True}]},
        {"role": "assistant", "content": "The answer is"}],
        output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}})
    assert spec.messages[2] == {"role": "tool", "tool_call_id": "a", "content": "Error: timeout"}
    assert spec.continue_final_message and spec.messages[-1] == {"role": "assistant", "content": "The answer is"}
    assert spec.json_schema == {"type": "object"} and spec.json_schema_strict


@pytest.mark.parametrize("choice, mode, name, parallel", [
    ({"type": "auto"}, ToolChoiceMode.AUTO, None, True),
    ({"type": "any", "disable_parallel_tool_use": True}, ToolChoiceMode.REQUIRED, None, False),
    ({"type": "tool", "name": "weather"}, ToolChoiceMode.NAMED, "weather", True),
    ({"type": "none"}, ToolChoiceMode.NONE, None, True),
])
def test_tool_choice(choice, mode, name, parallel):
    spec = spec_of(tools=[WEATHER], tool_choice=choice, messages=[{"role": "user", "content": "hi"}])
    assert (spec.tool_choice.mode, spec.tool_choice.name, spec.parallel_tool_calls) == (mode, name, parallel)


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": "x"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "image", "source": {}}]}]}]},
     "messages[2].content[0].content[0].type"),
    ({"messages": HI, "thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.type"),
    ({"messages": HI, "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]},
     "tools[0].type"),
    ({"messages": HI, "container": "c1"}, "container"),
    ({"messages": HI, "output_config": {"effort": "high"}}, "output_config.effort"),
    ({"messages": HI, "tools": [{**WEATHER, "input_examples": [{"city": "Oslo"}]}]}, "tools[0].input_examples"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "weight": 2}]}]},
     "messages[0].content[0].weight"),
    ({"messages": HI, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"messages": HI, "tool_choice": {"type": "any"}}, "tool_choice.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "zz", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": HI, "stop_sequences": [""]}, "stop_sequences"),
    ({"messages": HI + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                           "input": {}}]}]}, "messages[1]"),
])
def test_refusals_name_the_field(body, param):
    assert refusal(**body).param == param


def test_harmless_and_null_fields_are_accepted():
    spec = spec_of(messages=HI, metadata={"user_id": "u"}, service_tier="auto", cache_control={"type": "ephemeral"},
                   container=None, thinking={"type": "disabled"}, tools=[{**WEATHER, "cache_control": None}])
    assert spec.messages == [{"role": "user", "content": "hi"}]


def test_count_tokens_takes_the_prompt_fields_only():
    request = AnthropicCountTokensRequest.model_validate(
        {"model": "m", "system": "s", "messages": HI, "tools": [WEATHER], "max_tokens": 5, "temperature": 0.1})
    spec = anthropic_to_chat(request)
    assert spec.messages[0] == {"role": "system", "content": "s"} and spec.max_tokens is None
    assert MessageTokensCount.model_validate(anthropic_token_count(17)).input_tokens == 17


def test_message_bodies_parse_as_the_sdks_message():
    calls = [ToolCall("tu_1", "weather", '{"city": "Paris"}'), ToolCall("tu_2", "weather", "{}")]
    body = anthropic_message("msg_1", "m", "Let me check.", calls, AnthropicStopReason.TOOL_USE, 11, 7)
    message = Message.model_validate(body)
    assert [b.type for b in message.content] == ["text", "tool_use", "tool_use"]
    assert message.content[1].input == {"city": "Paris"} and message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (11, 7)
    empty = Message.model_validate(anthropic_message("msg_2", "m", "", [], AnthropicStopReason.END_TURN, 1, 0))
    assert [(b.type, b.text) for b in empty.content] == [("text", "")]
    only_calls = Message.model_validate(anthropic_message("m3", "m", "", calls[:1], AnthropicStopReason.TOOL_USE, 1, 1))
    assert [b.type for b in only_calls.content] == ["tool_use"]


def test_stop_reasons():
    assert anthropic_stop_reason(FinishReason.LENGTH, True) is AnthropicStopReason.MAX_TOKENS
    assert anthropic_stop_reason(FinishReason.STOP, True) is AnthropicStopReason.TOOL_USE
    assert anthropic_stop_reason(FinishReason.STOP, False, "END") is AnthropicStopReason.STOP_SEQUENCE
    assert anthropic_stop_reason(FinishReason.STOP, False) is AnthropicStopReason.END_TURN
    with pytest.raises(ValueError):
        anthropic_stop_reason(FinishReason.ERROR, False)


DELTAS = [TextDelta("Let me "), TextDelta(""), TextDelta("check."), ToolCallStart(0, "tu_1", "weather"),
          ToolCallArguments(0, '{"city": '), ToolCallArguments(0, '"Paris"}'), ToolCallStart(1, "tu_2", "weather"),
          ToolCallArguments(1, "{}")]


def encoded_stream() -> bytes:
    encoder = AnthropicStreamEncoder("msg_1", "m", input_tokens=9)
    return b"".join(encoder.feed(d) for d in DELTAS) + encoder.finish(AnthropicStopReason.TOOL_USE, 12)


def test_stream_events_are_anthropics_sequence():
    events = parse_sse(encoded_stream())
    adapter = TypeAdapter(RawMessageStreamEvent)
    for name, data in events:
        assert name == data["type"]
        adapter.validate_python(data)
    shape = [(d["type"], d.get("index"), d.get("delta", {}).get("type")) for _, d in events]
    assert shape == [
        ("message_start", None, None),
        ("content_block_start", 0, None), ("content_block_delta", 0, "text_delta"),
        ("content_block_delta", 0, "text_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "input_json_delta"),
        ("content_block_delta", 1, "input_json_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None), ("message_delta", None, None), ("message_stop", None, None)]


def test_arguments_of_a_call_that_is_not_open_are_refused():
    encoder = AnthropicStreamEncoder("msg_1", "m", 1)
    encoder.feed(ToolCallStart(0, "a", "f"))
    encoder.feed(ToolCallStart(1, "b", "f"))
    with pytest.raises(ValueError, match="tool call 0"):
        encoder.feed(ToolCallArguments(0, "{}"))


def sdk_client(handler) -> anthropic.Anthropic:
    return anthropic.Anthropic(api_key="k", base_url="http://test", max_retries=0,
                               http_client=httpx2.Client(transport=httpx2.MockTransport(handler)))


def test_the_sdk_reads_our_stream_and_its_request_translates():
    seen = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(anthropic_to_chat(AnthropicMessagesRequest.model_validate_json(request.content)))
        return httpx2.Response(200, content=encoded_stream(), headers={"content-type": "text/event-stream"})

    with sdk_client(handler).messages.stream(model="m", max_tokens=64, tools=[WEATHER], system="sys",
                                             messages=[{"role": "user", "content": "Weather in Paris?"}]) as stream:
        final = stream.get_final_message()
    assert seen[0].stream and seen[0].messages[0] == {"role": "system", "content": "sys"}
    assert final.content[0].text == "Let me check."
    assert [(b.name, b.input) for b in final.content[1:]] == [("weather", {"city": "Paris"}), ("weather", {})]
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("tool_use", 9, 12)


@pytest.mark.parametrize("status, kind, sdk_error", [
    (400, "invalid_request_error", anthropic.BadRequestError), (404, "not_found_error", anthropic.NotFoundError),
    (429, "rate_limit_error", anthropic.RateLimitError), (500, "api_error", anthropic.InternalServerError),
    (503, "overloaded_error", anthropic.InternalServerError)])
def test_error_bodies(status, kind, sdk_error):
    body = anthropic_error_body(APIError(status, "it went wrong", param="x"))
    assert ErrorResponse.model_validate(body).error.type == kind

    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(status, json=body)

    with pytest.raises(sdk_error) as caught:
        sdk_client(handler).messages.create(model="m", max_tokens=5, messages=HI)
    assert caught.value.body["error"]["message"] == "it went wrong"
