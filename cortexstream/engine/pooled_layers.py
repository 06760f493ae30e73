"""Budgets shared across layers (PyramidKV, `KVPolicy.pools_layers`), stored without padding: cells of one layer's
arrays that hold another layer's key.

Every layer of a sequence has the same slots (one block table, one mask), so a layer that keeps more keys than
another cannot grow its own column. A policy that gives lower layers more keys than upper ones (their mean the
budget) stores the surplus of a layer in the cells the layers keeping fewer leave free, exactly as pooled heads
lend cells inside one layer (`engine.pooled_heads`): the arena holds `budget` slots per sequence and nothing is
padded. The runtime records each cell's owning layer next to its owning head (`PolicyState.owner_layers`).

Attention changes for both sides. A layer's own arrays may hold cells it lent (another layer's keys): it does not
attend them. Its keys stored in other layers' arrays (`ForeignCells`) are gathered from the arena at each pass
(`read_foreign`, the block table of that step) and attended by the owning head's query group like its other cells.
Lent cells are always in the compressed part of the cache (new tokens are written to every layer's own slots),
so they are older than any query: no mask applies to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import mlx.core as mx
import numpy as np

from cortexstream.kv.sequence_kv import SequenceKV


@dataclass(frozen=True)
class ForeignCells:
    """One layer's keys held in other layers' cells, ordered by lender: lender layer, column (KV head of the
    lender's arrays) and slot of each cell, and the head of the borrowing layer that owns it."""

    lenders: np.ndarray
    columns: np.ndarray
    slots: np.ndarray
    heads: np.ndarray

    def __len__(self) -> int:
        return int(self.lenders.shape[0])


def foreign_cells(owners: list[np.ndarray], owner_layers: list[np.ndarray]) -> list[ForeignCells | None]:
    """Per layer, the cells of other layers' arrays that hold its keys (None: none). `owners[m]` / `owner_layers[m]`
    `[H, n]`: the head and the layer whose key each cell of layer m's arrays holds."""
    found: list[list[tuple[int, np.ndarray, np.ndarray, np.ndarray]]] = [[] for _ in owners]
    for lender, (heads, layers) in enumerate(zip(owners, owner_layers)):
        columns, slots = np.nonzero(layers != lender)
        for borrower in np.unique(layers[columns, slots]):
            pick = layers[columns, slots] == borrower
            found[int(borrower)].append((lender, columns[pick], slots[pick], heads[columns[pick], slots[pick]]))
    out: list[ForeignCells | None] = []
    for parts in found:
        if not parts:
            out.append(None)
            continue
        out.append(ForeignCells(
            np.concatenate([np.full(len(c), lender, np.int64) for lender, c, _, _ in parts]),
            np.concatenate([c for _, c, _, _ in parts]).astype(np.int64),
            np.concatenate([s for _, _, s, _ in parts]).astype(np.int64),
            np.concatenate([h for _, _, _, h in parts]).astype(np.int64)))
    return out


def lender_groups(cells: ForeignCells) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """`cells` per lender, in their order (they are grouped by lender): (lender layer, columns, sequence slots)."""
    return [(int(lender), cells.columns[cells.lenders == lender], cells.slots[cells.lenders == lender])
            for lender in np.unique(cells.lenders)]


def resolve_cells(seq: SequenceKV, groups: Iterable[tuple[int, np.ndarray, np.ndarray]]
                  ) -> list[tuple[int, mx.array, mx.array]]:
    """Per group of cells (lender layer, columns, sequence slots): the lender, the columns and the arena slots as
    int32 arrays, through the sequence's block table as it is now."""
    out = []
    for lender, columns, slots in groups:
        arena_slots = seq.arena.slot_indices(seq.blocks, 0, int(slots.max()) + 1)[slots]
        out.append((int(lender), mx.array(columns.astype(np.int32)), mx.array(arena_slots.astype(np.int32))))
    return out


def gather_resolved(arena: Any, reads: list[tuple[int, mx.array, mx.array]]) -> tuple[mx.array, mx.array]:
    """The keys `[F, D]` and values `[F, Dv]` of resolved cells (`resolve_cells`), in their order (dequantized when
    the arena stores codes)."""
    keys, values = zip(*(arena.gather_cells(lender, columns, slots) for lender, columns, slots in reads))
    if len(keys) == 1:
        return keys[0], values[0]
    return mx.concatenate(keys, axis=0), mx.concatenate(values, axis=0)


def read_foreign(seq: SequenceKV, cells: ForeignCells) -> tuple[mx.array, mx.array]:
    """The keys `[F, D]` and values `[F, Dv]` of `cells`, read from the lenders' arrays through the sequence's block
    table as it is now (dequantized when the arena stores codes)."""
    return gather_resolved(seq.arena, resolve_cells(seq, lender_groups(cells)))


def add_foreign(scores: list[np.ndarray], cells: ForeignCells, received: np.ndarray) -> None:
    """Add the attention `received` `[F]` by a layer's foreign cells to the lenders' per-cell scores (in place)."""
    for lender in np.unique(cells.lenders):
        pick = cells.lenders == lender
        np.add.at(scores[int(lender)], (cells.columns[pick], cells.slots[pick]), received[pick])


def layer_columns(layer: int, heads: int, num_slots: int) -> np.ndarray:
    """Owner layers `[H, n]` of cells that hold their own layer's keys (every cell before any lending)."""
    return np.full((heads, num_slots), layer, dtype=np.int16)


__all__ = ["ForeignCells", "add_foreign", "foreign_cells", "gather_resolved", "layer_columns", "lender_groups",
           "read_foreign", "resolve_cells"]
