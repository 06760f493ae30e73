"""`ResponsesStreamEncoder`: one completion's `StreamDelta`s as the Responses API's typed SSE events.

Text opens a message item (`output_item.added`, `content_part.added`) and streams as `output_text.delta`; a
`ToolCallStart` closes the open item and opens a function_call item whose arguments stream as
`function_call_arguments.delta`. Closing an item sends its `.done` events. The event shapes are in
openai_responses_events.py's module docstring.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from cortexstream.server.errors import APIError
from cortexstream.server.openai_responses_events import (
    ResponsesStatus, output_function_call, output_message, response_object, responses_error_event, responses_usage,
)
from cortexstream.server.tool_types import StreamDelta, TextDelta, ToolCall, ToolCallArguments, ToolCallStart, \
    new_call_id
from cortexstream.server.wire import typed_sse


class ResponsesStreamEncoder:
    """Feed it `StreamDelta`s, get SSE bytes; `text`, `tool_calls` and `output` are what it has sent so far."""

    def __init__(self, response_id: str, model: str, echo: dict[str, Any], created_at: Optional[int] = None) -> None:
        self.response_id = response_id
        self.model = model
        self.echo = echo
        self.created_at = int(time.time()) if created_at is None else created_at
        self.output: list[dict[str, Any]] = []  # closed items, in output order
        self.text = ""  # all output text, across message items
        self.tool_calls: list[ToolCall] = []
        self._sequence = 0
        self._started = False
        self._finished = False
        self._item: Optional[dict[str, Any]] = None  # the open item
        self._item_text = ""  # the open message item's text
        self._call: Optional[ToolCallStart] = None  # the open function_call item's start
        self._arguments = ""

    # --- framing ------------------------------------------------------------------------------------------------
    def _event(self, event_type: str, **fields: Any) -> bytes:
        payload = {"type": event_type, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return typed_sse(event_type, payload)

    def _response(self, status: ResponsesStatus, usage: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        return response_object(self.response_id, self.model, self.created_at, self.echo, list(self.output), status,
                               usage)

    def start(self) -> bytes:
        """`response.created` and `response.in_progress` (sent by the first `feed` or `finish` if not called)."""
        if self._started:
            return b""
        self._started = True
        return (self._event("response.created", response=self._response(ResponsesStatus.IN_PROGRESS))
                + self._event("response.in_progress", response=self._response(ResponsesStatus.IN_PROGRESS)))

    # --- items --------------------------------------------------------------------------------------------------
    def _open(self, item: dict[str, Any]) -> bytes:
        out = self._close(ResponsesStatus.COMPLETED)
        self._item = item
        return out + self._event("response.output_item.added", output_index=len(self.output), item=item)

    def _close(self, status: ResponsesStatus) -> bytes:
        item, index = self._item, len(self.output)
        if item is None:
            return b""
        if item["type"] == "message":
            part = {"type": "output_text", "text": self._item_text, "annotations": []}
            where = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out = (self._event("response.output_text.done", text=self._item_text, logprobs=[], **where)
                   + self._event("response.content_part.done", part=part, **where))
            done = output_message(item["id"], self._item_text, status)
        else:
            assert self._call is not None
            call = ToolCall(self._call.id, self._call.name, self._arguments)
            self.tool_calls.append(call)
            out = self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                              arguments=self._arguments)
            done = output_function_call(item["id"], call, status)
        self._item, self._item_text, self._call, self._arguments = None, "", None, ""
        self.output.append(done)
        return out + self._event("response.output_item.done", output_index=index, item=done)

    def feed(self, item: StreamDelta) -> bytes:
        if self._finished:
            raise RuntimeError("ResponsesStreamEncoder: feed after finish")
        out = self.start()
        if isinstance(item, TextDelta):
            if not item.text:
                return out
            if self._item is None or self._item["type"] != "message":
                message = output_message(new_call_id("msg"), None, ResponsesStatus.IN_PROGRESS)
                out += self._open(message)
                out += self._event("response.content_part.added", item_id=message["id"],
                                   output_index=len(self.output), content_index=0,
                                   part={"type": "output_text", "text": "", "annotations": []})
            self._item_text += item.text
            self.text += item.text
            return out + self._event("response.output_text.delta", item_id=self._item["id"],
                                     output_index=len(self.output), content_index=0, delta=item.text, logprobs=[])
        if isinstance(item, ToolCallStart):
            out += self._open(output_function_call(new_call_id("fc"), ToolCall(item.id, item.name, ""),
                                                   ResponsesStatus.IN_PROGRESS))
            self._call = item
            return out
        if isinstance(item, ToolCallArguments):
            if self._call is None or self._call.index != item.index:
                raise ValueError(f"tool call {item.index}: arguments arrived while it is not the open item")
            if not item.fragment:
                return out
            self._arguments += item.fragment
            return out + self._event("response.function_call_arguments.delta", item_id=self._item["id"],
                                     output_index=len(self.output), delta=item.fragment)
        raise TypeError(f"not a StreamDelta: {type(item).__name__}")

    def finish(self, status: ResponsesStatus, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> bytes:
        """Closes the open item (incomplete with the response), then `response.completed` / `response.incomplete`
        with the whole response object."""
        if self._finished:
            raise RuntimeError("ResponsesStreamEncoder: finished twice")
        if status is ResponsesStatus.IN_PROGRESS:
            raise ValueError("status: a finished response is completed or incomplete")
        out = self.start() + self._close(status)
        self._finished = True
        final = "response.completed" if status is ResponsesStatus.COMPLETED else "response.incomplete"
        return out + self._event(final, response=self._response(
            status, responses_usage(input_tokens, output_tokens, cached_tokens)))

    def error(self, exc: APIError) -> bytes:
        """An `error` event, for a failure after the stream has started; the stream ends with it."""
        self._finished = True
        payload = responses_error_event(exc, self._sequence)
        self._sequence += 1
        return typed_sse("error", payload)
