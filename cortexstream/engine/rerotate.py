"""Re-rotation of cached keys for StreamingLLM's "positions inside the cache" mode (`StreamingLLM(rerotate=True)`).

Cached keys are post-RoPE: key j holds R(p_j) k_j for its position p_j. After eviction the paper's StreamingLLM
numbers the cache's slots 0..n-1 and gives new tokens position n, so positions never exceed the cache size (and
never leave the model's training context, which is what makes long streams stay flat). A RoPE rotation composes
additively, R(a) R(b) = R(a + b), so moving a key from position p to position i is one more rotation by i - p:
applied here with the model's own RoPE module at a (negative) offset, every token of a run sharing its shift.
Only RoPE variants that are pure rotations qualify (mlx's `nn.RoPE`, mlx-lm's `Llama3RoPE`); YaRN also rescales
the vector (mscale) and is refused, as is a model whose RoPE module cannot be found.
"""

from __future__ import annotations

from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from cortexstream.errors import InvalidArgumentError

KeyRotator = Callable[[mx.array, int], mx.array]  # (keys [H, n, D], shift) -> keys moved `shift` positions back

_PURE_ROTATIONS = ("RoPE", "Llama3RoPE")


def find_rope(model: Any) -> Any:
    """The model's RoPE module (the first layer's attention `rope`, as in mlx-lm's llama/qwen2/mistral)."""
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None) or getattr(model, "layers", None)
    attention = getattr(layers[0], "self_attn", None) if layers else None
    rope = getattr(attention, "rope", None)
    if rope is None:
        raise InvalidArgumentError("rerotate: the model has no layers[0].self_attn.rope; re-rotation is unsupported")
    if type(rope).__name__ not in _PURE_ROTATIONS or not isinstance(rope, nn.Module):
        raise InvalidArgumentError(
            f"rerotate: the model's RoPE ({type(rope).__name__}) is not a pure rotation; use rerotate=0"
        )
    return rope


def key_rotator(model: Any) -> KeyRotator:
    """A function moving post-RoPE keys back by `shift` positions with the model's own RoPE."""
    rope = find_rope(model)

    def rotate(keys: mx.array, shift: int) -> mx.array:
        heads, n, dim = keys.shape
        # One position per row: [H*n, 1, D] puts every key at offset -shift.
        moved = rope(keys.reshape(heads * n, 1, dim).astype(mx.float32), offset=-int(shift))
        return moved.reshape(heads, n, dim).astype(keys.dtype)

    return rotate


def renumber(seq: Any, positions: list[np.ndarray], rotate: KeyRotator) -> None:
    """Move every layer's slots to positions 0..n-1 (in place in the arena) and set the logical offset to n.

    positions[l]: `[kv_heads, n]` current positions of the slots (equal across heads: one index list evicts all).
    """
    n = seq.num_tokens
    target = np.arange(n)
    with seq.arena.lock:
        for layer, pos in enumerate(positions):
            if pos.shape[1] != n or not (pos == pos[:1]).all():
                raise InvalidArgumentError("rerotate: slot positions differ between heads or from the cache")
            shift = pos[0] - target
            changes = np.flatnonzero(np.diff(shift)) + 1
            starts = np.concatenate([[0], changes]).astype(int)
            stops = np.concatenate([changes, [n]]).astype(int)
            for start, stop in zip(starts, stops):
                if shift[start] == 0 or start == stop:
                    continue
                keys, values = seq.arena.read(layer, seq.blocks, n)
                moved = rotate(keys[:, start:stop], int(shift[start]))
                kept_values = values[:, start:stop]
                mx.eval(moved, kept_values)  # materialise before the same buffer is overwritten in place
                seq.arena.write(layer, seq.blocks, start, moved, kept_values)
            positions[layer] = np.broadcast_to(target, pos.shape).copy()
            seq.offsets[layer] = n
        mx.eval(seq.arena.arrays())
