"""Ada-KV (Feng et al., 2024) over SnapKV's votes: a layer's budget is shared by its KV heads, not split equally.

SnapKV keeps `budget` keys in every (layer, KV head). Heads differ: some spread their attention over many keys,
some over a few, so an equal split keeps keys a focused head does not need and drops keys a broad head does. Ada-KV
gives each layer `budget x kv_heads` keys in all and lets the heads compete for them: the votes of the observation
window (pooled along each head's keys, as SnapKV pools them) are compared across the layer's heads, and the
top-voted keys are kept wherever they are. `floor` (Ada-KV's safeguard, 0.2 in its paper) first gives each head at
least that fraction of an equal share, so no head is left with only its sinks and window.

Memory. A head may now keep more keys than the sequence has slots; the slots of a head that keeps fewer hold the
surplus (`pools_heads`): the engine records each stored cell's owning head and attends each head over its own
cells (`engine.pooled_heads`), so the arena holds `budget` slots per layer, as SnapKV's does, and no padding.
Always kept, per head: the first `sinks` keys and the last `window` (the observation window; `recent` as SnapKV's),
by position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import check_real, option_suffix
from cortexstream.policies.snapkv import SnapKV, pool_scores


def shared_cells(scores: np.ndarray, positions: np.ndarray, owners: np.ndarray, front: int, recent: int,
                 share: int, floor: float, pool: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """One layer's cells to keep (bool `[H, n]`) when its heads share `H x share` chosen keys: each head keeps its
    first `front` and last `recent` keys by position, then its best `floor x share` by `pool`ed score (scores in
    the head's position order), then the layer's best scores wherever they are, up to `H x share` in all."""
    heads, n = scores.shape
    flat_scores, flat_pos, flat_owner = scores.reshape(-1), positions.reshape(-1), owners.reshape(-1)
    keep = np.zeros(heads * n, dtype=bool)
    candidates, votes, minimum = [], [], []
    for head in range(heads):
        cells = np.nonzero(flat_owner == head)[0]
        cells = cells[np.argsort(flat_pos[cells], kind="stable")]  # this head's keys in position order
        if len(cells) < front + recent:
            raise InvalidArgumentError(f"shared budget: head {head} holds {len(cells)} keys, fewer than its "
                                       f"{front} first + {recent} last")
        keep[cells[:front]] = True
        keep[cells[len(cells) - recent:]] = True
        pooled = pool(flat_scores[cells])[front:len(cells) - recent]
        order = np.argsort(-pooled, kind="stable")
        candidates.append(cells[front:len(cells) - recent][order])
        votes.append(pooled[order])
        minimum.append(min(len(order), int(floor * share)))
    for head in range(heads):  # the safeguard: each head's best `floor` share first
        keep[candidates[head][:minimum[head]]] = True
    rest_cells = np.concatenate([c[m:] for c, m in zip(candidates, minimum)])
    rest_votes = np.concatenate([v[m:] for v, m in zip(votes, minimum)])
    left = heads * share - sum(minimum)
    if left > len(rest_cells):
        raise InvalidArgumentError(f"shared budget: {left} keys to choose from {len(rest_cells)} candidates")
    keep[rest_cells[np.argsort(-rest_votes, kind="stable")[:left]]] = True
    return keep.reshape(heads, n)


@dataclass(frozen=True)
class AdaKV(SnapKV):
    floor: float = 0.2

    name = "adakv"
    pools_heads = True
    # The layer's heads compete for one budget: a rank holding some of the heads would choose differently.
    selects_per_head = False
    parse_keys: ClassVar[dict[str, str]] = {**SnapKV.parse_keys, "floor": "float"}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_real("AdaKV", "floor", self.floor, 0, 1, "a fraction in [0, 1]")
        if self.pooled is not None:
            raise InvalidArgumentError("AdaKV: pooled is not supported: its heads share one ranking of the pooled "
                                       "votes (snapkv splits pooled and raw votes)")
        if self.merge is not None:
            raise InvalidArgumentError("AdaKV: merge is not supported: a pooled cell holds one head's key, and "
                                       "folding dropped keys into kept ones needs a per-head choice (snapkv)")

    def select(self, num_physical: int, context: int, scores: np.ndarray | None) -> np.ndarray | None:
        raise InvalidArgumentError("AdaKV selects cells (select_cells): the runtime must pool heads")

    def select_cells(self, num_physical: int, context: int, scores: np.ndarray | None, positions: np.ndarray,
                     owners: np.ndarray) -> np.ndarray | None:
        """Cells to keep, a bool mask `[L, H, n]` over the stored cells (column h, slot s) with exactly
        `budget x H` per layer (`eviction_target`: a little less when decoding went just over it); `positions` and
        `owners` `[L, H, n]` say which token of which head each cell holds. None: nothing to evict yet."""
        budget = self.budget_tokens(context)
        if num_physical <= budget:
            return None
        if scores is None:
            raise InvalidArgumentError("AdaKV: attention scores are required but were not collected")
        if scores.shape != positions.shape or scores.shape != owners.shape or scores.shape[-1] != num_physical:
            raise InvalidArgumentError(f"AdaKV: scores {scores.shape}, positions {positions.shape} and owners "
                                       f"{owners.shape} must all be [layers, heads, {num_physical}]")
        front = min(self.sinks, budget - 2)
        recent = min(self.recent_tokens(budget), budget - front - 1)
        keep = self.eviction_target(num_physical, budget, front + recent + 1)
        pool = lambda row: pool_scores(row[None], self.kernel, self.pooling)[0]  # noqa: E731
        return np.stack([shared_cells(s, p, o, front, recent, keep - front - recent, self.floor, pool)
                         for s, p, o in zip(scores, positions, owners)])

    def describe(self) -> str:
        return (f"adakv:budget={self.budget},window={self.window},kernel={self.kernel},"
                f"pooling={self.pooling.value},sinks={self.sinks},floor={self.floor:g}"
                f"{option_suffix('recent', self.recent)}")
