"""Index of the free runs (maximal ranges of consecutive free blocks) of a block pool.

Three structures describe the same set of runs:

* ``_len_by_start``  start -> length, so "is there a free run right after block b?" (in-place
  extension) and right-neighbour coalescing are O(1) dict look-ups;
* ``_start_by_end``  end (exclusive) -> start, for O(1) left-neighbour coalescing;
* ``_keys``          the runs ordered by (length, start), each packed into one int
  ``length * K + start`` (K = pool size > any start). Best fit is one bisect for the first key
  >= ``n * K``, the largest run is the last key, the smallest runs are at the front.

Packing (length, start) into a single int keeps the bisects on plain int comparisons (cheaper
than tuple comparisons) and makes ties resolve to the lowest start, so best fit is deterministic.

``_keys`` is a ``SortedInts``: sorted sublists of at most ``2 * LOAD`` ints plus a list of their
maxima (the layout of ``sortedcontainers.SortedList``, which is not a dependency of ours). A flat
``bisect``-ed list is O(log F) comparisons but O(F) ``memmove`` per insert/delete; sublists bound
the memmove to ~LOAD pointers, so each key operation is O(log F) comparisons plus O(LOAD) bytes
moved. A flat list is a little cheaper while few runs are free but grows with F, which a
fragmented pool makes large; a cost that stays put under heavy fragmentation beats a slightly
cheaper common case (figures: docs/performance.md, "Figures the code's design rests on").

Rejected alternatives: a buddy allocator rounds every request up to a power of two (wasting KV
memory) and cannot grow a run in place by an arbitrary ``extra``; a segment tree over the bitmap
costs O(log N) Python-level steps per query and update however few runs are free.

This class knows nothing about reference counts or owners and does no locking: the caller
(``BlockAllocator``) guarantees that what it releases is really in use, and holds the lock.
"""

from __future__ import annotations

from bisect import bisect_left, insort

import numpy as np

LOAD = 512  # sublist size target: memmove of 2*LOAD pointers stays well under a microsecond


class SortedInts:
    """Sorted set of distinct ints: O(log F) bisects, inserts/deletes move at most ~2*LOAD pointers."""

    def __init__(self) -> None:
        self._lists: list[list[int]] = []
        self._maxes: list[int] = []  # _maxes[i] == _lists[i][-1]; bisected to pick a sublist
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def tolist(self) -> list[int]:
        return [x for sub in self._lists for x in sub]

    def first(self) -> int:
        return self._lists[0][0]

    def last(self) -> int:
        return self._maxes[-1]

    def first_ge(self, x: int) -> int | None:
        i = bisect_left(self._maxes, x)
        if i == len(self._maxes):
            return None
        sub = self._lists[i]
        return sub[bisect_left(sub, x)]

    def add(self, x: int) -> None:
        self._len += 1
        if not self._lists:
            self._lists.append([x])
            self._maxes.append(x)
            return
        i = bisect_left(self._maxes, x)
        if i == len(self._maxes):  # new maximum: goes at the end of the last sublist
            i -= 1
            self._lists[i].append(x)
            self._maxes[i] = x
        else:
            insort(self._lists[i], x)
        sub = self._lists[i]
        if len(sub) > 2 * LOAD:  # split so no later memmove exceeds ~2*LOAD pointers
            self._lists[i : i + 1] = [sub[:LOAD], sub[LOAD:]]
            self._maxes.insert(i, sub[LOAD - 1])

    def remove(self, x: int) -> None:
        i = bisect_left(self._maxes, x)
        sub = self._lists[i]
        j = bisect_left(sub, x)
        assert sub[j] == x, f"key {x} not in index"
        del sub[j]
        self._len -= 1
        if not sub:
            del self._lists[i], self._maxes[i]
        elif j == len(sub):
            self._maxes[i] = sub[-1]

    def check(self) -> None:
        """AssertionError unless sublists are non-empty, bounded, sorted and agree with _maxes."""
        flat = self.tolist()
        assert len(flat) == self._len, f"length counter {self._len} != {len(flat)} keys"
        assert all(a < b for a, b in zip(flat, flat[1:])), "keys not strictly increasing"
        assert all(0 < len(sub) <= 2 * LOAD for sub in self._lists), "empty or oversized sublist"
        assert self._maxes == [sub[-1] for sub in self._lists], "sublist maxima out of sync"

    def pop_first(self) -> int:
        sub = self._lists[0]
        x = sub.pop(0)
        self._len -= 1
        if not sub:
            del self._lists[0], self._maxes[0]
        return x


class FreeRunIndex:
    """Free runs of a pool of ``num_blocks`` blocks; starts with the whole pool free."""

    def __init__(self, num_blocks: int) -> None:
        self._k = num_blocks  # key multiplier: any start < num_blocks, so keys never collide
        self._len_by_start: dict[int, int] = {0: num_blocks}
        self._start_by_end: dict[int, int] = {num_blocks: 0}
        self._keys = SortedInts()
        self._keys.add(num_blocks * self._k)
        self.num_free = num_blocks

    # ----------------------------------------------------------------- queries
    @property
    def num_runs(self) -> int:
        return len(self._keys)

    def largest(self) -> int:
        return self._keys.last() // self._k if len(self._keys) else 0

    def run_length_at(self, start: int) -> int:
        """Length of the free run beginning exactly at ``start`` (0 if none does)."""
        return self._len_by_start.get(start, 0)

    def best_fit(self, n: int) -> int | None:
        """Start of the smallest run with length >= n (lowest start on ties), or None."""
        key = self._keys.first_ge(n * self._k)
        return None if key is None else key % self._k

    def high_water(self) -> int:
        """One past the highest block not free (0 when all are): the start of the free run that ends the pool."""
        return self._start_by_end.get(self._k, self._k)

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
        requests, and they sit at the front of ``_keys``, so each costs one pop. The
        remainder is carved from the front of the first run that is too big, which is by
        construction the best fit for that remainder. Returns the (start, length) pieces taken.
        """
        keys, k = self._keys, self._k
        taken: list[tuple[int, int]] = []
        remaining = n
        while remaining:
            length, start = divmod(keys.first(), k)
            if length > remaining:  # best fit for the remainder: carve its front, keep the rest
                self._remove(start, length)
                self._add(start + remaining, length - remaining)
                taken.append((start, remaining))
                break
            keys.pop_first()
            del self._len_by_start[start]
            del self._start_by_end[start + length]
            taken.append((start, length))
            remaining -= length
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

    def release_sorted(self, ids: list[int]) -> None:
        """Release sorted distinct block ids, one ``release`` per group of consecutive ids."""
        if not ids:
            return
        start = prev = ids[0]
        for b in ids[1:]:
            if b != prev + 1:
                self.release(start, prev + 1 - start)
                start = b
            prev = b
        self.release(start, prev + 1 - start)

    # ----------------------------------------------------------------- helpers
    def _add(self, start: int, length: int) -> None:
        self._len_by_start[start] = length
        self._start_by_end[start + length] = start
        self._keys.add(length * self._k + start)

    def _remove(self, start: int, length: int) -> None:
        del self._len_by_start[start]
        del self._start_by_end[start + length]
        self._keys.remove(length * self._k + start)

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
        self._keys.check()
        assert self._keys.tolist() == sorted(n * self._k + s for s, n in expected.items()), "size index out of sync"
        assert self.num_free == int(free_mask.sum()), (
            f"num_free counter {self.num_free} != {int(free_mask.sum())} free blocks in bitmap"
        )
