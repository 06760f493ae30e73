"""Merging policies: shrink the cache by replacing windows of old tokens with fewer synthesised slots.

Eviction (`select` -> `SequenceKV.keep`) chooses tokens; a merging policy synthesises new ones (a learned
compressor, a sidecar bead, mean pooling, token merging) and writes them through `SequenceKV.replace`, which frees
the blocks the range no longer needs. The cache of a sequence is kept in three parts:

    [ sinks raw tokens | merged slots (oldest text) | raw tail: tokens not yet merged, the last `recent` of them protected ]

After every forward pass the runtime (`PolicyState.merge`) asks `merge_range` for a physical range to merge, reads
that range's K/V for every layer, calls `merge(layer, keys, values, mass)` and writes the result in place; it
repeats until `merge_range` returns None. The default `merge_range` takes every complete window of `window` raw
tokens between the merged slots and the protected recent tail, so between forward passes the raw tail holds fewer
than `recent + window` tokens and the physical size is about `sinks + recent + (context - sinks - recent) *
slots_per_window / window`.

Bookkeeping kept by the runtime, per physical slot: `mass` (how many original tokens it stands for; the same in
every layer and head, since `replace` edits one range in all layers), `positions` (the newest logical position
it covers) and `bias` (an additive attention-logit bias per layer and KV head, e.g. a bead's log-mass; 0 for raw
tokens). A policy with `uses_logit_bias` gets its biases added to the attention logits through the SDPA hook
(`engine.attention_hook`), in single-sequence and batched decode alike. Keys stay post-RoPE and are never re-rotated:
a merged slot has no position of its own, and new tokens continue from the logical length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import math

import mlx.core as mx
import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import KVPolicy, check_count


@dataclass
class Merged:
    """What `merge` returns for one layer: M new slots for a range of N physical slots.

    keys `[H, M, Dk]`, values `[H, M, Dv]`; bias `[H, M]` (additive logit bias, e.g. log-mass) or None for 0;
    sizes: how many consecutive physical slots of the range each new slot replaces (sum N), or None for N // M each.
    """

    keys: mx.array
    values: mx.array
    bias: mx.array | np.ndarray | None = None
    sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class MergingPolicy(KVPolicy):
    """Base for window-merging policies: every `window` raw tokens past the sinks become `slots_per_window`."""

    window: int = 4
    sinks: int = 4
    recent: int = 64

    evicts = True  # the runtime keeps a PolicyState for it (edits the cache)
    merges = True
    uses_logit_bias = False
    slots_per_window: ClassVar[int] = 1
    parse_keys: ClassVar[dict[str, str]] = {"window": "count", "sinks": "count", "recent": "count"}

    def __post_init__(self) -> None:
        check_count("window", self.window, 2)
        check_count("sinks", self.sinks, 0)
        check_count("recent", self.recent, 0)
        if self.slots_per_window >= self.window:
            raise InvalidArgumentError(f"{self.name}: window {self.window} must exceed {self.slots_per_window} slots")

    # --- sizes ------------------------------------------------------------------------------------------------
    def budget_tokens(self, context: int) -> int:
        """Largest physical size between forward passes for a request of `context` tokens."""
        raw = self.sinks + self.recent + self.window - 1
        windows = max(0, math.ceil((int(context) - self.sinks - self.recent) / self.window))
        return min(int(context), raw + windows * self.slots_per_window) if context > 0 else raw

    def compression_ratio(self) -> float:
        return self.window / self.slots_per_window

    # --- the runtime's calls ----------------------------------------------------------------------------------
    def merge_range(self, num_physical: int, context: int, mass: np.ndarray) -> tuple[int, int] | None:
        """Physical slots [start, end) to merge now, or None. `mass[i]`: original tokens slot i stands for."""
        first_raw = self.first_raw_slot(mass)
        mergeable = num_physical - self.recent - first_raw
        windows = mergeable // self.window
        if windows <= 0:
            return None
        return first_raw, first_raw + windows * self.window

    def first_raw_slot(self, mass: np.ndarray) -> int:
        """First slot of the raw tail: after the sinks and after the last merged slot."""
        merged = np.flatnonzero(np.asarray(mass)[self.sinks:] != 1)
        return self.sinks + (int(merged[-1]) + 1 if merged.size else 0)

    def merge(self, layer: int, keys: mx.array, values: mx.array, mass: np.ndarray) -> Merged:
        """Merge one layer's range: keys `[H, N, Dk]`, values `[H, N, Dv]` (N a multiple of `window`)."""
        raise NotImplementedError

    def merge_from_arena(self, layer: int, arena: Any, blocks: list[int], start: int, end: int,
                         mass: np.ndarray) -> Merged:
        """Merge physical slots [start, end) of a sequence (block table `blocks`) in one layer of `arena`; what the
        runtime calls. By default the range is read out and given to `merge`; policies with a kernel that reads
        the arena through the block table (the compressor, the sidecar) override it so the range is never
        gathered into a separate tensor first."""
        keys, values = arena.read(layer, blocks, end)
        return self.merge(layer, keys[:, start:end], values[:, start:end], mass)

    def describe(self) -> str:
        return f"{self.name}:window={self.window},sinks={self.sinks},recent={self.recent}"

    def windows_of(self, array: mx.array) -> mx.array:
        """`[H, N, D]` -> `[H, N // window, window, D]`."""
        heads, n, dim = array.shape
        return array.reshape(heads, n // self.window, self.window, dim)


def describe_extra(base: str, **values: Any) -> str:
    extra = ",".join(f"{k}={v}" for k, v in values.items() if v is not None)
    return f"{base},{extra}" if extra else base
