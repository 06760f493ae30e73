"""Weights must be finite: a NaN or inf in a checkpoint is a broken file, found at load time rather than as
garbage text many tokens later."""

from __future__ import annotations

from typing import Mapping

import mlx.core as mx

from cortexstream.errors import ModelLoadError


def check_finite(tensors: Mapping[str, mx.array], source: str) -> None:
    """Raise ModelLoadError naming `source` and the first tensor that holds a NaN or an infinity."""
    for name in sorted(tensors):
        array = tensors[name]
        if not mx.issubdtype(array.dtype, mx.floating):
            continue
        if not bool(mx.all(mx.isfinite(array)).item()):
            bad = int(mx.sum(mx.logical_not(mx.isfinite(array))).item())
            raise ModelLoadError(f"{source}: tensor '{name}' holds {bad} NaN/inf values of {array.size} "
                                 "(corrupt or diverged weights)")
