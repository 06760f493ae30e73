"""Mean pooling: the untrained baseline of the merging policies (`merging`).

Every window of `window` raw tokens past the sinks becomes one slot holding the mean key and the mean value.
With `log_mass` (default) the slot also gets +log(window) on its attention logits, so it weighs like the window
it replaced: if the window's keys were all equal, attention over the pooled slot would then be exactly attention
over the window (mass-weighted pooling is the first-order bead of `cortexstream.sidecar`, with uniform weights).
Without it, a pooled slot competes like a single token. Baseline for the learned compressor and the sidecar.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import mlx.core as mx
import numpy as np

from cortexstream.policies.merging import Merged, MergingPolicy


@dataclass(frozen=True)
class MeanPool(MergingPolicy):
    """Replace each window of `window` old tokens by its mean key/value (sinks and `recent` tokens stay raw)."""

    log_mass: bool = True

    name = "meanpool"
    merges_per_head = True  # each head averages its own keys/values over windows the lengths and mass fix
    parse_keys: ClassVar[dict[str, str]] = {**MergingPolicy.parse_keys, "log_mass": "bool"}

    @property
    def uses_logit_bias(self) -> bool:  # type: ignore[override]
        return self.log_mass

    def merge(self, layer: int, keys: mx.array, values: mx.array, mass: np.ndarray) -> Merged:
        heads = keys.shape[0]
        weights = mx.array(np.asarray(mass, np.float32).reshape(-1, self.window))  # [W, window]
        total = weights.sum(axis=-1)  # [W]
        w = (weights / total[:, None])[None, :, :, None]
        pooled_k = (self.windows_of(keys).astype(mx.float32) * w).sum(axis=2).astype(keys.dtype)
        pooled_v = (self.windows_of(values).astype(mx.float32) * w).sum(axis=2).astype(values.dtype)
        bias = None
        if self.log_mass:
            bias = np.broadcast_to(np.log(np.asarray(total)), (heads, total.shape[0])).astype(np.float32)
        return Merged(pooled_k, pooled_v, bias)

    def describe(self) -> str:
        return super().describe() + ("" if self.log_mass else ",log_mass=0")

