"""Request body of OpenAI's Responses API, `POST /v1/responses`.

Field names follow the Responses API: function tools in its flat form (`{"type": "function", "name", "description",
"parameters", "strict"}`), structured output under `text.format`, `max_output_tokens`. `top_k` and `seed` are
extensions, as on `/v1/chat/completions`. Input items and content parts of other types (images, files, reasoning,
built-in tools' calls) parse as catch-all models so the translation can refuse them by name. Unknown fields are
kept and judged by `wire.refuse_unknown_fields`: those on the `harmless_fields` lists below are ignored, any other
is refused with a 400.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag
from typing_extensions import Annotated

from cortexstream.server.wire import OpenModel, discriminate_by_type

# Top-level fields accepted and ignored: tags, storage and billing choices, prompt-cache hints, stream framing.
# None of them changes the text a model produces. (`store`, `metadata` and `user` are declared fields too.)
RESPONSES_HARMLESS_FIELDS: tuple[str, ...] = (
    "user",  # an end-user tag
    "metadata",  # key-value tags, echoed back
    "store",  # whether the response is kept for `previous_response_id` (the server honours it when storing)
    "service_tier",  # capacity tier
    "prompt_cache_key",  # prompt-cache routing hint (this server caches prefixes on its own)
    "prompt_cache_retention",
    "prompt_cache_options",
    "safety_identifier",  # an end-user tag for abuse detection
    "stream_options",  # {"include_obfuscation"}: padding of stream events
)
# Fields of input items and parts accepted and ignored: ids and statuses of earlier output, its annotations.
RESPONSES_HARMLESS_ITEM_FIELDS: tuple[str, ...] = ("id", "status", "phase")
RESPONSES_HARMLESS_PART_FIELDS: tuple[str, ...] = ("annotations", "logprobs")
VERBOSITY_DEFAULT = "medium"  # the only `text.verbosity` this server can honour: it does nothing
TRUNCATION_DEFAULT = "disabled"  # the only `truncation`: an over-long prompt is refused, not cut


class TextPart(OpenModel):
    harmless_fields: ClassVar[tuple[str, ...]] = RESPONSES_HARMLESS_PART_FIELDS
    type: Literal["input_text", "output_text"]
    text: StrictStr


class OtherPart(OpenModel):
    """A content part of a type this server does not read (input_image, input_file, refusal, ...)."""

    type: StrictStr


ContentPart = Annotated[
    Union[Annotated[TextPart, Tag("text")], Annotated[OtherPart, Tag("other")]],
    Discriminator(discriminate_by_type({"input_text": "text", "output_text": "text"})),
]


class MessageItem(OpenModel):
    harmless_fields: ClassVar[tuple[str, ...]] = RESPONSES_HARMLESS_ITEM_FIELDS
    type: Optional[Literal["message"]] = None
    role: Literal["user", "system", "developer", "assistant"]
    content: Union[StrictStr, list[ContentPart]]


class FunctionCallItem(OpenModel):
    harmless_fields: ClassVar[tuple[str, ...]] = RESPONSES_HARMLESS_ITEM_FIELDS
    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr  # JSON text


class FunctionCallOutputItem(OpenModel):
    harmless_fields: ClassVar[tuple[str, ...]] = RESPONSES_HARMLESS_ITEM_FIELDS
    type: Literal["function_call_output"]
    call_id: StrictStr
    output: Union[StrictStr, list[ContentPart]]


class OtherItem(OpenModel):
    """An input item of a type this server does not read (reasoning, item_reference, built-in tool calls, ...)."""

    type: StrictStr


_item_tag = discriminate_by_type(("message", "function_call", "function_call_output"))


def _input_item_tag(value: Any) -> str:
    # An item without `type` but with a `role` is a message (the API's "easy input message").
    if isinstance(value, dict) and "type" not in value and "role" in value:
        return "message"
    return _item_tag(value)


InputItem = Annotated[
    Union[Annotated[MessageItem, Tag("message")], Annotated[FunctionCallItem, Tag("function_call")],
          Annotated[FunctionCallOutputItem, Tag("function_call_output")], Annotated[OtherItem, Tag("other")]],
    Discriminator(_input_item_tag),
]


class ResponsesTool(OpenModel):
    """A tool; only `type: "function"` is served, the rest (web_search, file_search, ...) are refused by name."""

    type: StrictStr
    name: Optional[StrictStr] = None
    description: Optional[StrictStr] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[StrictBool] = None  # the Responses API's default is true


class ResponsesToolChoice(OpenModel):
    type: StrictStr  # "function" is served; allowed_tools, built-in tool types, ... are refused
    name: Optional[StrictStr] = None


class TextFormat(OpenModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[StrictStr] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None
    description: Optional[StrictStr] = None


class ResponsesTextConfig(OpenModel):
    format: Optional[TextFormat] = None
    verbosity: Optional[StrictStr] = None


class ResponsesRequest(OpenModel):
    harmless_fields: ClassVar[tuple[str, ...]] = RESPONSES_HARMLESS_FIELDS
    model: Optional[StrictStr] = None
    input: Union[StrictStr, list[InputItem]]
    instructions: Optional[StrictStr] = None
    tools: Optional[list[ResponsesTool]] = None
    tool_choice: Union[Literal["auto", "none", "required"], ResponsesToolChoice, None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[ResponsesTextConfig] = None
    max_output_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[float] = Field(default=None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[StrictInt] = Field(default=None, ge=0)
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    previous_response_id: Optional[StrictStr] = None
    truncation: Optional[StrictStr] = None
    store: Optional[StrictBool] = None
    metadata: Optional[dict[str, StrictStr]] = None
    user: Optional[StrictStr] = None
