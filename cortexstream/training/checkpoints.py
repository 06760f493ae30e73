"""Training checkpoints shared by the trainers (compressor, sidecar, C2C): weights, optimizer state and a JSON
state, each written to a temporary file and renamed, so an interrupted save never leaves a torn checkpoint."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import mlx.core as mx
import mlx.optimizers as optim
from mlx.utils import tree_flatten


def atomic_write(path: str, write: Callable[[str], None]) -> None:
    """`write(tmp)` then rename over `path` (a .safetensors temp name keeps its suffix: MLX appends one otherwise)."""
    tmp = path + ".tmp" + (".safetensors" if path.endswith(".safetensors") else "")
    write(tmp)
    os.replace(tmp, path)


def save_checkpoint(out_dir: str, weights_name: str, save_weights: Callable[[str], None],
                    optimizer: optim.Optimizer, state: dict[str, Any]) -> None:
    """`<weights_name>` via `save_weights(path)`, `optimizer.safetensors` and `state.json` in `out_dir`."""
    atomic_write(os.path.join(out_dir, weights_name), save_weights)
    atomic_write(os.path.join(out_dir, "optimizer.safetensors"),
                 lambda p: mx.save_safetensors(p, dict(tree_flatten(optimizer.state))))

    def write_json(p: str) -> None:
        with open(p, "w", encoding="utf-8") as fh:
            json.dump(state, fh, indent=1)

    atomic_write(os.path.join(out_dir, "state.json"), write_json)
