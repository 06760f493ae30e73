"""Short passes (decode steps, small verify passes) over a pooled layout, at the cost of the cells kept.

In a pooled layout (`engine.pooled_heads`, `engine.pooled_layers`) most cells of KV head h's column hold head h's
own keys; the rest hold keys lent by or to other heads and layers. `pooled_heads.attend_flat` attends every cell
of the layer with every query head (KV heads times the products) and rebuilds its masks at each step. Here each
KV head attends its own column as plain grouped-query attention, with a mask that hides the cells it does not own,
plus its keys held elsewhere (other columns of the layer, other layers' cells: the extras), gathered at each pass
through the block table. One softmax spans both parts, so the result is exact attention over the owned cells.

The layout changes only when the policy compacts the cache: `LayerCells` (masks, the extras' places and the
indices that route their attention back) is built once per compaction and layer; new tokens are appended to every
column's own slots, so they extend the column mask with zeros. Reading the extras through a changed block table
(copy-on-write, preemption) is the only per-pass work besides the attention itself (`ExtrasReader`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from cortexstream.engine.attention_hook import additive_mask
from cortexstream.engine.pooled_layers import ForeignCells, gather_resolved, lender_groups, resolve_cells
from cortexstream.kv.sequence_kv import SequenceKV

NEG_INF = float("-inf")


class ExtraGroup(NamedTuple):
    """The extras one layer's arrays hold (the attending layer's own, lent within it, or another's): the column
    and sequence slot of each cell."""

    lender: int
    columns: np.ndarray
    slots: np.ndarray


@dataclass(frozen=True)
class LayerCells:
    """One layer's attended cells, fixed from one compaction to the next.

    `column_mask` `[H, 1, 1, stored]`: 0 (or the cell's logit bias) where column h's slot holds head h's key of this
    layer, -inf elsewhere. Extras (ordered: groups in order, cells in group order) are gathered into `[X, D]`;
    `index` `[H, E]` picks each head's (padding repeats cell 0, hidden by `extra_mask` `[H, 1, 1, E]`), `back` `[X]`
    is each extra's place in the flattened `[H, E]`, `local_index` the flat `[H, stored]` cell of the first
    `num_local` extras (lent within this layer) for routing their attention back. Foreign extras follow in
    `ForeignCells` order."""

    stored: int
    column_mask: mx.array
    groups: tuple[ExtraGroup, ...]
    index: mx.array | None
    extra_mask: mx.array | None
    back: mx.array | None
    local_index: mx.array | None
    num_local: int

    @property
    def num_extras(self) -> int:
        return sum(len(g.slots) for g in self.groups)


def layer_cells(layer: int, owners: np.ndarray, owner_layers: np.ndarray, bias: np.ndarray | None,
                foreign: ForeignCells | None, foreign_bias: np.ndarray | None) -> LayerCells:
    """The cells of `layer` as its state stands (`owners`, `owner_layers`, `bias` `[H, n]`; `foreign` its keys in
    other layers' cells with their biases `[F]`)."""
    heads, stored = owners.shape
    columns = np.arange(heads)[:, None]
    own = (owners == columns) & (owner_layers == layer)
    zero = np.zeros((heads, stored), np.float32) if bias is None else bias.astype(np.float32)
    column_mask = mx.array(np.where(own, zero, NEG_INF).astype(np.float32))[:, None, None, :]
    lent_cols, lent_slots = np.nonzero((owner_layers == layer) & (owners != columns))
    groups: list[ExtraGroup] = []
    extra_heads, extra_bias = [], []
    if len(lent_slots):
        groups.append(ExtraGroup(layer, lent_cols.astype(np.int64), lent_slots.astype(np.int64)))
        extra_heads.append(owners[lent_cols, lent_slots].astype(np.int64))
        extra_bias.append(zero[lent_cols, lent_slots])
    if foreign is not None:
        groups += [ExtraGroup(*group) for group in lender_groups(foreign)]
        extra_heads.append(foreign.heads.astype(np.int64))
        extra_bias.append(np.zeros(len(foreign), np.float32) if foreign_bias is None
                          else foreign_bias.astype(np.float32))
    num_local = len(lent_slots)
    if not groups:
        return LayerCells(stored, column_mask, (), None, None, None, None, 0)
    head_of = np.concatenate(extra_heads)
    cell_bias = np.concatenate(extra_bias)
    counts = np.bincount(head_of, minlength=heads)
    width = int(counts.max())
    index = np.zeros((heads, width), np.int32)
    mask = np.full((heads, width), NEG_INF, np.float32)
    back = np.empty(len(head_of), np.int32)
    for head in range(heads):
        mine = np.nonzero(head_of == head)[0]
        index[head, : len(mine)] = mine
        mask[head, : len(mine)] = cell_bias[mine]
        back[mine] = head * width + np.arange(len(mine))
    local_index = mx.array((lent_cols * stored + lent_slots).astype(np.int32)) if num_local else None
    return LayerCells(stored, column_mask, tuple(groups), mx.array(index), mx.array(mask)[:, None, None, :],
                      mx.array(back), local_index, num_local)


class ExtrasReader:
    """Reads a layer's extras from the arena, the arena slots resolved once per block table."""

    def __init__(self, cells: LayerCells) -> None:
        self.cells = cells
        self._key: tuple[Any, ...] | None = None
        self._reads: list[tuple[int, mx.array, mx.array]] = []

    def read(self, seq: SequenceKV) -> tuple[mx.array, mx.array]:
        """Keys `[X, D]` and values `[X, Dv]` of the extras, in `LayerCells` order."""
        key = tuple(seq.blocks)  # slots stay valid as the arena grows (growth appends)
        if key != self._key:
            self._reads = resolve_cells(seq, self.cells.groups)
            self._key = key
        return gather_resolved(seq.arena, self._reads)


def attend_columns(cells: LayerCells, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                   mask: Any, valid: int | None, extra_keys: mx.array | None, extra_values: mx.array | None,
                   record_from: int | None) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """Attention of one sequence over a pooled layer: queries `[1, Hq, Q, D]`; keys / values `[1, H, T, Dv]` as
    the cache gives them (slots from `cells.stored` on are this pass's or later own cells); `mask` mlx-lm's for
    `[Q, T]`; slots from `valid` on are padding. Returns the output `[1, Hq, Q, Dv]` and, from query row
    `record_from` (None: not recorded), the attention this layer's cells received `[H, valid]` (summed over the
    rows and each group's heads) and that of its foreign cells `[F]` (None when there are none)."""
    _, q_heads, num_queries, dim = queries.shape
    heads, num_keys = keys.shape[1], keys.shape[2]
    group = q_heads // heads
    valid = num_keys if valid is None else int(valid)
    dtype = keys.dtype
    q = (queries[0] * scale).astype(dtype).reshape(heads, group * num_queries, dim)
    logits = (q @ keys[0].swapaxes(1, 2)).astype(mx.float32).reshape(heads, group, num_queries, num_keys)
    tail = num_keys - cells.stored
    add = cells.column_mask if tail == 0 else \
        mx.concatenate([cells.column_mask, mx.zeros((heads, 1, 1, tail), mx.float32)], axis=-1)
    base = additive_mask(mask, 0, num_queries, num_queries, num_keys)
    if base is not None:
        add = add + (base[0][None] if base.shape[1] == 1 else base[0].reshape(heads, group, num_queries, num_keys))
    if valid < num_keys:
        add = add + mx.where(mx.arange(num_keys) < valid, 0.0, NEG_INF).astype(mx.float32)
    logits = logits + add
    width = 0
    if cells.index is not None:
        ek, ev = extra_keys[cells.index], extra_values[cells.index]  # [H, E, D]
        width = ek.shape[1]
        extra = (q @ ek.astype(dtype).swapaxes(1, 2)).astype(mx.float32).reshape(heads, group, num_queries, width)
        logits = mx.concatenate([logits, extra + cells.extra_mask], axis=-1)
    probs = mx.softmax(logits, axis=-1, precise=True)
    flat = probs.reshape(heads, group * num_queries, num_keys + width)
    out = flat[..., :num_keys].astype(dtype) @ values[0]
    if width:
        out = out + flat[..., num_keys:].astype(dtype) @ ev.astype(dtype)
    out = out.reshape(1, q_heads, num_queries, -1).astype(queries.dtype)
    if record_from is None:
        return out, None, None
    received = probs[:, :, record_from:, :].sum(axis=(1, 2))  # [H, T + E]
    local = received[:, :num_keys]
    far = None
    if width:
        per_extra = received[:, num_keys:].reshape(-1)[cells.back]  # [X], LayerCells order
        if cells.num_local:
            lent = mx.zeros((heads * cells.stored,), mx.float32).at[cells.local_index].add(
                per_extra[: cells.num_local]).reshape(heads, cells.stored)
            if tail:
                lent = mx.concatenate([lent, mx.zeros((heads, tail), mx.float32)], axis=1)
            local = local + lent
        if cells.num_local < per_extra.shape[0]:
            far = per_extra[cells.num_local:]
    return out, local[:, :valid], far


__all__ = ["ExtrasReader", "LayerCells", "attend_columns", "layer_cells"]
