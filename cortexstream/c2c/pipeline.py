"""The paper's inference recipe on prompt caches: fuse the prompt but its last token, then let the receiver compute
the last token on the fused cache and decode (thu-nics/C2C README "Use existing C2C Fusers": `kv_cache_index` =
[sharer mask for the first n-1 tokens, -1 (no fusion) for the last]; `RosettaModel.forward` runs the sharers only
on the fused section).

    cache, last = fused_prompt_cache(receiver, ids, sharer, sharer_ids, fuser)
    for token, _ in mlx_lm.generate.generate_step(last, receiver, prompt_cache=cache): ...

With `arena=engine.arena` the receiver's cache takes its blocks from the engine's arena (call
`release_cache(cache)` when done); the sharer's cache is private and dropped on return.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx

from cortexstream.c2c.fusion import CacheFuser
from cortexstream.c2c.safety import DPConfig, check_tenants
from cortexstream.errors import InvalidArgumentError
from cortexstream.kv.prompt_cache import make_prompt_cache


def prefill(model: Any, ids: Sequence[int], cache: list[Any], step: int = 512) -> None:
    """Run `ids` through `model` into `cache` in chunks of `step` tokens (bounded activation memory)."""
    for lo in range(0, len(ids), step):
        model(mx.array(list(ids[lo : lo + step]), dtype=mx.uint32)[None], cache=cache)
        mx.eval([tuple(c.state)[:2] for c in cache])  # mlx-lm KVCache state also holds an int offset


def fused_prompt_cache(
    receiver_model: Any,
    receiver_ids: Sequence[int],
    sharer_model: Any,
    sharer_ids: Sequence[int],
    fuser: CacheFuser,
    *,
    arena: Any = None,
    max_tokens: int | None = None,
    layer_mask: Any = None,
    src_tenant: Any = None,
    tgt_tenant: Any = None,
    allow_cross_tenant: bool = False,
    dp: DPConfig | None = None,
) -> tuple[list[Any], mx.array]:
    """Receiver cache of `receiver_ids[:-1]` fused with the sharer's cache of `sharer_ids[:-1]`, and the last
    receiver token (`[1]` array) to feed next. `sharer_ids` must be token-aligned (same length; `TokenAligner`).
    max_tokens: room reserved in the receiver's cache (default: the prompt; it grows or takes arena blocks later).
    """
    check_tenants(src_tenant, tgt_tenant, allow_cross_tenant)  # before any model sees the prompts
    if len(receiver_ids) < 2:
        raise InvalidArgumentError("receiver_ids: need at least 2 tokens (all but the last are fused)")
    if len(sharer_ids) != len(receiver_ids):
        raise InvalidArgumentError(f"sharer_ids: {len(sharer_ids)} tokens for {len(receiver_ids)} receiver tokens; "
                                   "align them first (c2c.alignment.TokenAligner)")
    head = list(receiver_ids[:-1])
    tgt = make_prompt_cache(receiver_model, max_tokens or len(receiver_ids), arena=arena)
    src = make_prompt_cache(sharer_model, len(sharer_ids))
    try:
        prefill(receiver_model, head, tgt)
        prefill(sharer_model, list(sharer_ids[:-1]), src)
        fuser.fuse(src, tgt, layer_mask, src_tenant, tgt_tenant, allow_cross_tenant, dp=dp)
    except BaseException:
        release_cache(tgt)
        raise
    return tgt, mx.array([int(receiver_ids[-1])], dtype=mx.uint32)


def release_cache(cache: list[Any]) -> None:
    """Give an arena-backed prompt cache's blocks back (no-op for other caches)."""
    seq = getattr(cache[0], "sequence", None) if cache else None
    if seq is not None:
        seq.release()
