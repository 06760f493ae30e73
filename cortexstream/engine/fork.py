"""Parallel sampling (`n > 1`) without a second prefill: children forked from a parent sequence.

The parent is queued as an ordinary request carrying a `SequenceHook` before its last prompt token. The
scheduler calls it between forward passes once every prompt token but the last is in the KV. The hook then
creates one child sequence per extra completion. Each child takes the parent's block table by reference (`BlockAllocator.share`),
so the prompt's blocks are counted once in the arena, and joins the running queue with exactly one pending
token: the last prompt token. The scheduler puts that token into the next decode batch with the parent's own, so
every completion samples its first token from the same prompt KV. The only block a child ever copies is the
partly filled last one, through the copy-on-write that `BlockManager.reserve` plans and `SequenceKV.make_writable`
performs. A child is an ordinary sequence from then on (recomputable from its tokens, prefix-cache registration,
abort, preemption).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence as TypingSequence

from cortexstream.engine.engine import Engine
from cortexstream.engine.request_state import _RequestState
from cortexstream.engine.seeded import install_seeded_sampler
from cortexstream.engine.sequence import Sequence, SequenceHook, SequenceStatus
from cortexstream.engine.sampling import SamplingParams

# Called on the engine thread for every child created: (child request id, child sequence).
ChildCallback = Callable[[str, Sequence], None]


def find_sequence(engine: Engine, request_id: str) -> Sequence | None:
    """The engine's sequence for `request_id` while it is waiting or running (None otherwise)."""
    return engine.lookup(request_id)


def child_sampling(parent: SamplingParams, index: int) -> SamplingParams:
    """Completion `index`'s sampling: the parent's, with its own seed so seeded children differ."""
    return parent if parent.seed is None else replace(parent, seed=parent.seed + index)


def add_forking_request(
    engine: Engine,
    prompt_tokens: list[int],
    sampling: SamplingParams,
    request_ids: TypingSequence[str],
    *,
    kv_policy: object = None,
    tenant: str | None = None,
    skip_child: Callable[[str], bool] = lambda _rid: False,
    on_child: ChildCallback | None = None,
) -> Sequence | None:
    """Queue `len(request_ids)` completions of one prompt; the first id is the parent. Engine thread only.

    Returns the parent's sequence (None when the engine finished it at once, e.g. rejected as too large).
    `skip_child(id)` is asked at fork time, so a child whose client left before the fork is never created.
    """
    parent_id, *child_ids = request_ids
    engine.add_request(prompt_tokens, sampling, kv_policy=kv_policy, tenant=tenant, request_id=parent_id)
    install_seeded_sampler(engine, parent_id, sampling)
    parent = find_sequence(engine, parent_id)
    if parent is None or not child_ids:
        return parent
    def fork(seq: Sequence) -> None:
        for index, child_id in enumerate(child_ids, start=1):
            if skip_child(child_id):
                continue
            child = _fork_child(engine, seq, child_id, child_sampling(sampling, index))
            if on_child is not None:
                on_child(child_id, child)

    parent.attach_hook(SequenceHook.before_last_prompt_token(parent, fork, "fork"))
    return parent


def _fork_child(engine: Engine, parent: Sequence, child_id: str, sampling: SamplingParams) -> Sequence:
    """A running copy of `parent` (all prompt tokens but the last computed) sharing its blocks by reference."""
    if child_id in engine._states:
        raise RuntimeError(f"request_id: '{child_id}' is already in use")
    block_manager = engine.block_manager
    # Only the blocks that hold computed tokens are shared; the block the last prompt token goes into (when it
    # starts a new block) is allocated by the child's own `reserve`.
    shared = list(parent.block_table[: block_manager.blocks_for(parent.num_physical)])
    engine.arena.allocator.share(shared)
    child = Sequence(
        list(parent.prompt_ids), sampling, request_id=child_id, tenant=parent.tenant,
        kv_policy=parent.kv_policy, arrival_time=parent.arrival_time,
    )
    child.block_table.extend(shared)
    child.block_hashes = list(parent.block_hashes)
    child.num_computed = parent.num_computed
    child.num_physical = parent.num_physical
    child.num_cached_prefix = parent.num_cached_prefix
    child.status = SequenceStatus.RUNNING
    # The engine's per-request state (sampler, text stream) is what add_request would have made.
    engine._states[child_id] = _RequestState(child, engine.tokenizer, engine._eos_ids)
    install_seeded_sampler(engine, child_id, sampling)
    engine.scheduler.running.append(child)
    return child
