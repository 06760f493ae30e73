"""Token Merging baseline (after ToMe, Bolya et al. 2023, applied to the KV cache): inside each window of old
tokens, repeatedly merge the two most cosine-similar keys until `slots` remain.

Per layer and KV head, each window of `window` raw tokens is reduced greedily: the pair of current slots whose
keys have the highest cosine similarity becomes one slot holding the size-weighted mean key and value (sizes
start at each slot's mass, 1 for raw tokens), until `slots` slots are left. Each head may merge different pairs:
keys are post-RoPE, so a merged slot needs no position, and attention is order-free over the keys it sees.
With `log_mass` (ToMe's "proportional attention") a slot of size s also gets +log(s) on its attention logits, so
it weighs like the s tokens it replaced; without it, it competes like one token.

Bookkeeping. The runtime keeps one mass/position row for all layers and heads (`merging`), but different heads
merge different tokens, so `Merged.sizes` is nominal: each window's `slots` output slots are booked as
consecutive runs of (nearly) equal length. The true per-head group sizes live only in the logit bias. Greedy
merging is O(window^3) per window, batched over every (head, window) of a range with numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import check_count
from cortexstream.policies.merging import Merged, MergingPolicy


def greedy_merge(keys: np.ndarray, values: np.ndarray, sizes: np.ndarray,
                 slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batched greedy merging: keys [B, N, Dk], values [B, N, Dv], sizes [B, N] -> ([B, M, Dk], [B, M, Dv], [B, M]).

    Each step merges, in every row, the pair (i < j) of live slots with the highest key cosine similarity (ties:
    the first pair in row-major order) into slot i. Surviving slots keep their original order.
    """
    k = keys.astype(np.float64).copy()
    v = values.astype(np.float64).copy()
    s = sizes.astype(np.float64).copy()
    rows, n, _ = k.shape
    alive = np.ones((rows, n), bool)
    upper = np.triu(np.ones((n, n), bool), k=1)
    index = np.arange(rows)
    for _ in range(n - slots):
        unit = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
        sim = unit @ unit.transpose(0, 2, 1)
        valid = upper[None] & alive[:, :, None] & alive[:, None, :]
        flat = np.where(valid, sim, -np.inf).reshape(rows, n * n).argmax(axis=1)
        i, j = np.divmod(flat, n)
        si, sj = s[index, i], s[index, j]
        total = si + sj
        k[index, i] = (k[index, i] * si[:, None] + k[index, j] * sj[:, None]) / total[:, None]
        v[index, i] = (v[index, i] * si[:, None] + v[index, j] * sj[:, None]) / total[:, None]
        s[index, i] = total
        alive[index, j] = False
    keep = np.nonzero(alive)[1].reshape(rows, slots)  # np.nonzero walks row-major: ascending per row
    return (np.take_along_axis(k, keep[..., None], axis=1), np.take_along_axis(v, keep[..., None], axis=1),
            np.take_along_axis(s, keep, axis=1))


@dataclass(frozen=True)
class TokenMerging(MergingPolicy):
    """Merge the most similar keys of each `window` old tokens down to `slots` slots (per layer and KV head)."""

    window: int = 16
    sinks: int = 4
    recent: int = 64
    slots: int = 2
    log_mass: bool = True

    name = "tome"
    merges_per_head = True  # each (head, window) pairs its own keys; the windows come from the lengths and mass
    parse_keys: ClassVar[dict[str, str]] = {**MergingPolicy.parse_keys, "slots": "count", "log_mass": "bool"}

    def __post_init__(self) -> None:
        check_count("slots", self.slots, 1)
        super().__post_init__()
        if 2 * self.slots > self.window:
            # every booked run must stand for >= 2 tokens: the runtime tells merged slots from raw ones by mass != 1
            raise InvalidArgumentError(f"tome: slots {self.slots} must be at most window {self.window} / 2")

    @property
    def slots_per_window(self) -> int:  # type: ignore[override]
        return self.slots

    @property
    def uses_logit_bias(self) -> bool:  # type: ignore[override]
        return self.log_mass

    def nominal_sizes(self, windows: int) -> tuple[int, ...]:
        """Bookkeeping runs per output slot: each window split into `slots` nearly equal consecutive runs."""
        base, extra = divmod(self.window, self.slots)
        one = [base + 1] * extra + [base] * (self.slots - extra)
        return tuple(one * windows)

    def merge(self, layer: int, keys: mx.array, values: mx.array, mass: np.ndarray) -> Merged:
        heads, n, dk = keys.shape
        if n % self.window:
            raise InvalidArgumentError(f"tome: merge range of {n} slots is not a multiple of window {self.window}")
        windows = n // self.window
        k = np.array(self.windows_of(keys).astype(mx.float32)).reshape(heads * windows, self.window, dk)
        v = np.array(self.windows_of(values).astype(mx.float32)).reshape(heads * windows, self.window, -1)
        sizes = np.broadcast_to(np.asarray(mass, np.float64).reshape(1, windows, self.window),
                                (heads, windows, self.window)).reshape(heads * windows, self.window)
        mk, mv, ms = greedy_merge(k, v, sizes, self.slots)
        out_k = mx.array(mk.reshape(heads, windows * self.slots, dk).astype(np.float32)).astype(keys.dtype)
        out_v = mx.array(mv.reshape(heads, windows * self.slots, -1).astype(np.float32)).astype(values.dtype)
        bias = np.log(ms).reshape(heads, windows * self.slots).astype(np.float32) if self.log_mass else None
        return Merged(out_k, out_v, bias, self.nominal_sizes(windows))

    def describe(self) -> str:
        return super().describe() + f",slots={self.slots}" + ("" if self.log_mass else ",log_mass=0")
