"""Validation and text rendering of block handles, shared by ``BlockAllocator``'s public methods.

Kept out of allocator.py so the allocator reads as its algorithm; nothing here touches state.
"""

from __future__ import annotations

import operator
from array import array
from collections.abc import Iterable

import numpy as np

FREE = -1  # block_map / owner_of value of a free block
SHARED = -2  # block_map value of a block whose ref count is > 1
ANONYMOUS = -3  # block_map value of an in-use block allocated without an owner (owner=-1)

_OWNER_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def as_count(value: object, name: str) -> int:
    """Accept Python/NumPy ints (not bools): a float or a bool here is always a caller bug."""
    if type(value) is int:  # fast path: this runs on every allocate
        return value
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return operator.index(value)


def check_block(block: object, num_blocks: int) -> int:
    b = as_count(block, "block")
    if not 0 <= b < num_blocks:
        raise ValueError(f"block id {b} out of range [0, {num_blocks})")
    return b


def check_owner(owner: object) -> int:
    o = as_count(owner, "owner")
    if o < FREE:  # -2/-3 would be indistinguishable from SHARED/ANONYMOUS in block_map
        raise ValueError(f"owner must be >= -1 (negative ids are reserved), got {o}")
    return o


def as_block_ids(blocks: Iterable[int], num_blocks: int, name: str) -> tuple[list[int], int]:
    """Validate a handle (int ids in range, before any state is read).

    Returns (ids, start): start is ids[0] if the ids are consecutive, else -1, so callers
    can check and update a contiguous handle with list slices instead of a Python loop.
    """
    if isinstance(blocks, np.ndarray):
        if blocks.ndim != 1 or (blocks.size and blocks.dtype.kind not in "iu"):
            raise ValueError(f"{name} must be a flat array of int block ids, got {blocks.dtype}")
        ids = blocks.tolist()
    else:
        ids = blocks if type(blocks) is list else list(blocks)
    if not ids:
        return ids, -1
    first, last, n = ids[0], ids[-1], len(ids)
    # Consecutive fast path: equality with the range pins every middle element to that int
    # value, so only the ends need type and bounds checks.
    consecutive = type(first) is int and type(last) is int and last - first == n - 1
    if consecutive and ids == list(range(first, last + 1)):
        if first < 0 or last >= num_blocks:
            raise ValueError(f"{name}: block id {first if first < 0 else last} out of range [0, {num_blocks})")
        return ids, first
    try:
        ids = array("q", ids).tolist()  # C-speed rejection of floats/str/None; NumPy ints -> int
    except (TypeError, OverflowError) as e:
        raise ValueError(f"{name} must be a list of int block ids: {e}") from None
    lo, hi = min(ids), max(ids)
    if lo < 0 or hi >= num_blocks:
        raise ValueError(f"{name}: block id {lo if lo < 0 else hi} out of range [0, {num_blocks})")
    return ids, (ids[0] if n == 1 else -1)


def render_block_map(bmap: list[int], width: int, summary: str) -> str:
    """One char per block ('.' free, '#' shared, '+' anonymous, owner id mod 62 as 0-9a-zA-Z),
    rows of ``width`` chars, then ``summary``."""
    width = as_count(width, "width")
    if width <= 0:
        raise ValueError(f"width must be > 0, got {width}")
    special = {FREE: ".", SHARED: "#", ANONYMOUS: "+"}
    chars = "".join(special.get(v) or _OWNER_CHARS[v % 62] for v in bmap)
    rows = [chars[i : i + width] for i in range(0, len(chars), width)]
    rows.append(summary)
    return "\n".join(rows)
