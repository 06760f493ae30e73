"""Parallel sampling (`n > 1`) without a second prefill: children forked from a parent sequence.

The parent is queued as an ordinary request carrying a `SequenceHook` before its last prompt token. The
scheduler calls it between forward passes once every prompt token but the last is in the KV. The hook then
creates one child sequence per extra completion (`Engine.spawn_child`). Each child takes the parent's computed
blocks by reference (`BlockManager.fork`), so the prompt's blocks are counted once in the arena, and joins the
running queue with exactly one pending token: the last prompt token. The scheduler puts that token into the next
decode batch with the parent's own, so every completion samples its first token from the same prompt KV. The only
block a child ever copies is the partly filled last one, through the copy-on-write that `BlockManager.reserve`
plans and the runner performs. A child is an ordinary sequence from then on (recomputable from its tokens,
prefix-cache registration, abort, preemption).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Sequence as TypingSequence

from cortexstream.engine.seeded import install_seeded_sampler
from cortexstream.engine.sequence import Sequence, SequenceHook
from cortexstream.engine.sampling import SamplingParams

# Called on the engine thread for every child created: (child request id, child sequence).
ChildCallback = Callable[[str, Sequence], None]


def child_sampling(parent: SamplingParams, index: int) -> SamplingParams:
    """Completion `index`'s sampling: the parent's, with its own seed so seeded children differ."""
    return parent if parent.seed is None else replace(parent, seed=parent.seed + index)


def add_forking_request(
    engine: Any,  # the Engine (engine/engine.py calls this from `Engine.fork`; no import back up)
    prompt_tokens: list[int],
    sampling: SamplingParams,
    request_ids: TypingSequence[str],
    *,
    kv_policy: object = None,
    tenant: str | None = None,
    skip_child: Callable[[str], bool] = lambda _rid: False,
    on_child: ChildCallback | None = None,
    speculative: Any = None,
) -> Sequence | None:
    """Queue `len(request_ids)` completions of one prompt; the first id is the parent. Engine thread only
    (`Engine.fork` calls this).

    Returns the parent's sequence (None when the engine finished it at once, e.g. rejected as too large).
    `skip_child(id)` is asked at fork time, so a child whose client left before the fork is never created.
    """
    parent_id, *child_ids = request_ids
    engine.add_request(prompt_tokens, sampling, kv_policy=kv_policy, tenant=tenant, request_id=parent_id,
                       speculative=speculative)
    parent = engine.lookup(parent_id)
    if parent is None or not child_ids:
        return parent

    def fork(seq: Sequence) -> None:
        for index, child_id in enumerate(child_ids, start=1):
            if skip_child(child_id):
                continue
            child_spec = child_sampling(sampling, index)
            child = engine.spawn_child(seq, child_id, child_spec)
            if seq.reconstruction is not None:  # KVzip: the child repeats its own context before decoding
                child.reconstruction = seq.reconstruction.fresh()
            install_seeded_sampler(engine, child_id, child_spec)
            if on_child is not None:
                on_child(child_id, child)

    engine.attach_hook(parent_id, SequenceHook.before_last_prompt_token(parent, fork, "fork"))
    return parent
