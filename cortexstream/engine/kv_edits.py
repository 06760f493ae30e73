"""KV read and written from outside the model, between two engine steps (C2C fusion through `Engine.read_kv` /
`Engine.write_kv`).

Not part of any `StepPlan`: KV written from outside the model is exactly what cannot be reproduced from tokens, so
the scheduler marks such a request as never recomputed nor prefix-cached (`Scheduler.make_writable`) and the
runner copies and writes plain block tables.
"""

from __future__ import annotations

import mlx.core as mx

from cortexstream.engine.runner import ModelRunner
from cortexstream.engine.scheduler import Scheduler
from cortexstream.engine.sequence import Sequence
from cortexstream.errors import InvalidArgumentError

LayerKV = tuple[mx.array, mx.array]


def read_kv(runner: ModelRunner, seq: Sequence, num_tokens: int | None) -> list[LayerKV]:
    """Per layer `(K, V)` `[1, H, N, D]` of the sequence's first `num_tokens` (default all) KV slots, as evaluated
    copies."""
    n = seq.num_physical if num_tokens is None else int(num_tokens)
    if not 0 < n <= seq.num_physical or not seq.uses_arena:
        raise InvalidArgumentError(f"num_tokens: {n} must be in 1..{seq.num_physical} for request "
                                   f"'{seq.request_id}' (on the arena)")
    return runner.read_kv(tuple(seq.block_table), n)


def write_kv(scheduler: Scheduler, runner: ModelRunner, seq: Sequence, layers: list[LayerKV | None],
             start: int) -> int:
    """Overwrite KV slots [start, start + N) with `(K, V)` `[1, H, N, D]` per layer (None: leave it alone), after
    copying shared blocks. Returns the number of layers written."""
    cfg = runner.arena.config
    if len(layers) != cfg.num_layers:
        raise InvalidArgumentError(f"write_kv: {len(layers)} layers given, the engine's model has {cfg.num_layers}")
    written = [(i, pair) for i, pair in enumerate(layers) if pair is not None]
    if not written:
        return 0
    n = written[0][1][0].shape[2]
    if start < 0 or start + n > seq.num_physical or not seq.uses_arena:
        raise InvalidArgumentError(f"write_kv: tokens [{start}, {start + n}) outside the request's "
                                   f"0..{seq.num_physical}")
    for i, (k, v) in written:
        want_k, want_v = (1, cfg.num_kv_heads, n, cfg.head_dim), (1, cfg.num_kv_heads, n, cfg.value_head_dim)
        if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
            raise InvalidArgumentError(f"write_kv: layer {i} K/V {k.shape}/{v.shape}, expected {want_k}/{want_v}")
    mx.eval([pair for _, pair in written])
    runner.copy_blocks(scheduler.make_writable(seq, start, start + n))
    runner.write_kv(tuple(seq.block_table), start, written)
    return len(written)
