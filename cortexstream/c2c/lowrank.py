"""The seed's fuser: per-layer low-rank projector plus a learnable per-layer gate, for same-shaped caches.

Form (seed `C2C (Cache-to-Cache): Cross-Model KV Cache Fusion`, sections "Cache Projector", "Layer Gate",
"Fusion Operation"): per receiver layer l,
    P_l(x) = up_l(down_l(x))            (head_dim -> rank -> head_dim, bias-free, applied per head and token)
    g_l    = sigmoid(alpha_l)           (alpha initialised to 0, i.e. g = 0.5, as the seed)
    K_t   <- (1 - g_l) K_t + g_l P_l(K_s),   V_t <- (1 - g_l) V_t + g_l P_l(V_s)
Module names (`k_down`, `k_up`, `v_down`, `v_up`, `alpha`) follow the seed so its state dicts port by name.

Choices where the seed is silent:
- It needs the same KV-head count and head_dim on both sides (it blends element-wise); different shapes raise
  and point to `C2CProjectorFuser`. If the layer counts differ, receiver layer l reads the sharer layer given by
  the last-aligned map (alignment.last_aligned), as the paper does; equal counts map l -> l.
- A gate of exactly 0 (alpha = -inf, or sigmoid underflow) means "do not touch": the layer is skipped, so the
  receiver stays bit-identical rather than `1 * K + 0 * P(K)` (which turns -0.0 into +0.0 and inf*0 into NaN).
- Arithmetic is float32; the result is cast to the receiver's dtype.
- An untrained fuser (random projector, g = 0.5) overwrites half of the receiver's cache with noise: it exists
  to be trained (or loaded), not served. Use `gate_init=-inf` for a fuser that starts as the identity.
"""

from __future__ import annotations

import math
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cortexstream.c2c.alignment import last_aligned
from cortexstream.c2c.fusion import CacheFuser, LayerKV, check_same_tokens
from cortexstream.errors import InvalidArgumentError


class CacheProjector(nn.Module):
    """Low-rank K and V maps for one layer: head_dim -> rank -> head_dim (seed's `CacheProjector`)."""

    def __init__(self, head_dim: int, rank: int = 64) -> None:
        super().__init__()
        if head_dim < 1 or rank < 1:
            raise InvalidArgumentError(f"CacheProjector: head_dim={head_dim} and rank={rank} must be >= 1")
        self.k_down = nn.Linear(head_dim, rank, bias=False)
        self.k_up = nn.Linear(rank, head_dim, bias=False)
        self.v_down = nn.Linear(head_dim, rank, bias=False)
        self.v_up = nn.Linear(rank, head_dim, bias=False)

    def __call__(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return self.k_up(self.k_down(keys)), self.v_up(self.v_down(values))


class LayerGate(nn.Module):
    """g = sigmoid(alpha), one learnable logit per receiver layer (seed's `LayerGate`)."""

    def __init__(self, n_layers: int, init: float = 0.0) -> None:
        super().__init__()
        self.alpha = mx.full((n_layers,), init, dtype=mx.float32)

    def __call__(self) -> mx.array:
        return mx.sigmoid(self.alpha)


class C2CFuser(CacheFuser):
    """`C2CFuser(n_layers=..., head_dim=..., rank=...)`; `fuse(src_cache, tgt_cache, ...)` as in the seed."""

    def __init__(self, n_layers: int, head_dim: int, rank: int = 64, gate_init: float = 0.0) -> None:
        super().__init__()
        if n_layers < 1:
            raise InvalidArgumentError(f"C2CFuser: n_layers={n_layers} must be >= 1")
        self.n_layers, self.head_dim, self.rank = int(n_layers), int(head_dim), int(rank)
        self.projectors = [CacheProjector(head_dim, rank) for _ in range(n_layers)]
        self.gate = LayerGate(n_layers, gate_init)
        self.eval()

    @property
    def num_target_layers(self) -> int:
        return self.n_layers

    def layer_map(self, num_source_layers: int) -> dict[int, int]:
        """Receiver layer -> sharer layer: identity for equal depths, else last-aligned (clamped)."""
        if num_source_layers == self.n_layers:
            return {t: t for t in range(self.n_layers)}
        return {t: s[0] for t, s in last_aligned(self.n_layers, num_source_layers).items()}

    def open_layers(self, num_source_layers: int) -> list[bool]:
        gates = np.array(self.gate())
        return [bool(g > 0) for g in gates]

    def config(self) -> dict[str, int | float]:
        return {"n_layers": self.n_layers, "head_dim": self.head_dim, "rank": self.rank}

    def _check(self, src: LayerKV, tgt: LayerKV, s: int, t: int) -> None:
        check_same_tokens(src, tgt, s, t)
        for name, (k, v) in (("source", src), ("target", tgt)):
            if k.shape[3] != self.head_dim or v.shape[3] != self.head_dim:
                raise InvalidArgumentError(
                    f"{name} layer {s if name == 'source' else t}: head_dim {k.shape[3]}/{v.shape[3]}, fuser has "
                    f"{self.head_dim}; for models of different shapes use C2CProjectorFuser")
        if src[0].shape[1] != tgt[0].shape[1]:
            raise InvalidArgumentError(
                f"source layer {s} has {src[0].shape[1]} KV heads, target layer {t} has {tgt[0].shape[1]}: the "
                "low-rank form blends head by head; use C2CProjectorFuser for different head counts")

    def fused_layers(
        self, src: Sequence[LayerKV], tgt: Sequence[LayerKV], active: Sequence[bool] | None = None
    ) -> list[LayerKV]:
        self._check_target_layers(len(tgt))
        mapping = self.layer_map(len(src))
        gates = self.gate()
        out: list[LayerKV] = []
        for t, (kt, vt) in enumerate(tgt):
            if active is not None and not active[t]:
                out.append((kt, vt))
                continue
            s = mapping[t]
            self._check(src[s], (kt, vt), s, t)
            ks, vs = src[s]
            pk, pv = self.projectors[t](ks.astype(mx.float32), vs.astype(mx.float32))
            g = gates[t]
            k = (1 - g) * kt.astype(mx.float32) + g * pk
            v = (1 - g) * vt.astype(mx.float32) + g * pv
            out.append((k.astype(kt.dtype), v.astype(vt.dtype)))
        return out

    def close_gates(self, layers: Sequence[int] | None = None) -> None:
        """Set g = 0 exactly (alpha = -inf) on `layers` (all by default): those layers become the identity."""
        alpha = np.array(self.gate.alpha)
        alpha[list(range(self.n_layers)) if layers is None else list(layers)] = -math.inf
        self.gate.alpha = mx.array(alpha)
