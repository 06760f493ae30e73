"""Merging what eviction drops into what it keeps (D2O / CaM style), for policies with `merges_evicted`.

An evicting policy chose, per layer and KV head, the slots to keep. Before they are compacted, every dropped slot
is matched to the kept slot of the same head whose key is most similar (cosine); when that similarity reaches the
policy's `threshold`, the dropped value is folded into the kept one as a weighted average (the kept value with
weight 1, each merged value with its similarity), so the information a dropped token carried still reaches the
queries that attend to its nearest survivor. Keys are left as they are: they carry their own RoPE position, and
which queries find a slot is the kept token's business. Runs on the arena as written (a quantized arena is read
dequantized and only the changed values are written back, requantized; keys are never rewritten).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from cortexstream.compression.evicted_merger import Fold, d2o_fold, group_means
from cortexstream.kv.sequence_kv import SequenceKV


def merged_values(seq: SequenceKV, keep: np.ndarray, threshold: float) -> tuple[list[mx.array | None], int]:
    """Per layer, the new values `[H, n_keep, D]` of the kept slots in ascending slot order (None: unchanged),
    and how many dropped slots were merged. `keep`: `[L, H, n_keep]` slots to keep (before compaction). The groups
    and the fold are the ones the learned merger was trained against (`group_means`, `d2o_fold`)."""
    new, merged = folded_kv(seq, keep, threshold, lambda layer, anchor_k, anchor_v, mean_k, mean_v, weight: (
        anchor_k, d2o_fold(anchor_v, mean_v, weight)))
    return [None if pair is None else pair[1] for pair in new], merged


def folded_kv(seq: SequenceKV, keep: np.ndarray, threshold: float,
              fold: Fold) -> tuple[list[tuple[mx.array, mx.array] | None], int]:
    """A learned fold (`KVPolicy.folds_keys`): per layer the new keys and values `[H, n_keep, D]` of the kept
    slots in ascending slot order (None: no group in that layer), and how many dropped slots joined a group.
    The groups are D2O's (`compression.evicted_merger.group_means`, the code the merger was trained with)."""
    out: list[tuple[mx.array, mx.array] | None] = []
    merged = 0
    n = seq.num_tokens
    for layer in range(keep.shape[0]):
        keys, values = seq.arena.read(layer, seq.blocks, n)
        rows = mx.array(np.sort(keep[layer], axis=-1).astype(np.int32))
        anchor_k, anchor_v, mean_k, mean_v, weight, joined = group_means(keys, values, rows, threshold)
        count = int(joined.item())
        if count == 0:
            out.append(None)
            continue
        merged += count
        out.append(fold(layer, anchor_k, anchor_v, mean_k, mean_v, weight))
    return out, merged


def write_kv(seq: SequenceKV, new: list[tuple[mx.array, mx.array] | None]) -> None:
    """After compaction: write each layer's folded keys and values at slots 0..n_keep-1."""
    for layer, pair in enumerate(new):
        if pair is not None:
            seq.write_kv(layer, 0, pair[0], pair[1])
    mx.eval(seq.arena.arrays())


def write_values(seq: SequenceKV, values: list[mx.array | None]) -> None:
    """After compaction: write each layer's new kept values at slots 0..n_keep-1 (keys stay as stored)."""
    for layer, new in enumerate(values):
        if new is not None:
            seq.write_values(layer, 0, new)
    mx.eval(seq.arena.arrays())
