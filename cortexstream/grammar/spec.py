"""What a constrained request's output must match: a `GrammarSpec`, plain hashable data the scheduler carries.

Made from a JSON schema (a dict, JSON text or a pydantic model class), "any JSON object", a Lark grammar or a
regular expression, and turned into an llguidance grammar. `check()` compiles nothing for a tokenizer but finds every
error llguidance would (an unsupported schema keyword, a Lark syntax error) so a request can be refused before it is
queued, with the problem named.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from cortexstream.errors import InvalidArgumentError

# JSON layout the grammar allows: one space after ',' and ':' as models write it, and no free whitespace, which a
# small model can otherwise emit until max_tokens.
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"  # any JSON object
    LARK = "lark"  # llguidance's Lark dialect (may embed `%json {...}`)
    REGEX = "regex"
    LLGUIDANCE = "llguidance"  # an llguidance grammar as built elsewhere (e.g. a tool-call grammar)


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    source: str  # the schema as canonical JSON text, the Lark grammar or the regex
    name: str = "response_format"  # the argument/field errors name

    def __post_init__(self) -> None:
        if not isinstance(self.kind, GrammarKind):
            raise InvalidArgumentError(f"{self.name}: kind must be a GrammarKind, got {self.kind!r}")
        if not isinstance(self.source, str) or (self.kind is not GrammarKind.JSON_OBJECT and not self.source):
            raise InvalidArgumentError(f"{self.name}: empty {self.kind.value}")

    # --- constructors -----------------------------------------------------------------------------------------
    @classmethod
    def json_schema(cls, schema: Any, name: str = "response_format") -> "GrammarSpec":
        """From a dict, JSON text or a pydantic model class (whose objects then allow no keys beyond their fields:
        pydantic would drop them anyway, and a model left free to add keys wastes tokens on them)."""
        if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
            schema = closed_objects(schema.model_json_schema())
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidArgumentError(f"{name}: the schema is not valid JSON: {exc}") from exc
        if not isinstance(schema, dict):
            raise InvalidArgumentError(f"{name}: a JSON schema must be an object, got {type(schema).__name__}")
        return cls(GrammarKind.JSON_SCHEMA, json.dumps(schema), name)  # key order kept: properties come in it

    @classmethod
    def json_object(cls, name: str = "response_format") -> "GrammarSpec":
        return cls(GrammarKind.JSON_OBJECT, "", name)

    @classmethod
    def lark(cls, grammar: str, name: str = "grammar") -> "GrammarSpec":
        return cls(GrammarKind.LARK, grammar, name)

    @classmethod
    def regex(cls, pattern: str, name: str = "regex") -> "GrammarSpec":
        return cls(GrammarKind.REGEX, pattern, name)

    @classmethod
    def llguidance(cls, grammar: str, name: str = "grammar") -> "GrammarSpec":
        return cls(GrammarKind.LLGUIDANCE, grammar, name)

    # --- to llguidance ----------------------------------------------------------------------------------------
    def llguidance_grammar(self) -> str:
        from llguidance import LLMatcher

        if self.kind is GrammarKind.JSON_SCHEMA:
            return LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT)
        if self.kind is GrammarKind.JSON_OBJECT:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.kind is GrammarKind.LARK:
            return LLMatcher.grammar_from_lark(self.source)
        if self.kind is GrammarKind.LLGUIDANCE:
            return self.source
        return LLMatcher.grammar_from_regex(self.source)

    def check(self) -> str:
        """The llguidance grammar, or InvalidArgumentError naming this spec's field and llguidance's reason."""
        from llguidance import LLMatcher

        try:
            grammar = self.llguidance_grammar()
        except ValueError as exc:
            raise InvalidArgumentError(f"{self.name}: {exc}") from exc
        error = LLMatcher.validate_grammar(grammar)
        if error:
            raise InvalidArgumentError(f"{self.name}: cannot be enforced: {' '.join(error.split())}")
        return grammar


def closed_objects(schema: Any) -> Any:
    """A copy of `schema` where every object with `properties` and no `additionalProperties` gets it false."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: closed_objects(value) for key, value in schema.items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_for(response_format: Any, name: str = "response_format") -> GrammarSpec | None:
    """The Python API's `response_format`: None, a GrammarSpec, a pydantic model class, a JSON-schema dict, or
    OpenAI's forms ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"schema": ...}})."""
    if response_format is None or isinstance(response_format, GrammarSpec):
        return response_format
    if isinstance(response_format, type) and hasattr(response_format, "model_json_schema"):
        return GrammarSpec.json_schema(response_format, name)
    if isinstance(response_format, dict):
        kind = response_format.get("type")
        if kind == "json_object" and len(response_format) == 1:
            return GrammarSpec.json_object(name)
        if kind == "json_schema" and isinstance(response_format.get("json_schema"), dict):
            inner = response_format["json_schema"]
            if "schema" not in inner:
                raise InvalidArgumentError(f"{name}.json_schema: has no 'schema'")
            return GrammarSpec.json_schema(inner["schema"], name)
        if kind == "text" and len(response_format) == 1:
            return None
        return GrammarSpec.json_schema(response_format, name)
    if isinstance(response_format, str):
        return GrammarSpec.json_schema(response_format, name)
    raise InvalidArgumentError(f"{name}: expected a JSON schema (dict or JSON text), a pydantic model class or a "
                               f"GrammarSpec, got {type(response_format).__name__}")
