"""Request bodies of /v1/chat/completions and /v1/completions (pydantic: the app's OpenAPI schema).

Field names and ranges follow OpenAI's API; `top_k`, `min_p`, `repetition_penalty` and `kv_policy` are
extensions. Unknown fields are kept and judged by `wire.refuse_unknown_fields`: those on a model's
`harmless_fields` (metadata that cannot change the answer) are ignored, any other one is a 400 naming it
(`logit_bias`, `functions`, `audio`, ...; `kv_dtype` and `kv_group_size` get their own message in prepare.py,
the server's KV storage being fixed at start-up). docs/server.md lists both sets.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr

from cortexstream.server.wire import OpenModel

# Fields that cannot change an answer: accepted and ignored.
HARMLESS_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")

MAX_N = 8
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class StreamOptions(OpenModel):
    harmless_fields = ("include_obfuscation",)
    include_usage: StrictBool = False


class ContentPart(OpenModel):
    type: StrictStr  # only "text" is served (prepare.py refuses the others by name)
    text: StrictStr | None = None


class FunctionCallPart(OpenModel):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class MessageToolCall(OpenModel):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCallPart


class ChatMessage(OpenModel):
    harmless_fields = ("name", "refusal", "annotations")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[ContentPart], None] = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: StrictStr | None = None


class FunctionDefinition(OpenModel):
    name: StrictStr = Field(min_length=1, max_length=64)
    description: StrictStr = ""
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(OpenModel):
    type: StrictStr  # only "function" (prepare.py refuses the others by name)
    function: FunctionDefinition | None = None


class SamplingFields(OpenModel):
    """Fields both endpoints share."""

    harmless_fields = HARMLESS_FIELDS
    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: StrictInt | None = None
    stop: Union[StrictStr, list[StrictStr], None] = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    kv_policy: StrictStr | None = None
    speculative: StrictStr | None = None  # "ngram:k=4,n=3" or "off" (None: the server's default)
    user: StrictStr | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return stops


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ChatTool] | None = None
    tool_choice: Union[StrictStr, dict[str, Any], None] = None
    parallel_tool_calls: StrictBool = True
    response_format: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    echo: StrictBool = False
