"""Compressor weights shipped inside the package (`cortexstream/compression/weights/`), found by model shape.

`weights/manifest.json` lists one entry per file: the model it was trained for and the shape a cache must have
to use it (layers, KV heads, head_dim) and its factor. A policy built with `weights=None` asks `find_shipped` for
the entry matching the running model; when there is none, the error lists what is shipped and how to train one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

from cortexstream.compression.evicted_merger import MERGES, MergerNetwork
from cortexstream.errors import InvalidArgumentError, ModelLoadError

WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")
MANIFEST = os.path.join(WEIGHTS_DIR, "manifest.json")


class Merges(str, Enum):
    """What a shipped file merges: fixed windows of tokens (a window compressor) or evicted tokens into kept ones (a
    merger, `compression.evicted_merger`)."""

    WINDOWS = "windows"
    EVICTED = MERGES


@dataclass(frozen=True)
class ShippedWeights:
    file: str  # name inside WEIGHTS_DIR
    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    factor: int
    merges: Merges = Merges.WINDOWS
    network: MergerNetwork = MergerNetwork.COMPRESSOR  # a merger's network

    def __post_init__(self) -> None:  # the manifest gives strings
        for name, kind in (("merges", Merges), ("network", MergerNetwork)):
            value = getattr(self, name)
            try:
                object.__setattr__(self, name, kind(value))
            except ValueError:
                allowed = ", ".join(repr(k.value) for k in kind)
                raise ValueError(f"{self.file}: {name}={value!r} is not one of {allowed}") from None

    @property
    def path(self) -> str:
        return os.path.join(WEIGHTS_DIR, self.file)

    def describe(self) -> str:
        return (f"{self.file} ({self.model}: {self.num_layers} layers, {self.num_kv_heads} KV heads, head_dim "
                f"{self.head_dim}, factor {self.factor})")


@lru_cache(maxsize=1)
def shipped_weights() -> tuple[ShippedWeights, ...]:
    """Every entry of the manifest (empty when the package ships no weights)."""
    if not os.path.exists(MANIFEST):
        return ()
    try:
        with open(MANIFEST, encoding="utf-8") as fh:
            entries = json.load(fh)["weights"]
        return tuple(ShippedWeights(**entry) for entry in entries)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{MANIFEST}: unreadable manifest of shipped compressor weights: {exc}") from exc


def shipped_factors() -> set[int]:
    return {entry.factor for entry in shipped_weights() if entry.merges is Merges.WINDOWS}


def find_shipped(factor: int, *, head_dim: int, num_kv_heads: int, num_layers: int | None = None,
                 merges: Merges = Merges.WINDOWS,
                 network: MergerNetwork = MergerNetwork.COMPRESSOR) -> ShippedWeights:
    """The shipped weights for this cache shape and factor (num_layers None: not checked yet); `merges`: window
    compressors or mergers of evicted tokens (`compression.evicted_merger`)."""
    merges, network = Merges(merges), MergerNetwork(network)
    for entry in shipped_weights():
        if (entry.factor, entry.head_dim, entry.num_kv_heads, entry.merges, entry.network) == \
                (factor, head_dim, num_kv_heads, merges, network) and \
                num_layers in (None, entry.num_layers):
            return entry
    have = "; ".join(e.describe() for e in shipped_weights() if (e.merges, e.network) == (merges, network)) or "none"
    layers = "?" if num_layers is None else num_layers
    if merges is Merges.EVICTED:
        raise InvalidArgumentError(
            f"merger: weights=None but no shipped {network.value} merger of evicted tokens fits this model "
            f"({layers} layers, {num_kv_heads} KV heads, head_dim {head_dim}); shipped: {have}. Train one with "
            f"`cortexstream train merger --network {network.value} --out DIR` and pass "
            f"weights=DIR/merger.safetensors")
    raise InvalidArgumentError(
        f"compressor: weights=None but no shipped weights fit this model ({layers} layers, {num_kv_heads} KV "
        f"heads, head_dim {head_dim}) at factor {factor}; shipped: {have}. Train some with `cortexstream train "
        f"compressor --factor {factor} --out DIR` and pass weights=DIR/compressor.safetensors")
