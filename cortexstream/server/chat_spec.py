"""`ChatSpec`: the one request every chat-like API (`/v1/messages`, `/v1/responses`) translates into.

Its `messages` are in OpenAI chat form, as HF chat templates take them: roles system / user / assistant / tool;
an assistant turn may carry `tool_calls=[{"id", "type": "function", "function": {"name", "arguments": {...}}}]`
with the arguments as a *mapping* (Qwen's templates iterate over them), and a tool turn carries `tool_call_id` and
`content`. Sampling values are as the client sent them (None = the server's default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from cortexstream.server.tool_types import FunctionTool, ToolCall, ToolChoice, ToolChoiceMode

ROLES = ("system", "user", "assistant", "tool")


def template_tool_call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """One entry of an assistant turn's `tool_calls`, in the form chat templates iterate."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_arguments(text: str, where: str) -> dict[str, Any]:
    """A call's arguments JSON text as the object it must be; ValueError naming `where` otherwise."""
    try:
        value = json.loads(text)
    except (TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: the arguments are not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{where}: the arguments must be a JSON object, not {type(value).__name__}")
    return value


def assistant_turn(text: str, tool_calls: list[ToolCall]) -> dict[str, Any]:
    """The chat-form message of a completion (what a conversation store appends after the request's messages)."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = [template_tool_call(c.id, c.name, parse_arguments(c.arguments, f"tool call {c.id}"))
                                 for c in tool_calls]
    return message


def _check_message(index: int, message: Any) -> None:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in ROLES:
        raise ValueError(f"{where}: must be a dict whose role is one of {ROLES}")
    if not isinstance(message.get("content"), str):
        raise ValueError(f"{where}.content: must be a string")
    if message["role"] == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise ValueError(f"{where}.tool_call_id: a tool message names the call it answers")
    for call in message.get("tool_calls", ()):
        if message["role"] != "assistant" or not isinstance(call.get("function", {}).get("arguments"), dict):
            raise ValueError(f"{where}.tool_calls: only assistant turns carry calls, arguments as a mapping")


@dataclass(frozen=True)
class ChatSpec:
    messages: list[dict[str, Any]]
    tools: tuple[FunctionTool, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    json_schema: dict[str, Any] | None = None  # structured output: the text must match this schema
    json_schema_strict: bool = False
    json_object: bool = False  # JSON mode: the text must be some JSON object
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    model: str | None = None
    # The last message is an assistant turn to continue (Anthropic's prefill), not a finished one: render it
    # with `continue_final_message=True` and no generation prompt.
    continue_final_message: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError("messages: at least one message")
        for index, message in enumerate(self.messages):
            _check_message(index, message)
        names = [tool.name for tool in self.tools]
        if len(set(names)) != len(names):
            raise ValueError("tools: tool names must be unique")
        mode = self.tool_choice.mode
        if mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED) and not self.tools:
            raise ValueError(f"tool_choice: {mode.value} needs at least one tool")
        if mode is ToolChoiceMode.NAMED and self.tool_choice.name not in names:
            raise ValueError(f"tool_choice: no tool is named {self.tool_choice.name!r}")
        if self.json_schema is not None and self.json_object:
            raise ValueError("json_schema: a schema and plain JSON mode exclude each other")
        if self.json_schema is not None and not isinstance(self.json_schema, dict):
            raise ValueError("json_schema: must be a JSON-schema object")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError("max_tokens: must be at least 1")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop: stop strings must be non-empty strings")
        if self.continue_final_message and self.messages[-1]["role"] != "assistant":
            raise ValueError("continue_final_message: the last message must be an assistant turn")

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` argument for a chat template (None without tools)."""
        return [tool.template_form() for tool in self.tools] or None
