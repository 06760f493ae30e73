"""Reconstruction passes (KVzip, `policies.kvzip`): run, recorded, rolled back, then the cache compressed.

One pass computes a reconstruction chunk (`ReconstructionPrompt.chunk_tokens`: the prefix, then a chunk of the
context) on the sequence's cache, at the logical positions after the context, every query attending to the whole
cached context and to the chunk's earlier tokens. The attention hook records each context key's maximum
(`engine.reconstruction`); no logits are computed and nothing is sampled. The pass's K/V were written into the
slots after the context: rolling back is setting the sequence's physical and logical lengths back to what they
were, so the next write (a decode step) overwrites them; in the engine the block manager then frees the blocks
past the context (the runner reports the length). After the last chunk the context counts as reconstructed and
the policy evicts down to its budget.

Two callers: the engine's runner (one `WorkKind.SCORE` item of a step, `score_item`) and the direct path on an
explicit prompt cache (`reconstruct`, e.g. `bench retrieval`).
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from cortexstream.engine.forward import body_of
from cortexstream.engine.policy_prompt_cache import policy_state_of
from cortexstream.engine.policy_kv_cache import policy_caches
from cortexstream.engine.policy_runtime import PolicyState
from cortexstream.engine.reconstruction_prompt import ReconstructionPrompt
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.sequence_kv import SequenceKV


def score_pass(model: Any, seq: SequenceKV, state: PolicyState, tokens: Sequence[int]) -> None:
    """One reconstruction chunk on `seq`: the context's maxima folded into `state`, the sequence's lengths back
    where they were (the chunk's K/V are left in slots past them, unread)."""
    rec = state.reconstruction
    if rec is None:
        raise InvalidArgumentError(f"{state.policy.describe()}: this policy does not reconstruct its context")
    if not tokens:
        raise InvalidArgumentError("reconstruction: a pass needs at least one token")
    lengths, offsets = list(seq.lengths), list(seq.offsets)
    rec.context = seq.num_tokens
    try:
        body_of(model)(mx.array(list(tokens), dtype=mx.uint32)[None], cache=policy_caches(seq, state))
        mx.eval(rec.arrays(), seq.arena.arrays())
    finally:
        rec.context = None
        seq.lengths, seq.offsets = lengths, offsets  # roll back: the chunk was scoring work, not context
    rec.fold(state.scores)


def finish(seq: SequenceKV, state: PolicyState, context: int) -> int:
    """The context is reconstructed: the policy evicts down to its budget. Returns the slots removed."""
    state.reconstruction.scored_end = seq.logical_length
    return state.after_forward(seq, context)


def score_item(model: Any, seq: SequenceKV, state: PolicyState, tokens: Sequence[int], compress: bool,
               context: int) -> int:
    """The runner's side of a `WorkKind.SCORE` item on a synced view; returns the physical length it leaves."""
    score_pass(model, seq, state, tokens)
    if compress:
        finish(seq, state, context)
    return seq.num_tokens


def reconstruct(model: Any, prompt_cache: list[Any], context_ids: Sequence[int], prompt: ReconstructionPrompt,
                context: int, chunk: int | None = None) -> int:
    """Direct path: after a prompt was fed to a policy prompt cache (`engine.policy_prompt_cache`) whose policy
    reconstructs, repeat `context_ids` (the tokens not reconstructed yet, e.g. that prompt) in chunks of `chunk`
    (default: the policy's), then compress to the budget of `context` tokens. Returns the slots evicted."""
    state = policy_state_of(prompt_cache)
    if state is None or state.reconstruction is None:
        raise InvalidArgumentError("reconstruct: the prompt cache carries no policy that reconstructs (kvzip)")
    ids = [int(t) for t in context_ids]
    if not ids:
        raise InvalidArgumentError("reconstruct: context_ids is empty")
    size = state.policy.chunk if chunk is None else chunk
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise InvalidArgumentError(f"reconstruct: chunk {size!r} must be an integer >= 1")
    seq = prompt_cache[0].sequence
    for start in range(0, len(ids), size):
        score_pass(model, seq, state, prompt.chunk_tokens(ids[start : start + size]))
    return finish(seq, state, context)


__all__ = ["finish", "reconstruct", "score_item", "score_pass"]
