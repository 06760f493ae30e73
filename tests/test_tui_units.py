"""TUI building blocks without a screen: message replacement, block-map scaling, the engine-thread snapshot
(owners, cached, evicted marks, built from `Engine.snapshot()`) and `Engine.drop_cached`, which makes "clear
conversation" free blocks."""

from __future__ import annotations

import numpy as np

from cortexstream.tui.messages import (
    FLAG_CACHED,
    FLAG_TRIMMED,
    FREE,
    SHARED,
    EngineSnapshot,
    ReplyDelta,
    StatsUpdate,
)
from cortexstream.tui.snapshot import SnapshotBuilder
from cortexstream.tui.widgets.block_map import FILL, GLYPH, render_cells, scale
from cortexstream.engine.engine import Engine


def _snapshot() -> EngineSnapshot:
    return EngineSnapshot(np.zeros(4, np.int32), np.zeros(4, np.uint8), {}, 0, 0.0, 0, 0.0, 0.0)


def test_only_stats_replace_stats():
    old, new = StatsUpdate(_snapshot()), StatsUpdate(_snapshot())
    delta = ReplyDelta(1, "r", "text", 1)
    assert new.can_replace(old)
    assert not new.can_replace(delta) and not delta.can_replace(old) and not delta.can_replace(delta)


def test_block_map_packs_thousands_of_blocks_into_the_space_it_has():
    rng = np.random.default_rng(0)
    owners = rng.choice([FREE, FREE, 0, 1, 2, SHARED], size=5000).astype(np.int32)
    flags = np.zeros(5000, np.uint8)
    text, per_cell = render_cells(owners, flags, width=40, height=10)
    assert per_cell == scale(5000, 40, 10) == 13
    rows = text.plain.split("\n")
    assert len(rows) <= 10 and all(len(row) <= 40 for row in rows)
    assert set(text.plain) <= set(FILL) | {GLYPH["free"], "\n"}
    small, one = render_cells(owners[:100], flags[:100], width=40, height=10)
    assert one == 1 and len(small.plain.replace("\n", "")) == 100


def test_snapshot_owners_cached_blocks_and_clear(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4)
    builder = SnapshotBuilder()
    ids = {}
    for conv, prompt in ((1, "the first conversation"), (2, "a second one")):
        ids[conv] = engine.add_request(prompt, max_tokens=12, tenant=f"chat-{conv}")
        builder.track(ids[conv], conv, engine.snapshot(blocks=False).sequence(ids[conv]).owner)
    engine.step()
    live = builder.build(engine.snapshot())
    assert live.conversations[1].running and live.conversations[2].running
    assert np.count_nonzero(live.owners == 1) == live.conversations[1].blocks > 0
    while engine.has_unfinished:
        engine.step()
    done = builder.build(engine.snapshot())
    for conv in (1, 2):
        mine = done.owners == conv
        assert mine.any() and np.all(done.flags[mine] & FLAG_CACHED)
        assert done.conversations[conv].cached_blocks == int(mine.sum())
    kept = int(np.count_nonzero(done.owners == 2))
    freed = engine.drop_cached(builder.forget(1))
    after = builder.build(engine.snapshot())
    assert freed == int(np.count_nonzero(done.owners == 1))
    assert not np.any(after.owners == 1) and int(np.count_nonzero(after.owners == 2)) == kept
    assert engine.arena.allocator.num_used_blocks == kept
    engine.arena.allocator.check_invariants()


def test_snapshot_marks_policy_evictions(tiny):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, kv_tokens=1024, block_size=4)
    builder = SnapshotBuilder()
    rid = engine.add_request("a conversation longer than its window", max_tokens=60,
                             kv_policy="streaming:window=16,sinks=4")
    builder.track(rid, 1, engine.snapshot(blocks=False).sequence(rid).owner)
    trimmed = False
    while engine.has_unfinished:
        engine.step()
        snap = builder.build(engine.snapshot())
        trimmed |= bool(np.any(snap.flags[snap.owners == 1] & FLAG_TRIMMED))
        usage = snap.conversations[1]
        assert usage.physical <= usage.logical
    assert trimmed
    assert usage.logical > usage.physical
