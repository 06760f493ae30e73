"""Anthropic Messages request -> `ChatSpec`, or an `APIError(400)` naming the field this server cannot honour.

How Anthropic's conversation maps onto chat-template messages:

* `system` (a string, or text blocks joined by a blank line) becomes the first message, role system;
* a user turn's `tool_result` blocks become `tool` messages (in block order, among the turn's text), its text
  blocks (joined by a blank line) a user message; a result with `is_error` reads "Error: <content>";
* an assistant turn becomes one assistant message: its text blocks joined as the model wrote them (no separator),
  its `tool_use` blocks as `tool_calls` with the input as a mapping;
* a final assistant turn without tool calls is a prefill: the completion continues it (`continue_final_message`).

Refused (they would change the answer): image, document, thinking and other non-text blocks; server tools (a
`type` other than "custom"); `thinking` of type "enabled" (a text model cannot think on a budget).
"""

from __future__ import annotations

from typing import Any, Union

from cortexstream.server.anthropic_protocol import (
    AnthropicCountTokensRequest, AnthropicMessage, AnthropicMessagesRequest, TextBlock, ToolResultBlock,
    ToolUseBlock,
)
from cortexstream.server.chat_spec import ChatSpec, template_tool_call
from cortexstream.server.errors import APIError
from cortexstream.server.protocol import MAX_STOP_STRINGS
from cortexstream.server.tool_types import FunctionTool, ToolChoice, ToolChoiceMode
from cortexstream.server.wire import as_api_error, bad_request, refuse_unknown_fields

AnthropicRequest = Union[AnthropicMessagesRequest, AnthropicCountTokensRequest]
THINKING_ACCEPTED = ("disabled", "adaptive")  # adaptive: the model may decide not to think, which is what it does
BLOCK_SEPARATOR = "\n\n"  # between the text blocks of a system prompt or a user turn
TOOL_ERROR_PREFIX = "Error: "


def _text_of(blocks: list[Any], where: str, separator: str) -> str:
    texts = []
    for index, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise _unsupported_block(block, f"{where}[{index}]")
        texts.append(block.text)
    return separator.join(texts)


def _unsupported_block(block: Any, where: str) -> APIError:
    return bad_request(f"{where}.type", f"{block.type!r} blocks are not supported by this server (a text model: "
                                        "text, tool_use and tool_result blocks only)")


def _user_turn(message: AnthropicMessage, where: str, call_ids: set[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    texts: list[str] = []

    def flush() -> None:
        if texts:
            out.append({"role": "user", "content": BLOCK_SEPARATOR.join(texts)})
            texts.clear()

    for index, block in enumerate(message.content):
        here = f"{where}.content[{index}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolResultBlock):
            if block.tool_use_id not in call_ids:
                raise bad_request(f"{here}.tool_use_id", f"no earlier tool_use block has the id {block.tool_use_id!r}")
            content = block.content if isinstance(block.content, str) else \
                _text_of(block.content, f"{here}.content", BLOCK_SEPARATOR)
            flush()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": TOOL_ERROR_PREFIX + content if block.is_error else content})
        elif isinstance(block, ToolUseBlock):
            raise bad_request(f"{here}.type", "tool_use blocks belong in assistant turns")
        else:
            raise _unsupported_block(block, here)
    flush()
    return out


def _assistant_turn(message: AnthropicMessage, where: str, call_ids: set[str]) -> dict[str, Any]:
    texts: list[str] = []
    calls = []
    for index, block in enumerate(message.content):
        here = f"{where}.content[{index}]"
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            call_ids.add(block.id)
            calls.append(template_tool_call(block.id, block.name, block.input))
        elif isinstance(block, ToolResultBlock):
            raise bad_request(f"{here}.type", "tool_result blocks belong in user turns")
        else:
            raise _unsupported_block(block, here)
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return turn


def anthropic_messages(request: AnthropicRequest) -> list[dict[str, Any]]:
    """The conversation in chat-template form (system prompt first)."""
    out: list[dict[str, Any]] = []
    system = request.system if isinstance(request.system, str) or request.system is None else \
        _text_of(request.system, "system", BLOCK_SEPARATOR)
    if system:
        out.append({"role": "system", "content": system})
    call_ids: set[str] = set()
    for index, message in enumerate(request.messages):
        where = f"messages[{index}]"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif not message.content:
            raise bad_request(f"{where}.content", "at least one content block")
        elif message.role == "assistant":
            out.append(_assistant_turn(message, where, call_ids))
        elif message.role == "user":
            out.extend(_user_turn(message, where, call_ids))
        else:
            out.append({"role": "system", "content": _text_of(message.content, f"{where}.content", BLOCK_SEPARATOR)})
    return out


def _tools(request: AnthropicRequest) -> tuple[FunctionTool, ...]:
    tools = []
    for index, tool in enumerate(request.tools or ()):
        if tool.type not in (None, "custom"):
            raise bad_request(f"tools[{index}].type", f"server tool {tool.type!r} is not supported by this server "
                                                      "(custom tools only: name, description, input_schema)")
        if tool.input_schema is None:
            raise bad_request(f"tools[{index}].input_schema", "required for a custom tool")
        tools.append(as_api_error(lambda t=tool: FunctionTool(t.name, t.description, t.input_schema, t.strict),
                                  f"tools[{index}]"))
    return tuple(tools)


def _tool_choice(request: AnthropicRequest, tools: tuple[FunctionTool, ...]) -> tuple[ToolChoice, bool]:
    choice = request.tool_choice
    if choice is None:
        return ToolChoice(), True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request("tool_choice.name", "required when tool_choice.type is 'tool'")
        if choice.name not in {tool.name for tool in tools}:
            raise bad_request("tool_choice.name", f"no tool in `tools` is named {choice.name!r}")
        return ToolChoice(ToolChoiceMode.NAMED, choice.name), parallel
    if choice.name is not None:
        raise bad_request("tool_choice.name", f"only goes with tool_choice.type 'tool', not {choice.type!r}")
    if choice.type == "any" and not tools:
        raise bad_request("tool_choice.type", "'any' needs at least one tool in `tools`")
    mode = {"auto": ToolChoiceMode.AUTO, "any": ToolChoiceMode.REQUIRED, "none": ToolChoiceMode.NONE}[choice.type]
    return ToolChoice(mode), parallel


def _check_thinking(request: AnthropicRequest) -> None:
    if request.thinking is not None and request.thinking.type not in THINKING_ACCEPTED:
        raise bad_request("thinking.type", f"{request.thinking.type!r} is not supported by this server (a model "
                                           f"without extended thinking; accepted: {', '.join(THINKING_ACCEPTED)})")


def _stops(request: AnthropicMessagesRequest) -> tuple[str, ...]:
    stops = tuple(request.stop_sequences or ())
    if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
        raise bad_request("stop_sequences", f"at most {MAX_STOP_STRINGS} non-empty strings")
    return stops


def anthropic_to_chat(request: AnthropicRequest) -> ChatSpec:
    """The ChatSpec of a messages request, or of a count_tokens request (then without sampling fields)."""
    _check_thinking(request)
    tools = _tools(request)
    choice, parallel = _tool_choice(request, tools)
    messages = anthropic_messages(request)
    refuse_unknown_fields(request)
    last = messages[-1]
    if last["role"] == "assistant" and "tool_calls" in last:
        raise bad_request(f"messages[{len(request.messages) - 1}]",
                          "a final assistant turn with tool_use blocks needs a user turn with their tool_result")
    fmt = request.output_config.format if request.output_config is not None else None
    sampling: dict[str, Any] = {}
    if isinstance(request, AnthropicMessagesRequest):
        sampling = {"max_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
                    "top_k": request.top_k, "stop": _stops(request), "stream": request.stream}
    return as_api_error(lambda: ChatSpec(
        messages=messages, tools=tools, tool_choice=choice, parallel_tool_calls=parallel,
        json_schema=fmt.schema_ if fmt is not None else None, json_schema_strict=fmt is not None,
        model=request.model, continue_final_message=last["role"] == "assistant", **sampling))
