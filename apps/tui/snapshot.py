"""`EngineView` (`Engine.snapshot()`) -> `EngineSnapshot` for the block map and stats. Runs on the engine thread
only (the builder's maps are updated there).

The view's `block_map()` knows owners (Sequence.owner ids) and reference counts, but not conversations
and not which references are a live sequence's and which the prefix cache's. So the live sequences' block tables
decide "whose" a block is (two or more tables: a shared prefix), and a block in no table but still allocated is
held by the prefix cache alone; its allocator owner id says which conversation's turn computed it.

Eviction marks: blocks of a sequence whose physical KV is shorter than the tokens it has seen (its policy evicted
or compressed some) carry FLAG_TRIMMED. Marking the freed blocks themselves would show nothing: a policy
reserves blocks for a chunk and frees the surplus within the same step, so they are never seen in use.
"""

from __future__ import annotations

import time

import numpy as np

from cortexstream.engine.snapshot import EngineView
from cortexstream.tui.messages import (
    FLAG_CACHED,
    FLAG_ON_DISK,
    FLAG_TRIMMED,
    FREE,
    OTHER,
    SHARED,
    ConversationUsage,
    EngineSnapshot,
)


class SnapshotBuilder:
    """Keeps the request -> conversation and owner -> conversation maps the snapshots need."""

    def __init__(self) -> None:
        self.conv_of_request: dict[str, int] = {}
        self.owners_of_conv: dict[int, set[int]] = {}
        self.conv_of_owner: dict[int, int] = {}
        self.last_usage: dict[int, tuple[int, int]] = {}  # conversation -> (logical, physical) last seen

    # --- bookkeeping ------------------------------------------------------------------------------------------
    def track(self, request_id: str, conv_id: int, owner: int | None) -> None:
        """Remember a new request (and its sequence's owner id, which tags every block it allocates)."""
        self.conv_of_request[request_id] = conv_id
        self.owners_of_conv.setdefault(conv_id, set())
        if owner is not None:
            self._note_owner(conv_id, owner)

    def _note_owner(self, conv_id: int, owner: int) -> None:
        self.owners_of_conv.setdefault(conv_id, set()).add(owner)
        self.conv_of_owner[owner] = conv_id

    def forget(self, conv_id: int) -> set[int]:
        """Drop a conversation; returns its sequences' owner ids (to free its cached blocks)."""
        owners = self.owners_of_conv.pop(conv_id, set())
        for owner in owners:
            self.conv_of_owner.pop(owner, None)
        for request_id in [r for r, c in self.conv_of_request.items() if c == conv_id]:
            del self.conv_of_request[request_id]
        self.last_usage.pop(conv_id, None)
        return owners

    def observe(self, view: EngineView) -> None:
        """Note each live conversation's logical (KV computed) and physical (KV held) tokens; every step (a
        view taken with blocks=False is enough)."""
        for seq in view.running:
            conv = self.conv_of_request.get(seq.request_id)
            if conv is not None:
                self.last_usage[conv] = (seq.num_computed, seq.num_physical)

    def finished(self, conv_id: int, prompt_tokens: int, generation_tokens: int) -> None:
        """A reply ended (its sequence is already released): its final counts, the last sampled token having
        no KV; the physical count keeps the gap the policy had made."""
        if generation_tokens == 0:
            return  # rejected or aborted before its first token: keep the previous turn's numbers
        logical = prompt_tokens + generation_tokens - 1
        before_logical, before_physical = self.last_usage.get(conv_id, (logical, logical))
        gap = max(before_logical - before_physical, 0) if before_logical <= logical else 0
        self.last_usage[conv_id] = (logical, max(logical - gap, 0))

    # --- the snapshot -----------------------------------------------------------------------------------------
    def build(self, view: EngineView) -> EngineSnapshot:
        """`view`: taken with blocks (the default)."""
        bmap = view.block_map()
        n = int(bmap.size)
        owners = np.where(bmap == FREE, FREE, OTHER).astype(np.int32)
        flags = np.zeros(n, np.uint8)
        users = np.zeros(n, np.int32)
        running: set[int] = set()
        for seq in view.running:
            conv = self.conv_of_request.get(seq.request_id)
            table = np.asarray(seq.block_table, dtype=np.int64)
            users[table] += 1
            owners[table] = OTHER if conv is None else conv
            if conv is None:
                continue
            self._note_owner(conv, seq.owner)
            running.add(conv)
            if seq.num_physical < seq.num_computed:
                flags[table] |= FLAG_TRIMMED
            self.last_usage[conv] = (seq.num_computed, seq.num_physical)
        for seq in view.waiting:
            conv = self.conv_of_request.get(seq.request_id)
            if conv is not None:
                self._note_owner(conv, seq.owner)
        owners[users > 1] = SHARED
        cached = (users == 0) & (bmap != FREE)
        flags[cached] |= FLAG_CACHED
        if view.disk_blocks:
            flags[np.asarray(view.disk_blocks, dtype=np.int64)] |= FLAG_ON_DISK
        for owner in np.unique(bmap[cached & (bmap >= 0)]).tolist():
            owners[cached & (bmap == owner)] = self.conv_of_owner.get(int(owner), OTHER)
        owners[cached & (bmap == SHARED)] = SHARED
        return EngineSnapshot(
            owners=owners,
            flags=flags,
            stats=dict(view.stats),
            prefill_tokens=view.num_prompt_tokens_computed,
            prefill_time=view.prefill_time,
            decode_tokens=view.num_decode_tokens,
            decode_time=view.decode_time,
            wall_time=time.perf_counter(),
            conversations=self._usage(owners, cached, running),
        )

    def _usage(self, owners: np.ndarray, cached: np.ndarray, running: set[int]) -> dict[int, ConversationUsage]:
        usage: dict[int, ConversationUsage] = {}
        for conv in sorted(self.owners_of_conv):
            mine = owners == conv
            logical, physical = self.last_usage.get(conv, (0, 0))
            usage[conv] = ConversationUsage(
                logical=logical,
                physical=physical,
                blocks=int(np.count_nonzero(mine & ~cached)),
                cached_blocks=int(np.count_nonzero(mine & cached)),
                running=conv in running,
            )
        return usage
