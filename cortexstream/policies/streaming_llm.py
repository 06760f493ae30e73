"""StreamingLLM (Xiao et al., 2023): keep the first `sinks` tokens (attention sinks) and a window of recent ones.

Surviving tokens keep their original positions (RoPE is applied once, when a token is computed), so new tokens
continue from the logical position. The paper instead numbers positions inside the cache: `rerotate=True` does
that (`rerotate`: kept keys are rotated to positions 0..n-1 after each eviction and new tokens continue from n),
so positions never leave the model's training context on endless streams. This needs no
attention scores, so it runs on the fast path (no SDPA hook) and evicts with one index list for every layer/head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import Budget, KVPolicy, check_budget, check_count, resolve_budget


@dataclass(frozen=True)
class StreamingLLM(KVPolicy):
    """Attention sinks + sliding window. Give `window` (tokens or fraction of the context) or the total `budget`
    (sinks included); the cache holds at most sinks + window tokens between forward passes."""

    sinks: int = 4
    window: Budget | None = None
    budget: Budget | None = None
    rerotate: bool = False

    name = "streaming"
    evicts = True
    parse_keys: ClassVar[dict[str, str]] = {"sinks": "count", "window": "budget", "budget": "budget",
                                            "rerotate": "bool"}

    def __post_init__(self) -> None:
        check_count("sinks", self.sinks, 0)
        check_budget("window", self.window, allow_none=True)
        check_budget("budget", self.budget, allow_none=True)
        if (self.window is None) == (self.budget is None):
            raise InvalidArgumentError("StreamingLLM: give exactly one of window= (recent tokens) or budget= (total)")
        if not isinstance(self.rerotate, bool):
            raise InvalidArgumentError(f"StreamingLLM: rerotate={self.rerotate!r} must be True or False")
        if isinstance(self.budget, int) and self.budget <= self.sinks:
            raise InvalidArgumentError(f"StreamingLLM: budget {self.budget} must exceed sinks {self.sinks}")

    def budget_tokens(self, context: int) -> int:
        if self.window is not None:
            return self.sinks + resolve_budget(self.window, context)
        return max(resolve_budget(self.budget, context), self.sinks + 1)

    def select(self, num_physical: int, context: int, scores: np.ndarray | None) -> np.ndarray | None:
        budget = self.budget_tokens(context)
        if num_physical <= budget:
            return None
        window = self.eviction_target(num_physical, budget, self.sinks + 1) - self.sinks
        return np.concatenate([np.arange(self.sinks), np.arange(num_physical - window, num_physical)])

    def describe(self) -> str:
        size = f"window={self.window}" if self.window is not None else f"budget={self.budget}"
        return f"streaming:sinks={self.sinks},{size}" + (",rerotate=1" if self.rerotate else "")
