"""What rank 0 tells the other ranks (pickled over the control channel), and what they answer (JSON).

Rank 0 -> ranks: `OpenEngine` (an engine was attached: its arena's layout, the runner's settings and the source of
its draft model), `RunStep` (one step's plan, as plain data), `CloseEngine`, `Heartbeat` (rank 0 is alive and idle)
and `Stop` (exit; with an error when rank 0 failed). Ranks -> rank 0: `Ack` (every step up to `step` is computed)
or `Failure` (why this rank stops). Answers are JSON, so rank 0 never unpickles what another process sent.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any

from cortexstream.engine.step_plan import StepPlan
from cortexstream.kv.arena_config import ArenaConfig


@dataclass(frozen=True)
class OpenEngine:
    engine_id: int
    arena: ArenaConfig
    batch_prefill: bool
    mixed_prefill: bool
    small_batch_rows: int  # rank 0's small-batch kernel rows: every rank's matmuls take the same path
    draft_model: str | None = None  # the draft model's source (draft-model speculation): every rank loads it whole


@dataclass(frozen=True)
class RunStep:
    engine_id: int
    step: int  # counts every RunStep of the session from 1
    plan: StepPlan
    seed: int | None = None  # MLX's global random seed for this step (requests sampled without a seed of their own)


@dataclass(frozen=True)
class CloseEngine:
    engine_id: int


@dataclass(frozen=True)
class Heartbeat:
    pass


@dataclass(frozen=True)
class Stop:
    error: str | None = None  # None: a clean end


class AnswerKind(enum.Enum):
    HELLO = "hello"
    ACK = "ack"
    FAILURE = "failure"


@dataclass(frozen=True)
class Answer:
    """A rank's message to rank 0."""

    kind: AnswerKind
    rank: int
    step: int = 0  # ACK: every step up to this one is computed
    text: str = ""  # HELLO: the session token; FAILURE: the reason; ACK of Stop: the rank's BlockLedger digest

    def encode(self) -> bytes:
        return json.dumps({"kind": self.kind.value, "rank": self.rank, "step": self.step, "text": self.text}).encode()

    @classmethod
    def decode(cls, data: bytes) -> "Answer":
        try:
            raw: dict[str, Any] = json.loads(data.decode())
            return cls(AnswerKind(raw["kind"]), int(raw["rank"]), int(raw.get("step", 0)), str(raw.get("text", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not an answer of a rank: {exc}") from exc
