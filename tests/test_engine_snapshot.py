"""`Engine.snapshot()` / `EngineClient.snapshot()`: the read-only view interfaces use instead of the engine's parts.
Its block tables, reference counts, owners and prefix-cache blocks agree with the allocator after prefix sharing;
`Engine.drop_cached` frees a finished conversation's cached blocks; the view comes through both clients."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cortexstream.engine.client import EngineClient, InProcessClient, ThreadedClient
from cortexstream.engine.engine import Engine
from cortexstream.engine.snapshot import EngineView, SequenceView

PROMPT = [int(x) for x in np.random.default_rng(3).integers(3, 250, size=17)]  # 4 full blocks of 4 + 1 token


def _engine(tiny, **kwargs) -> Engine:
    model, tokenizer = tiny
    return Engine(model, tokenizer, kv_tokens=256, block_size=4, **kwargs)


def _step_until_first_token(engine: Engine, rid: str) -> None:
    for _ in range(50):
        if any(o.request_id == rid and o.token is not None for o in engine.step()):
            return
    raise AssertionError(f"{rid}: no token after 50 steps")


def _assert_matches_allocator(engine: Engine, view: EngineView) -> None:
    allocator = engine.arena.allocator
    assert view.block_ref_counts.tolist() == [allocator.ref_count(b) for b in range(view.num_blocks)]
    assert view.block_owners.tolist() == [allocator.owner_of(b) for b in range(view.num_blocks)]
    assert np.array_equal(view.block_map(), allocator.block_map())
    assert list(view.prefix_cached_blocks) == engine.block_manager.cached_block_ids()
    assert (view.num_blocks, view.num_free_blocks, view.num_used_blocks) == (
        allocator.num_total_blocks, allocator.num_free_blocks, allocator.num_used_blocks)
    # Every reference is a live table's or the prefix cache's.
    expected = np.zeros(view.num_blocks, np.int64)
    for seq in view.sequences:
        np.add.at(expected, list(seq.block_table), 1)
    np.add.at(expected, list(view.prefix_cached_blocks), 1)
    assert np.array_equal(expected, view.block_ref_counts)


def test_view_of_a_shared_prefix_matches_the_allocator(tiny):
    engine = _engine(tiny)
    first = engine.add_request(PROMPT, max_tokens=30)
    waiting = engine.snapshot(blocks=False)
    seq = waiting.sequence(first)
    assert waiting.running == () and seq == waiting.waiting[0]
    assert (seq.status, seq.num_tokens, seq.num_computed, seq.block_table) == ("waiting", 17, 0, ())
    assert waiting.block_ref_counts is None and waiting.block_owners is None and waiting.prefix_cached_blocks is None
    with pytest.raises(ValueError):
        waiting.block_map()

    _step_until_first_token(engine, first)
    second = engine.add_request(PROMPT, max_tokens=30)
    engine.step()  # admits the second request on the first one's cached prompt blocks
    view = engine.snapshot()
    a, b = view.sequence(first), view.sequence(second)
    assert [s.request_id for s in view.running] == [first, second] and view.waiting == ()
    assert a.status == b.status == "running" and a.owner != b.owner
    assert b.num_cached_prefix == 16 and a.num_cached_prefix == 0
    shared = b.block_table[:4]
    assert shared == a.block_table[:4]
    assert set(shared) <= set(view.prefix_cached_blocks)
    assert view.block_ref_counts[list(shared)].tolist() == [3] * 4  # both tables and the prefix cache
    assert view.block_owners[list(shared)].tolist() == [a.owner] * 4  # the first computed them
    assert view.block_owners[b.block_table[4]] == b.owner and view.block_ref_counts[b.block_table[4]] == 1
    assert view.num_prompt_tokens_computed >= 17 and view.num_decode_tokens > 0
    assert view.stats["running"] == 2 and view.num_preemptions == 0
    _assert_matches_allocator(engine, view)


def test_view_is_plain_read_only_data(tiny):
    engine = _engine(tiny)
    rid = engine.add_request(PROMPT, max_tokens=4)
    _step_until_first_token(engine, rid)
    view = engine.snapshot()
    with pytest.raises(dataclasses.FrozenInstanceError):
        view.num_blocks = 0  # type: ignore[misc]
    with pytest.raises(ValueError):
        view.block_ref_counts[0] = 7
    seq = view.running[0]
    assert isinstance(seq, SequenceView) and isinstance(seq.block_table, tuple)
    table = seq.block_table
    while engine.has_unfinished:
        engine.step()
    assert view.running[0].block_table == table  # the engine went on; the view did not change
    assert engine.snapshot(blocks=False).running == ()


def test_drop_cached_frees_a_finished_conversations_blocks(tiny):
    engine = _engine(tiny)
    first = engine.add_request(PROMPT, max_tokens=6)
    other = engine.add_request([7, 8, 9, 10, 11, 12, 13, 14, 15], max_tokens=6)
    view = engine.snapshot(blocks=False)
    owners = {view.sequence(first).owner}
    kept_owner = view.sequence(other).owner
    while engine.has_unfinished:
        engine.step()
    done = engine.snapshot()
    assert done.sequences == () and done.num_used_blocks == len(done.prefix_cached_blocks) > 0
    mine = [b for b in done.prefix_cached_blocks if done.block_owners[b] in owners]
    kept = [b for b in done.prefix_cached_blocks if done.block_owners[b] == kept_owner]
    assert mine and kept
    assert engine.drop_cached(owners) == len(mine)
    after = engine.snapshot()
    assert list(after.prefix_cached_blocks) == kept and after.num_used_blocks == len(kept)
    assert after.num_free_blocks == done.num_free_blocks + len(mine)
    assert all(after.block_ref_counts[b] == 0 for b in mine)
    assert engine.drop_cached(owners) == 0  # nothing of theirs is left
    _assert_matches_allocator(engine, after)
    engine.arena.allocator.check_invariants()


@pytest.mark.parametrize("kind", ["in_process", "threaded"])
def test_snapshot_through_the_client(tiny, kind):
    engine = _engine(tiny)
    client = InProcessClient(engine) if kind == "in_process" else ThreadedClient(engine)
    try:
        assert isinstance(client, EngineClient)
        rid = client.submit(PROMPT, max_tokens=200)
        stream = client.stream(rid)
        next(o for o in stream if o.token is not None)  # prefilled and decoding
        view = client.snapshot()
        assert isinstance(view, EngineView) and view.sequence(rid).status == "running"
        assert view.block_ref_counts is not None and len(view.block_owners) == view.num_blocks
        light = client.snapshot(blocks=False)
        assert light.block_ref_counts is None and light.sequence(rid) is not None
        assert light.num_used_blocks == view.num_used_blocks > 0
        client.abort(rid)
        list(stream)
        assert client.snapshot(blocks=False).sequences == ()
    finally:
        client.close()
