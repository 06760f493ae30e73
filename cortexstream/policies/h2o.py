"""H2O, Heavy-Hitter Oracle (Zhang et al., 2023): keep the tokens that received the most attention, plus the
most recent ones.

Scores are the attention probability each key received, summed over every query that has seen it (prompt chunks,
decode steps and later chat turns) and over the query heads of its GQA group, so each (layer, KV head) chooses its
own heavy hitters and `SequenceKV.keep` gets `[L, H, n]` indices. Always kept, in every layer and head:
- the first `max(sinks, keep_prefix)` tokens (attention sinks; `keep_prefix` protects e.g. a system prompt);
- the last `recent` tokens (default: half of what the protected prefix leaves, the paper's heavy/recent split).
Ties between equal scores go to the older token (a stable sort), so selection is deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import Budget, KVPolicy, check_budget, check_count, resolve_budget


@dataclass(frozen=True)
class H2O(KVPolicy):
    """Heavy hitters + recent window within `budget` tokens (int) or a fraction of the context (float)."""

    budget: Budget = 0.2
    sinks: int = 4
    recent: int | None = None
    keep_prefix: int = 0

    name = "h2o"
    evicts = True
    needs_attention_scores = True
    # Each KV head ranks its own slots by the attention of its GQA group's queries (a softmax per query head), and
    # the count kept depends only on the budget and the lengths.
    selects_per_head = True
    parse_keys: ClassVar[dict[str, str]] = {"budget": "budget", "sinks": "count", "recent": "count",
                                            "keep_prefix": "count"}

    def __post_init__(self) -> None:
        check_budget("budget", self.budget)
        check_count("sinks", self.sinks, 0)
        check_count("keep_prefix", self.keep_prefix, 0)
        if self.recent is not None:
            check_count("recent", self.recent, 0)
        if isinstance(self.budget, int) and self.budget < self.minimum_budget:
            raise InvalidArgumentError(
                f"H2O: budget {self.budget} must be >= {self.minimum_budget} "
                f"(protected prefix {self.protected} + recent {self.recent or 0} + 1 heavy hitter)"
            )

    @property
    def protected(self) -> int:
        return max(self.sinks, self.keep_prefix)

    @property
    def minimum_budget(self) -> int:
        return self.protected + (self.recent or 0) + 1

    def budget_tokens(self, context: int) -> int:
        return max(resolve_budget(self.budget, context), self.minimum_budget)

    def recent_tokens(self, budget: int) -> int:
        if self.recent is not None:
            return self.recent
        return (budget - self.protected) // 2

    def select(self, num_physical: int, context: int, scores: np.ndarray | None) -> np.ndarray | None:
        budget = self.budget_tokens(context)
        if num_physical <= budget:
            return None
        if scores is None:
            raise InvalidArgumentError(f"{self.name}: key scores are required but were not collected")
        front, recent = self.protected, self.recent_tokens(budget)
        heavy = self.eviction_target(num_physical, budget, front + recent + 1) - front - recent
        layers, heads, n = scores.shape
        if n != num_physical:
            raise InvalidArgumentError(f"H2O: {n} scores for {num_physical} physical tokens")
        middle = scores[:, :, front : n - recent]
        order = np.argsort(-middle, axis=-1, kind="stable")[..., :heavy] + front
        keep = np.concatenate([
            np.broadcast_to(np.arange(front), (layers, heads, front)),
            np.sort(order, axis=-1),
            np.broadcast_to(np.arange(n - recent, n), (layers, heads, recent)),
        ], axis=-1)
        return keep

    def describe(self) -> str:
        recent = "" if self.recent is None else f",recent={self.recent}"
        prefix = f",keep_prefix={self.keep_prefix}" if self.keep_prefix else ""
        return f"h2o:budget={self.budget},sinks={self.sinks}{recent}{prefix}"
