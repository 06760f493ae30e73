"""Property tests for cortexstream.kv.allocator: SortedInts vs a sorted set, and a hypothesis state machine
running BlockAllocator against a brute-force model."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cortexstream.errors import OutOfBlocksError
from cortexstream.kv import free_runs
from cortexstream.kv.allocator import BlockAllocator
from cortexstream.kv.free_runs import SortedInts


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("apq"), st.integers(0, 60)), max_size=120))
def test_sorted_ints_matches_sorted_set(ops: list[tuple[str, int]]) -> None:
    with mock.patch.object(free_runs, "LOAD", 2):
        keys, model = SortedInts(), set()
        for op, x in ops:
            if op == "a" and x not in model:
                keys.add(x)
                model.add(x)
            elif op == "a":
                keys.remove(x)
                model.discard(x)
            elif op == "p" and model:
                assert keys.pop_first() == min(model)
                model.discard(min(model))
            assert keys.first_ge(x) == min((k for k in model if k >= x), default=None)
            keys.check()
            assert keys.tolist() == sorted(model) and len(keys) == len(model)
            if model:
                assert (keys.first(), keys.last()) == (min(model), max(model))


def model_free_runs(rc: list[int]) -> list[tuple[int, int]]:
    """(start, length) of maximal free runs, by brute force over the model's ref counts."""
    runs, start = [], None
    for i, c in enumerate([*rc, 1]):
        if c == 0 and start is None:
            start = i
        elif c != 0 and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


class AllocatorMachine(RuleBasedStateMachine):
    """Random mixed workloads against a brute-force model: per-block ref counts + live handles.

    Each handle holds one reference to each of its blocks; `contig` handles must stay consecutive.
    """

    @initialize(n=st.integers(1, 40), load=st.sampled_from([1, 2, 512]))
    def setup(self, n: int, load: int) -> None:
        # tiny sublists make the size index split and merge buckets even in a 40-block pool
        self.saved_load, free_runs.LOAD = free_runs.LOAD, load
        self.a = BlockAllocator(n)
        self.rc = [0] * n
        self.owner = [-1] * n
        self.handles: list[tuple[list[int], bool]] = []

    def _unchanged(self, fn, exc) -> None:  # noqa: ANN001
        before = self.a.block_map()
        with pytest.raises(exc):
            fn()
        np.testing.assert_array_equal(self.a.block_map(), before)

    def _take(self, blocks: list[int], owner: int) -> None:
        for b in blocks:
            assert self.rc[b] == 0, f"allocator handed out block {b} which the model says is in use"
            self.rc[b], self.owner[b] = 1, owner

    @rule(n=st.integers(0, 12), owner=st.integers(-1, 70), contiguous=st.booleans())
    def allocate(self, n: int, owner: int, contiguous: bool) -> None:
        runs = model_free_runs(self.rc)
        fits = [r for r in runs if r[1] >= n]
        ok = bool(fits) or n == 0 if contiguous else n <= sum(length for _, length in runs)
        assert self.a.can_allocate(n, contiguous=contiguous) == ok
        if not ok:
            self._unchanged(lambda: self.a.allocate(n, owner=owner, contiguous=contiguous), OutOfBlocksError)
            return
        blocks = self.a.allocate(n, owner=owner, contiguous=contiguous)
        assert len(blocks) == n
        if contiguous and n:
            assert blocks == list(range(blocks[0], blocks[0] + n))
            # best fit: the hole it came from is no bigger than any other hole that fits
            hole = next(length for s, length in runs if s <= blocks[0] < s + length)
            assert hole == min(length for _, length in fits)
        self._take(blocks, owner)
        if blocks:  # an empty handle holds nothing and cannot be extended
            self.handles.append((blocks, contiguous))

    @precondition(lambda self: any(c for _, c in self.handles))
    @rule(data=st.data(), extra=st.integers(0, 6), owner=st.integers(-1, 5))
    def extend(self, data: st.DataObject, extra: int, owner: int) -> None:
        idx = data.draw(st.sampled_from([i for i, (_, c) in enumerate(self.handles) if c]))
        blocks, _ = self.handles[idx]
        after = range(blocks[-1] + 1, blocks[-1] + 1 + extra)
        if after.stop > len(self.rc) or any(self.rc[b] for b in after):
            before = self.a.block_map()
            assert self.a.extend_contiguous(blocks, extra, owner=owner) is None
            np.testing.assert_array_equal(self.a.block_map(), before)
            return
        new = self.a.extend_contiguous(blocks, extra, owner=owner)
        assert new == list(after)
        self._take(new, self.owner[blocks[-1]] if owner == -1 else owner)
        self.handles[idx] = (blocks + new, True)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def share(self, data: st.DataObject) -> None:
        blocks, contig = data.draw(st.sampled_from(self.handles))
        self.a.share(blocks)
        for b in blocks:
            self.rc[b] += 1
        self.handles.append((list(blocks), contig))

    @precondition(lambda self: self.handles)
    @rule(data=st.data(), owner=st.integers(-1, 5))
    def copy_on_write(self, data: st.DataObject, owner: int) -> None:
        idx = data.draw(st.integers(0, len(self.handles) - 1))
        blocks, _ = self.handles[idx]
        pos = data.draw(st.integers(0, len(blocks) - 1))
        old = blocks[pos]
        if self.rc[old] > 1 and 0 not in self.rc:
            self._unchanged(lambda: self.a.copy_on_write(old, owner=owner), OutOfBlocksError)
            return
        new, copied = self.a.copy_on_write(old, owner=owner)
        assert copied == (self.rc[old] > 1)
        if not copied:
            assert new == old
            return
        self.rc[old] -= 1
        self._take([new], owner)
        # the handle now points at a private copy: no longer one consecutive run
        self.handles[idx] = (blocks[:pos] + [new] + blocks[pos + 1 :], False)

    @precondition(lambda self: self.handles)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        blocks, _ = self.handles.pop(data.draw(st.integers(0, len(self.handles) - 1)))
        for b in blocks:
            self.rc[b] -= 1
        became_free = [b for b in blocks if self.rc[b] == 0]
        for b in became_free:
            self.owner[b] = -1
        assert self.a.free(blocks) == len(became_free)

    @precondition(lambda self: 0 in self.rc)
    @rule(data=st.data())
    def double_free(self, data: st.DataObject) -> None:
        victim = data.draw(st.sampled_from([b for b, c in enumerate(self.rc) if c == 0]))
        live = [b for blocks, _ in self.handles for b in blocks]
        self._unchanged(lambda: self.a.free(live[:3] + [victim]), ValueError)

    @invariant()
    def matches_model(self) -> None:
        a = self.a
        a.check_invariants()
        refs = [0] * len(self.rc)
        for blocks, contig in self.handles:
            for b in blocks:
                refs[b] += 1
            if contig and blocks:
                assert blocks == list(range(blocks[0], blocks[0] + len(blocks)))
        assert refs == self.rc  # every used block is held by exactly ref_count handles
        assert [a.ref_count(b) for b in range(len(self.rc))] == self.rc
        n_free = self.rc.count(0)
        assert a.num_free_blocks == n_free and a.num_used_blocks == len(self.rc) - n_free
        assert a.num_free_blocks + a.num_used_blocks == a.num_total_blocks
        largest = max((length for _, length in model_free_runs(self.rc)), default=0)
        assert a.largest_free_run() == largest
        assert a.fragmentation() == pytest.approx(0.0 if n_free == 0 else 1 - largest / n_free)
        expect = [-1 if c == 0 else -2 if c > 1 else (-3 if o == -1 else o) for c, o in zip(self.rc, self.owner)]
        assert a.block_map().tolist() == expect

    def teardown(self) -> None:
        if not hasattr(self, "a"):
            return
        free_runs.LOAD = self.saved_load
        for blocks, _ in self.handles:
            self.a.free(blocks)
        self.a.check_invariants()
        assert self.a.num_free_blocks == self.a.num_total_blocks
        assert self.a.fragmentation() == 0.0 and self.a.largest_free_run() == self.a.num_total_blocks


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_allocator_state_machine = AllocatorMachine.TestCase
