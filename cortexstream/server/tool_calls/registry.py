"""Which tool-call format a model writes, read from its chat template, and the parser for it.

The built-in families are `ToolFamily` members; `ToolParserRegistry` holds them and any a user registers (a
user family is named by a string). Detection reads the chat template, which renders past tool calls in the
format the model was trained to write: the markers are specific enough to tell the families apart. The model
type is a fallback for a model without a template. A registry is an ordinary object: build one with
`default_registry()` and register more on it; nothing here is shared process-wide.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Iterable, Union

from cortexstream.server.tool_calls.hermes import HermesToolParser
from cortexstream.server.tool_calls.llama3 import Llama3ToolParser
from cortexstream.server.tool_calls.mistral import MistralToolParser
from cortexstream.server.tool_calls.parser import ToolCallParser


class ToolFamily(enum.Enum):
    HERMES = "hermes"  # <tool_call>{"name", "arguments"}</tool_call>: Hermes, Qwen 2.5 / 3
    LLAMA3 = "llama3"  # {"name", "parameters"} as the message, maybe after <|python_tag|>: Llama 3.1-3.3
    MISTRAL = "mistral"  # [TOOL_CALLS][{"name", "arguments"}, ...]: Mistral 7B v0.3, Mixtral, Nemo
    MISTRAL_ARGS = "mistral_args"  # [TOOL_CALLS]name[ARGS]{...}: Mistral Small 3.2, Devstral, Magistral


FamilyKey = Union[ToolFamily, str]  # a built-in family, or the name a user registered one under
Detector = Callable[[Union[str, None], Union[str, None]], bool]  # (chat_template, model_type) -> is it this one

_LLAMA_HEADER = "<|start_header_id|>"
# Model types whose models write one family, for a model loaded without a chat template.
_MODEL_TYPES = {
    "qwen2": ToolFamily.HERMES, "qwen2_moe": ToolFamily.HERMES, "qwen3": ToolFamily.HERMES,
    "qwen3_moe": ToolFamily.HERMES, "mistral": ToolFamily.MISTRAL, "mixtral": ToolFamily.MISTRAL,
}


def detect_family(chat_template: str | None, model_type: str | None = None) -> ToolFamily | None:
    """The built-in family a model writes, from its chat template (or, without one, its model type)."""
    if chat_template is None:
        return _MODEL_TYPES.get((model_type or "").lower())
    if "[TOOL_CALLS]" in chat_template:
        return ToolFamily.MISTRAL_ARGS if "[ARGS]" in chat_template else ToolFamily.MISTRAL
    if "<tool_call>" in chat_template:
        return ToolFamily.HERMES
    if "<|python_tag|>" in chat_template or ("parameters" in chat_template and _LLAMA_HEADER in chat_template
                                             and "tool" in chat_template):
        return ToolFamily.LLAMA3
    return None


def parser_for(family: ToolFamily, known_tools: Iterable[str] = ()) -> ToolCallParser:
    """A new parser for one completion in a built-in family's format; `known_tools` (the offered tools' names)
    lets the Hermes parser read calls written without their markers."""
    if family is ToolFamily.HERMES:
        return HermesToolParser(known_tools=known_tools)
    if family is ToolFamily.LLAMA3:
        return Llama3ToolParser()
    if family in (ToolFamily.MISTRAL, ToolFamily.MISTRAL_ARGS):
        return MistralToolParser()  # reads both of Mistral's forms
    raise ValueError(f"family: {family!r} is not a built-in ToolFamily")


@dataclass(frozen=True)
class RegisteredFamily:
    name: str
    parser_factory: Callable[[], ToolCallParser]
    detect: Detector

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("name: a tool family's name must be a non-empty string")
        if not callable(self.parser_factory):
            raise ValueError(f"parser_factory: must be callable (family {self.name!r})")
        if not callable(self.detect):
            raise ValueError(f"detect: must be callable (family {self.name!r})")


class ToolParserRegistry:
    """The built-in families plus those registered on this instance; a registered family is detected first."""

    def __init__(self) -> None:
        self._registered: dict[str, RegisteredFamily] = {}

    def register_family(self, name: str, parser_factory: Callable[[], ToolCallParser], detect: Detector) -> None:
        """Add a family: `parser_factory()` makes a parser per completion; `detect(chat_template, model_type)`
        says whether a model writes this format."""
        entry = RegisteredFamily(name, parser_factory, detect)
        if name in {family.value for family in ToolFamily}:
            raise ValueError(f"name: {name!r} is a built-in tool family (ToolFamily.{ToolFamily(name).name})")
        if name in self._registered:
            raise ValueError(f"name: a tool family {name!r} is already registered")
        self._registered[name] = entry

    def families(self) -> list[FamilyKey]:
        """Every family this registry knows, registered ones first (the order detection tries them in)."""
        return [*self._registered, *ToolFamily]

    def detect_family(self, chat_template: str | None, model_type: str | None = None) -> FamilyKey | None:
        for entry in self._registered.values():
            if entry.detect(chat_template, model_type):
                return entry.name
        return detect_family(chat_template, model_type)

    def parser_for(self, family: FamilyKey, known_tools: Iterable[str] = ()) -> ToolCallParser:
        """A parser for one completion; a registered family's factory takes no arguments (`known_tools` is for
        the built-in families)."""
        if isinstance(family, ToolFamily):
            return parser_for(family, known_tools)
        entry = self._registered.get(family)
        if entry is None:
            raise ValueError(f"family: no tool family {family!r}; known: "
                             f"{', '.join(str(f.value if isinstance(f, ToolFamily) else f) for f in self.families())}")
        parser = entry.parser_factory()
        if not isinstance(parser, ToolCallParser):
            raise TypeError(f"parser_factory of tool family {family!r} returned {type(parser).__name__}, "
                            "not a ToolCallParser")
        return parser


def default_registry() -> ToolParserRegistry:
    """A registry with the built-in families only."""
    return ToolParserRegistry()
