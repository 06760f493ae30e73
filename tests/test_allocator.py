"""Unit tests for cortexstream.kv.allocator.BlockAllocator: allocation, extension, fragmentation, the block map.

Freeing, sharing and copy-on-write: test_allocator_refcounts.py; the hypothesis state machine:
test_allocator_properties.py.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from cortexstream.errors import OutOfBlocksError
from cortexstream.kv.allocator import BlockAllocator


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


# ------------------------------------------------------------------ high water (what a growing arena must back)
def test_high_water_is_one_past_the_highest_block_in_use() -> None:
    a = BlockAllocator(32)
    assert a.high_water == 0
    first = a.allocate(3, contiguous=True)
    second = a.allocate(4)
    assert first == [0, 1, 2] and second == [3, 4, 5, 6] and a.high_water == 7
    a.free(first)
    assert a.high_water == 7  # a hole below the top does not lower it
    assert a.allocate(2, contiguous=True) == [0, 1] and a.high_water == 7  # the hole is reused first
    a.free(second)
    assert a.high_water == 2
    a.allocate(30)
    assert a.high_water == 32 and a.num_free_blocks == 0


def test_on_high_water_hears_every_allocation_before_its_ids_are_handed_out() -> None:
    heard: list[tuple[int, int]] = []
    a = BlockAllocator(16)
    a.on_high_water = lambda high: heard.append((high, a.num_used_blocks))
    run = a.allocate(2, owner=1, contiguous=True)
    assert heard[-1] == (2, 2)
    assert a.extend_contiguous(run, 3) == [2, 3, 4] and heard[-1] == (5, 5)
    a.allocate(4)
    assert heard[-1] == (9, 9)
    a.share([0])
    new, copied = a.copy_on_write(0, owner=2)
    assert copied and new == 9 and heard[-1] == (10, 10)
    assert len(heard) == 4  # frees and shares announce nothing
    a.free(run + [2, 3, 4])
    assert len(heard) == 4


def test_a_failing_high_water_callback_undoes_the_allocation() -> None:
    a = BlockAllocator(16)
    run = a.allocate(2, owner=1, contiguous=True)
    a.share(run[:1])
    before = a.block_map().copy()
    refs = [a.ref_count(b) for b in range(16)]

    def refuse(high: int) -> None:
        raise MemoryError(f"cannot back {high} blocks")

    a.on_high_water = refuse
    for attempt in (lambda: a.allocate(3, contiguous=True), lambda: a.allocate(5),
                    lambda: a.extend_contiguous(run, 2), lambda: a.copy_on_write(run[0])):
        with pytest.raises(MemoryError):
            attempt()
        np.testing.assert_array_equal(a.block_map(), before)
        assert [a.ref_count(b) for b in range(16)] == refs
        a.check_invariants()


def test_best_fit_keeps_the_high_water_near_the_live_blocks_under_churn() -> None:
    """Holes are reused before the free tail, so in a pool far larger than what is live the high water (what a
    growing arena backs) stays within a small factor of the most blocks ever live at once."""
    for seed in range(3):
        rng = random.Random(seed)
        a = BlockAllocator(50_000)
        live: list[list[int]] = []
        used = peak_used = peak_high = 0
        for _ in range(4000):
            if live and (used > 900 or rng.random() < 0.45):
                handle = live.pop(rng.randrange(len(live)))
                used -= len(handle)
                a.free(handle)
            else:
                n = rng.randint(1, 64)
                live.append(a.allocate(n, contiguous=rng.random() < 0.7))
                used += n
            peak_used, peak_high = max(peak_used, used), max(peak_high, a.high_water)
        assert peak_high < 1.6 * peak_used, (seed, peak_used, peak_high)
