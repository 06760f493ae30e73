"""What crosses the engine/event-loop boundary: a request's job, its token events, and its handle."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from cortexstream.engine.finish_reason import FinishReason
from cortexstream.engine.sampling import SamplingParams
from cortexstream.engine.sequence import Sequence


@dataclass(frozen=True)
class TokenEvent:
    """One step's output for one completion, as the event loop sees it."""

    index: int  # which of the request's n completions
    token: int | None
    text: str
    finish_reason: FinishReason | None
    error: str | None
    time: float  # perf_counter at the end of the engine step
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    cached_tokens: int | None = None  # prompt tokens served from the prefix cache (first event only)
    stop_string: str | None = None  # the stop string a 'stop' finish ended on


@dataclass
class EngineJob:
    """What one API request asks of the engine."""

    request_ids: list[str]  # one per completion; the first is the parent that is prefilled
    prompt_tokens: list[int]
    sampling: SamplingParams
    kv_policy: Any = None
    tenant: str | None = None
    top_logprobs: int | None = None  # None: no log-probabilities; 0: the sampled token's only
    fork: bool = True  # False: n independent requests (evicting policies keep their blocks private)
    speculative: Any = None  # the request's speculative decoding setting (None: the server's default)


@dataclass
class Tracked:
    """Engine-thread bookkeeping of one completion."""

    index: int
    top_logprobs: int | None
    sequence: Sequence | None = None
    siblings: list[str] = field(default_factory=list)  # children to finish if the parent ends before forking
    started: bool = False


class RequestHandle:
    """Event-loop side of one API request: its completions' events arrive on `events`."""

    def __init__(self, job: EngineJob, arrival: float) -> None:
        self.job = job
        self.arrival = arrival
        self.events: asyncio.Queue[TokenEvent | BaseException] = asyncio.Queue()
        self.unfinished = set(range(len(job.request_ids)))  # completions whose final event is not delivered yet
        self.last_time = [None] * len(job.request_ids)
        self.aborted = False
        self._unread_finals = len(job.request_ids)  # final events the reader has not taken from `events` yet

    @property
    def finished(self) -> bool:
        """Every completion's final event is delivered (some may still wait in `events`)."""
        return not self.unfinished

    def mark_read(self, event: TokenEvent) -> None:
        """The reader took `event` from `events`."""
        if event.finish_reason is not None:
            self._unread_finals -= 1

    @property
    def all_read(self) -> bool:
        """Every completion's final event is delivered and taken: nothing more will come."""
        return self._unread_finals <= 0
