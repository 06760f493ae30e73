"""`Compressor`: a merging KV policy that replaces every `factor` old tokens by one slot made by a learned compressor.

The cache keeps `sinks` raw tokens, then merged slots, then the raw tail (the last `recent` tokens protected); each
complete window of `factor` raw tokens that leaves the protected tail goes through the layer's text-K and text-V
MLPs of a FastCache-style `KVCompressor` ([H, N / f, D * f], f consecutive tokens side by side, token-major as in
the reference) and becomes one slot (see `merging` for the runtime and bookkeeping).

Weights: `weights=None` uses the weights shipped in the package for the running model's shape (layers, KV heads,
head_dim) and `factor`; a path loads a `.safetensors`, `.pth`/`.pt` (torch.save) or InfiniLM `.bin`; a
`KVCompressor` object is used as given. Loading is lazy (first merge) and cached per file in this module, so the
policy itself stays a small frozen, hashable value: two policies naming the same file share one compressor.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

from cortexstream.compression.compressor import KVCompressor
from cortexstream.compression.evicted_merger import load_merger
from cortexstream.compression.shipped import find_shipped, shipped_factors
from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import check_count
from cortexstream.policies.merging import Merged, MergingPolicy

# (real path, mtime_ns, size, kind) -> network with float32 weights; a rewritten file is a new key
_LOADED: dict[tuple[str, int, int, str], Any] = {}
_LOCK = threading.Lock()


def load_cached(path: str, merges: str = "windows") -> Any:
    """A compressor from a file, loaded once per (path, modification time, size) and held as float32 (shipped
    files are float16; CPU matmuls are faster and exact enough in float32). merges="evicted": a merger of evicted
    tokens, a compressor or a sidecar (`compression.evicted_merger.load_merger`, which refuses window networks)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise InvalidArgumentError(f"weights: cannot read '{path}': {exc.strerror}") from None
    key = (os.path.realpath(path), st.st_mtime_ns, st.st_size, merges)
    with _LOCK:
        if key not in _LOADED:
            comp = load_merger(path) if merges == "evicted" else KVCompressor.from_file(path)
            comp.update(tree_map(lambda a: a.astype(mx.float32), comp.parameters()))
            mx.eval(comp.parameters())
            _LOADED[key] = comp
        return _LOADED[key]


@dataclass(frozen=True, init=False)
class Compressor(MergingPolicy):
    """Learned token merging: `factor` raw tokens -> 1 slot, `sinks` first and `recent` last tokens kept raw.

    weights: None (shipped weights for this model and factor), a file path, or a `KVCompressor`.
    """

    factor: int = 4
    weights: str | None = None  # the path, None for shipped weights, or "<object ...>" for a KVCompressor
    compressor: KVCompressor | None = field(default=None, compare=False, hash=False, repr=False)

    name = "compressor"
    parse_keys: ClassVar[dict[str, str]] = {"factor": "count", "sinks": "count", "recent": "count",
                                            "weights": "str"}

    def __init__(self, factor: int = 4, weights: "str | os.PathLike[str] | KVCompressor | None" = None,
                 sinks: int = 4, recent: int = 64) -> None:
        check_count("factor", factor, 2)
        comp = None
        if isinstance(weights, KVCompressor):
            comp, label = weights, f"<KVCompressor object at {id(weights):#x}>"
        elif isinstance(weights, (str, os.PathLike)):
            label = os.fspath(weights)
            if not os.path.isfile(label):
                raise InvalidArgumentError(f"weights: file '{label}' does not exist")
            load_cached(label)  # read and check the file now, not when a prompt first grows long enough
        elif weights is None:
            label = None
        else:
            raise InvalidArgumentError(f"weights: expected a path, a KVCompressor or None, got "
                                       f"{type(weights).__name__}")
        for name, value in (("window", factor), ("sinks", sinks), ("recent", recent), ("factor", factor),
                            ("weights", label), ("compressor", comp)):
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.compressor is not None and self.compressor.factor != self.factor:
            raise InvalidArgumentError(f"weights: the KVCompressor merges {self.compressor.factor} tokens, "
                                       f"factor is {self.factor}")
        if self.weights is None and self.factor not in shipped_factors():
            have = ", ".join(map(str, sorted(shipped_factors()))) or "none"
            raise InvalidArgumentError(f"compressor: no shipped weights for factor {self.factor} (shipped factors: "
                                       f"{have}); pass weights=PATH from `cortexstream train compressor`")

    # --- weights ----------------------------------------------------------------------------------------------
    def resolve(self, *, num_kv_heads: int, head_dim: int, num_layers: int | None = None) -> KVCompressor:
        """The compressor for a cache of this shape (loads it on first use); errors name what does not fit."""
        if self.compressor is not None:
            comp, source = self.compressor, "the KVCompressor object"
        elif self.weights is not None:
            comp, source = load_cached(self.weights), self.weights
        else:
            entry = find_shipped(self.factor, head_dim=head_dim, num_kv_heads=num_kv_heads, num_layers=num_layers)
            comp, source = load_cached(entry.path), entry.path
        c = comp.config
        if c.factor != self.factor:
            raise InvalidArgumentError(f"weights: {source} merges {c.factor} tokens, factor is {self.factor}")
        if c.head_dim != head_dim:
            raise InvalidArgumentError(f"weights: {source} has head_dim {c.head_dim}, the model's is {head_dim}")
        if num_layers is not None and c.num_layers != num_layers:
            raise InvalidArgumentError(f"weights: {source} has {c.num_layers} layers, the model has {num_layers}")
        return comp

    # --- the runtime's calls ----------------------------------------------------------------------------------
    def merge(self, layer: int, keys: mx.array, values: mx.array, mass: np.ndarray) -> Merged:
        """keys/values `[H, N, D]` (N a multiple of factor) -> `[H, N / factor, D]` through layer's MLPs."""
        heads, n, dim = keys.shape
        comp = self._compressor_for(layer, heads, dim, n)
        merged_keys, merged_values = comp.merge_windows(keys, values, layer)
        return Merged(merged_keys, merged_values)

    def merge_from_arena(self, layer: int, arena: Any, blocks: list[int], start: int, end: int,
                         mass: np.ndarray) -> Merged:
        """The same merge, reading the windows through the block table inside the fused gather + first-layer
        kernel (`KVCompressor.merge_windows_from_arena`) instead of reading the range out first."""
        cfg = arena.config
        comp = self._compressor_for(layer, cfg.num_kv_heads, cfg.head_dim, end - start)
        keys, values, table = arena.sequence_buffers(layer, blocks, end)
        merged_keys, merged_values = comp.merge_windows_from_arena(
            keys, values, table, start, (end - start) // self.factor, layer, cfg.block_size)
        return Merged(merged_keys, merged_values)

    def _compressor_for(self, layer: int, heads: int, head_dim: int, num_slots: int) -> KVCompressor:
        if num_slots % self.factor:
            raise InvalidArgumentError(f"compressor: merge range of {num_slots} slots is not a multiple of "
                                       f"{self.factor}")
        comp = self.resolve(num_kv_heads=heads, head_dim=head_dim)
        if layer >= comp.config.num_layers:
            raise InvalidArgumentError(f"weights: {self.weights or 'shipped weights'} have {comp.config.num_layers} "
                                       f"layers, the model has more (layer {layer})")
        return comp

    def describe(self) -> str:
        base = f"{self.name}:factor={self.factor},sinks={self.sinks},recent={self.recent}"
        # an object has no string form: the description then names the shipped/default form only
        return f"{base},weights={self.weights}" if self.weights and self.compressor is None else base

