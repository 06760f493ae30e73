"""A /v1/chat/completions request -> `ChatSpec` (the form /v1/messages and /v1/responses translate into too), or
an `APIError(400)` naming the field this server cannot honour.

Messages keep their roles (`developer` is rendered as `system`); an assistant message's `tool_calls` carry their
arguments as a mapping (chat templates iterate them), so arguments that are not a JSON object are a 400. Content
parts other than text (images, audio, files) are refused by name: this is a text model.
"""

from __future__ import annotations

from typing import Any

from cortexstream.server.chat_spec import ChatSpec, parse_arguments, template_tool_call
from cortexstream.server.errors import APIError
from cortexstream.server.protocol import ChatCompletionRequest, ChatMessage
from cortexstream.server.tool_types import FunctionTool, ToolChoice, ToolChoiceMode
from cortexstream.server.wire import as_api_error, bad_request, refuse_unknown_fields

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def _content(message: ChatMessage, where: str) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for index, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise bad_request(f"{where}.content[{index}].type", f"{part.type!r} content is not supported by this "
                                                                "server (a text model: text parts only)")
        texts.append(part.text)
    return "".join(texts)


def _message(message: ChatMessage, index: int) -> dict[str, Any]:
    where = f"messages[{index}]"
    out: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                           "content": _content(message, where)}
    if message.tool_calls:
        if message.role != "assistant":
            raise bad_request(f"{where}.tool_calls", "only assistant messages carry tool calls")
        out["tool_calls"] = [
            template_tool_call(call.id, call.function.name,
                               as_api_error(lambda c=call, i=i: parse_arguments(
                                   c.function.arguments, f"{where}.tool_calls[{i}].function.arguments")))
            for i, call in enumerate(message.tool_calls)]
    if message.role == "tool":
        if not message.tool_call_id:
            raise bad_request(f"{where}.tool_call_id", "a tool message must name the call it answers")
        out["tool_call_id"] = message.tool_call_id
    return out


def _tools(request: ChatCompletionRequest) -> tuple[FunctionTool, ...]:
    tools = []
    for index, tool in enumerate(request.tools or ()):
        if tool.type != "function" or tool.function is None:
            raise bad_request(f"tools[{index}].type", f"{tool.type!r} tools are not supported (function tools only)")
        fn = tool.function
        parameters = fn.parameters if fn.parameters is not None else {"type": "object", "properties": {}}
        tools.append(as_api_error(lambda fn=fn, p=parameters: FunctionTool(fn.name, fn.description, p,
                                                                          bool(fn.strict)),
                                  f"tools[{index}].function"))
    return tuple(tools)


def _tool_choice(value: Any) -> ToolChoice:
    if value is None:
        return ToolChoice()
    if isinstance(value, str):
        modes = {m.value: m for m in (ToolChoiceMode.AUTO, ToolChoiceMode.NONE, ToolChoiceMode.REQUIRED)}
        if value not in modes:
            raise bad_request("tool_choice", f"{value!r}: expected 'auto', 'none', 'required' or "
                                             "{'type': 'function', 'function': {'name': ...}}")
        return ToolChoice(modes[value])
    function = value.get("function") if value.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise bad_request("tool_choice", "a named choice is {'type': 'function', 'function': {'name': ...}}")
    return ToolChoice(ToolChoiceMode.NAMED, name)


def _response_format(value: dict[str, Any] | None) -> tuple[dict[str, Any] | None, bool, bool]:
    """(schema, strict, json_object) from OpenAI's `response_format`."""
    if value is None:
        return None, False, False
    kind = value.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request("response_format.type", f"{kind!r}: expected one of {', '.join(RESPONSE_FORMAT_TYPES)}")
    if kind == "text":
        return None, False, False
    if kind == "json_object":
        return None, False, True
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
        raise bad_request("response_format.json_schema.schema", "a json_schema format needs its schema object")
    return spec["schema"], bool(spec.get("strict")), False


def chat_to_spec(request: ChatCompletionRequest) -> ChatSpec:
    refuse_unknown_fields(request)
    messages = [_message(m, i) for i, m in enumerate(request.messages)]
    schema, strict, json_object = _response_format(request.response_format)
    if request.tool_choice is not None and not request.tools:
        raise APIError(400, "tool_choice: given without tools", param="tool_choice")
    return as_api_error(lambda: ChatSpec(
        messages=messages, tools=_tools(request), tool_choice=_tool_choice(request.tool_choice),
        parallel_tool_calls=request.parallel_tool_calls, json_schema=schema, json_schema_strict=strict,
        json_object=json_object, stop=request.stop_strings(), seed=request.seed, model=request.model))
