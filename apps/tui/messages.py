"""What crosses from the engine side to the UI: immutable snapshots wrapped in Textual Messages.

The engine thread never touches a widget. It builds plain data (numpy arrays, dicts, dataclasses) and hands it
over with `App.post_message`, which is thread-safe; the UI thread renders it. Stats are posted far more often than
the UI needs them, so `StatsUpdate.can_replace` lets Textual drop stale ones still waiting in the queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from textual.message import Message

from cortexstream.engine.finish_reason import FinishReason

# Per-block owner codes in `EngineSnapshot.owners` (a value >= 0 is a conversation id).
FREE = -1
SHARED = -2  # in the block tables of two or more live sequences (a shared prefix)
OTHER = -3  # in use, but not by a conversation of this UI (anonymous or unknown owner)

# Per-block flag bits in `EngineSnapshot.flags`.
FLAG_CACHED = 1  # held only by the prefix cache: a finished turn's KV, reusable by the conversation's next turn
FLAG_TRIMMED = 2  # its sequence holds fewer KV tokens than it has seen (its policy evicted or compressed some)
FLAG_ON_DISK = 4  # the disk tier holds a copy of its KV (`--kv-disk`): it survives a restart or leaving the arena


@dataclass(frozen=True)
class ConversationUsage:
    """KV use of one conversation: logical tokens (seen) vs physical tokens (KV slots actually held)."""

    logical: int
    physical: int
    blocks: int  # blocks in its live sequence's table
    cached_blocks: int  # blocks of its earlier turns kept by the prefix cache
    running: bool


@dataclass(frozen=True)
class EngineSnapshot:
    """A consistent picture of the engine, taken on the engine thread between two steps."""

    owners: np.ndarray  # int32 per block: conversation id, FREE, SHARED or OTHER
    flags: np.ndarray  # uint8 per block: FLAG_* bits
    stats: dict[str, Any]  # Engine.stats()
    prefill_tokens: int
    prefill_time: float
    decode_tokens: int
    decode_time: float
    wall_time: float  # time.perf_counter() when taken
    conversations: dict[int, ConversationUsage] = field(default_factory=dict)


class StatsUpdate(Message):
    """The newest engine snapshot; a newer one waiting in the queue makes an older one pointless."""

    def __init__(self, snapshot: EngineSnapshot) -> None:
        super().__init__()
        self.snapshot = snapshot

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, StatsUpdate)


class ReplyDelta(Message):
    """New text of one reply (possibly empty), and its end: finish_reason set, with `error` when it failed.
    `ttft` is set once per reply, on the first delta after its first token."""

    def __init__(
        self,
        conv_id: int,
        request_id: str,
        text: str,
        generated: int,
        finish_reason: FinishReason | None = None,
        error: str | None = None,
        ttft: float | None = None,
    ) -> None:
        super().__init__()
        self.conv_id = conv_id
        self.request_id = request_id
        self.text = text
        self.generated = generated
        self.finish_reason = finish_reason
        self.error = error
        self.ttft = ttft


class RequestFailed(Message):
    """The engine refused a request before it started (bad arguments, engine stopped...)."""

    def __init__(self, conv_id: int, request_id: str, error: str) -> None:
        super().__init__()
        self.conv_id = conv_id
        self.request_id = request_id
        self.error = error


class ConversationCleared(Message):
    """A conversation's KV is gone: `freed` blocks went back to the arena."""

    def __init__(self, conv_id: int, freed: int) -> None:
        super().__init__()
        self.conv_id = conv_id
        self.freed = freed


class EngineReady(Message):
    """The model is loaded and the engine thread runs; `engine_link` is the UI's handle on it."""

    def __init__(self, engine_link: Any, model_label: str, backend_label: str) -> None:
        super().__init__()
        self.engine_link = engine_link
        self.model_label = model_label
        self.backend_label = backend_label


class EngineError(Message):
    """Something failed on the engine side; `fatal` when there is no engine at all (e.g. the model did not load)."""

    def __init__(self, error: str, fatal: bool = False) -> None:
        super().__init__()
        self.error = error
        self.fatal = fatal
