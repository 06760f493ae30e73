"""Helpers of the policies that choose cells wherever they are stored (`pools_layers`: PyramidKV, KVzipHeads):
a column's cells found by owner in position order, and counts topped up in a given order."""

from __future__ import annotations

from typing import Iterable

import numpy as np

from cortexstream.errors import InvalidArgumentError


def columns_by_owner(owners: np.ndarray, positions: np.ndarray, columns: int, name: str
                     ) -> tuple[list[np.ndarray], np.ndarray]:
    """The flat indices of the cells each owner (`layer x H + head`, `columns` of them) holds, in position order,
    and how many each holds."""
    flat_owner, flat_pos = owners.reshape(-1), positions.reshape(-1)
    sizes = np.bincount(flat_owner, minlength=columns)
    if sizes.shape[0] != columns or (flat_owner < 0).any():
        raise InvalidArgumentError(f"{name}: owners outside [0, {columns})")
    by_owner = np.split(np.argsort(flat_owner, kind="stable"), np.cumsum(sizes)[:-1])
    return [cells[np.argsort(flat_pos[cells], kind="stable")] for cells in by_owner], sizes


def fill_in_order(counts: np.ndarray, room: np.ndarray, left: int, order: Iterable[int]) -> np.ndarray:
    """`counts` topped up by `left` in all, each entry up to `room`, entries taken in `order` (in place)."""
    for i in order:
        if left <= 0:
            break
        add = min(int(room[i] - counts[i]), left)
        counts[i] += add
        left -= add
    return counts


__all__ = ["columns_by_owner", "fill_in_order"]
