"""Index of the free runs (maximal ranges of consecutive free blocks) of a block pool.

Three structures describe the same set of runs:

* ``_len_by_start``  start -> length, so "is there a free run right after block b?" (in-place
  extension) and right-neighbour coalescing are O(1) dict look-ups;
* ``_start_by_end``  end (exclusive) -> start, for O(1) left-neighbour coalescing;
* ``_keys``          a sorted list of ``length * K + start`` (K = pool size > any start), i.e. the
  runs ordered by (length, start) packed into one int. Best fit is one ``bisect`` for the first key
  >= ``n * K``, the largest run is ``_keys[-1]``, the smallest runs are at the front.

Packing (length, start) into a single int keeps ``bisect`` on plain int comparisons (about 2x
faster than tuples) and makes ties resolve to the lowest start, so best fit is deterministic.

Cost: a lookup is O(log F) comparisons (F = number of free runs). Inserting or deleting a key in a
Python list is O(log F) comparisons plus a ``memmove`` of up to F pointers; that memmove is a few
microseconds even at F ~ 30k (the worst case for a 64k-block pool), below the interpreter overhead
of the call, which is why a balanced tree or a bucketed list would not pay for itself here
(see bench/results/allocator.md). A buddy allocator was rejected because it rounds every request
up to a power of two (wasting KV memory) and cannot grow a run by an arbitrary ``extra`` in place.

This class knows nothing about reference counts or owners and does no locking: the caller
(``BlockAllocator``) guarantees that what it releases is really in use, and holds the lock.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np


class FreeRunIndex:
    """Free runs of a pool of ``num_blocks`` blocks; starts with the whole pool free."""

    def __init__(self, num_blocks: int) -> None:
        self._k = num_blocks  # key multiplier: any start < num_blocks, so keys never collide
        self._len_by_start: dict[int, int] = {0: num_blocks}
        self._start_by_end: dict[int, int] = {num_blocks: 0}
        self._keys: list[int] = [num_blocks * self._k]
        self.num_free = num_blocks

    # ----------------------------------------------------------------- queries
    @property
    def num_runs(self) -> int:
        return len(self._keys)

    def largest(self) -> int:
        return self._keys[-1] // self._k if self._keys else 0

    def run_length_at(self, start: int) -> int:
        """Length of the free run beginning exactly at ``start`` (0 if none does)."""
        return self._len_by_start.get(start, 0)

    def best_fit(self, n: int) -> int | None:
        """Start of the smallest run with length >= n (lowest start on ties), or None."""
        i = bisect_left(self._keys, n * self._k)
        if i == len(self._keys):
            return None
        return self._keys[i] % self._k

    def runs(self) -> list[tuple[int, int]]:
        """All free runs as (start, length), ordered by start."""
        return sorted(self._len_by_start.items())

    # --------------------------------------------------------------- mutations
    def carve_front(self, start: int, n: int) -> None:
        """Take the first ``n`` blocks of the run starting at ``start`` (caller checked length)."""
        length = self._len_by_start[start]
        self._remove(start, length)
        if length > n:
            self._add(start + n, length - n)
        self.num_free -= n

    def take_smallest(self, n: int) -> list[tuple[int, int]]:
        """Take ``n`` blocks (caller checked ``n <= num_free``), smallest runs first.

        Consuming whole small runs first leaves the large runs intact for later contiguous
        requests, and removing them is one slice delete from the front of ``_keys``. The
        remainder is carved from the front of the first run that is too big, which is by
        construction the best fit for that remainder. Returns the (start, length) pieces taken.
        """
        keys, k = self._keys, self._k
        taken: list[tuple[int, int]] = []
        remaining = n
        i = 0
        while remaining:
            length, start = divmod(keys[i], k)
            if length <= remaining:
                taken.append((start, length))
                del self._len_by_start[start]
                del self._start_by_end[start + length]
                remaining -= length
                i += 1
            else:
                taken.append((start, remaining))
                break
        del keys[:i]
        if remaining:
            start, length = taken[-1][0], keys[0] // k
            self._remove(start, length)
            self._add(start + remaining, length - remaining)
        self.num_free -= n
        return taken

    def release(self, start: int, length: int) -> None:
        """Return [start, start+length) to the pool, merging with free neighbours."""
        self.num_free += length
        end = start + length
        left = self._start_by_end.get(start)
        if left is not None:
            self._remove(left, start - left)
            start = left
        right_len = self._len_by_start.get(end)
        if right_len is not None:
            self._remove(end, right_len)
            end += right_len
        self._add(start, end - start)

    def release_sorted_ids(self, ids: np.ndarray) -> None:
        """Release a sorted array of distinct block ids, one ``release`` per consecutive group."""
        if ids.size == 0:
            return
        breaks = np.flatnonzero(np.diff(ids) != 1) + 1
        bounds = [0, *breaks.tolist(), int(ids.size)]
        starts = ids[bounds[:-1]].tolist()
        for start, lo, hi in zip(starts, bounds[:-1], bounds[1:]):
            self.release(start, hi - lo)

    # ----------------------------------------------------------------- helpers
    def _add(self, start: int, length: int) -> None:
        self._len_by_start[start] = length
        self._start_by_end[start + length] = start
        insort(self._keys, length * self._k + start)

    def _remove(self, start: int, length: int) -> None:
        del self._len_by_start[start]
        del self._start_by_end[start + length]
        key = length * self._k + start
        i = bisect_left(self._keys, key)
        del self._keys[i]

    # -------------------------------------------------------------- validation
    def check(self, free_mask: np.ndarray) -> None:
        """Raise AssertionError unless the index describes exactly the free blocks in ``free_mask``."""
        padded = np.concatenate(([False], free_mask, [False])).astype(np.int8)
        edges = np.diff(padded)
        starts = np.flatnonzero(edges == 1)
        ends = np.flatnonzero(edges == -1)
        expected = dict(zip(starts.tolist(), (ends - starts).tolist()))
        assert self._len_by_start == expected, (
            f"free-run index {sorted(self._len_by_start.items())} != bitmap runs {sorted(expected.items())}"
        )
        assert self._start_by_end == {s + n: s for s, n in expected.items()}, "end index out of sync"
        assert self._keys == sorted(n * self._k + s for s, n in expected.items()), "size index out of sync"
        assert self.num_free == int(free_mask.sum()), (
            f"num_free counter {self.num_free} != {int(free_mask.sum())} free blocks in bitmap"
        )
