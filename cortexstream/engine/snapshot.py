"""`EngineView`: a read-only picture of an engine between two steps, for interfaces (`Engine.snapshot()`).

Plain data only (ints, strings, tuples, read-only NumPy arrays): nothing in a view refers to a live `Sequence`,
the scheduler or the arena, so a view can cross threads and be kept while the engine goes on. Interfaces (the
server's /v1/kv and /metrics, the TUI, benchmarks) read the engine through views and `EngineClient.snapshot`,
never through the engine's parts.

`blocks=False` leaves out the per-block arrays and the prefix-cache block ids (their fields are None): those are
O(arena blocks) to copy, the rest is O(live sequences), cheap enough to take after every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from cortexstream.engine.sequence import Sequence
from cortexstream.kv.block_handles import ANONYMOUS, FREE, SHARED


@dataclass(frozen=True)
class SequenceView:
    """One live (running or waiting) sequence."""

    request_id: str
    owner: int  # the allocator owner id of the blocks it allocates (`EngineView.block_owners`)
    tenant: str | None
    status: str  # "running" or "waiting"
    block_table: tuple[int, ...]
    num_tokens: int  # prompt + output (+ a token in flight)
    num_computed: int  # tokens whose KV has been computed
    num_physical: int  # KV slots held; below num_computed once a policy evicted or compressed
    num_cached_prefix: int  # prompt tokens served from the prefix cache at its last admission
    num_pending: int  # tokens whose KV is still to be computed (the prompt at first, then 1 per decode step)


@dataclass(frozen=True)
class EngineView:
    """The engine between two steps; see the module docstring."""

    running: tuple[SequenceView, ...]
    waiting: tuple[SequenceView, ...]
    block_size: int
    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int  # prefix-cache blocks included
    num_preemptions: int
    num_prompt_tokens_computed: int  # prefill tokens computed so far
    prefill_time: float  # seconds spent in prefill chunks
    num_decode_tokens: int  # tokens decoded so far (one per sequence per decode step)
    decode_time: float  # seconds spent in decode batches
    num_generated_tokens: int
    stats: dict[str, Any]  # Engine.stats()
    # With blocks=True only (else None): per-block reference counts and allocator owner ids (FREE for a free
    # block; a block allocated without owner also reads FREE), and the prefix cache's blocks, oldest first.
    block_ref_counts: np.ndarray | None = None
    block_owners: np.ndarray | None = None
    prefix_cached_blocks: tuple[int, ...] | None = None
    # Arena blocks whose KV the disk tier holds too (with blocks, and a disk tier; else empty)
    disk_blocks: tuple[int, ...] = ()

    @property
    def sequences(self) -> tuple[SequenceView, ...]:
        """Running, then waiting."""
        return self.running + self.waiting

    def sequence(self, request_id: str) -> SequenceView | None:
        return next((s for s in self.sequences if s.request_id == request_id), None)

    def block_map(self) -> np.ndarray:
        """`BlockAllocator.block_map()` codes: owner id, FREE, SHARED (ref count > 1), ANONYMOUS."""
        if self.block_ref_counts is None or self.block_owners is None:
            raise ValueError("block_map: this view was taken with blocks=False")
        out = self.block_owners.copy()
        out[(self.block_ref_counts > 0) & (out == FREE)] = ANONYMOUS
        out[self.block_ref_counts > 1] = SHARED
        return out


def _sequence_view(seq: Sequence) -> SequenceView:
    return SequenceView(
        request_id=seq.request_id, owner=seq.owner, tenant=seq.tenant, status=seq.status.value,
        block_table=tuple(seq.block_table), num_tokens=seq.num_tokens, num_computed=seq.num_computed,
        num_physical=seq.num_physical, num_cached_prefix=seq.num_cached_prefix, num_pending=seq.num_pending,
    )


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def _block_state(allocator: Any) -> tuple[np.ndarray, np.ndarray]:
    """Per-block reference counts and owner ids (FREE when free or allocated without owner, as `owner_of` says)
    from the allocator's public calls: `block_map()`, one code per block, and for the shared blocks only (the
    map folds their count and owner into SHARED) `ref_count` and `owner_of`."""
    codes = allocator.block_map()
    ref_counts = (codes != FREE).astype(np.int64)
    owners = np.where(codes >= 0, codes, FREE).astype(np.int64)
    for block in np.flatnonzero(codes == SHARED).tolist():
        ref_counts[block] = allocator.ref_count(block)
        owners[block] = allocator.owner_of(block)
    return ref_counts, owners


def take_snapshot(engine: Any, blocks: bool = True) -> EngineView:
    """Build the view of an `Engine` (on the thread that steps it); `Engine.snapshot` calls this (typed Any: this
    module must not import engine.py, which imports it)."""
    scheduler, allocator = engine.scheduler, engine.arena.allocator
    ref_counts = owners = cached = None
    on_disk: tuple[int, ...] = ()
    if blocks:
        counts, holders = _block_state(allocator)
        ref_counts, owners = _read_only(counts), _read_only(holders)
        cached = tuple(engine.block_manager.cached_block_ids())
        on_disk = tuple(engine.block_manager.blocks_on_disk())
    return EngineView(
        running=tuple(_sequence_view(s) for s in scheduler.running),
        waiting=tuple(_sequence_view(s) for s in scheduler.waiting),
        block_size=engine.arena.config.block_size,
        num_blocks=allocator.num_total_blocks,
        num_free_blocks=allocator.num_free_blocks,
        num_used_blocks=allocator.num_used_blocks,
        num_preemptions=scheduler.num_preemptions,
        num_prompt_tokens_computed=engine.num_prompt_tokens_computed,
        prefill_time=engine.prefill_time,
        num_decode_tokens=engine.num_decode_tokens,
        decode_time=engine.decode_time,
        num_generated_tokens=engine.num_generated_tokens,
        stats=engine.stats(),
        block_ref_counts=ref_counts,
        block_owners=owners,
        prefix_cached_blocks=cached,
        disk_blocks=on_disk,
    )


def engine_stats(engine: Any) -> dict[str, Any]:
    """The engine's counters as a flat dict: the arena's, then running/waiting requests, preemptions, the prefix
    cache's blocks and hits, generated tokens, and the disk tier's counters when it has one."""
    stats: dict[str, Any] = dict(engine.arena.stats())
    stats.update(
        running=len(engine.scheduler.running),
        waiting=len(engine.scheduler.waiting),
        preemptions=engine.scheduler.num_preemptions,
        prefix_cached_blocks=engine.block_manager.num_cached_blocks,
        prefix_hit_blocks=engine.block_manager.num_prefix_hits,
        generated_tokens=engine.num_generated_tokens,
        spec_verify_steps=engine.scheduler.num_verified,
        spec_drafted_tokens=engine.scheduler.num_drafted,
        spec_accepted_tokens=engine.scheduler.num_accepted,
    )
    if engine.disk is not None:
        stats.update(engine.disk.stats())
    return stats
