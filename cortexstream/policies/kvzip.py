"""KVzip (Kim et al., 2025): query-agnostic compression by context reconstruction.

Once a prompt is complete, the model is made to repeat it: a reconstruction prompt ("Repeat the previous
context exactly." as a user turn, then the context itself as the assistant's reply, teacher-forced) is run over
the cache, in chunks of `chunk` context tokens, each chunk's queries attending to the whole cached context. A
cached key's importance is the most attention it received from any reconstruction query (the maximum over the
queries and over the query heads of its GQA group, not a sum); each (layer, KV head) keeps the first `sinks`
tokens and its `budget - sinks` most important keys. The reconstruction's own K/V are scoring work, not context:
the runtime rolls them back (`engine.reconstruction`). Since the scores come from the context alone, what is kept
serves any later question, at the cost of about one more prefill of the context, paid once.

With `kernel` > 1 a key's score is the most any key within `kernel // 2` places of it received (max pooling along
the head's keys, as SnapKV pools its votes): a sentence fact is read through its neighbours, and keeping only the
single tokens the reconstruction peaked on loses the words around them. `kernel=1` is the paper's selection.

With `shared=1` a layer's heads share its budget as Ada-KV's do (`policies.adakv`, the non-uniform head budgets
of the KVzip paper): the layer keeps `budget x heads` keys, each head its sinks and at least `floor` of an equal
share, the rest going to the best-scored keys of any head (`pools_heads`; the surplus stored in cells other heads
leave free, `engine.pooled_heads`).

Tokens added after a reconstruction (generated tokens, a later turn's prompt before its own reconstruction) carry
no reconstruction score yet: they are kept ahead of every scored key, so a cache over its budget gives up its
least important context first.

`merge=T` (not with `shared=1`): a dropped key close to a kept key of its head (cosine >= T) folds its value into
that kept key's value instead of being lost (CaM / D2O style, `engine.evict_merge`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import (
    Budget, FoldsDropped, KVPolicy, check_budget, check_count, check_real, merge_suffix, resolve_budget,
)
from cortexstream.policies.snapkv import Pooling, pool_scores


@dataclass(frozen=True)
class KVzip(FoldsDropped, KVPolicy):
    """Keep `budget` tokens (int, or a fraction of the context) per layer and KV head: sinks, then the keys the
    context's reconstruction attended to most."""

    budget: Budget = 0.33
    sinks: int = 4
    chunk: int = 2048
    kernel: int = 1
    shared: bool = False
    floor: float = 0.2
    merge: float | None = None

    name = "kvzip"
    evicts = True
    needs_attention_scores = True
    reconstructs = True
    # Each KV head ranks its own slots by the most attention its GQA group's reconstruction queries paid them, and
    # keeps sinks + budget - sinks of them: a count fixed by the budget and the lengths, the same in every head.
    parse_keys: ClassVar[dict[str, str]] = {"budget": "budget", "sinks": "count", "chunk": "count",
                                            "kernel": "count", "shared": "bool", "floor": "float",
                                            "merge": "float"}

    @property
    def selects_per_head(self) -> bool:  # type: ignore[override]
        return not self.shared

    @property
    def pools_heads(self) -> bool:  # type: ignore[override]
        return self.shared

    def __post_init__(self) -> None:
        check_budget("budget", self.budget)
        check_count("sinks", self.sinks, 0)
        check_count("chunk", self.chunk, 1)
        check_count("kernel", self.kernel, 1)
        if self.kernel % 2 == 0:
            raise InvalidArgumentError(f"KVzip: kernel {self.kernel} must be odd (a window centred on each key)")
        if not isinstance(self.shared, bool):
            raise InvalidArgumentError(f"KVzip: shared {self.shared!r} must be a boolean")
        check_real("KVzip", "floor", self.floor, 0, 1, "a fraction in [0, 1]")
        self.check_merge("KVzip")
        if self.merge is not None and self.shared:
            raise InvalidArgumentError("KVzip: merge needs a per-head choice; shared=1 pools heads (a cell "
                                       "holds one head's key), give one or the other")
        if isinstance(self.budget, int) and self.budget < self.minimum_budget:
            raise InvalidArgumentError(f"KVzip: budget {self.budget} must be >= {self.minimum_budget} (sinks "
                                       f"{self.sinks} + 1 scored key)")

    @property
    def minimum_budget(self) -> int:
        return self.sinks + 1

    def budget_tokens(self, context: int) -> int:
        return max(resolve_budget(self.budget, context), self.minimum_budget)

    def max_physical_tokens(self, max_total_tokens: int, chunk: int, prompt_tokens: int | None = None) -> int | None:
        """The budget plus a pass, or the whole prompt plus a scoring chunk while it is prefilled and reconstructed
        (it is compressed once the reconstruction ran)."""
        bound = self.budget_tokens(max_total_tokens) + chunk
        return bound if prompt_tokens is None else max(bound, prompt_tokens + chunk)

    def select(self, num_physical: int, context: int, scores: np.ndarray | None) -> np.ndarray | None:
        budget = self.budget_tokens(context)
        if num_physical <= budget:
            return None
        if scores is None:
            raise InvalidArgumentError("KVzip: reconstruction scores are required but were not collected")
        layers, heads, n = scores.shape
        if n != num_physical:
            raise InvalidArgumentError(f"KVzip: {n} scores for {num_physical} physical tokens")
        front = min(self.sinks, budget - 1)
        pooled = self._pooled(scores)
        keep = self.eviction_target(num_physical, budget, front + 1)
        chosen = np.argsort(-pooled[:, :, front:], axis=-1, kind="stable")[..., : keep - front] + front
        return np.concatenate([np.broadcast_to(np.arange(front), (layers, heads, front)),
                               np.sort(chosen, axis=-1)], axis=-1)

    def _pooled(self, scores: np.ndarray) -> np.ndarray:
        fresh = np.isinf(scores)  # not scored yet: kept first, and not spread to their neighbours by pooling
        return np.where(fresh, scores, pool_scores(np.where(fresh, 0.0, scores), self.kernel, Pooling.MAX))

    def select_cells(self, num_physical: int, context: int, scores: np.ndarray | None, positions: np.ndarray,
                     owners: np.ndarray) -> np.ndarray | None:
        """With `shared`: the cells to keep when a layer's heads share its budget (see the module docstring)."""
        from cortexstream.policies.adakv import shared_cells

        if not self.shared:
            raise InvalidArgumentError("KVzip: select_cells needs shared=1")
        budget = self.budget_tokens(context)
        if num_physical <= budget:
            return None
        if scores is None:
            raise InvalidArgumentError("KVzip: reconstruction scores are required but were not collected")
        front = min(self.sinks, budget - 1)
        keep = self.eviction_target(num_physical, budget, front + 1)
        pool = lambda row: self._pooled(row[None])[0]  # noqa: E731
        return np.stack([shared_cells(s, p, o, front, 0, keep - front, self.floor, pool)
                         for s, p, o in zip(scores, positions, owners)])

    def describe(self) -> str:
        shared = f",shared=1,floor={self.floor:g}" if self.shared else ""
        return (f"kvzip:budget={self.budget},sinks={self.sinks},chunk={self.chunk},kernel={self.kernel}{shared}"
                f"{merge_suffix(self.merge)}")
