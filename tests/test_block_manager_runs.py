"""Run-wise block reservation and give-back in the block manager (pure Python, no model)."""

from __future__ import annotations

from cortexstream.engine.block_manager import BlockManager
from cortexstream.engine.sampling import SamplingParams
from cortexstream.engine.sequence import Sequence
from cortexstream.kv.allocator import BlockAllocator

BS = 4


def make(num_blocks: int) -> BlockManager:
    return BlockManager(BlockAllocator(num_blocks), BS, prefix_caching=False)


def seq(prompt_len: int, max_tokens: int) -> Sequence:
    return Sequence(list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=max_tokens))


def is_run(table: list[int]) -> bool:
    return table == list(range(table[0], table[0] + len(table)))


def test_admission_reserves_prompt_and_max_tokens_as_one_run():
    manager = make(64)
    a, b = seq(10, 6), seq(10, 6)
    for s in (a, b):
        manager.admit(s)
    assert len(a.block_table) == len(b.block_table) == 4  # ceil(16 / 4), not ceil(10 / 4)
    assert is_run(a.block_table) and is_run(b.block_table)
    assert b.block_table[0] - a.block_table[0] == 4  # evenly spaced: one strided view decodes both
    a.output_ids.extend([1] * 5)
    a.num_computed = a.num_physical = 15
    assert manager.reserve(a, 1) and len(a.block_table) == 4  # already reserved: nothing allocated


def test_growth_beyond_the_reservation_extends_the_run_in_place():
    manager = make(64)
    a = seq(3, 1000)
    manager.reserve_ahead = False
    manager.admit(a)  # one block, nothing ahead
    manager.reserve_ahead = True
    a.num_computed = a.num_physical = 4
    assert manager.reserve(a, 1)
    assert len(a.block_table) == 1 + 1 + 8 and is_run(a.block_table)  # the block it needs plus a run ahead


def test_reserved_tails_are_given_back_when_another_request_needs_blocks():
    manager = make(12)
    a = seq(4, 40)  # could reach 44 tokens = 11 blocks: all reserved at admission
    manager.admit(a)
    assert len(a.block_table) == 11 and manager.allocator.num_free_blocks == 1
    b = seq(12, 4)  # needs 3 blocks for its prompt
    assert manager.can_admit(b)
    manager.admit(b)
    assert len(b.block_table) == 3
    assert len(a.block_table) == 11 - 2 and is_run(a.block_table)  # gave back the two newest blocks of its tail
    manager.allocator.check_invariants()
    # never below what its tokens (and the next one) need
    a_keep = manager.blocks_for(a.num_tokens + 1)
    c = seq(40, 1)
    assert not manager.can_admit(c)
    assert manager.num_trimmable() == len(a.block_table) - a_keep


def test_release_gives_back_the_whole_reservation():
    manager = make(32)
    a = seq(5, 50)
    manager.admit(a)
    assert manager.allocator.num_used_blocks == manager.blocks_for(55)
    manager.release(a)
    assert manager.allocator.num_used_blocks == 0
    assert manager.num_trimmable() == 0


def test_without_a_free_run_admission_falls_back_to_scattered_blocks():
    manager = make(8)
    holes = manager.allocator.allocate(8)
    manager.allocator.free(holes[::2])  # four free blocks, no two adjacent
    a = seq(12, 20)
    assert manager.can_admit(a)
    manager.admit(a)
    assert sorted(a.block_table) == holes[::2][:3]
