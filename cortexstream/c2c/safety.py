"""Safety around cache fusion: tenant isolation, layer redaction masks, and optional Gaussian noise (DP).

Why these three (the seed's "Security Considerations", done so that each promise can be tested):
- Tenant isolation fails closed. `check_tenants` runs before any cache is read. Tenants are compared with `==`,
  so `None` (no tenant) only matches `None`: an anonymous source never reaches a named receiver by accident.
- Redaction: a layer mask is about the *receiver's* layers (1 = fuse, 0 = leave this layer bit-identical).
  Only 0/1 values are accepted: a fractional mask could mean "scale" or "threshold", and guessing wrong would leak.
- Differential privacy: what leaves the sharer is the per-row change of the receiver's cache,
  `delta = fused - target`, one row = one (layer, token, K-or-V) vector over all heads (`H * D` numbers).
  Each row is clipped to L2 norm `clip_norm` (else the noise scale would mean nothing: an unbounded delta has
  unbounded sensitivity) and Gaussian noise with std `noise_multiplier * clip_norm` is added per coordinate.
  `dp_epsilon` gives the (epsilon, delta) this buys; see README.md for what it does and does not protect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

from cortexstream.errors import InvalidArgumentError


def check_tenants(src_tenant: Any, tgt_tenant: Any, allow_cross_tenant: bool = False) -> None:
    """Raise PermissionError when the sharer's and receiver's tenants differ, unless explicitly allowed."""
    if src_tenant != tgt_tenant and not allow_cross_tenant:
        raise PermissionError(
            f"cross-tenant cache fusion refused: source tenant {src_tenant!r} != target tenant {tgt_tenant!r} "
            "(pass allow_cross_tenant=True only if both parties agreed to share)"
        )


def normalize_layer_mask(layer_mask: Any, num_layers: int) -> list[bool]:
    """A mask over the receiver's layers as booleans (True = fuse). None means every layer."""
    if layer_mask is None:
        return [True] * num_layers
    values = np.asarray(layer_mask.tolist() if isinstance(layer_mask, mx.array) else layer_mask)
    if values.ndim != 1 or values.shape[0] != num_layers:
        raise InvalidArgumentError(f"layer_mask: expected {num_layers} entries (one per receiver layer), "
                                   f"got shape {values.shape}")
    if values.dtype != bool and not np.isin(values, (0, 1)).all():
        raise InvalidArgumentError(f"layer_mask: entries must be 0/1 or booleans (1 = fuse, 0 = redact), "
                                   f"got {values.tolist()}")
    return [bool(v) for v in values]


@dataclass(frozen=True)
class DPConfig:
    """Per-row clipping and Gaussian noise on what fusion adds to the receiver's cache.

    clip_norm: C, the L2 bound of each (layer, token, K-or-V) row of `fused - target` (all heads together).
    noise_multiplier: z; the noise std is `z * C` per coordinate. 0 means clip only (no privacy, just a bound).
    seed: PRNG seed for the noise (None draws from MLX's global generator). Fixed seeds are for tests only:
        reusing a seed across releases lets noise cancel and voids the guarantee.
    """

    clip_norm: float
    noise_multiplier: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.clip_norm, (int, float)) and math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise InvalidArgumentError(f"clip_norm: {self.clip_norm!r} must be a positive finite number")
        if not (isinstance(self.noise_multiplier, (int, float)) and math.isfinite(self.noise_multiplier)
                and self.noise_multiplier >= 0):
            raise InvalidArgumentError(f"noise_multiplier: {self.noise_multiplier!r} must be >= 0")

    @property
    def noise_std(self) -> float:
        return float(self.noise_multiplier * self.clip_norm)


def clip_rows(delta: mx.array, clip_norm: float) -> mx.array:
    """Scale each token's row (all heads of one position) of `[B, H, N, D]` to L2 norm <= clip_norm."""
    b, h, n, d = delta.shape
    rows = delta.astype(mx.float32).transpose(0, 2, 1, 3).reshape(b, n, h * d)
    norms = mx.sqrt(mx.sum(rows * rows, axis=-1, keepdims=True))
    scale = mx.minimum(1.0, clip_norm / mx.maximum(norms, 1e-12))
    return (rows * scale).reshape(b, n, h, d).transpose(0, 2, 1, 3)


def privatize(fused: mx.array, target: mx.array, config: DPConfig, key: mx.array | None = None) -> mx.array:
    """`target + clip(fused - target) + N(0, (z C)^2)`, computed in float32, returned in target's dtype."""
    delta = clip_rows(fused.astype(mx.float32) - target.astype(mx.float32), config.clip_norm)
    if config.noise_std > 0:
        delta = delta + config.noise_std * mx.random.normal(delta.shape, dtype=mx.float32, key=key)
    return (target.astype(mx.float32) + delta).astype(target.dtype)


def privatize_layers(
    fused: Sequence[tuple[mx.array, mx.array]],
    target: Sequence[tuple[mx.array, mx.array]],
    config: DPConfig,
) -> list[tuple[mx.array, mx.array]]:
    """Apply `privatize` to every array fusion changed. An array returned as the very same object as the
    receiver's (a redacted layer, a closed gate) carries nothing from the sharer and gets no noise, so redacted
    layers stay bit-identical under DP too."""
    base = mx.random.key(config.seed) if config.seed is not None else None
    keys = iter(mx.random.split(base, 2 * len(fused))) if base is not None else None
    out = []
    for (fk, fv), (tk, tv) in zip(fused, target):
        kk, kv = (next(keys), next(keys)) if keys is not None else (None, None)
        out.append((fk if fk is tk else privatize(fk, tk, config, kk),
                    fv if fv is tv else privatize(fv, tv, config, kv)))
    return out


def count_released_rows(
    fused: Sequence[tuple[mx.array, mx.array]], target: Sequence[tuple[mx.array, mx.array]]
) -> int:
    """Rows (layer x token x K-or-V, batch included) that fusion changed: the `rows` to pass to `dp_epsilon`."""
    rows = 0
    for (fk, fv), (tk, tv) in zip(fused, target):
        for f, t in ((fk, tk), (fv, tv)):
            if f is not t:
                rows += t.shape[0] * t.shape[2]
    return rows


def dp_epsilon(noise_multiplier: float, rows: int, delta: float = 1e-6) -> float:
    """(epsilon, delta)-DP of one fusion that released `rows` noised rows, for the sharer's whole context.

    Neighbouring inputs: any two sharer contexts (replace-one of the *entire* contribution). Every released row
    can move by at most 2C, so the release is a Gaussian mechanism with L2 sensitivity 2C*sqrt(rows) and
    std zC: rho-zCDP with rho = 2*rows/z^2 (Bun & Steinke 2016), converted by eps = rho + 2*sqrt(rho*ln(1/delta)).
    Several fusions compose: add their rows. Returns inf without noise.
    """
    if rows < 0 or not 0 < delta < 1:
        raise InvalidArgumentError(f"dp_epsilon: rows={rows} must be >= 0 and delta={delta} in (0, 1)")
    if rows == 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    rho = 2.0 * rows / noise_multiplier**2
    return rho + 2.0 * math.sqrt(rho * math.log(1.0 / delta))
