"""Tests for BlockAllocator's reference counting: free, double free, share, handle types, copy-on-write."""

from __future__ import annotations

import numpy as np
import pytest

from cortexstream.errors import OutOfBlocksError
from cortexstream.kv.allocator import BlockAllocator


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
    assert a.any_shared(prefix) and a.any_shared(prefix[2:]) and not a.any_shared([])
    assert a.block_map().tolist()[:4] == [-2, -2, -2, -1]
    assert a.free(prefix) == 0
    assert a.free(prefix[:1]) == 0
    assert [a.ref_count(b) for b in prefix] == [1, 1, 1]
    assert not a.any_shared(prefix)
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

