"""The server's own words for tools and what a completion streams, shared by the three chat-like APIs.

`/v1/chat/completions`, `/v1/responses` and `/v1/messages` each translate their request's tools into
`FunctionTool`s and a `ToolChoice`, and each renders the same stream of `TextDelta`, `ToolCallStart` and
`ToolCallArguments` (what a tool-call parser makes of a completion's text) in its own wire format.
"""

from __future__ import annotations

import enum
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Union


@dataclass(frozen=True)
class FunctionTool:
    """A function the model may call: its JSON-schema `parameters` are what a constrained call must match."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("tool name: must be a non-empty string")
        if not isinstance(self.parameters, dict):
            raise ValueError(f"tool {self.name!r} parameters: must be a JSON-schema object")

    def template_form(self) -> dict[str, Any]:
        """The OpenAI-style dict chat templates expect in their `tools` argument."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def __hash__(self) -> int:
        return hash((self.name, self.description, json.dumps(self.parameters, sort_keys=True), self.strict))


class ToolChoiceMode(enum.Enum):
    AUTO = "auto"  # the model decides; calls are parsed from its text
    NONE = "none"  # no call: tools are still shown to the template, the output is plain text
    REQUIRED = "required"  # at least one call, enforced by a grammar
    NAMED = "named"  # exactly this function, enforced by a grammar


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None  # the function, for NAMED

    def __post_init__(self) -> None:
        if (self.mode is ToolChoiceMode.NAMED) != (self.name is not None):
            raise ValueError("tool_choice: a function name goes with mode NAMED, and only with it")


@dataclass(frozen=True)
class ToolCall:
    """A complete call: `arguments` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str


def new_call_id(prefix: str = "call") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


# --- what a completion's text turns into, in order --------------------------------------------------------------
@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int  # 0, 1, ... within this completion
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArguments:
    index: int
    fragment: str  # the next piece of the arguments' JSON text


StreamDelta = Union[TextDelta, ToolCallStart, ToolCallArguments]
