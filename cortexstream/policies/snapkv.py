"""SnapKV (Li et al., 2024): the question votes for the keys to keep.

After a prompt's prefill, the queries of its last `window` positions (where a user's question sits) have
attended to every key; each (layer, KV head) keeps the keys those queries attended to most, after pooling the
votes over neighbouring keys with a 1-D kernel (`pooling` max or avg, `kernel` wide, "same" padding) so a fact
is kept with its context rather than as isolated tokens. Always kept: the first `sinks` tokens and the last
`window` (the observation window itself).

When the votes are taken. The runtime (`engine.observation`) records attention only from queries at or after
`prompt_end - window`, where `prompt_end` is the end of the prompt being prefilled, and holds eviction back until
that prompt is complete: the whole prompt is resident while it is prefilled (`max_physical_tokens` says so), and
it is compressed once its question has voted. Queries after it (generated tokens, and in a continued conversation
the next turn's observation window) keep voting, so a growing conversation is compressed again with the same
scores, as H2O accumulates its own. Without a known prompt end (perplexity over a text), the last `window`
queries of each forward pass vote and eviction follows every pass.

GQA: a KV head's votes are summed over its query heads (as `attention_received` gives them).

`recent` (default: the window) is how many of the newest keys are kept by position: a count, or a fraction of the
budget (`recent=0.5` is H2O's split). Keeping more than the window serves text that is read on, not asked about
(perplexity over a stream): the window alone keeps the last 32.

`pooled` (default: every voted slot) is how many voted slots go to the pooled votes (a count, or a fraction of the
budget); the other voted slots go to the raw votes, unpooled. What keeps a fact is a few pooled slots around what
the question attended to (its context comes along); what keeps a stream of text predictable is many single heavy
hitters and recent tokens. `pooled` splits one budget between the two instead of spending it all on neighbours.

`merge=T` (CaM / D2O style, `engine.evict_merge`): a key the votes drop is not lost when it is close to a kept key
of its head (cosine >= T): its value is folded into that kept key's value. Same slots and memory as without.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import (
    Budget, FoldsDropped, KVPolicy, check_budget, check_count, merge_suffix, option_suffix, resolve_budget,
)


class Pooling(str, enum.Enum):
    MAX = "max"
    AVG = "avg"


def pool_scores(scores: np.ndarray, kernel: int, pooling: Pooling) -> np.ndarray:
    """Pool along the last axis with a `kernel`-wide window centred on each key (odd kernels; "same" size).
    Max pooling pads with -inf (edges see only real keys); avg pooling pads with zeros, as avg_pool1d does."""
    if kernel <= 1:
        return scores
    half = kernel // 2
    fill = -np.inf if pooling is Pooling.MAX else 0.0
    padded = np.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(half, half)], constant_values=fill)
    windows = sliding_window_view(padded, kernel, axis=-1)
    return windows.max(axis=-1) if pooling is Pooling.MAX else windows.mean(axis=-1)


@dataclass(frozen=True)
class SnapKV(FoldsDropped, KVPolicy):
    """Keep `budget` tokens (int, or a fraction of the context) per layer and KV head: sinks, the observation
    window, and the keys the window's queries voted for."""

    budget: Budget = 0.2
    window: int = 32
    kernel: int = 7
    pooling: Pooling = Pooling.MAX
    sinks: int = 4
    merge: float | None = None
    recent: Budget | None = None
    pooled: Budget | None = None

    name = "snapkv"
    evicts = True
    needs_attention_scores = True
    selects_per_head = True  # votes pooled along one head's keys, a budget-fixed count per (layer, KV head)
    parse_keys: ClassVar[dict[str, str]] = {"budget": "budget", "window": "count", "kernel": "count",
                                            "pooling": "str", "sinks": "count", "merge": "float",
                                            "recent": "budget", "pooled": "budget"}

    def __post_init__(self) -> None:
        check_budget("budget", self.budget)
        check_count("window", self.window, 1)
        check_count("kernel", self.kernel, 1)
        check_count("sinks", self.sinks, 0)
        if self.kernel % 2 == 0:
            raise InvalidArgumentError(f"SnapKV: kernel {self.kernel} must be odd (a window centred on each key)")
        try:
            object.__setattr__(self, "pooling", Pooling(self.pooling))
        except ValueError:
            raise InvalidArgumentError(f"SnapKV: pooling {self.pooling!r} must be one of "
                                       f"{', '.join(p.value for p in Pooling)}") from None
        if self.recent is not None:
            check_budget("recent", self.recent)
        if self.pooled is not None:
            check_budget("pooled", self.pooled)
        self.check_merge(type(self).__name__)
        if isinstance(self.budget, int) and self.budget < self.minimum_budget:
            raise InvalidArgumentError(f"SnapKV: budget {self.budget} must be >= {self.minimum_budget} (sinks "
                                       f"{self.sinks} + 1 voted key + at least 1 of the window)")

    @property
    def observation_window(self) -> int:
        return self.window

    @property
    def minimum_budget(self) -> int:
        return self.sinks + 2

    def budget_tokens(self, context: int) -> int:
        return max(resolve_budget(self.budget, context), self.minimum_budget)

    def max_physical_tokens(self, max_total_tokens: int, chunk: int, prompt_tokens: int | None = None) -> int | None:
        """The budget plus a pass, or the whole prompt while it is prefilled (it is compressed at its end). Without
        `prompt_tokens` no prompt end is known, and eviction follows every pass (see `engine.observation`)."""
        bound = self.budget_tokens(max_total_tokens) + chunk
        return bound if prompt_tokens is None else max(bound, prompt_tokens + chunk)

    def recent_tokens(self, budget: int) -> int:
        """The newest keys kept by position: `recent` (a count, or a fraction of `budget`), else the window."""
        if self.recent is None:
            return self.window
        return self.recent if isinstance(self.recent, int) else int(self.recent * budget)

    def pooled_tokens(self, budget: int) -> int:
        """Voted slots chosen by the pooled votes: `pooled` (a count, or a fraction of `budget`)."""
        assert self.pooled is not None
        return self.pooled if isinstance(self.pooled, int) else int(self.pooled * budget)

    def select(self, num_physical: int, context: int, scores: np.ndarray | None) -> np.ndarray | None:
        budget = self.budget_tokens(context)
        if num_physical <= budget:
            return None
        if scores is None:
            raise InvalidArgumentError("SnapKV: attention scores are required but were not collected")
        layers, heads, n = scores.shape
        if n != num_physical:
            raise InvalidArgumentError(f"SnapKV: {n} scores for {num_physical} physical tokens")
        front = min(self.sinks, budget - 2)
        recent = min(self.recent_tokens(budget), budget - front - 1)
        voted = self.eviction_target(num_physical, budget, front + recent + 1) - front - recent
        pooled = pool_scores(scores, self.kernel, self.pooling)[:, :, front : n - recent]
        count = voted if self.pooled is None else min(voted, self.pooled_tokens(budget))
        order = np.argsort(-pooled, axis=-1, kind="stable")[..., :count]
        if count < voted:  # the rest by the raw votes, among the slots the pooled ones left
            raw = np.array(scores[:, :, front : n - recent], dtype=np.float64)
            np.put_along_axis(raw, order, -np.inf, axis=-1)
            order = np.concatenate([order, np.argsort(-raw, axis=-1, kind="stable")[..., :voted - count]], axis=-1)
        order = order + front
        return np.concatenate([
            np.broadcast_to(np.arange(front), (layers, heads, front)),
            np.sort(order, axis=-1),
            np.broadcast_to(np.arange(n - recent, n), (layers, heads, recent)),
        ], axis=-1)

    def describe(self) -> str:
        return (f"snapkv:budget={self.budget},window={self.window},kernel={self.kernel},"
                f"pooling={self.pooling.value},sinks={self.sinks}"
                f"{option_suffix('recent', self.recent)}{option_suffix('pooled', self.pooled)}"
                f"{merge_suffix(self.merge)}")
