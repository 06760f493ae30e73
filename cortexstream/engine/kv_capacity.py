"""KV capacity arithmetic the scheduler (engine/scheduler.py) checks against the arena's blocks. Pure Python.

- `physical_budget`: the most KV slots a sequence can ever hold (its policy's bound, else prompt + max_tokens, and a
  reconstructing policy's scoring passes past the prompt).
- `rejection`: why a request can never run because that budget needs more blocks than the arena has (the scheduler
  finishes it at once as rejected with this reason), or None.
- `room_to_grow`: whether every running sequence can take its next two tokens without anyone being preempted (the
  block condition for pipelining the next step).

A module of its own so the scheduler keeps to choosing each step's work. It reads the sequences and the block
manager and writes nothing; the scheduler passes its configuration with each call, since the engine may replace it
between steps.
"""

from __future__ import annotations

from cortexstream.engine.block_manager import BlockManager
from cortexstream.engine.scheduler_config import SchedulerConfig
from cortexstream.engine.sequence import Sequence


def physical_budget(seq: Sequence, config: SchedulerConfig) -> int:
    """Most KV slots the sequence can ever hold: its policy's bound, else prompt + max_tokens; a reconstructing
    policy's scoring passes (KVzip) sit after the prompt for a step each, beyond the sequence's own tokens."""
    limit = seq.kv_policy.max_physical_tokens(seq.max_total_tokens, config.prefill_step_size, len(seq.prompt_ids))
    own = min(seq.max_total_tokens, limit) if limit else seq.max_total_tokens
    plan = seq.reconstruction
    if plan is None:
        return own
    context = len(seq.prompt_ids)
    return max(own, context + plan.largest_item(context, config.prefill_step_size))


def rejection(seq: Sequence, blocks: BlockManager, config: SchedulerConfig) -> str | None:
    """Why the request can never run (its `physical_budget` needs more KV blocks than the arena has), or None."""
    needed = blocks.blocks_for(physical_budget(seq, config)) if seq.uses_arena else 0
    total = blocks.allocator.num_total_blocks
    if needed <= total:
        return None
    return (f"needs {needed} KV blocks ({physical_budget(seq, config)} tokens) but the arena has {total}; "
            + ("its kv_policy repeats the prompt after it (a reconstruction pass of up to prefill_step_size "
               "tokens): give the engine more KV or shorten the prompt" if seq.reconstruction is not None else
               "lower max_tokens, shorten the prompt, or use a KV policy with a budget"))


def room_to_grow(running: list[Sequence], blocks: BlockManager) -> bool:
    """True when the free blocks let every running sequence take its next two tokens (and copy on write) without
    preempting anyone."""
    # A sequence with room reserved for its next two tokens needs no block, unless it writes a shared one.
    allocator, bs = blocks.allocator, blocks.block_size
    need = 0
    for seq in running:
        table = seq.block_table
        if not seq.uses_arena:
            continue
        if len(table) * bs < seq.num_tokens + 2 or allocator.ref_count(table[seq.num_physical // bs]) > 1:
            need += 2
    return allocator.num_free_blocks >= need


__all__ = ["physical_budget", "rejection", "room_to_grow"]
