"""Why a request ended: one enum for the engine, the server and the public calls.

Its members are strings (`FinishReason.STOP == "stop"`, `str(...)`, f-strings and JSON give the bare value), so the
OpenAI wire format and callers that compare with plain strings see exactly what they saw before.
"""

from __future__ import annotations

import enum


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORTED = "aborted"  # the caller aborted it
    REJECTED = "rejected"  # it can never fit the KV arena
    ERROR = "error"  # a sampler, a hook or the step failed for this request (the reason is in `error`)

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
