"""KVzip at the level of heads (Kim et al., 2025, context-independent variant; the retrieval / streaming split of
DuoAttention, Xiao et al., 2024): query-agnostic compression with no pass over the context.

KVzip scores every key by the attention the model pays it while repeating its context, which costs about one more
prefill per prompt. Which heads need their whole context is, however, a property of the model, not of the text:
the mean of a head's KVzip scores is stable from one text to another (`policies.head_profile`). So a profile
measured once per model, offline, ranks the (layer, KV head) pairs, and at run time:

- every head keeps its first `sinks` tokens and its newest `window` (a streaming head keeps only these);
- the rest of the budget goes, in profile order, to whole heads: the best-ranked heads keep every token they hold
  (retrieval heads), the next one as many of its newest tokens as the budget has left.

The cache holds `budget` slots per layer and KV head on average, as KVzip's does: a retrieval head keeps far more
keys than the sequence has slots, and its surplus is stored in the cells streaming heads leave free, in any layer
(`pools_heads`, `pools_layers`: `engine.pooled_heads`, `engine.pooled_layers`). No attention is recorded and no
reconstruction runs; the choice needs only positions, so the policy evicts after every pass like H2O (the peak is
the budget plus one pass) and serves any later question.

`profile=PATH` uses a profile file (`cortexstream train head-profile`); otherwise the shipped profile for the
cache's shape (layers x KV heads) is used, and a model without one is refused with the command that measures it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import Budget, KVPolicy, check_budget, check_count, resolve_budget
from cortexstream.policies.head_profile import find_profile
from cortexstream.policies.owned_cells import columns_by_owner, fill_in_order


def head_counts(sizes: np.ndarray, importance: np.ndarray, fixed: int, total: int) -> np.ndarray:
    """Keys kept per column (a (layer, head) pair, flattened): `fixed` each (or all it holds), then whole columns
    in decreasing `importance` until `total`, the last one partly."""
    counts = np.minimum(sizes, fixed)
    left = total - int(counts.sum())
    if left < 0 or int(sizes.sum()) < total:
        raise InvalidArgumentError(f"kvzip_heads: {total} keys cannot be kept from columns holding "
                                   f"{int(sizes.sum())} with {fixed} each fixed")
    return fill_in_order(counts, sizes, left, np.argsort(-importance, kind="stable"))


@dataclass(frozen=True)
class KVzipHeads(KVPolicy):
    """Keep `budget` tokens (int, or a fraction of the context) per layer and KV head on average: sinks and a
    window for every head, whole contexts for the heads the model's profile ranks first."""

    budget: Budget = 0.33
    window: int = 64
    sinks: int = 4
    profile: str | None = None

    name = "kvzip_heads"
    evicts = True
    pools_heads = True
    pools_layers = True
    selects_per_head = False  # the heads of all layers compete for one budget
    parse_keys: ClassVar[dict[str, str]] = {"budget": "budget", "window": "count", "sinks": "count",
                                            "profile": "str"}

    def __post_init__(self) -> None:
        check_budget("budget", self.budget)
        check_count("window", self.window, 1)
        check_count("sinks", self.sinks, 0)
        if self.profile is not None and not isinstance(self.profile, str):
            raise InvalidArgumentError(f"kvzip_heads: profile {self.profile!r} must be a path to a profile file")
        if isinstance(self.budget, int) and self.budget < self.minimum_budget:
            raise InvalidArgumentError(f"kvzip_heads: budget {self.budget} must be >= {self.minimum_budget} (sinks "
                                       f"{self.sinks} + window {self.window} + 1)")

    @property
    def minimum_budget(self) -> int:
        return self.sinks + self.window + 1

    def budget_tokens(self, context: int) -> int:
        return max(resolve_budget(self.budget, context), self.minimum_budget)

    def select(self, num_physical: int, context: int, scores: np.ndarray | None) -> np.ndarray | None:
        raise InvalidArgumentError("kvzip_heads selects cells (select_cells): the runtime must pool layers")

    def select_cells(self, num_physical: int, context: int, scores: np.ndarray | None, positions: np.ndarray,
                     owners: np.ndarray) -> np.ndarray | None:
        """Cells to keep, a bool mask `[L, H, n]` with exactly `budget x H x L` in all (`eviction_target`: a little
        less when decoding went just over it); `owners` `[L, H, n]` holds
        each cell's owner as `layer x H + head`, `positions` its token's position."""
        budget = self.budget_tokens(context)
        if num_physical <= budget:
            return None
        if positions.shape != owners.shape or positions.shape[-1] != num_physical:
            raise InvalidArgumentError(f"kvzip_heads: positions {positions.shape} and owners {owners.shape} must be "
                                       f"[layers, heads, {num_physical}]")
        layers, heads, _ = positions.shape
        importance = find_profile(layers, heads, self.profile).array().reshape(-1)
        columns, sizes = columns_by_owner(owners, positions, layers * heads, "kvzip_heads")
        keep_slots = self.eviction_target(num_physical, budget, self.minimum_budget)
        counts = head_counts(sizes, importance, self.sinks + self.window, layers * heads * keep_slots)
        keep = np.zeros(positions.size, dtype=bool)
        for cells, count in zip(columns, counts):  # each column's cells in position order
            front = min(self.sinks, int(count))
            keep[cells[:front]] = True
            keep[cells[len(cells) - (int(count) - front):]] = True
        return keep.reshape(positions.shape)

    def describe(self) -> str:
        profile = "" if self.profile is None else f",profile={self.profile}"
        return f"kvzip_heads:budget={self.budget},window={self.window},sinks={self.sinks}{profile}"


__all__ = ["KVzipHeads", "head_counts"]
