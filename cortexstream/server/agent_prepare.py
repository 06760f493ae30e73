"""A `ChatSpec` -> the prompt tokens (chat template rendered with the tools), the grammar the output must follow,
and whether its text is parsed for tool calls; shared by /v1/chat/completions, /v1/responses and /v1/messages.

Tools reach the model through its own chat template's `tools` argument, and its calls are read by the parser of
the family that template writes (`ToolSupport`, found once per server). Choices:
- `tool_choice` AUTO: the text is parsed for calls; NONE: the tools are left out of the prompt and nothing is
  parsed, so the answer is text; REQUIRED / NAMED: a grammar makes the completion exactly one call (or one or more
  when `parallel_tool_calls`) with arguments matching the tool's schema.
- Tools on a model whose template renders none (or whose call format no parser knows) are a 400: sent anyway, they
  would be dropped without a word.
- `response_format` json_schema / json_object: a grammar; with `tool_choice` REQUIRED / NAMED it is a 400 (one
  completion cannot be both a call and a JSON answer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cortexstream.engine.prompt import chat_tokens
from cortexstream.errors import InvalidArgumentError
from cortexstream.grammar.spec import GrammarSpec
from cortexstream.server.chat_spec import ChatSpec
from cortexstream.server.errors import APIError
from cortexstream.server.tool_calls import (FamilyKey, ToolCallParser, ToolFamily, ToolParserRegistry,
                                            default_registry, special_marker_ids, tool_call_grammar)
from cortexstream.server.tool_types import ToolChoiceMode


@dataclass(frozen=True)
class ToolSupport:
    """Which tool-call format this model writes (None: its template renders no tools)."""

    family: FamilyKey | None
    special_tokens: dict[str, int]
    registry: ToolParserRegistry

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, registry: ToolParserRegistry | None = None) -> "ToolSupport":
        registry = registry or default_registry()
        template = getattr(tokenizer, "chat_template", None)
        family = registry.detect_family(template if isinstance(template, str) else None)
        special: dict[str, int] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if isinstance(family, ToolFamily) and backend is not None:
            special = special_marker_ids(family, backend.to_str())
        return cls(family, special, registry)

    def parser(self, known_tools: tuple[str, ...] = ()) -> ToolCallParser:
        """A parser for one completion; `known_tools`: the names of the tools the request offered."""
        return self.registry.parser_for(self.family, known_tools)


@dataclass(frozen=True)
class PreparedTurn:
    tokens: list[int]
    grammar: GrammarSpec | None
    tool_names: tuple[str, ...] = ()  # the offered tools when the text is read for calls (none: it is not)

    @property
    def parse_tools(self) -> bool:
        """Whether the completion's text is read for tool calls (a parser may read untagged calls to them)."""
        return bool(self.tool_names)


def render(tokenizer: Any, spec: ChatSpec, with_tools: bool) -> list[int]:
    try:
        return chat_tokens(tokenizer, spec.messages, spec.template_tools() if with_tools else None,
                           spec.continue_final_message)
    except Exception as exc:  # noqa: BLE001 - a template that cannot render these messages is the client's input
        raise APIError(400, f"messages: the chat template failed: {type(exc).__name__}: {exc}",
                       param="messages") from exc


def _checked(spec: GrammarSpec) -> GrammarSpec:
    try:
        spec.check()
    except InvalidArgumentError as exc:
        raise APIError(400, str(exc), param=spec.name, code="invalid_schema") from exc
    return spec


def output_grammar(spec: ChatSpec, support: ToolSupport) -> GrammarSpec | None:
    mode = spec.tool_choice.mode
    constrained_call = bool(spec.tools) and mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.NAMED)
    if constrained_call and (spec.json_schema is not None or spec.json_object):
        raise APIError(400, "response_format: cannot be combined with tool_choice 'required' or a named function",
                       param="response_format")
    if spec.json_schema is not None:
        return _checked(GrammarSpec.json_schema(spec.json_schema))
    if spec.json_object:
        return _checked(GrammarSpec.json_object())
    if not constrained_call:
        return None
    if not isinstance(support.family, ToolFamily):
        raise APIError(400, f"tool_choice: {mode.value} calls are enforced by a grammar for the built-in tool "
                            f"families only; this model's is {support.family!r}", param="tool_choice")
    try:
        grammar = tool_call_grammar(support.family, list(spec.tools), spec.tool_choice, spec.parallel_tool_calls,
                                    support.special_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tools", code="invalid_schema") from exc
    return _checked(GrammarSpec.llguidance(grammar, name="tools"))


def prepare_turn(spec: ChatSpec, tokenizer: Any, support: ToolSupport) -> PreparedTurn:
    use_tools = bool(spec.tools) and spec.tool_choice.mode is not ToolChoiceMode.NONE
    if use_tools and support.family is None:
        raise APIError(400, "tools: this model's chat template renders no tools in a format this server can "
                            "parse (Hermes/Qwen, Llama 3, Mistral, or a registered family)", param="tools")
    grammar = output_grammar(spec, support)
    tokens = render(tokenizer, spec, with_tools=use_tools)
    names = tuple(tool.name for tool in spec.tools) if use_tools else ()
    return PreparedTurn(tokens, grammar, tool_names=names)
