"""Request bodies of /v1/chat/completions and /v1/completions (pydantic: the app's OpenAPI schema).

Field names and ranges follow OpenAI's API; `top_k`, `min_p`, `repetition_penalty` and `kv_policy` are
extensions. Unknown fields are accepted and ignored, as OpenAI clients send fields of newer API versions, except
`kv_dtype` and `kv_group_size`, which prepare.py refuses (the server's KV storage is fixed at start-up).
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

MAX_N = 8
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: StrictBool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[TextPart], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")
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
    user: StrictStr | None = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return stops


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)


class CompletionRequest(SamplingFields):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    echo: StrictBool = False
