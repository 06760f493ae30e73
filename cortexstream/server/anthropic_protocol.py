"""Request bodies of Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

Field names follow Anthropic's API. Content blocks other than `text`, `tool_use` and `tool_result` (images,
documents, thinking, server-tool blocks) parse as `OtherBlock`, so the translation can refuse them by name rather
than fail with a vague union error. Unknown fields are kept and judged by `wire.refuse_unknown_fields`: those on
the `harmless_fields` lists below are ignored, any other is refused with a 400.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag
from typing_extensions import Annotated

from cortexstream.server.wire import OpenModel, discriminate_by_type

# Top-level fields accepted and ignored: request metadata, billing and routing choices, prompt-cache hints. None of
# them changes the text a model produces.
ANTHROPIC_HARMLESS_FIELDS: tuple[str, ...] = (
    "metadata",  # {"user_id"}: an end-user tag
    "service_tier",  # priority vs standard capacity
    "inference_geo",  # where inference runs
    "speed",  # a faster serving mode of the same model
    "cache_control",  # a prompt-cache hint (this server caches prefixes on its own)
    "user_profile_id",
    "workspace_id",
)
# Fields of content blocks and tools accepted and ignored.
ANTHROPIC_HARMLESS_BLOCK_FIELDS: tuple[str, ...] = (
    "cache_control",  # a prompt-cache breakpoint
    "citations",  # citations of an earlier answer's text block
    "caller",  # who made an earlier tool_use (direct, or a server tool)
)
ANTHROPIC_HARMLESS_TOOL_FIELDS: tuple[str, ...] = (
    "cache_control",
    "eager_input_streaming",  # how a tool's input is streamed, not what it is
)
# count_tokens counts the prompt only: the generation fields a client copies from its messages call are moot there.
COUNT_TOKENS_HARMLESS_FIELDS: tuple[str, ...] = ANTHROPIC_HARMLESS_FIELDS + (
    "max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream",
)


class TextBlock(OpenModel):
    harmless_fields: ClassVar[tuple[str, ...]] = ANTHROPIC_HARMLESS_BLOCK_FIELDS
    type: Literal["text"]
    text: StrictStr


class OtherBlock(OpenModel):
    """A block of a type this server does not read (image, document, thinking, ...): refused by the translation."""

    type: StrictStr


ResultContentBlock = Annotated[
    Union[Annotated[TextBlock, Tag("text")], Annotated[OtherBlock, Tag("other")]],
    Discriminator(discriminate_by_type(("text",))),
]


class ToolUseBlock(OpenModel):
    harmless_fields: ClassVar[tuple[str, ...]] = ANTHROPIC_HARMLESS_BLOCK_FIELDS
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


class ToolResultBlock(OpenModel):
    harmless_fields: ClassVar[tuple[str, ...]] = ANTHROPIC_HARMLESS_BLOCK_FIELDS
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: Union[StrictStr, list[ResultContentBlock]] = ""
    is_error: StrictBool = False


ContentBlock = Annotated[
    Union[Annotated[TextBlock, Tag("text")], Annotated[ToolUseBlock, Tag("tool_use")],
          Annotated[ToolResultBlock, Tag("tool_result")], Annotated[OtherBlock, Tag("other")]],
    Discriminator(discriminate_by_type(("text", "tool_use", "tool_result"))),
]


class AnthropicMessage(OpenModel):
    role: Literal["user", "assistant", "system"]
    content: Union[StrictStr, list[ContentBlock]]


class AnthropicTool(OpenModel):
    """A client tool (`type` absent or "custom"); any other `type` is a server tool, refused by the translation."""

    harmless_fields: ClassVar[tuple[str, ...]] = ANTHROPIC_HARMLESS_TOOL_FIELDS
    name: StrictStr
    type: Optional[StrictStr] = None
    description: StrictStr = ""
    input_schema: Optional[dict[str, Any]] = None
    strict: StrictBool = False


class AnthropicToolChoice(OpenModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[StrictStr] = None  # for "tool"
    disable_parallel_tool_use: StrictBool = False


class ThinkingConfig(OpenModel):
    type: StrictStr  # "enabled" / "adaptive" / "disabled" / ...
    budget_tokens: Optional[StrictInt] = None


class OutputFormat(OpenModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenModel):
    format: Optional[OutputFormat] = None  # structured output; `effort` and others are unknown here, so refused


class AnthropicCountTokensRequest(OpenModel):
    """`POST /v1/messages/count_tokens`: the prompt-shaping fields of a messages request."""

    harmless_fields: ClassVar[tuple[str, ...]] = COUNT_TOKENS_HARMLESS_FIELDS
    model: StrictStr
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[StrictStr, list[TextBlock], None] = None
    tools: Optional[list[AnthropicTool]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[OutputConfig] = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    """`POST /v1/messages`."""

    harmless_fields: ClassVar[tuple[str, ...]] = ANTHROPIC_HARMLESS_FIELDS
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: Optional[list[StrictStr]] = None
    temperature: Optional[float] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    top_k: Optional[StrictInt] = Field(default=None, ge=0)
    stream: StrictBool = False
    metadata: Optional[dict[str, Any]] = None
