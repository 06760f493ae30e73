"""Tool calls in a completion's text: parsers per model family, detecting the family, and call grammars.

`parser` (the streaming machinery every family shares), `call_json` (where a streamed JSON value ends; a
decoded call's checks), `hermes`, `llama3`, `mistral` (the families), `registry` (which family a model writes;
user families), `grammar` (llguidance grammars for `tool_choice` required / named).
"""

from cortexstream.server.tool_calls.grammar import special_marker_ids, tool_call_grammar
from cortexstream.server.tool_calls.hermes import HermesToolParser
from cortexstream.server.tool_calls.llama3 import Llama3ToolParser
from cortexstream.server.tool_calls.mistral import MistralToolParser, mistral_call_id
from cortexstream.server.tool_calls.parser import ToolCallParser, parse_complete
from cortexstream.server.tool_calls.registry import (FamilyKey, ToolFamily, ToolParserRegistry, default_registry,
                                                     detect_family, parser_for)

__all__ = ["FamilyKey", "HermesToolParser", "Llama3ToolParser", "MistralToolParser", "ToolCallParser",
           "ToolFamily", "ToolParserRegistry", "default_registry", "detect_family", "mistral_call_id",
           "parse_complete", "parser_for", "special_marker_ids", "tool_call_grammar"]
