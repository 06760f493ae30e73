"""Responses API request (+ the stored conversation of `previous_response_id`) -> `ChatSpec`, or an
`APIError(400)` naming the field this server cannot honour.

How the input maps onto chat-template messages:

* `instructions` becomes the first message, role system; it is not part of the conversation a later request
  continues (the Responses API does not carry instructions over `previous_response_id`);
* the previous conversation comes next, then the input: a string is one user message; message items keep their
  role (developer reads as system) with their text parts joined; `function_call` items become `tool_calls` of an
  assistant message (consecutive calls, and calls right after an assistant message, share one), their JSON
  arguments parsed into a mapping; `function_call_output` items become `tool` messages.

Refused: non-function tools and tool choices, non-text parts (images, files), other input items (reasoning,
item references, built-in tools' calls), `truncation: "auto"`, a `text.verbosity` other than "medium".
"""

from __future__ import annotations

from typing import Any, Optional

from cortexstream.server.chat_spec import ChatSpec, parse_arguments, template_tool_call
from cortexstream.server.errors import APIError
from cortexstream.server.openai_responses_protocol import (
    TRUNCATION_DEFAULT, VERBOSITY_DEFAULT, FunctionCallItem, FunctionCallOutputItem, MessageItem, ResponsesRequest,
    TextPart,
)
from cortexstream.server.tool_types import FunctionTool, ToolChoice, ToolChoiceMode
from cortexstream.server.wire import as_api_error, bad_request, refuse_unknown_fields

_MODES = {"auto": ToolChoiceMode.AUTO, "none": ToolChoiceMode.NONE, "required": ToolChoiceMode.REQUIRED}


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, TextPart):
            raise bad_request(f"{where}[{index}].type", f"{part.type!r} parts are not supported by this server "
                                                        "(a text model: input_text and output_text only)")
        texts.append(part.text)
    return "".join(texts)


def _call_ids(messages: list[dict[str, Any]]) -> set[str]:
    return {call["id"] for m in messages for call in m.get("tool_calls", ())}


def responses_conversation(request: ResponsesRequest,
                           previous: Optional[list[dict[str, Any]]] = None) -> list[dict[str, Any]]:
    """The previous conversation followed by this request's input, in chat-template form, without `instructions`:
    what a response store keeps (with the answer appended) for a later `previous_response_id`."""
    if request.previous_response_id is not None and previous is None:
        raise APIError(400, f"previous_response_id: no stored response has the id {request.previous_response_id!r}",
                       param="previous_response_id", code="previous_response_not_found")
    out = [dict(message) for message in previous or ()]
    if isinstance(request.input, str):
        out.append({"role": "user", "content": request.input})
        return out
    call_ids = _call_ids(out)
    for index, item in enumerate(request.input):
        where = f"input[{index}]"
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content, f"{where}.content")})
        elif isinstance(item, FunctionCallItem):
            arguments = as_api_error(lambda i=item, w=where: parse_arguments(i.arguments, f"{w}.arguments"),
                                     f"{where}.arguments")
            call = template_tool_call(item.call_id, item.name, arguments)
            call_ids.add(item.call_id)
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last["tool_calls"] = [*last.get("tool_calls", ()), call]
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in call_ids:
                raise bad_request(f"{where}.call_id", f"no earlier function_call has the call_id {item.call_id!r}")
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _text(item.output, f"{where}.output")})
        else:
            raise bad_request(f"{where}.type", f"{item.type!r} input items are not supported by this server "
                                               "(message, function_call and function_call_output only)")
    return out


def _tools(request: ResponsesRequest) -> tuple[FunctionTool, ...]:
    tools = []
    for index, tool in enumerate(request.tools or ()):
        where = f"tools[{index}]"
        if tool.type != "function":
            raise bad_request(f"{where}.type", f"{tool.type!r} tools are not supported by this server (function "
                                               "tools only)")
        if tool.name is None:
            raise bad_request(f"{where}.name", "required for a function tool")
        parameters = tool.parameters if tool.parameters is not None else {"type": "object", "properties": {}}
        strict = True if tool.strict is None else tool.strict
        tools.append(as_api_error(lambda t=tool, p=parameters, s=strict: FunctionTool(
            t.name, t.description or "", p, s), where))
    return tuple(tools)


def _tool_choice(request: ResponsesRequest, tools: tuple[FunctionTool, ...]) -> ToolChoice:
    choice = request.tool_choice
    if choice is None:
        return ToolChoice()
    if isinstance(choice, str):
        if choice == "required" and not tools:
            raise bad_request("tool_choice", "'required' needs at least one function in `tools`")
        return ToolChoice(_MODES[choice])
    if choice.type != "function":
        raise bad_request("tool_choice.type", f"{choice.type!r} is not supported by this server (\"auto\", "
                                              "\"none\", \"required\" or {\"type\": \"function\", \"name\"} only)")
    if choice.name is None:
        raise bad_request("tool_choice.name", "required for a function tool choice")
    if choice.name not in {tool.name for tool in tools}:
        raise bad_request("tool_choice.name", f"no function in `tools` is named {choice.name!r}")
    return ToolChoice(ToolChoiceMode.NAMED, choice.name)


def _format(request: ResponsesRequest) -> dict[str, Any]:
    text = request.text
    if text is not None and text.verbosity not in (None, VERBOSITY_DEFAULT):
        raise bad_request("text.verbosity", f"only {VERBOSITY_DEFAULT!r} is supported by this server")
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return {}
    if fmt.type == "json_object":
        return {"json_object": True}
    if fmt.schema_ is None:
        raise bad_request("text.format.schema", "required when text.format.type is 'json_schema'")
    return {"json_schema": fmt.schema_, "json_schema_strict": bool(fmt.strict)}


def responses_to_chat(request: ResponsesRequest, previous: Optional[list[dict[str, Any]]] = None) -> ChatSpec:
    """The ChatSpec of a Responses request; `previous` is the stored conversation of its `previous_response_id`
    (None when there is none, or none stored: then a request that names one gets a 400)."""
    if request.truncation not in (None, TRUNCATION_DEFAULT):
        raise bad_request("truncation", f"only {TRUNCATION_DEFAULT!r} is supported by this server (a prompt "
                                        "that does not fit is refused, not cut)")
    tools = _tools(request)
    choice = _tool_choice(request, tools)
    structured = _format(request)
    conversation = responses_conversation(request, previous)
    refuse_unknown_fields(request)
    if not conversation:
        raise bad_request("input", "at least one input item")
    instructions = [{"role": "system", "content": request.instructions}] if request.instructions else []
    return as_api_error(lambda: ChatSpec(
        messages=instructions + conversation, tools=tools, tool_choice=choice,
        parallel_tool_calls=True if request.parallel_tool_calls is None else request.parallel_tool_calls,
        max_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p,
        top_k=request.top_k, seed=request.seed, stream=request.stream, model=request.model, **structured))
