"""Anthropic Messages response shapes: the whole `message` body, the SSE event stream, errors, token counts.

The stream is Anthropic's: `message_start`; per content block `content_block_start`, its deltas (`text_delta`, or
`input_json_delta` carrying `partial_json` for a tool_use block) and `content_block_stop`; then `message_delta`
(stop_reason, usage.output_tokens) and `message_stop`. Each event is `event: <type>\\ndata: <json>\\n\\n`.
"""

from __future__ import annotations

import enum
from typing import Any

from cortexstream.engine.finish_reason import FinishReason
from cortexstream.server.chat_spec import parse_arguments
from cortexstream.server.errors import APIError
from cortexstream.server.tool_types import StreamDelta, TextDelta, ToolCall, ToolCallArguments, ToolCallStart, \
    new_call_id
from cortexstream.server.wire import typed_sse

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error",
                422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
                504: "timeout_error", 529: "overloaded_error"}


class AnthropicStopReason(str, enum.Enum):
    END_TURN = "end_turn"
    MAX_TOKENS = "max_tokens"
    STOP_SEQUENCE = "stop_sequence"
    TOOL_USE = "tool_use"


def anthropic_stop_reason(finish_reason: FinishReason, has_tool_calls: bool,
                          stop_sequence: str | None = None) -> AnthropicStopReason:
    """Why a successful completion ended, in Anthropic's words (a failed one is an error, not a stop reason)."""
    if finish_reason is FinishReason.LENGTH:
        return AnthropicStopReason.MAX_TOKENS
    if finish_reason is not FinishReason.STOP:
        raise ValueError(f"finish_reason: {finish_reason} is a failure, not a stop reason")
    if has_tool_calls:
        return AnthropicStopReason.TOOL_USE
    return AnthropicStopReason.STOP_SEQUENCE if stop_sequence is not None else AnthropicStopReason.END_TURN


def new_message_id() -> str:
    return new_call_id("msg")


def anthropic_message(message_id: str, model: str, text: str, tool_calls: list[ToolCall],
                      stop_reason: AnthropicStopReason | None, input_tokens: int, output_tokens: int,
                      stop_sequence: str | None = None) -> dict[str, Any]:
    """A `message` body. A text block leads when there is text, or when there is nothing else."""
    content: list[dict[str, Any]] = []
    if text or not tool_calls:
        content.append({"type": "text", "text": text})
    for call in tool_calls:
        content.append({"type": "tool_use", "id": call.id, "name": call.name,
                        "input": parse_arguments(call.arguments, f"tool call {call.id}")})
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": None if stop_reason is None else stop_reason.value, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def anthropic_error_body(exc: APIError) -> dict[str, Any]:
    """Anthropic's error body for an APIError: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ERROR_TYPES.get(exc.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def anthropic_error_event(exc: APIError) -> bytes:
    """The `error` event a stream ends with when generation fails after the response has started."""
    return typed_sse("error", anthropic_error_body(exc))


def anthropic_token_count(input_tokens: int) -> dict[str, Any]:
    """The body of `/v1/messages/count_tokens`."""
    return {"input_tokens": input_tokens}


class AnthropicStreamEncoder:
    """Turns one completion's `StreamDelta`s into Anthropic's SSE events (bytes, possibly several events)."""

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self._started = False
        self._finished = False
        self._blocks = 0  # content blocks opened so far
        self._open: str | None = None  # "text" / "tool_use": the kind of the open block
        self._open_call: int | None = None  # the tool call index of the open tool_use block

    def start(self) -> bytes:
        """`message_start` (sent by the first `feed` or `finish` if not called)."""
        if self._started:
            return b""
        self._started = True
        message = anthropic_message(self.message_id, self.model, "", [], None, self.input_tokens, 0)
        message["content"] = []
        return typed_sse("message_start", {"type": "message_start", "message": message})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = self._open_call = None
        return typed_sse("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})

    def _begin(self, block: dict[str, Any]) -> bytes:
        out = self._close()
        self._blocks += 1
        self._open = block["type"]
        return out + typed_sse("content_block_start", {"type": "content_block_start", "index": self._blocks - 1,
                                                       "content_block": block})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return typed_sse("content_block_delta", {"type": "content_block_delta", "index": self._blocks - 1,
                                                 "delta": delta})

    def feed(self, item: StreamDelta) -> bytes:
        if self._finished:
            raise RuntimeError("AnthropicStreamEncoder: feed after finish")
        out = self.start()
        if isinstance(item, TextDelta):
            if not item.text:
                return out
            if self._open != "text":
                out += self._begin({"type": "text", "text": ""})
            return out + self._delta({"type": "text_delta", "text": item.text})
        if isinstance(item, ToolCallStart):
            out += self._begin({"type": "tool_use", "id": item.id, "name": item.name, "input": {}})
            self._open_call = item.index
            return out
        if isinstance(item, ToolCallArguments):
            if self._open_call != item.index:
                raise ValueError(f"tool call {item.index}: arguments arrived while it is not the open block "
                                 "(Anthropic's blocks are sequential)")
            if not item.fragment:
                return out
            return out + self._delta({"type": "input_json_delta", "partial_json": item.fragment})
        raise TypeError(f"not a StreamDelta: {type(item).__name__}")

    def finish(self, stop_reason: AnthropicStopReason, output_tokens: int, stop_sequence: str | None = None) -> bytes:
        """Closes the open block, then `message_delta` and `message_stop`."""
        if self._finished:
            raise RuntimeError("AnthropicStreamEncoder: finished twice")
        out = self.start() + self._close()
        self._finished = True
        out += typed_sse("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": stop_reason.value, "stop_sequence": stop_sequence},
                                           "usage": {"output_tokens": output_tokens}})
        return out + typed_sse("message_stop", {"type": "message_stop"})
