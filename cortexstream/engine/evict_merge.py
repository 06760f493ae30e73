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

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from cortexstream.compression.evicted_merger import Fold, d2o_fold, group_means
from cortexstream.kv.sequence_kv import SequenceKV


# Folded rows are materialised once computed, so the compaction and the writes that follow update the arena's
# buffers in place instead of copying them (a pending fold still reads them). Up to this many bytes of rows are
# evaluated at once; more, a layer at a time.
MATERIALISE_BYTES = 64 << 20


@dataclass(frozen=True)
class FoldedRows:
    """One layer's kept rows from the first one a fold changed: keys (None: unchanged) and values `[H, m, D]` for
    slots `start`.. after compaction."""

    start: int
    keys: mx.array | None
    values: mx.array

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + (0 if self.keys is None else self.keys.nbytes)


def merged_values(seq: SequenceKV, keep: np.ndarray, threshold: float) -> tuple[list[FoldedRows | None], int]:
    """Per layer, the new values of the kept slots a fold changed (None: none), and how many dropped slots were
    merged. `keep`: `[L, H, n_keep]` slots to keep (before compaction). The groups and the fold are the ones the
    learned merger was trained against (`group_means`, `d2o_fold`)."""
    return folded_kv(seq, keep, threshold, lambda layer, anchor_k, anchor_v, mean_k, mean_v, weight: (
        anchor_k, d2o_fold(anchor_v, mean_v, weight)), with_keys=False)


def folded_kv(seq: SequenceKV, keep: np.ndarray, threshold: float, fold: Fold,
              with_keys: bool = True) -> tuple[list[FoldedRows | None], int]:
    """A learned fold (`KVPolicy.folds_keys`): per layer the new keys and values of the kept slots in ascending
    slot order from the first one in a group (None: no group in that layer), and how many dropped slots joined a
    group. The groups are D2O's (`compression.evicted_merger.group_means`, the code the merger was trained with).
    `with_keys=False`: the fold leaves keys as stored, so its keys are neither kept nor computed."""
    out: list[FoldedRows | None] = []
    merged = 0
    n = seq.num_tokens
    for layer in range(keep.shape[0]):
        keys, values = seq.arena.read(layer, seq.blocks, n)
        rows = mx.array(np.sort(keep[layer], axis=-1).astype(np.int32))
        anchor_k, anchor_v, mean_k, mean_v, weight, joined = group_means(keys, values, rows, threshold)
        grouped = (weight > 0).any(axis=0)  # [n_keep]: some head's anchor has a group
        mx.eval(joined, grouped)
        count = int(joined.item())
        if count == 0:
            out.append(None)
            continue
        merged += count
        start = int(np.argmax(np.asarray(grouped)))
        new_k, new_v = fold(layer, anchor_k, anchor_v, mean_k, mean_v, weight)
        out.append(FoldedRows(start, new_k[:, start:] if with_keys else None, new_v[:, start:]))
    _materialise(out)  # before the compaction writes the buffers these rows are read from
    return out, merged


def _materialise(new: list[FoldedRows | None]) -> None:
    rows = [r for r in new if r is not None]
    if sum(r.nbytes for r in rows) <= MATERIALISE_BYTES:
        mx.eval([[r.values] + ([] if r.keys is None else [r.keys]) for r in rows])
        return
    for r in rows:
        mx.eval(r.values, [] if r.keys is None else r.keys)


def write_kv(seq: SequenceKV, new: list[FoldedRows | None]) -> None:
    """After compaction: write each layer's folded keys and values at their slots."""
    for layer, rows in enumerate(new):
        if rows is not None:
            seq.write_kv(layer, rows.start, rows.keys, rows.values)
    mx.eval(seq.arena.arrays())


def write_values(seq: SequenceKV, new: list[FoldedRows | None]) -> None:
    """After compaction: write each layer's new kept values at their slots (keys stay as stored)."""
    for layer, rows in enumerate(new):
        if rows is not None:
            seq.write_values(layer, rows.start, rows.values)
    mx.eval(seq.arena.arrays())
