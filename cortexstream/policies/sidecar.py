"""Sidecar KV policy (issue #8): every `window` old tokens become one learned bead (`cortexstream.sidecar`).

The cache of a sequence is `[sinks raw | beads | raw tail]` (see `merging`): after every forward pass each
complete window of `window` raw tokens between the beads and the protected `recent` tail is replaced in the arena
(`SequenceKV.replace`, which frees the blocks the range no longer needs) by the bead `SidecarNet` computes from
that window's post-RoPE keys and values, per layer and KV head. Compression of the old text is `window`x.

Bead mass. A bead stands for `window` tokens and must weigh like them: the network returns a log-mass beta per
(KV head, bead) (about log window; see `sidecar.network`), which is `Merged.bias` here. The runtime adds it to
the bead's attention logits through the SDPA hook (`uses_logit_bias`), in single-sequence and batched decode.

Bead position. Keys are post-RoPE and never re-rotated, so a bead keeps the relative-position information its
window's rotated keys carried; new tokens continue from the logical length (the runtime keeps the RoPE offset
counting original tokens, not slots). A bead is booked at its window's newest position.

Weights. `weights=None` picks the file shipped in `cortexstream/sidecar/weights/` whose stored config matches
this window and the cache's shape (KV heads, head_dim; chosen on the first merge, when the shape is known);
`weights=PATH` loads that file (`cortexstream train sidecar --export PATH`). Networks are loaded once per
process and shared (`sidecar.shipped`), so the frozen policy holds only a path and stays hashable.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np

from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.merging import Merged, MergingPolicy, describe_extra


@functools.lru_cache(maxsize=None)
def _shipped_path(window: int, head_dim: int, value_dim: int, num_kv_heads: int) -> str:
    # merge runs once per layer per merged range: scan the weights folder once per shape, not every call
    from cortexstream.sidecar.shipped import find_shipped

    return find_shipped(window, head_dim, value_dim, num_kv_heads)


@dataclass(frozen=True)
class Sidecar(MergingPolicy):
    """Replace each window of `window` old tokens by one learned bead (sinks and `recent` tokens stay raw)."""

    window: int = 16
    sinks: int = 4
    recent: int = 64
    weights: str | None = None

    name = "sidecar"
    uses_logit_bias = True
    parse_keys: ClassVar[dict[str, str]] = {**MergingPolicy.parse_keys, "weights": "str"}

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.weights is not None:
            if not isinstance(self.weights, str) or not self.weights:
                raise InvalidArgumentError(f"sidecar: weights={self.weights!r} must be a file path or None")
            if not os.path.isfile(self.weights):
                raise InvalidArgumentError(f"sidecar: weights file '{self.weights}' does not exist")

    def weights_path(self, num_kv_heads: int, head_dim: int, value_dim: int) -> str:
        """The file this policy uses for a cache of this shape (the given one, or the matching shipped one)."""
        if self.weights is not None:
            return self.weights
        return _shipped_path(self.window, head_dim, value_dim, num_kv_heads)

    def network(self, num_kv_heads: int, head_dim: int, value_dim: int):  # noqa: ANN201 - a SidecarNet
        from cortexstream.sidecar.shipped import load_cached

        path = self.weights_path(num_kv_heads, head_dim, value_dim)
        net = load_cached(path)
        cfg = net.config
        if cfg.window != self.window:
            raise InvalidArgumentError(f"sidecar: weights '{path}' were trained for window {cfg.window}, "
                                       f"not window {self.window}")
        if (cfg.num_kv_heads, cfg.head_dim, cfg.v_dim) != (num_kv_heads, head_dim, value_dim):
            raise InvalidArgumentError(
                f"sidecar: weights '{path}' are for {cfg.num_kv_heads} KV heads x head_dim {cfg.head_dim} "
                f"(values {cfg.v_dim}); this model's cache has {num_kv_heads} x {head_dim} (values {value_dim})")
        return net

    def merge(self, layer: int, keys: mx.array, values: mx.array, mass: np.ndarray) -> Merged:
        heads, n, head_dim = keys.shape
        net = self._network_for(layer, heads, head_dim, values.shape[-1], n, mass)
        k_b, v_b, beta = net.beads_with_mass(self.windows_of(keys), self.windows_of(values), layer)
        return Merged(k_b, v_b, beta)

    def merge_from_arena(self, layer: int, arena: Any, blocks: list[int], start: int, end: int,
                         mass: np.ndarray) -> Merged:
        """The same merge with the windows packed straight from the arena through the block table
        (`kernels.compress_gather.pack_windows`: Metal, or its pure-MLX reference)."""
        from cortexstream.kernels.compress_gather import pack_windows

        cfg = arena.config
        heads, window = cfg.num_kv_heads, self.window
        net = self._network_for(layer, heads, cfg.head_dim, cfg.value_head_dim, end - start, mass)
        count = (end - start) // window

        def windows(buffer: mx.array) -> mx.array:  # [H, count, window * D] -> [H, count, window, D], no copy
            packed = pack_windows(buffer, blocks, start, count, window, cfg.block_size)
            return packed.reshape(heads, count, window, buffer.shape[-1])

        keys, values, blocks = arena.sequence_buffers(layer, blocks, end)
        k_b, v_b, beta = net.beads_with_mass(windows(keys), windows(values), layer)
        return Merged(k_b, v_b, beta)

    def _network_for(self, layer: int, heads: int, head_dim: int, value_dim: int, num_slots: int,
                     mass: np.ndarray):  # noqa: ANN202 - a SidecarNet
        if num_slots % self.window:
            raise InvalidArgumentError(f"sidecar: merge range of {num_slots} slots is not a multiple of window "
                                       f"{self.window}")
        if not (np.asarray(mass) == 1).all():
            # the network was trained on windows of raw tokens; re-merging beads is outside what it learned
            raise InvalidArgumentError("sidecar: can only merge raw tokens (the range holds merged slots)")
        net = self.network(heads, head_dim, value_dim)
        if not 0 <= layer < net.config.num_layers:
            raise InvalidArgumentError(f"sidecar: layer {layer} is outside the {net.config.num_layers} layers the "
                                       "weights were trained for (wrong model?)")
        return net

    def describe(self) -> str:
        return describe_extra(super().describe(), weights=self.weights)
