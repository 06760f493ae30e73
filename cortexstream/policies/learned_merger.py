"""`LearnedMerger`: H2O's eviction with what it drops folded into the kept tokens by a learned network.

D2O's choice of groups (each dropped slot joins the kept slot of its head whose key is most similar, when their
cosine reaches `threshold`), with the fold learned: the window compressor's MLPs retrained on [kept token, group
mean] pairs (`compression.evicted_merger`, `cortexstream train merger`) rewrite both the key and the value of a
kept slot that absorbed a group. Same budget and memory as H2O.

Weights: `weights=None` uses the merger shipped for the running model's cache shape (`compression/weights/`,
`merges: evicted` and `network` in the manifest; `network=sidecar` picks the sidecar's); a path loads a file from
`cortexstream train merger` (a window compressor's or sidecar's file is refused, and the file decides the network);
a `KVCompressor` or `SidecarNet` object is used as given. Loaded on first use and cached per file.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import mlx.core as mx

from cortexstream.compression.compressor import KVCompressor
from cortexstream.compression.evicted_merger import (MERGES, Merger, MergerNetwork, check_merger, check_network,
                                                     check_threshold, learned_fold, network_of)
from cortexstream.compression.shipped import Merges, find_shipped
from cortexstream.errors import InvalidArgumentError
from cortexstream.policies.base import Budget
from cortexstream.sidecar.network import SidecarNet
from cortexstream.policies.compressor import load_cached
from cortexstream.policies.d2o import D2O


@dataclass(frozen=True, init=False)
class LearnedMerger(D2O):
    network: str = MergerNetwork.COMPRESSOR.value
    weights: str | None = None  # the path, None for shipped weights, or "<object ...>" for a network object
    merger: Merger | None = field(default=None, compare=False, hash=False, repr=False)

    name = "merger"
    folds_keys = True
    parse_keys: ClassVar[dict[str, str]] = {**D2O.parse_keys, "network": "str", "weights": "str"}

    def __init__(self, budget: Budget = 0.2, sinks: int = 4, recent: int | None = None, keep_prefix: int = 0,
                 threshold: float = 0.5, network: str | None = None,
                 weights: "str | os.PathLike[str] | KVCompressor | SidecarNet | None" = None) -> None:
        merger = None
        if network is not None:
            check_network("LearnedMerger", network)
        if isinstance(weights, (KVCompressor, SidecarNet)):
            check_merger(weights, "weights")
            merger, label = weights, f"<{type(weights).__name__} object at {id(weights):#x}>"
            found = network_of(weights).value
        elif isinstance(weights, (str, os.PathLike)):
            label = os.fspath(weights)
            if not os.path.isfile(label):
                raise InvalidArgumentError(f"weights: file '{label}' does not exist")
            found = network_of(load_cached(label, MERGES)).value  # read and check the file now
        elif weights is None:
            label, found = None, network or MergerNetwork.COMPRESSOR.value
        else:
            raise InvalidArgumentError(f"weights: expected a path, a KVCompressor, a SidecarNet or None, got "
                                       f"{type(weights).__name__}")
        if network is not None and network != found:
            raise InvalidArgumentError(f"LearnedMerger: network={network} but the weights hold a {found} merger")
        for name, value in (("budget", budget), ("sinks", sinks), ("recent", recent), ("keep_prefix", keep_prefix),
                            ("threshold", threshold), ("network", found), ("weights", label), ("merger", merger)):
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        super().__post_init__()
        check_threshold(type(self).__name__, self.threshold)

    def resolve(self, *, num_kv_heads: int, head_dim: int, num_layers: int | None = None) -> Merger:
        """The merger for a cache of this shape (loaded on first use); errors name what does not fit."""
        if self.merger is not None:
            merger, source = self.merger, f"the {type(self.merger).__name__} object"
        elif self.weights is not None:
            merger, source = load_cached(self.weights, MERGES), self.weights
        else:
            entry = find_shipped(2, head_dim=head_dim, num_kv_heads=num_kv_heads, num_layers=num_layers,
                                 merges=Merges.EVICTED, network=MergerNetwork(self.network))
            merger, source = load_cached(entry.path, MERGES), entry.path
        if merger.config.head_dim != head_dim:
            raise InvalidArgumentError(f"weights: {source} has head_dim {merger.config.head_dim}, the model's is "
                                       f"{head_dim}")
        if num_layers is not None and merger.config.num_layers != num_layers:
            raise InvalidArgumentError(f"weights: {source} has {merger.config.num_layers} layers, the model has "
                                       f"{num_layers}")
        if isinstance(merger, SidecarNet) and merger.config.num_kv_heads != num_kv_heads:
            raise InvalidArgumentError(f"weights: {source} was trained for {merger.config.num_kv_heads} KV heads, "
                                       f"the model has {num_kv_heads}")
        return merger

    def fold_evicted(self, layer: int, anchor_k: mx.array, anchor_v: mx.array, mean_k: mx.array, mean_v: mx.array,
                     weight: mx.array) -> tuple[mx.array, mx.array]:
        """New keys and values `[H, k, D]` of the kept slots (see `compression.evicted_merger.learned_fold`)."""
        merger = self.resolve(num_kv_heads=anchor_k.shape[0], head_dim=anchor_k.shape[-1])
        if layer >= merger.config.num_layers:
            raise InvalidArgumentError(f"weights: {self.weights or 'shipped merger'} has {merger.config.num_layers} "
                                       f"layers, the model has more (layer {layer})")
        return learned_fold(merger, layer, anchor_k, anchor_v, mean_k, mean_v, weight)

    def describe(self) -> str:
        base = super().describe().replace("d2o:", "merger:", 1)
        if self.network != MergerNetwork.COMPRESSOR.value:
            base += f",network={self.network}"
        return f"{base},weights={self.weights}" if self.weights and self.merger is None else base
