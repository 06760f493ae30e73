"""Budgets shared by a layer's KV heads (Ada-KV), stored without padding: cells that hold another head's key.

A sequence's slot holds one key and value per KV head: the cell (h, s). A policy that shares a layer's budget
among its heads (`KVPolicy.pools_heads`) may keep more keys of one head than the sequence keeps slots. Padding each
head to the largest count would spend the memory the policy saves, so the surplus goes into the cells the other
heads leave free, and the policy runtime records each cell's owning head (`PolicyState.owners`). The arena does not
change (same blocks, slots and storage types, so quantized blocks, copy-on-write and the disk tier move cells as
they move slots); attention does: each GQA group attends to the cells its KV head owns, wherever they are
(`attend_owned`). That is the same number of key-query products as plain attention (every cell is attended by one
group) and the gathers are transient.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from cortexstream.engine.attention_hook import additive_mask, attention_received, original_sdpa
from cortexstream.engine.reconstruction import attend_and_max, attention_max
from cortexstream.errors import InvalidArgumentError


class Reduce(enum.Enum):
    """How the attention a cell received is reduced over queries and a group's heads: summed (H2O's and SnapKV's
    votes, `attention_received`) or the largest (KVzip's reconstruction, `attention_max`)."""

    SUM = "sum"
    MAX = "max"


@dataclass(frozen=True)
class Foreign:
    """A layer's keys held in other layers' cells, as read for one pass (`engine.pooled_layers`): keys `[F, D]`,
    values `[F, Dv]`, the owning head of each `[F]`, and an additive logit per cell or None."""

    keys: mx.array
    values: mx.array
    heads: np.ndarray
    bias: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.heads.shape[0])


def column_owners(heads: int, num_slots: int) -> np.ndarray:
    """Owners `[H, n]` of cells that hold their own column's key (every cell before any pooling)."""
    return np.broadcast_to(np.arange(heads, dtype=np.int16)[:, None], (heads, num_slots)).copy()


def place(keep: np.ndarray) -> np.ndarray:
    """Where the kept cells go: `keep` bool `[H, n]` with `H x m` cells kept gives, for the new `[H, m]` layout,
    each cell's source as a flat index `h * n + s`. A column keeps its own kept cells first (in slot order); the
    heads that keep more than `m` lend their surplus, in head and slot order, to the columns left short."""
    heads, n = keep.shape
    total = int(keep.sum())
    if total % heads:
        raise InvalidArgumentError(f"pooled heads: {total} cells kept, not a multiple of the {heads} KV heads")
    m = total // heads
    own = [np.nonzero(keep[h])[0] + h * n for h in range(heads)]
    surplus = np.concatenate([cells[m:] for cells in own])
    out = np.empty((heads, m), dtype=np.int64)
    taken = 0
    for h, cells in enumerate(own):
        mine = cells[:m]
        need = m - len(mine)
        out[h] = np.concatenate([mine, surplus[taken:taken + need]])
        taken += need
    return out


def gather_cells(rows: np.ndarray, sources: np.ndarray) -> np.ndarray:
    """Per-cell state `[H, n]` (scores, positions, owners, biases) moved as `place`'s `sources` `[H, m]` say."""
    return rows.reshape(-1)[sources.reshape(-1)].reshape(sources.shape)


def is_pooled(owners: np.ndarray) -> bool:
    """Whether some cell holds another head's key."""
    return bool((owners != np.arange(owners.shape[0])[:, None]).any())


def attend_owned(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
                 sinks: mx.array | None, owners: np.ndarray, bias: np.ndarray | None = None,
                 valid: int | None = None, record_from: int | None = None,
                 reduce: Reduce = Reduce.SUM) -> tuple[mx.array, mx.array | None]:
    """Attention of one sequence whose cells have owners.

    queries `[1, Hq, Q, D]`; keys / values `[1, H, T, D]` as the cache gives them (cell (h, s) at `[0, h, s]`);
    `owners` `[H, T]`; `bias` `[H, T]` an additive logit per cell (merged slots) or None; only slots below
    `valid` are real (a padded batch row). The mask is mlx-lm's for the `[Q, T]` slots; a cell takes its slot's.
    Returns the output `[1, Hq, Q, Dv]` and, when `record_from` is given, the attention each cell received from
    query rows `record_from:` and its group's query heads, summed or the largest (`reduce`), `[H, valid]` float32
    (else None).
    """
    out, received, _ = attend_cells(queries, keys, values, scale, mask, sinks, owners, bias, valid, record_from,
                                    reduce)
    return out, received


def attend_cells(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
                 sinks: mx.array | None, owners: np.ndarray, bias: np.ndarray | None = None,
                 valid: int | None = None, record_from: int | None = None, reduce: Reduce = Reduce.SUM,
                 mine: np.ndarray | None = None, foreign: Foreign | None = None
                 ) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """`attend_owned` over cells lent across layers too (`engine.pooled_layers`): `mine` bool `[H, T]` marks the
    cells of these arrays that hold this layer's keys (None: all; the others were lent and are not attended), and
    `foreign` is this layer's keys held in other layers' cells, attended by their owning head with no mask (they
    are older than any query). Returns the output, the received attention of this layer's cells `[H, valid]` and
    that of the foreign cells `[F]` (None when not recorded or no foreign cells)."""
    _, q_heads, num_queries, dim = queries.shape
    heads, num_keys = keys.shape[1], keys.shape[2]
    if owners.shape != (heads, num_keys):
        raise InvalidArgumentError(f"pooled heads: owners {owners.shape} for keys of {heads} heads x {num_keys}")
    valid = num_keys if valid is None else int(valid)
    if num_queries <= FLAT_QUERIES:
        return attend_flat(queries, keys, values, scale, mask, sinks, owners, bias, valid, record_from, reduce,
                           mine, foreign)
    group = q_heads // heads
    flat_keys = keys[0].reshape(heads * num_keys, dim)
    flat_values = values[0].reshape(heads * num_keys, values.shape[-1])
    slots = np.tile(np.arange(num_keys), heads)
    owner_of = owners.reshape(-1)
    attended = slots < valid if mine is None else (slots < valid) & mine.reshape(-1)
    base = additive_mask(mask, 0, num_queries, num_queries, num_keys)
    outs, received, order, received_foreign, order_foreign = [], [], [], [], []
    for head in range(heads):
        cells = np.nonzero((owner_of == head) & attended)[0]
        extra = np.zeros(0, np.int64) if foreign is None else np.nonzero(foreign.heads == head)[0]
        index = mx.array(cells.astype(np.int32))
        heads_of_group = slice(head * group, (head + 1) * group)
        cell_mask = None
        if base is not None:
            rows = base if base.shape[1] == 1 else base[:, heads_of_group]
            cell_mask = rows[..., mx.array(slots[cells].astype(np.int32))]
            if len(extra):  # foreign cells: visible to every query
                cell_mask = mx.concatenate([cell_mask, mx.zeros((*cell_mask.shape[:-1], len(extra)),
                                                                cell_mask.dtype)], axis=-1)
        if bias is not None or (foreign is not None and foreign.bias is not None and len(extra)):
            own_bias = np.zeros(len(cells), np.float32) if bias is None else bias.reshape(-1)[cells]
            more = np.zeros(len(extra), np.float32) if foreign is None or foreign.bias is None \
                else foreign.bias[extra]
            logits = mx.array(np.concatenate([own_bias, more]).astype(np.float32))[None, None, None, :]
            cell_mask = logits if cell_mask is None else cell_mask + logits
        q = queries[:, heads_of_group]
        k, v = flat_keys[index], flat_values[index]
        if len(extra):
            pick = mx.array(extra.astype(np.int32))
            k = mx.concatenate([k, foreign.keys[pick].astype(k.dtype)], axis=0)
            v = mx.concatenate([v, foreign.values[pick].astype(v.dtype)], axis=0)
        k, v = k[None, None], v[None, None]
        group_sinks = None if sinks is None else sinks[heads_of_group]
        if reduce is Reduce.MAX and record_from == 0:  # a reconstruction pass: one computation for both
            out_head, best = attend_and_max(q, k, v, scale, cell_mask, group_sinks)
            outs.append(out_head)
            got = best[0, 0]
        else:
            outs.append(original_sdpa(q, k, v, None, scale=scale,
                                      mask=None if cell_mask is None else cell_mask.astype(queries.dtype),
                                      sinks=group_sinks))
            if record_from is None:
                continue
            rows_mask = None if cell_mask is None else cell_mask[..., record_from:, :]
            measure = attention_received if reduce is Reduce.SUM else attention_max
            got = measure(q[:, :, record_from:], k, scale, rows_mask, group_sinks)[0, 0]
        received.append(got[: len(cells)])
        order.append(cells)
        if len(extra):
            received_foreign.append(got[len(cells):])
            order_foreign.append(extra)
    out = mx.concatenate(outs, axis=1)
    if not order:
        return out, None, None
    index = mx.array(np.concatenate(order).astype(np.int32))
    flat = mx.zeros((heads * num_keys,), mx.float32).at[index].add(mx.concatenate(received))
    local = flat.reshape(heads, num_keys)[:, :valid]
    if not order_foreign:
        return out, local, None
    where = mx.array(np.concatenate(order_foreign).astype(np.int32))
    far = mx.zeros((len(foreign),), mx.float32).at[where].add(mx.concatenate(received_foreign))
    return out, local, far


# Up to this many queries (decode steps, small verify passes) a pass is short. A policy's short passes attend per
# column (`engine.pooled_decode`); here, where that layout is not kept (a reconstruction pass, a model with sinks),
# a layer is attended in one call over all its cells, each query head masked to its group's cells: KV heads times
# more products than the per-head gathers, one kernel instead of one per head, and no copy of the owned cells.
# Longer passes (prompt chunks) gather per head.
FLAT_QUERIES = 4


def attend_flat(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any,
                sinks: mx.array | None, owners: np.ndarray, bias: np.ndarray | None, valid: int,
                record_from: int | None, reduce: Reduce, mine: np.ndarray | None, foreign: Foreign | None
                ) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """`attend_cells` as one attention over every cell of the layer (and its foreign cells) as a single KV head,
    each query head masked to the cells its KV head owns. Same results, same returns."""
    _, q_heads, num_queries, dim = queries.shape
    heads, num_keys = keys.shape[1], keys.shape[2]
    group = q_heads // heads
    slots = np.tile(np.arange(num_keys), heads)
    owner_of = owners.reshape(-1).astype(np.int64)
    attended = slots < valid if mine is None else (slots < valid) & mine.reshape(-1)
    owner_of = np.where(attended, owner_of, -1)
    cell_keys, cell_values = keys[0].reshape(heads * num_keys, dim), values[0].reshape(heads * num_keys, -1)
    cell_bias = np.zeros(heads * num_keys, np.float32) if bias is None else bias.reshape(-1).astype(np.float32)
    far = 0 if foreign is None else len(foreign)
    if far:
        owner_of = np.concatenate([owner_of, foreign.heads.astype(np.int64)])
        cell_keys = mx.concatenate([cell_keys, foreign.keys.astype(cell_keys.dtype)])
        cell_values = mx.concatenate([cell_values, foreign.values.astype(cell_values.dtype)])
        more = np.zeros(far, np.float32) if foreign.bias is None else foreign.bias.astype(np.float32)
        cell_bias = np.concatenate([cell_bias, more])
    owned = owner_of[None, :] == (np.arange(q_heads) // group)[:, None]  # [Hq, C]
    add = np.where(owned, cell_bias[None, :], -np.inf).astype(np.float32)
    total = mx.array(add)[None, :, None, :]  # [1, Hq, 1, C]
    base = additive_mask(mask, 0, num_queries, num_queries, num_keys)
    if base is not None:  # a cell takes its slot's mask; foreign cells are older than any query
        by_slot = base[..., mx.array(slots.astype(np.int32))]
        if far:
            by_slot = mx.concatenate([by_slot, mx.zeros((*by_slot.shape[:-1], far), by_slot.dtype)], axis=-1)
        total = total + by_slot
    k, v = cell_keys[None, None], cell_values[None, None]
    if reduce is Reduce.MAX and record_from == 0:
        out, best = attend_and_max(queries, k, v, scale, total, sinks)
        got = best[0, 0]
    else:
        out = original_sdpa(queries, k, v, None, scale=scale, mask=total.astype(queries.dtype), sinks=sinks)
        if record_from is None:
            return out, None, None
        measure = attention_received if reduce is Reduce.SUM else attention_max
        rows = total if total.shape[2] == 1 else total[..., record_from:, :]
        got = measure(queries[:, :, record_from:], k, scale, rows, sinks)[0, 0]
    local = got[: heads * num_keys].reshape(heads, num_keys)[:, :valid]
    return out, local, (got[heads * num_keys:] if far else None)
