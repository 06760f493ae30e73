"""What every fuser shares: reading caches as K/V arrays, the guarded `fuse` (tenants, redaction, DP) and the
in-place write-back.

Two levels, so that training (later) and serving use the same math:
- `fused_layers(src, tgt, active)` is pure: lists of per-layer `(K, V)` arrays `[B, H, N, D]` in, the same out.
  It is an ordinary function of the fuser's parameters, so `mlx.nn.value_and_grad` can train through it.
  A layer that is not active comes back as the receiver's very own arrays (same Python objects), which is how
  "untouched" is proved cheaply downstream (no noise, no write).
- `fuse(src_cache, tgt_cache, ...)` is the serving entry point (the seed's signature): it checks tenants before
  reading anything, combines the redaction mask with the fuser's own gates (a closed gate, exactly 0, is the same
  as a redacted layer: the layer is not written at all, so it stays bit-identical), runs `fused_layers` in eval
  mode, optionally applies DP, and writes the changed layers back into `tgt_cache` in place. It returns
  `tgt_cache`, which `mlx_lm.generate_step(..., prompt_cache=...)` and the engine can decode from directly.

Caches may be `ArenaKVCache` lists (`cortexstream.make_prompt_cache`), mlx-lm `KVCache` lists, or plain lists
of `(K, V)` arrays (then a new list is returned and nothing is mutated).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from cortexstream.c2c.safety import DPConfig, check_tenants, count_released_rows, normalize_layer_mask, privatize_layers
from cortexstream.errors import InvalidArgumentError

LayerKV = tuple[mx.array, mx.array]


def _is_pair(item: Any) -> bool:
    return isinstance(item, (tuple, list)) and len(item) == 2 and all(isinstance(a, mx.array) for a in item)


def read_layers(cache: Sequence[Any], what: str) -> list[LayerKV]:
    """Per-layer `(K, V)` `[B, H, N, D]` from a cache list (ArenaKVCache, mlx-lm KVCache) or `(K, V)` pairs."""
    if cache is None or len(cache) == 0:
        raise InvalidArgumentError(f"{what}: no layers")
    out: list[LayerKV] = []
    for i, layer in enumerate(cache):
        if _is_pair(layer):
            k, v = layer
        else:
            state = getattr(layer, "state", None)
            if state is None:
                raise InvalidArgumentError(f"{what}: layer {i} is neither a cache nor a (K, V) pair")
            kind = type(layer).__name__
            if "Rotating" in kind or "Quantized" in kind:
                raise InvalidArgumentError(f"{what}: layer {i} is a {kind}; fusion needs plain caches whose slots "
                                           "are token positions (ArenaKVCache or KVCache)")
            if len(state) == 0 or state[0] is None:
                raise InvalidArgumentError(f"{what}: layer {i} holds no tokens (prefill it first)")
            k, v = state[0], state[1]
            if len(state) == 3 and isinstance(state[2], int):  # mlx-lm KVCache: (buffer, buffer, offset)
                k, v = k[..., : state[2], :], v[..., : state[2], :]
            if not isinstance(k, mx.array):
                raise InvalidArgumentError(f"{what}: layer {i} state is not a (K, V) array pair ({kind})")
        if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
            raise InvalidArgumentError(f"{what}: layer {i} K/V shapes {k.shape}/{v.shape} are not [B, H, N, D]")
        out.append((k, v))
    return out


def write_layers(cache: Sequence[Any], fused: Sequence[LayerKV], target: Sequence[LayerKV]) -> Any:
    """Write the layers fusion changed back into `cache` (in place); arrays in, new list out."""
    if all(_is_pair(layer) for layer in cache):
        return [(k, v) for k, v in fused]
    changed = [i for i, (f, t) in enumerate(zip(fused, target)) if f[0] is not t[0] or f[1] is not t[1]]
    # Materialise before writing: the receiver's arrays may be lazy views of the very buffers we overwrite.
    mx.eval([fused[i] for i in changed])
    arenas = {}
    for i in changed:
        seq = getattr(cache[i], "sequence", None)
        if seq is not None:  # ArenaKVCache: the setter writes into the arena (copy-on-write for shared blocks)
            cache[i].state = fused[i]
            arenas[id(seq.arena)] = seq.arena
        elif len(cache[i].state) == 3:  # mlx-lm KVCache
            cache[i].state = (fused[i][0], fused[i][1], fused[i][0].shape[2])
        else:
            cache[i].state = fused[i]
    for arena in arenas.values():
        mx.eval(arena.arrays())
    return cache


def check_same_tokens(src: LayerKV, tgt: LayerKV, s: int, t: int) -> None:
    if src[0].shape[0] != tgt[0].shape[0] or src[0].shape[2] != tgt[0].shape[2]:
        raise InvalidArgumentError(
            f"source layer {s} has batch x tokens {src[0].shape[0]} x {src[0].shape[2]}, target layer {t} has "
            f"{tgt[0].shape[0]} x {tgt[0].shape[2]}: fuse token-aligned caches (see c2c.alignment.TokenAligner)"
        )


class CacheFuser(nn.Module):
    """Base class: subclasses define `fused_layers`, `open_layers` and `num_target_layers`."""

    num_target_layers: int

    def __init__(self) -> None:
        super().__init__()
        self.last_released_rows = 0  # rows the last `fuse` changed: feed to safety.dp_epsilon

    # --- subclass API -----------------------------------------------------------------------------------------
    def fused_layers(
        self, src: Sequence[LayerKV], tgt: Sequence[LayerKV], active: Sequence[bool] | None = None
    ) -> list[LayerKV]:
        """Pure, differentiable fusion; inactive layers return the receiver's own arrays."""
        raise NotImplementedError

    def open_layers(self, num_source_layers: int) -> list[bool]:
        """Receiver layers this fuser would change at inference (mapped, gate not exactly closed)."""
        raise NotImplementedError

    def __call__(
        self, src: Sequence[LayerKV], tgt: Sequence[LayerKV], active: Sequence[bool] | None = None
    ) -> list[LayerKV]:
        return self.fused_layers(src, tgt, active)

    def _check_target_layers(self, n: int) -> None:
        if n != self.num_target_layers:
            raise InvalidArgumentError(f"tgt_cache has {n} layers, the fuser was built for {self.num_target_layers}")

    # --- serving ----------------------------------------------------------------------------------------------
    def fuse(
        self,
        src_cache: Sequence[Any],
        tgt_cache: Sequence[Any],
        layer_mask: Any = None,
        src_tenant: Any = None,
        tgt_tenant: Any = None,
        allow_cross_tenant: bool = False,
        *,
        dp: DPConfig | None = None,
    ) -> Any:
        """Fuse the sharer's cache into the receiver's, in place; returns `tgt_cache`.

        layer_mask: per receiver layer, 1 = fuse, 0 = redact (left bit-identical); None = all layers.
        src_tenant / tgt_tenant: must be equal (None only equals None) unless allow_cross_tenant=True,
            else PermissionError before any cache is read.
        dp: optional clipping + Gaussian noise on what fusion adds (off by default); see safety.DPConfig.
        """
        check_tenants(src_tenant, tgt_tenant, allow_cross_tenant)
        src = read_layers(src_cache, "src_cache")
        tgt = read_layers(tgt_cache, "tgt_cache")
        self._check_target_layers(len(tgt))
        mask = normalize_layer_mask(layer_mask, len(tgt))
        active = [m and g for m, g in zip(mask, self.open_layers(len(src)))]
        was_training = self.training
        self.eval()
        try:
            fused = self.fused_layers(src, tgt, active)
        finally:
            self.train(was_training)
        if dp is not None:
            fused = privatize_layers(fused, tgt, dp)
        self.last_released_rows = count_released_rows(fused, tgt)
        return write_layers(tgt_cache, fused, tgt)
