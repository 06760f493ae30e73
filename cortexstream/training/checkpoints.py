"""Training checkpoints shared by the trainers (compressor, sidecar, C2C): weights, optimizer state and a JSON
state, each written to a temporary file and renamed, so an interrupted save never leaves a torn checkpoint."""

from __future__ import annotations

import os
from typing import Any, Callable

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten

from cortexstream.atomic_files import atomic_write, write_json_atomic


def save_checkpoint(out_dir: str, weights_name: str, save_weights: Callable[[str], None],
                    optimizer: optim.Optimizer, state: dict[str, Any]) -> None:
    """`<weights_name>` via `save_weights(path)`, `optimizer.safetensors` and `state.json` in `out_dir`."""
    atomic_write(os.path.join(out_dir, weights_name), save_weights)
    atomic_write(os.path.join(out_dir, "optimizer.safetensors"),
                 lambda p: mx.save_safetensors(p, dict(tree_flatten(optimizer.state))))
    write_json_atomic(os.path.join(out_dir, "state.json"), state, indent=1)
