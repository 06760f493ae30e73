"""Responses API response shapes: the `response` object and its typed SSE event stream.

A stream is `response.created`, `response.in_progress`, then per output item `response.output_item.added`, its
content (`response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done` for a message; `response.function_call_arguments.delta`..., `.done` for a function
call) and `response.output_item.done`; last `response.completed` (or `response.incomplete` when
`max_output_tokens` cut the answer). Every event carries a `sequence_number` from 0; each is sent as
`event: <type>\\ndata: <json>\\n\\n`.
"""

from __future__ import annotations

import enum
import time
from typing import Any, Optional

from cortexstream.engine.finish_reason import FinishReason
from cortexstream.server.errors import APIError
from cortexstream.server.openai_responses_protocol import ResponsesRequest
from cortexstream.server.tool_types import ToolCall, new_call_id


class ResponsesStatus(str, enum.Enum):
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"  # cut by max_output_tokens


def responses_status(finish_reason: FinishReason) -> ResponsesStatus:
    """The status of a successfully finished response (a failed one is an error)."""
    if finish_reason is FinishReason.LENGTH:
        return ResponsesStatus.INCOMPLETE
    if finish_reason is not FinishReason.STOP:
        raise ValueError(f"finish_reason: {finish_reason} is a failure, not a response status")
    return ResponsesStatus.COMPLETED


def new_response_id() -> str:
    return new_call_id("resp")


def request_echo(request: ResponsesRequest) -> dict[str, Any]:
    """The fields of a `response` object that repeat its (translated, so supported) request."""
    tools = [{"type": "function", "name": t.name, "description": t.description,
              "parameters": t.parameters if t.parameters is not None else {"type": "object", "properties": {}},
              "strict": True if t.strict is None else t.strict} for t in request.tools or ()]
    choice: Any = request.tool_choice if request.tool_choice is not None else "auto"
    if not isinstance(choice, str):
        choice = {"type": "function", "name": choice.name}
    fmt = request.text.format if request.text is not None else None
    text_format = fmt.model_dump(by_alias=True, exclude_none=True) if fmt is not None else {"type": "text"}
    return {
        "instructions": request.instructions, "metadata": request.metadata or {},
        "parallel_tool_calls": True if request.parallel_tool_calls is None else request.parallel_tool_calls,
        "temperature": request.temperature, "top_p": request.top_p, "tool_choice": choice, "tools": tools,
        "text": {"format": text_format}, "max_output_tokens": request.max_output_tokens,
        "previous_response_id": request.previous_response_id, "truncation": "disabled",
        "store": True if request.store is None else request.store, "user": request.user,
    }


def responses_usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    # cache_write_tokens: this server does not count tokens written to its prefix cache, so it reports none.
    return {"input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def output_message(item_id: str, text: Optional[str], status: ResponsesStatus) -> dict[str, Any]:
    """A message output item; `text=None` gives the empty item a stream announces before its first part."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {"type": "message", "id": item_id, "status": status.value, "role": "assistant", "content": content}


def output_function_call(item_id: str, call: ToolCall, status: ResponsesStatus) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": status.value}


def response_object(response_id: str, model: str, created_at: int, echo: dict[str, Any],
                    output: list[dict[str, Any]], status: ResponsesStatus,
                    usage: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": response_id, "object": "response", "created_at": created_at, "model": model,
                            "status": status.value, "error": None, "incomplete_details": None, "output": output,
                            "usage": usage, **echo}
    if status is ResponsesStatus.INCOMPLETE:
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


def responses_body(response_id: str, model: str, echo: dict[str, Any], text: str, tool_calls: list[ToolCall],
                   status: ResponsesStatus, input_tokens: int, output_tokens: int, cached_tokens: int = 0,
                   created_at: Optional[int] = None) -> dict[str, Any]:
    """A whole (non-streamed) response: a message item when there is text or nothing else, then the calls; the
    last item is incomplete when the response is."""
    items: list[dict[str, Any]] = []
    if text or not tool_calls:
        items.append(output_message(new_call_id("msg"), text, ResponsesStatus.COMPLETED))
    items += [output_function_call(new_call_id("fc"), call, ResponsesStatus.COMPLETED) for call in tool_calls]
    if status is ResponsesStatus.INCOMPLETE:
        items[-1]["status"] = ResponsesStatus.INCOMPLETE.value
    return response_object(response_id, model, int(time.time()) if created_at is None else created_at, echo, items,
                           status, responses_usage(input_tokens, output_tokens, cached_tokens))


def responses_error_event(exc: APIError, sequence_number: int) -> dict[str, Any]:
    """The payload of an `error` event, for a failure after the stream has started."""
    return {"type": "error", "code": exc.code, "message": exc.message, "param": exc.param,
            "sequence_number": sequence_number}
