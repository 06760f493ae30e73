"""The record written into the JSON: the shared machine description (`benchmarks.machine`), shapes and settings."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import mlx.core as mx

from cortexstream.benchmarks.machine import machine, machine_sentence

from .common import BIG_CACHE, BLOCK, HEAD_DIM, KV_HEADS, Q_HEADS, SEED, SPARE


def openblas_loaded() -> bool:
    """Whether OpenBLAS was LD_PRELOADed (MLX's wheel otherwise uses its bundled reference BLAS; NumPy's own
    OpenBLAS, which is always mapped, does not count)."""
    preload = [p for p in os.environ.get("LD_PRELOAD", "").replace(":", " ").split() if "openblas" in p]
    if not preload:
        return False
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return True
    return any(os.path.realpath(p) in maps or p in maps for p in preload)


def machine_meta(args: argparse.Namespace, warmup: int, steps: int) -> dict:
    return {
        **machine(),
        "shapes": {"q_heads": Q_HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "float32",
                   "block_size": BLOCK},
        "warmup": warmup,
        "steps": steps,
        "quick": args.quick,
        "seed": SEED,
        "spare_blocks_fraction": SPARE,
        "mlx_default_cache_limit": default_cache_limit(),
        "big_cache_limit": BIG_CACHE,
    }


def machine_line(meta: dict, command: str) -> str:
    """The first sentence of a report: the command, the machine and how long the run took."""
    return f"`{command}` on {machine_sentence(meta)}; {meta['elapsed_s']:.0f} s."


def steps_sentence(meta: dict) -> str:
    """How each figure was taken, for the reports of the scripts that time one attention layer's decode step."""
    return (f"One attention layer's decode step, median of {meta['steps']} steps after {meta['warmup']} warm-up, "
            "variants interleaved in a rotating order.")


def default_cache_limit() -> int:
    limit = mx.set_cache_limit(0)
    mx.set_cache_limit(limit)
    return limit

