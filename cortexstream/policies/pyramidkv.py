"""PyramidKV (Cai et al., 2024, arXiv 2406.02069): SnapKV's votes, more keys in lower layers, fewer in upper ones.

Lower layers spread their attention over the whole context, upper layers focus on a few keys, so an equal budget
per layer keeps keys high up that nobody reads and drops keys low down that are read. PyramidKV keeps, per layer
and KV head, SnapKV's sinks and window plus a voted count that falls linearly from the first layer to the last:
from `2k - k/beta` to `k/beta`, where k is SnapKV's voted count at the same budget (the schedule kvpress took from
KVCache-Factory). The mean over layers is k, so the cache holds what SnapKV's holds.

Memory. A lower layer now keeps more keys than the sequence has slots. Its surplus is stored in the cells that
upper layers leave free (`pools_layers`; `engine.pooled_layers`): the arena holds `budget` slots per sequence, as
SnapKV's, and nothing is padded. A layer cannot keep more keys than it holds (in a later compression an upper
layer holds only what it kept plus the new tokens): the schedule is capped there and the excess goes to the
lowest layers with room.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import check_real, option_suffix
from cortexstream.policies.owned_cells import columns_by_owner, fill_in_order
from cortexstream.policies.snapkv import SnapKV, pool_scores


def layer_counts(layers: int, voted: int, beta: float, room: np.ndarray) -> np.ndarray:
    """Voted keys per layer: integers summing to `layers x voted` that fall linearly from `2 voted - voted/beta`
    (first layer) to `voted/beta` (last), each at most `room[l]` (the excess going to the lowest layers with room)."""
    total = layers * voted
    room = np.asarray(room, dtype=np.int64)
    if room.shape != (layers,) or (room < 0).any() or int(room.sum()) < total:
        raise InvalidArgumentError(f"PyramidKV: {total} voted keys do not fit the layers' room {room.tolist()}")
    if layers == 1:
        target = np.array([float(voted)])
    else:
        low = voted / beta
        target = (2 * voted - low) - (2 * voted - 2 * low) * np.arange(layers) / (layers - 1)
    counts = np.floor(target).astype(np.int64)
    counts[np.argsort(-(target - counts), kind="stable")[: total - int(counts.sum())]] += 1
    counts = np.minimum(counts, room)
    return fill_in_order(counts, room, total - int(counts.sum()), range(layers))


@dataclass(frozen=True)
class PyramidKV(SnapKV):
    beta: float = 20.0

    name = "pyramidkv"
    pools_heads = True
    pools_layers = True
    # a layer's count depends on the others' room: a rank holding some heads would choose differently
    selects_per_head = False
    parse_keys: ClassVar[dict[str, str]] = {**SnapKV.parse_keys, "beta": "float"}

    def __post_init__(self) -> None:
        super().__post_init__()
        check_real("PyramidKV", "beta", self.beta, 1, float("inf"), "a number >= 1 (1: every layer the same)")
        if self.pooled is not None:
            raise InvalidArgumentError("PyramidKV: pooled is not supported: its heads share one ranking of the pooled "
                                       "votes (snapkv splits pooled and raw votes)")
        if self.merge is not None:
            raise InvalidArgumentError("PyramidKV: merge is not supported: a lent cell holds one layer's key, and "
                                       "folding dropped keys into kept ones needs a per-head choice (snapkv)")

    def select(self, num_physical: int, context: int, scores: np.ndarray | None) -> np.ndarray | None:
        raise InvalidArgumentError("PyramidKV selects cells (select_cells): the runtime must pool layers")

    def select_cells(self, num_physical: int, context: int, scores: np.ndarray | None, positions: np.ndarray,
                     owners: np.ndarray) -> np.ndarray | None:
        """Cells to keep, a bool mask `[L, H, n]` over the stored cells with exactly `budget x H x L` in all
        (`eviction_target`: a little less when decoding went just over it);
        `owners` `[L, H, n]` holds each cell's owner as `layer x H + head`, `positions` its token's position."""
        budget = self.budget_tokens(context)
        if num_physical <= budget:
            return None
        if scores is None:
            raise InvalidArgumentError("PyramidKV: attention scores are required but were not collected")
        if scores.shape != positions.shape or scores.shape != owners.shape or scores.shape[-1] != num_physical:
            raise InvalidArgumentError(f"PyramidKV: scores {scores.shape}, positions {positions.shape} and owners "
                                       f"{owners.shape} must all be [layers, heads, {num_physical}]")
        layers, heads, _ = scores.shape
        front = min(self.sinks, budget - 2)
        recent = min(self.recent_tokens(budget), budget - front - 1)
        flat_scores = scores.reshape(-1)
        columns, sizes = columns_by_owner(owners, positions, layers * heads, "PyramidKV")
        held = sizes.reshape(layers, heads).min(axis=1)
        keep_slots = self.eviction_target(num_physical, budget, front + recent + 1)
        counts = layer_counts(layers, keep_slots - front - recent, self.beta, held - front - recent)
        keep = np.zeros(flat_scores.shape[0], dtype=bool)
        for code, cells in enumerate(columns):
            voted = int(counts[code // heads])
            keep[cells[:front]] = True
            keep[cells[len(cells) - recent:]] = True
            middle = cells[front:len(cells) - recent]
            pooled = pool_scores(flat_scores[middle][None], self.kernel, self.pooling)[0]
            keep[middle[np.argsort(-pooled, kind="stable")[:voted]]] = True
        return keep.reshape(scores.shape)

    def describe(self) -> str:
        return (f"pyramidkv:budget={self.budget},window={self.window},kernel={self.kernel},"
                f"pooling={self.pooling.value},sinks={self.sinks},beta={self.beta:g}"
                f"{option_suffix('recent', self.recent)}")


__all__ = ["PyramidKV", "layer_counts"]
