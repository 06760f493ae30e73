"""Reference-counted KV block allocator with contiguous and paged allocation (pure Python/NumPy).

The KV arena is a pool of ``num_blocks`` fixed-size blocks. A sequence either holds one
*contiguous* run of block ids (cheap to attend over as a single slice, growable in place with
``extend_contiguous``) or any set of *paged* block ids (never fails while enough blocks are free).
Blocks are reference counted so sequences can share a prompt prefix; ``copy_on_write`` splits a
shared block before it is written.

Design choices (see ``free_runs.py`` for the run index itself):

* Free space is indexed as maximal free runs: start/end dicts plus a bucketed sorted list of
  (length, start) keys searched with ``bisect``, so allocation costs O(log F + n) (F = number of
  free runs) instead of a linear scan of the bitmap.
* Contiguous requests use **best fit** (smallest run that fits, lowest start on ties): it keeps the
  large runs whole for later large requests, where first fit would nibble the first large run.
  The block is carved from the front of the run so the leftover tail sits right after the new
  run, which is exactly what ``extend_contiguous`` wants to find free.
* Paged requests consume the **smallest runs first**: they fill the fragmentation holes that
  contiguous requests cannot use and leave large runs for contiguous requests; the smallest runs
  sit at the front of the size index, so each whole run consumed costs one pop.
* Frees coalesce with both neighbours, so the index always holds maximal runs and
  ``largest_free_run`` is the true largest hole.
* Per-block state (ref count, owner) lives in two Python lists; a consecutive handle is checked
  and updated with list slices (C speed), other handles block by block. Every public method
  validates fully before mutating, so a raised error leaves the allocator unchanged.
* One ``threading.Lock`` guards every public method; internal ``_..._locked`` helpers never
  re-acquire it.
* ``high_water`` is one past the highest block in use. Both policies above keep it low in a
  fresh pool: best fit and smallest-runs-first take the free tail (the largest run while the pool
  is far from full) only when no hole serves the request, and carve it from its front. A KV arena
  whose buffers grow on demand backs only blocks below its high water: ``on_high_water`` is
  called (outside the lock) after every allocation with the new mark, before its ids are handed
  out; if the callback raises, the allocation is undone and the error propagates.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from cortexstream.errors import OutOfBlocksError
from cortexstream.kv.block_handles import (
    ANONYMOUS,
    FREE,
    SHARED,
    as_block_ids,
    as_count,
    check_block,
    check_owner,
    render_block_map,
)
from cortexstream.kv.free_runs import FreeRunIndex

__all__ = ["ANONYMOUS", "FREE", "SHARED", "BlockAllocator"]


class BlockAllocator:
    """Thread-safe allocator of ``num_blocks`` KV blocks; see the module docstring."""

    def __init__(self, num_blocks: int, on_high_water: Callable[[int], None] | None = None) -> None:
        num_blocks = as_count(num_blocks, "num_blocks")
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self._n = num_blocks
        self._lock = threading.Lock()
        self._runs = FreeRunIndex(num_blocks)
        # Plain lists, not NumPy: handles are a few dozen blocks, where a NumPy call's fixed
        # overhead outweighs list slices and indexing (docs/performance.md has the figures).
        self._refcount: list[int] = [0] * num_blocks
        self._owner: list[int] = [FREE] * num_blocks
        self.on_high_water = on_high_water
        # Told the ids of every allocation after on_high_water (the arena marks them fresh: a block's earlier
        # contents are not its new owner's, channel_quantized.py).
        self.on_allocate: Callable[[list[int]], None] | None = None

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

    @property
    def high_water(self) -> int:
        """One past the highest block id in use (0 when none is): ids handed out so far are all below it."""
        with self._lock:
            return self._runs.high_water()

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
        n = as_count(n, "n")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        with self._lock:
            return n <= (self._runs.largest() if contiguous else self._runs.num_free)

    def allocate(self, n: int, owner: int = -1, contiguous: bool = False) -> list[int]:
        """Allocate ``n`` blocks with ref count 1; contiguous=True returns ``n`` consecutive ids.

        Raises OutOfBlocksError (allocating nothing) when the request cannot be met.
        """
        n = as_count(n, "n")
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        owner = check_owner(owner)
        with self._lock:
            if n == 0:
                return []
            if contiguous:
                start = self._runs.best_fit(n)
                if start is None:
                    raise self._oob_locked(n, contiguous=True)
                self._runs.carve_front(start, n)
                self._mark_used_locked(start, n, owner)
                out = list(range(start, start + n))
            else:
                if n > self._runs.num_free:
                    raise self._oob_locked(n, contiguous=False)
                out = []
                for start, length in self._runs.take_smallest(n):
                    self._mark_used_locked(start, length, owner)
                    out.extend(range(start, start + length))
            high = self._runs.high_water()
        self._announce(high, lambda: self.free(out))
        self._handed_out(out)
        return out

    def extend_contiguous(self, blocks: list[int], extra: int, owner: int = -1) -> list[int] | None:
        """Grow the contiguous run ``blocks`` by ``extra`` blocks in place.

        Returns the new block ids (``blocks[-1] + 1 ...``) or None, changing nothing, when those
        blocks are not all free. ``owner=-1`` means "same owner as ``blocks[-1]``", so an arena
        growing a sequence does not have to repeat its id.
        """
        extra = as_count(extra, "extra")
        if extra < 0:
            raise ValueError(f"extra must be >= 0, got {extra}")
        owner = check_owner(owner)
        ids, start = as_block_ids(blocks, self._n, "blocks")
        if not ids:
            raise ValueError("extend_contiguous needs a non-empty run of blocks to grow")
        if start < 0:
            raise ValueError(f"blocks are not one contiguous run: {ids}")
        with self._lock:
            self._check_in_use_locked(ids, start)
            if extra == 0:
                return []
            first_new = start + len(ids)
            # The run's last block is in use, so a free block right after it starts a free run.
            if self._runs.run_length_at(first_new) < extra:
                return None
            if owner == FREE:
                owner = self._owner[first_new - 1]
            self._runs.carve_front(first_new, extra)
            self._mark_used_locked(first_new, extra, owner)
            out = list(range(first_new, first_new + extra))
            high = self._runs.high_water()
        self._announce(high, lambda: self.free(out))
        self._handed_out(out)
        return out

    # --------------------------------------------------------- ref counting / free
    def free(self, blocks: Iterable[int]) -> int:
        """Drop one reference per listed block; returns how many blocks became free.

        A block listed more times than its ref count (including a free block) is a double free:
        ValueError naming the block, and no ref count changes.
        """
        ids, start = as_block_ids(blocks, self._n, "blocks")
        if not ids:
            return 0
        n = len(ids)
        with self._lock:
            rc = self._refcount
            counts: Counter[int] | None = None  # None: every id listed once
            if start >= 0:
                seg = rc[start : start + n]
                if 0 in seg:
                    self._raise_double_free(start + seg.index(0), 1)
                if seg.count(1) == n:  # the common case: sole holder of a contiguous run
                    rc[start : start + n] = [0] * n
                    self._owner[start : start + n] = [FREE] * n
                    self._runs.release(start, n)
                    return n
            elif len(set(ids)) != n:
                counts = Counter(ids)
            # validate everything before the first mutation
            if counts is None:
                for b in ids:
                    if rc[b] == 0:
                        self._raise_double_free(b, 1)
            else:
                for b, k in counts.items():
                    if k > rc[b]:
                        self._raise_double_free(b, k)
            freed: list[int] = []
            for b, k in counts.items() if counts is not None else zip(ids, [1] * n):
                left = rc[b] - k
                rc[b] = left
                if left == 0:
                    self._owner[b] = FREE
                    freed.append(b)
            freed.sort()
            self._runs.release_sorted(freed)
            return len(freed)

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference per listed block (e.g. a second sequence reusing a prompt prefix)."""
        ids, start = as_block_ids(blocks, self._n, "blocks")
        with self._lock:
            self._check_in_use_locked(ids, start)
            rc = self._refcount
            for b in ids:
                rc[b] += 1

    def ref_count(self, block: int) -> int:
        b = check_block(block, self._n)
        with self._lock:
            return self._refcount[b]

    def any_shared(self, blocks: Sequence[int]) -> bool:
        """Whether any of ``blocks`` has more than one reference: the lock-free check every decode step makes
        before writing, so the common case (nothing shared) costs no lock. Ids are not validated here;
        ``copy_on_write`` validates them on the slow path."""
        rc = self._refcount
        return any(rc[b] > 1 for b in blocks)

    def copy_on_write(self, block: int, owner: int = -1) -> tuple[int, bool]:
        """Make ``block`` private before a write: (block, False) if unshared, else (new, True).

        On (new, True) one reference to the old block has been dropped and the caller must copy
        the block's data into ``new``. OutOfBlocksError (nothing changed) if no block is free.
        """
        b = check_block(block, self._n)
        owner = check_owner(owner)
        with self._lock:
            self._check_in_use_locked([b], b)
            if self._refcount[b] == 1:
                return b, False
            if self._runs.num_free == 0:
                raise self._oob_locked(1, contiguous=False)
            ((new, _),) = self._runs.take_smallest(1)
            self._mark_used_locked(new, 1, owner)
            self._refcount[b] -= 1  # stays >= 1: it was > 1
            high = self._runs.high_water()

        def undo() -> None:
            self.free([new])
            with self._lock:
                self._refcount[b] += 1

        self._announce(high, undo)
        self._handed_out([new])
        return new, True

    def owner_of(self, block: int) -> int:
        """Owner passed at allocation (-1 for a free block, or for one allocated without owner)."""
        b = check_block(block, self._n)
        with self._lock:
            return self._owner[b]

    # --------------------------------------------------------------- inspection
    def block_map(self) -> np.ndarray:
        """Per-block int64 array: owner id, -1 free, -2 shared (ref count > 1), -3 anonymous."""
        with self._lock:
            return self._block_map_locked()

    def _block_map_locked(self) -> np.ndarray:
        out = np.array(self._owner, dtype=np.int64)
        rc = np.array(self._refcount, dtype=np.int64)
        # An anonymous block must not read as free (-1), or "map == -1" would lie about free space.
        out[(rc > 0) & (out == FREE)] = ANONYMOUS
        out[rc > 1] = SHARED
        return out

    def format_block_map(self, width: int = 64) -> str:
        """Text dump, one char per block: '.' free, '#' shared, '+' anonymous, owner id mod 62
        as 0-9a-zA-Z; rows of ``width`` chars, then a summary line."""
        with self._lock:
            bmap = self._block_map_locked().tolist()
            free = self._runs.num_free
            largest = self._runs.largest()
            frag = self._fragmentation_locked()
        summary = (
            f"free={free} used={self._n - free} total={self._n} "
            f"largest_free_run={largest} fragmentation={frag:.3f}"
        )
        return render_block_map(bmap, width, summary)

    def check_invariants(self) -> None:
        """Raise AssertionError if the ref counts, owners and free-run index disagree."""
        with self._lock:
            rc = np.array(self._refcount, dtype=np.int64)
            owner = np.array(self._owner, dtype=np.int64)
            assert len(rc) == len(owner) == self._n, "per-block state has the wrong length"
            assert (rc >= 0).all(), f"negative ref count at block {int(np.argmin(rc))}"
            free_mask = rc == 0
            stray = np.flatnonzero(free_mask & (owner != FREE))
            assert stray.size == 0, f"free block {stray[:1].tolist()} still has an owner"
            assert (owner >= FREE).all(), "owner ids below -1 are reserved"
            self._runs.check(free_mask)

    # ------------------------------------------------------------------ helpers
    def _announce(self, high: int, undo: Callable[[], object]) -> None:
        """Tell ``on_high_water`` the mark after an allocation (not under the lock: it may read the allocator);
        undo the allocation if it raises."""
        callback = self.on_high_water
        if callback is None:
            return
        try:
            callback(high)
        except BaseException:
            undo()
            raise

    def _handed_out(self, ids: list[int]) -> None:
        if self.on_allocate is not None and ids:
            self.on_allocate(ids)

    def _mark_used_locked(self, start: int, n: int, owner: int) -> None:
        self._refcount[start : start + n] = [1] * n
        self._owner[start : start + n] = [owner] * n

    def _oob_locked(self, n: int, contiguous: bool) -> OutOfBlocksError:
        kind = "contiguous" if contiguous else "paged"
        return OutOfBlocksError(
            f"cannot allocate {n} {kind} block(s): {self._runs.num_free} of {self._n} free, "
            f"largest free run {self._runs.largest()}"
        )

    def _raise_double_free(self, block: int, times: int) -> None:
        raise ValueError(
            f"double free of block {block}: freed {times} time(s) "
            f"but its ref count is {self._refcount[block]}"
        )

    def _check_in_use_locked(self, ids: list[int], start: int) -> None:
        rc = self._refcount
        if start >= 0:
            seg = rc[start : start + len(ids)]
            if 0 in seg:
                raise ValueError(f"block {start + seg.index(0)} is free (not allocated)")
            return
        for b in ids:
            if rc[b] == 0:
                raise ValueError(f"block {b} is free (not allocated)")
