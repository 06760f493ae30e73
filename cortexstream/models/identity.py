"""A model's identity for caches that outlive a process: a digest of its architecture and its weights.

The disk tier (kv/disk) keys stored KV blocks by it, so a block computed by one model is never read by another.
Hashing every byte of a multi-GB model would cost seconds at each start, so the digest covers every parameter's
name, shape and dtype plus a strided sample of its values (up to `SAMPLE` elements each, spread over the whole
tensor, first and last included): two checkpoints that differ in training or quantization differ in nearly every
element, so any sample tells them apart.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

SAMPLE = 4096


def _sample_bytes(array: mx.array) -> bytes:
    flat = array.reshape(-1)
    n = flat.size
    if n > SAMPLE:
        flat = flat[mx.array(np.linspace(0, n - 1, SAMPLE).astype(np.int64).astype(np.uint32))]
    if flat.dtype == mx.bfloat16:  # numpy has no bfloat16: hash its bits
        flat = flat.view(mx.uint16)
    return np.array(flat).tobytes()


def model_identity(model: Any) -> str:
    """A hex digest of the model's configuration (when it has `args`), parameter names, shapes, dtypes and a
    sample of every parameter's values."""
    h = hashlib.blake2b(digest_size=16)
    args = getattr(model, "args", None)
    if args is not None:
        fields = vars(args) if hasattr(args, "__dict__") else {}
        h.update(json.dumps(fields, sort_keys=True, default=str).encode())
    for name, value in sorted(tree_flatten(model.parameters()), key=lambda item: item[0]):
        h.update(f"{name}|{tuple(value.shape)}|{value.dtype}\x00".encode())
        h.update(_sample_bytes(value))
    return h.hexdigest()


__all__ = ["model_identity"]
