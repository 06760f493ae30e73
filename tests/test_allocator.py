"""Tests for cortexstream.kv.allocator.BlockAllocator: unit tests, then a hypothesis state machine."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from pathlib import Path
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


def singles(a: BlockAllocator) -> list[list[int]]:
    """Fill the whole pool with one-block handles, so tests can punch holes where they want."""
    return [a.allocate(1, owner=i % 5) for i in range(a.num_total_blocks)]


def make_holes(n: int, holes: list[range]) -> BlockAllocator:
    a = BlockAllocator(n)
    singles(a)
    for r in holes:
        a.free(list(r))
    return a


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "8", None])
def test_constructor_rejects_bad_num_blocks(bad: object) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockAllocator(bad)  # type: ignore[arg-type]


def test_fresh_allocator_counters() -> None:
    a = BlockAllocator(16)
    assert (a.num_total_blocks, a.num_free_blocks, a.num_used_blocks) == (16, 16, 0)
    assert a.largest_free_run() == 16 and a.fragmentation() == 0.0
    assert (a.block_map() == -1).all()
    a.check_invariants()


def test_allocate_zero_and_bad_n() -> None:
    a = BlockAllocator(4)
    assert a.allocate(0) == [] and a.allocate(0, contiguous=True) == []
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(ValueError):
            a.allocate(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="owner"):
        a.allocate(1, owner=-2)
    assert a.num_free_blocks == 4


def test_paged_out_of_blocks_is_fail_fast() -> None:
    a = BlockAllocator(10)
    a.allocate(4, owner=1, contiguous=True)
    a.allocate(3, owner=2)
    before = a.block_map()
    assert not a.can_allocate(4)
    with pytest.raises(OutOfBlocksError, match=r"cannot allocate 4 paged.*3 of 10 free.*largest free run 3"):
        a.allocate(4, owner=3)
    np.testing.assert_array_equal(a.block_map(), before)
    assert a.num_free_blocks == 3
    a.check_invariants()


def test_contiguous_out_of_blocks_when_fragmented() -> None:
    a = make_holes(8, [range(0, 1), range(2, 3), range(4, 5), range(6, 8)])
    before = a.block_map()
    assert a.num_free_blocks == 5 and a.largest_free_run() == 2
    assert not a.can_allocate(3, contiguous=True) and a.can_allocate(3)
    with pytest.raises(OutOfBlocksError, match=r"3 contiguous.*5 of 8 free.*largest free run 2"):
        a.allocate(3, owner=9, contiguous=True)
    np.testing.assert_array_equal(a.block_map(), before)
    assert sorted(a.allocate(3, owner=9)) == [0, 2, 4]  # paged still works, smallest holes first
    a.check_invariants()


def test_contiguous_ids_are_consecutive_and_owned() -> None:
    a = BlockAllocator(64)
    got = [a.allocate(n, owner=n, contiguous=True) for n in (5, 1, 17, 8)]
    for blocks in got:
        assert blocks == list(range(blocks[0], blocks[0] + len(blocks)))
        assert {a.owner_of(b) for b in blocks} == {len(blocks)}
    flat = [b for blocks in got for b in blocks]
    assert len(set(flat)) == len(flat) == a.num_used_blocks == 31
    a.check_invariants()


def test_contiguous_is_best_fit() -> None:
    # holes of 5, 2 and 3 blocks: a 2-block request must take the 2-hole, a 3-block the 3-hole
    a = make_holes(20, [range(1, 6), range(8, 10), range(13, 16)])
    assert a.allocate(2, contiguous=True) == [8, 9]
    assert a.allocate(3, contiguous=True) == [13, 14, 15]
    assert a.allocate(4, contiguous=True) == [1, 2, 3, 4]
    a.check_invariants()


def test_paged_takes_smallest_runs_first() -> None:
    a = make_holes(20, [range(0, 8), range(10, 11), range(14, 16)])
    got = a.allocate(4, owner=3)
    assert sorted(got) == [0, 10, 14, 15]  # the 1- and 2-holes, then the front of the big run
    assert a.largest_free_run() == 7
    a.check_invariants()


def test_extend_contiguous_in_place_or_none() -> None:
    a = BlockAllocator(16)
    run = a.allocate(4, owner=7, contiguous=True)
    assert run == [0, 1, 2, 3]
    more = a.extend_contiguous(run, 3)
    assert more == [4, 5, 6]
    assert {a.owner_of(b) for b in more} == {7}  # owner=-1 inherits the run's owner
    assert a.extend_contiguous(run + more, 0) == []
    blocker = a.allocate(1, owner=8, contiguous=True)
    assert blocker == [7]
    before = a.block_map()
    assert a.extend_contiguous(run + more, 1) is None
    np.testing.assert_array_equal(a.block_map(), before)
    other = a.allocate(2, owner=1, contiguous=True)  # [8, 9]
    assert a.extend_contiguous(other, 6, owner=2) == list(range(10, 16))
    assert a.owner_of(15) == 2 and a.num_free_blocks == 0
    assert a.extend_contiguous(other, 1) is None  # off the end of the pool
    a.check_invariants()


def test_extend_contiguous_rejects_bad_handles() -> None:
    a = BlockAllocator(16)
    a.allocate(4, contiguous=True)
    with pytest.raises(ValueError, match="contiguous"):
        a.extend_contiguous([0, 2], 1)
    with pytest.raises(ValueError, match="non-empty"):
        a.extend_contiguous([], 1)
    with pytest.raises(ValueError, match="block 9 is free"):
        a.extend_contiguous([9], 1)
    with pytest.raises(ValueError, match="extra"):
        a.extend_contiguous([0, 1], -1)
    assert a.num_used_blocks == 4


def test_double_free_is_rejected_without_changes() -> None:
    a = BlockAllocator(8)
    x = a.allocate(3, owner=1, contiguous=True)
    y = a.allocate(2, owner=2, contiguous=True)
    assert a.free(x) == 3
    before = a.block_map()
    with pytest.raises(ValueError, match=r"double free of block 0"):
        a.free(x)
    with pytest.raises(ValueError, match=r"double free of block 4"):
        a.free([y[0], y[1], y[1]])  # y[0] must not be freed either
    np.testing.assert_array_equal(a.block_map(), before)
    assert a.ref_count(y[0]) == 1 and a.num_free_blocks == 6
    with pytest.raises(ValueError, match="out of range"):
        a.free([8])
    with pytest.raises(ValueError):
        a.free([1.0])  # type: ignore[list-item]
    assert a.free([]) == 0
    a.check_invariants()


def test_share_and_ref_counts() -> None:
    a = BlockAllocator(8)
    prefix = a.allocate(3, owner=1, contiguous=True)
    a.share(prefix)
    a.share(prefix[:1])
    assert [a.ref_count(b) for b in prefix] == [3, 2, 2]
    assert a.block_map().tolist()[:4] == [-2, -2, -2, -1]
    assert a.free(prefix) == 0
    assert a.free(prefix[:1]) == 0
    assert [a.ref_count(b) for b in prefix] == [1, 1, 1]
    assert a.block_map().tolist()[:3] == [1, 1, 1]
    assert a.free(prefix) == 3 and a.num_free_blocks == 8
    with pytest.raises(ValueError, match="block 0 is free"):
        a.share([0])
    with pytest.raises(ValueError, match="out of range"):
        a.ref_count(8)
    a.check_invariants()


def test_handles_as_arrays_tuples_duplicates() -> None:
    a = BlockAllocator(10)
    x = a.allocate(4, owner=1, contiguous=True)  # [0..3]
    a.share(np.array([1, 3, 3]))  # NumPy ids; duplicates add one reference each
    assert [a.ref_count(b) for b in x] == [1, 2, 1, 3]
    assert a.free((3, 3)) == 0 and a.ref_count(3) == 1  # duplicate ids: the Counter path
    assert a.free(b for b in [np.int64(1), 3]) == 1  # a generator of NumPy ints, not consecutive
    assert a.ref_count(1) == 1 and a.owner_of(3) == -1
    for bad in ([9, 10], [-1, 0], np.array([[0]]), np.array([0.0]), ["0"], [0, None]):
        with pytest.raises(ValueError):
            a.free(bad)
    assert a.free(np.array([0, 1, 2], dtype=np.uint16)) == 3 and a.num_free_blocks == 10
    a.check_invariants()


def test_copy_on_write() -> None:
    a = BlockAllocator(4)
    blocks = a.allocate(3, owner=1, contiguous=True)
    assert a.copy_on_write(blocks[0], owner=2) == (blocks[0], False)  # unshared: write in place
    a.share(blocks)
    new, copied = a.copy_on_write(blocks[1], owner=2)
    assert copied and new == 3
    assert a.ref_count(blocks[1]) == 1 and a.ref_count(new) == 1 and a.owner_of(new) == 2
    # pool full, block 0 still shared: fail fast, nothing changes
    before = a.block_map()
    with pytest.raises(OutOfBlocksError, match="cannot allocate 1"):
        a.copy_on_write(blocks[0], owner=2)
    np.testing.assert_array_equal(a.block_map(), before)
    assert a.ref_count(blocks[0]) == 2
    with pytest.raises(ValueError, match="double free of block 1"):
        a.free(blocks + [new] + blocks)  # block 0 has 2 refs, block 1 only 1
    assert a.free(blocks + [new]) == 2 and a.ref_count(blocks[0]) == a.ref_count(blocks[2]) == 1
    with pytest.raises(ValueError, match="block 1 is free"):
        a.copy_on_write(blocks[1])
    a.check_invariants()


def test_fragmentation_on_hand_made_layout() -> None:
    a = BlockAllocator(10)
    assert a.fragmentation() == 0.0
    everything = singles(a)
    assert a.fragmentation() == 0.0  # nothing free
    for b in (0, 1, 2, 5, 8, 9):
        a.free(everything[b])
    assert a.num_free_blocks == 6 and a.largest_free_run() == 3
    assert a.fragmentation() == pytest.approx(0.5)
    a.free(everything[3] + everything[4])  # joins 0..2 and 5 into a 6-run
    assert a.largest_free_run() == 6 and a.fragmentation() == pytest.approx(1 - 6 / 8)
    a.free(everything[6] + everything[7])
    assert a.largest_free_run() == 10 and a.fragmentation() == 0.0
    a.check_invariants()


def test_format_block_map() -> None:
    a = BlockAllocator(12)
    a.allocate(3, owner=0, contiguous=True)
    shared = a.allocate(2, owner=11, contiguous=True)
    a.share(shared)
    a.allocate(1, owner=62 + 36, contiguous=True)  # cycles: 98 % 62 = 36 -> 'A'
    a.allocate(1, contiguous=True)  # anonymous
    text = a.format_block_map(width=5)
    assert text.splitlines() == [
        "000##",
        "A+...",
        "..",
        "free=5 used=7 total=12 largest_free_run=5 fragmentation=0.000",
    ]
    with pytest.raises(ValueError, match="width"):
        a.format_block_map(0)


def test_block_map_marks_anonymous_blocks_as_used() -> None:
    a = BlockAllocator(3)
    a.allocate(2)
    assert a.block_map().tolist() == [-3, -3, -1]
    assert a.owner_of(0) == -1 and a.ref_count(0) == 1


def test_check_invariants_detects_corruption() -> None:
    a = BlockAllocator(8)
    a.allocate(3, contiguous=True)
    a._refcount[5] = 1  # a used block the run index still thinks is free
    with pytest.raises(AssertionError):
        a.check_invariants()


def test_thread_safety() -> None:
    n_blocks, n_threads = 256, 8
    a = BlockAllocator(n_blocks)
    claimed = np.full(n_blocks, -1)  # who holds each block, per the threads' own bookkeeping
    errors: list[BaseException] = []
    start = threading.Barrier(n_threads)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # force many interleavings inside allocator methods

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        held: list[list[int]] = []
        try:
            start.wait()  # all threads hammer the allocator at once
            for _ in range(800):
                if held and (rng.random() < 0.45 or len(held) > 12):
                    blocks = held.pop(rng.randrange(len(held)))
                    claimed[blocks] = -1
                    a.free(blocks)
                    continue
                try:
                    blocks = a.allocate(rng.randint(1, 8), owner=tid, contiguous=rng.random() < 0.5)
                except OutOfBlocksError:
                    continue
                assert (claimed[blocks] == -1).all(), f"block handed out twice: {blocks}"
                claimed[blocks] = tid
                held.append(blocks)
            for blocks in held:
                claimed[blocks] = -1
                a.free(blocks)
        except BaseException as e:  # surfaced in the main thread
            errors.append(e)

    try:
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    a.check_invariants()
    assert a.num_free_blocks == n_blocks and a.largest_free_run() == n_blocks


def test_allocator_does_not_import_mlx() -> None:
    code = "import sys, cortexstream.kv.allocator; assert not [m for m in sys.modules if m.startswith('mlx')]"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


# ---------------------------------------------------------------------------- property tests


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
