"""Grammars that make a model write tool calls: llguidance Lark, with each call's arguments as an inline JSON
schema (`%json {...}`), in the format of the model's family.

For `tool_choice` REQUIRED (a call to any of the tools; one or more when calls may be parallel) and NAMED
(exactly that function). The completion is the call(s) and nothing else, written as that family's chat
template renders calls, so the family's parser reads back exactly the calls the grammar allowed: JSON with
`", "` and `": "` separators (what `json.dumps` and the templates' `tojson` write), the call's `name` first,
each call's arguments matching its tool's `parameters` schema.

A marker the tokenizer holds as an added token (Mistral's `[TOOL_CALLS]` and `[ARGS]`, Qwen's `<tool_call>`) never
matches a string literal (llguidance lexes added tokens apart from text): pass such tokens' ids in `special_tokens`
(`special_marker_ids` reads them from the tokenizer's JSON), and the grammar names the token instead.
Schemas are compiled leniently (keywords llguidance does not support are ignored) unless every tool is
`strict`; a schema that still fails is a ValueError naming the tool.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

import llguidance

from cortexstream.server.tool_calls.registry import ToolFamily
from cortexstream.server.tool_types import FunctionTool, ToolChoice, ToolChoiceMode

# What stands between parallel calls (Mistral's are array items, or each behind its own marker).
SEPARATORS = {ToolFamily.HERMES: "\n", ToolFamily.LLAMA3: "; "}
# The markers of each family's calls that a tokenizer may hold as special tokens.
MARKERS = {ToolFamily.HERMES: ("<tool_call>", "</tool_call>"), ToolFamily.LLAMA3: (),
           ToolFamily.MISTRAL: ("[TOOL_CALLS]",), ToolFamily.MISTRAL_ARGS: ("[TOOL_CALLS]", "[ARGS]")}
ARGUMENT_KEY = {ToolFamily.HERMES: "arguments", ToolFamily.LLAMA3: "parameters", ToolFamily.MISTRAL: "arguments"}


def special_marker_ids(family: ToolFamily, tokenizer_json: str) -> dict[str, int]:
    """The family's markers that the tokenizer (its HF `tokenizer.json` text) holds as added tokens -> ids. Added
    tokens, whether flagged special or not (Qwen's `<tool_call>` is not), are lexed apart from text by llguidance,
    so a grammar must name them by id."""
    wanted = set(MARKERS[family])
    found: dict[str, int] = {}
    for token in json.loads(tokenizer_json).get("added_tokens") or ():
        if token.get("content") in wanted:
            found[token["content"]] = int(token["id"])
    return found


def _arguments_schema(tool: FunctionTool) -> dict[str, Any]:
    schema = dict(tool.parameters)
    kind = schema.setdefault("type", "object")
    if kind != "object":
        raise ValueError(f"tools: the parameters of {tool.name!r} must be an object schema, not type {kind!r}")
    return schema


def _call_schema(tool: FunctionTool, argument_key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, argument_key: _arguments_schema(tool)},
            "required": ["name", argument_key], "additionalProperties": False}


def _json(schema: dict[str, Any], lenient: bool) -> str:
    style = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": lenient}
    return "%json " + json.dumps({"x-guidance": style, **schema}, ensure_ascii=False)


def _any_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _chosen_tools(tools: list[FunctionTool], choice: ToolChoice) -> list[FunctionTool]:
    if not tools:
        raise ValueError("tools: tool_choice requires a call, but no tools were given")
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"tools: function names must be unique, got {names}")
    if choice.mode is ToolChoiceMode.NAMED:
        chosen = [tool for tool in tools if tool.name == choice.name]
        if not chosen:
            raise ValueError(f"tool_choice: names function {choice.name!r}, which is not among the tools "
                             f"({', '.join(names)})")
        return chosen
    return list(tools)


def _literal(text: str, special_tokens: Mapping[str, int]) -> str:
    if text in special_tokens:
        return f"<[{special_tokens[text]}]>"
    return json.dumps(text, ensure_ascii=False)


def _lark(family: ToolFamily, tools: list[FunctionTool], parallel: bool, lenient: bool,
          special_tokens: Mapping[str, int]) -> str:
    if family is ToolFamily.MISTRAL:
        array = {"type": "array", "items": _any_of([_call_schema(t, "arguments") for t in tools]), "minItems": 1}
        if not parallel:
            array["maxItems"] = 1
        # `[TOOL_CALLS] [`: the space is how these SentencePiece models write the array after the marker.
        return f"start: {_literal('[TOOL_CALLS]', special_tokens)} \" \" calls\ncalls: {_json(array, lenient)}\n"
    if family is ToolFamily.MISTRAL_ARGS:
        marker, args = _literal("[TOOL_CALLS]", special_tokens), _literal("[ARGS]", special_tokens)
        rules = [f"call_{i}: {marker} {json.dumps(t.name, ensure_ascii=False)} {args} "
                 f"{_json(_arguments_schema(t), lenient)}" for i, t in enumerate(tools)]
        alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
        return f"start: call{'+' if parallel else ''}\ncall: {alternatives}\n" + "\n".join(rules) + "\n"
    repeat = f"({json.dumps(SEPARATORS[family])} call)*" if parallel else ""
    body = _json(_any_of([_call_schema(t, ARGUMENT_KEY[family]) for t in tools]), lenient)
    if family is ToolFamily.HERMES:
        call = (f"{_literal('<tool_call>', special_tokens)} \"\\n\" body \"\\n\" "
                f"{_literal('</tool_call>', special_tokens)}")
    else:
        call = "body"
    return f"start: call {repeat}\ncall: {call}\nbody: {body}\n"


def tool_call_grammar(family: ToolFamily, tools: list[FunctionTool], choice: ToolChoice, parallel: bool,
                      special_tokens: Mapping[str, int] | None = None) -> str | None:
    """The llguidance grammar a completion must follow for `choice`, or None when the choice constrains nothing
    (AUTO: the model decides, its text is parsed; NONE: no calls)."""
    if not isinstance(family, ToolFamily):
        raise ValueError(f"family: tool-call grammars exist for the built-in families only, not {family!r}")
    if choice.mode in (ToolChoiceMode.AUTO, ToolChoiceMode.NONE):
        return None
    special_tokens = dict(special_tokens or {})
    unknown = sorted(set(special_tokens) - set(MARKERS[family]))
    if unknown:
        raise ValueError(f"special_tokens: {unknown} are not markers of {family.value} calls "
                         f"({', '.join(MARKERS[family]) or 'it has none'})")
    if not all(isinstance(i, int) and i >= 0 for i in special_tokens.values()):
        raise ValueError(f"special_tokens: token ids must be non-negative integers, got {special_tokens}")
    chosen = _chosen_tools(tools, choice)
    lenient = not all(tool.strict for tool in chosen)
    lark = "%llguidance {}\n" + _lark(family, chosen, parallel, lenient, special_tokens)
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        names = ", ".join(tool.name for tool in chosen)
        raise ValueError(f"tools: the parameters schemas of {names} do not compile to a grammar: {error}")
    return grammar
