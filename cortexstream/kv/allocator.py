"""Reference-counted KV block allocator with contiguous and paged allocation (pure Python/NumPy).

The KV arena is a pool of ``num_blocks`` fixed-size blocks. A sequence either holds one
*contiguous* run of block ids (cheap to attend over as a single slice, growable in place with
``extend_contiguous``) or any set of *paged* block ids (never fails while enough blocks are free).
Blocks are reference counted so sequences can share a prompt prefix; ``copy_on_write`` splits a
shared block before it is written.

Design choices (see ``free_runs.py`` for the run index itself):

* Free space is indexed as maximal free runs, ordered by (length, start) in a ``bisect``-ed sorted
  list plus start/end dicts, so allocation is O(log F + n) instead of a linear scan of the bitmap.
* Contiguous requests use **best fit** (smallest run that fits, lowest start on ties): it keeps the
  large runs whole for later large requests, where first fit would nibble the first large run.
  The block is carved from the front of the run so the leftover tail sits right after the new
  run, which is exactly what ``extend_contiguous`` wants to find free.
* Paged requests consume the **smallest runs first**: they fill the fragmentation holes that
  contiguous requests cannot use and leave large runs for contiguous requests; whole runs come off
  the front of the size index in one slice delete.
* Frees coalesce with both neighbours, so the index always holds maximal runs and
  ``largest_free_run`` is the true largest hole.
* Per-block state lives in two NumPy arrays (ref count, owner) so validation of a whole handle is
  vectorised and ``block_map`` is a copy. Every public method validates fully before mutating,
  so a raised error leaves the allocator unchanged.
* One ``threading.Lock`` guards every public method; internal ``_..._locked`` helpers never
  re-acquire it.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Iterable

import numpy as np

from cortexstream.errors import OutOfBlocksError
from cortexstream.kv.free_runs import FreeRunIndex

FREE = -1  # block_map / owner_of value of a free block
SHARED = -2  # block_map value of a block whose ref count is > 1
ANONYMOUS = -3  # block_map value of an in-use block allocated without an owner (owner=-1)

_OWNER_CHARS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _as_count(value: object, name: str) -> int:
    """Accept Python/NumPy ints (not bools): a float or a bool here is always a caller bug."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return operator.index(value)


class BlockAllocator:
    """Thread-safe allocator of ``num_blocks`` KV blocks; see the module docstring."""

    def __init__(self, num_blocks: int) -> None:
        num_blocks = _as_count(num_blocks, "num_blocks")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self._n = num_blocks
        self._lock = threading.Lock()
        self._runs = FreeRunIndex(num_blocks)
        self._refcount = np.zeros(num_blocks, dtype=np.int32)
        self._owner = np.full(num_blocks, FREE, dtype=np.int64)

    # ----------------------------------------------------------------- counters
    @property
    def num_total_blocks(self) -> int:
        return self._n

    @property
    def num_free_blocks(self) -> int:
        with self._lock:
            return self._runs.num_free

    @property
    def num_used_blocks(self) -> int:
        with self._lock:
            return self._n - self._runs.num_free

    def largest_free_run(self) -> int:
        with self._lock:
            return self._runs.largest()

    def fragmentation(self) -> float:
        """1 - largest_free_run / num_free_blocks: 0.0 = all free space in one run (or none free)."""
        with self._lock:
            return self._fragmentation_locked()

    def _fragmentation_locked(self) -> float:
        free = self._runs.num_free
        return 0.0 if free == 0 else 1.0 - self._runs.largest() / free

    # --------------------------------------------------------------- allocation
    def can_allocate(self, n: int, contiguous: bool = False) -> bool:
        n = _as_count(n, "n")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            return n <= (self._runs.largest() if contiguous else self._runs.num_free)

    def allocate(self, n: int, owner: int = -1, contiguous: bool = False) -> list[int]:
        """Allocate ``n`` blocks with ref count 1; contiguous=True returns ``n`` consecutive ids.

        Raises OutOfBlocksError (allocating nothing) when the request cannot be met.
        """
        n = _as_count(n, "n")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        owner = self._check_owner(owner)
        with self._lock:
            if n == 0:
                return []
            if contiguous:
                start = self._runs.best_fit(n)
                if start is None:
                    raise self._oob_locked(n, contiguous=True)
                self._runs.carve_front(start, n)
                self._mark_used_locked(start, n, owner)
                return list(range(start, start + n))
            if n > self._runs.num_free:
                raise self._oob_locked(n, contiguous=False)
            out: list[int] = []
            for start, length in self._runs.take_smallest(n):
                self._mark_used_locked(start, length, owner)
                out.extend(range(start, start + length))
            return out

    def extend_contiguous(self, blocks: list[int], extra: int, owner: int = -1) -> list[int] | None:
        """Grow the contiguous run ``blocks`` by ``extra`` blocks in place.

        Returns the new block ids (``blocks[-1] + 1 ...``) or None, changing nothing, when those
        blocks are not all free. ``owner=-1`` means "same owner as ``blocks[-1]``", so an arena
        growing a sequence does not have to repeat its id.
        """
        extra = _as_count(extra, "extra")
        if extra < 0:
            raise ValueError(f"extra must be >= 0, got {extra}")
        owner = self._check_owner(owner)
        ids = self._as_ids(blocks, "blocks")
        if ids.size == 0:
            raise ValueError("extend_contiguous needs a non-empty run of blocks to grow")
        if ids.size > 1 and not np.all(np.diff(ids) == 1):
            raise ValueError(f"blocks are not one contiguous run: {ids.tolist()}")
        with self._lock:
            self._check_in_use_locked(ids)
            if extra == 0:
                return []
            first_new = int(ids[-1]) + 1
            # blocks[-1] is in use, so a free block right after it must start a run in the index.
            if self._runs.run_length_at(first_new) < extra:
                return None
            if owner == FREE:
                owner = int(self._owner[ids[-1]])
            self._runs.carve_front(first_new, extra)
            self._mark_used_locked(first_new, extra, owner)
            return list(range(first_new, first_new + extra))

    # --------------------------------------------------------- ref counting / free
    def free(self, blocks: Iterable[int]) -> int:
        """Drop one reference per listed block; returns how many blocks became free.

        A block listed more times than its ref count (including a free block) is a double free:
        ValueError naming the block, and no ref count changes.
        """
        ids = self._as_ids(blocks, "blocks")
        if ids.size == 0:
            return 0
        uniq, counts = np.unique(ids, return_counts=True)
        with self._lock:
            rc = self._refcount[uniq]
            bad = np.flatnonzero(counts > rc)
            if bad.size:
                b = int(uniq[bad[0]])
                raise ValueError(
                    f"double free of block {b}: freed {int(counts[bad[0]])} time(s) "
                    f"but its ref count is {int(rc[bad[0]])}"
                )
            rc = rc - counts
            self._refcount[uniq] = rc
            freed = uniq[rc == 0]
            self._owner[freed] = FREE
            self._runs.release_sorted_ids(freed)
            return int(freed.size)

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference per listed block (e.g. a second sequence reusing a prompt prefix)."""
        ids = self._as_ids(blocks, "blocks")
        if ids.size == 0:
            return
        uniq, counts = np.unique(ids, return_counts=True)
        with self._lock:
            self._check_in_use_locked(uniq)
            self._refcount[uniq] += counts.astype(np.int32)

    def ref_count(self, block: int) -> int:
        b = self._check_block(block)
        with self._lock:
            return int(self._refcount[b])

    def copy_on_write(self, block: int, owner: int = -1) -> tuple[int, bool]:
        """Make ``block`` private before a write: (block, False) if unshared, else (new, True).

        On (new, True) one reference to the old block has been dropped and the caller must copy
        the block's data into ``new``. OutOfBlocksError (nothing changed) if no block is free.
        """
        b = self._check_block(block)
        owner = self._check_owner(owner)
        with self._lock:
            self._check_in_use_locked(np.array([b]))
            if self._refcount[b] == 1:
                return b, False
            if self._runs.num_free == 0:
                raise self._oob_locked(1, contiguous=False)
            ((new, _),) = self._runs.take_smallest(1)
            self._mark_used_locked(new, 1, owner)
            self._refcount[b] -= 1  # stays >= 1: it was > 1
            return new, True

    def owner_of(self, block: int) -> int:
        """Owner passed at allocation (-1 for a free block, or for one allocated without owner)."""
        b = self._check_block(block)
        with self._lock:
            return int(self._owner[b])

    # --------------------------------------------------------------- inspection
    def block_map(self) -> np.ndarray:
        """Per-block int64 array: owner id, -1 free, -2 shared (ref count > 1), -3 anonymous."""
        with self._lock:
            return self._block_map_locked()

    def _block_map_locked(self) -> np.ndarray:
        out = self._owner.copy()
        # An anonymous block must not read as free (-1), or "map == -1" would lie about free space.
        out[(self._refcount > 0) & (self._owner == FREE)] = ANONYMOUS
        out[self._refcount > 1] = SHARED
        return out

    def format_block_map(self, width: int = 64) -> str:
        """Text dump, one char per block: '.' free, '#' shared, '+' anonymous, owner id mod 62
        as 0-9a-zA-Z; rows of ``width`` chars, then a summary line."""
        width = _as_count(width, "width")
        if width <= 0:
            raise ValueError(f"width must be > 0, got {width}")
        with self._lock:
            bmap = self._block_map_locked()
            free = self._runs.num_free
            largest = self._runs.largest()
            frag = self._fragmentation_locked()
        special = {FREE: ".", SHARED: "#", ANONYMOUS: "+"}
        chars = "".join(special.get(v, _OWNER_CHARS[v % 62] if v >= 0 else "?") for v in bmap.tolist())
        rows = [chars[i : i + width] for i in range(0, len(chars), width)]
        rows.append(
            f"free={free} used={self._n - free} total={self._n} "
            f"largest_free_run={largest} fragmentation={frag:.3f}"
        )
        return "\n".join(rows)

    def check_invariants(self) -> None:
        """Raise AssertionError if the ref counts, owners and free-run index disagree."""
        with self._lock:
            rc = self._refcount
            assert rc.min(initial=0) >= 0, f"negative ref count at block {int(np.argmin(rc))}"
            free_mask = rc == 0
            stray = np.flatnonzero(free_mask & (self._owner != FREE))
            assert stray.size == 0, f"free block {int(stray[0]) if stray.size else -1} still has an owner"
            assert self._owner.min(initial=FREE) >= FREE, "owner ids below -1 are reserved"
            self._runs.check(free_mask)

    # ------------------------------------------------------------------ helpers
    def _mark_used_locked(self, start: int, n: int, owner: int) -> None:
        self._refcount[start : start + n] = 1
        self._owner[start : start + n] = owner

    def _oob_locked(self, n: int, contiguous: bool) -> OutOfBlocksError:
        kind = "contiguous" if contiguous else "paged"
        return OutOfBlocksError(
            f"cannot allocate {n} {kind} block(s): {self._runs.num_free} of {self._n} free, "
            f"largest free run {self._runs.largest()}"
        )

    def _check_block(self, block: object) -> int:
        b = _as_count(block, "block")
        if not 0 <= b < self._n:
            raise ValueError(f"block id {b} out of range [0, {self._n})")
        return b

    def _check_owner(self, owner: object) -> int:
        o = _as_count(owner, "owner")
        if o < FREE:
            raise ValueError(f"owner must be >= -1 (negative ids are reserved), got {o}")
        return o

    def _as_ids(self, blocks: Iterable[int], name: str) -> np.ndarray:
        """Validate a handle: 1-D integer ids in range (checked before any state is read)."""
        arr = np.asarray(blocks if isinstance(blocks, (list, tuple, np.ndarray)) else list(blocks))
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)
        if arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise ValueError(f"{name} must be a flat list of int block ids, got {arr.dtype} shape {arr.shape}")
        arr = arr.astype(np.int64, copy=False)
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= self._n:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name}: block id {bad} out of range [0, {self._n})")
        return arr

    def _check_in_use_locked(self, ids: np.ndarray) -> None:
        free = ids[self._refcount[ids] == 0]
        if free.size:
            raise ValueError(f"block {int(free[0])} is free (not allocated)")
