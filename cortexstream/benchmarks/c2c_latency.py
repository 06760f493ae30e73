"""Handoff latency for `bench c2c`: C2C fusion vs text relay, from the moment the sharer has read the context to
the receiver's first-token logits.

Both paths start from the same state: the sharer's KV cache of `context + bridge[:-1]`, and the receiver holding
only the bridge tokens as its own prompt.
- C2C: the receiver prefills `bridge[:-1]`, the sharer's cache at those positions is fused into it, and the
  receiver computes `bridge[-1]` on the fused cache (the paper's recipe);
- text relay: the sharer reads `bridge[-1]` and writes `relay_tokens` tokens greedily (its message), the text is
  decoded and re-encoded with the receiver's tokenizer, and the receiver prefills `message + bridge` from scratch.
The sharer's reading of the context is common to both and not timed. C2C runs `trials` times after one warm-up, relay
`trials` times (the models are warm by then); the median is reported, with its parts.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from cortexstream.c2c.fusion import CacheFuser


def _prefill(model: Any, ids: Sequence[int], cache: list[Any]) -> mx.array:
    logits = model(mx.array(list(ids), dtype=mx.uint32)[None], cache=cache)[:, -1, :]
    mx.eval(logits)
    return logits


def sharer_state(sharer: Any, sharer_ids: Sequence[int], head: int) -> list[Any]:
    """The sharer's cache after reading `sharer_ids[:head]` (context + bridge[:-1])."""
    cache = [KVCache() for _ in sharer.layers]
    _prefill(sharer, sharer_ids[:head], cache)
    return cache


def c2c_once(receiver: Any, fuser: CacheFuser, sharer_cache: list[Any], bridge: Sequence[int], start: int
             ) -> dict[str, float]:
    tic = time.perf_counter()
    cache = [KVCache() for _ in receiver.layers]
    _prefill(receiver, bridge[:-1], cache)
    mid = time.perf_counter()
    n = len(bridge) - 1
    src = [(c.keys[..., start : start + n, :], c.values[..., start : start + n, :]) for c in sharer_cache]
    fuser.fuse(src, cache)
    logits = _prefill(receiver, bridge[-1:], cache)
    mx.eval(logits)
    end = time.perf_counter()
    return {"total": end - tic, "receiver_prefill": mid - tic, "fuse_and_last_token": end - mid}


def relay_once(sharer: Any, sharer_tok: Any, sharer_cache: list[Any], sharer_last: int, receiver: Any,
               receiver_tok: Any, bridge: Sequence[int], relay_tokens: int) -> dict[str, Any]:
    tic = time.perf_counter()
    logits = _prefill(sharer, [sharer_last], sharer_cache)
    message: list[int] = []
    for _ in range(relay_tokens):
        token = int(mx.argmax(logits, axis=-1).item())
        message.append(token)
        logits = _prefill(sharer, [token], sharer_cache)
    text = sharer_tok.decode(message)
    mid = time.perf_counter()
    relay_ids = list(receiver_tok.encode(text))
    cache = [KVCache() for _ in receiver.layers]
    _prefill(receiver, relay_ids + list(bridge), cache)
    end = time.perf_counter()
    for c in sharer_cache:  # undo the message so every trial starts from the same sharer state
        c.trim(relay_tokens + 1)
    return {"total": end - tic, "sharer_writes": mid - tic, "receiver_rereads": end - mid,
            "receiver_tokens": len(relay_ids) + len(bridge)}


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def handoff_latency(receiver: Any, receiver_tok: Any, sharer: Any, sharer_tok: Any, fuser: CacheFuser,
                    ids: Sequence[int], sharer_ids: Sequence[int], context: int, *, relay_tokens: Sequence[int],
                    trials: int = 3) -> dict[str, Any]:
    """Median C2C and relay handoff times for one window `ids` (context + bridge, receiver tokens)."""
    head = len(ids) - 1
    bridge = list(ids[context:])
    cache = sharer_state(sharer, sharer_ids, head)
    c2c = [c2c_once(receiver, fuser, cache, bridge, context) for _ in range(trials + 1)][1:]
    out: dict[str, Any] = {"c2c": _median(c2c), "bridge_tokens": len(bridge), "context_tokens": context,
                           "trials": trials, "relay": {},
                           "fused_layers": sum(fuser.open_layers(len(sharer.layers)))}  # 0: fusion is a no-op
    for k in relay_tokens:
        # No discarded warm-up here: the C2C runs already warmed both models, and a relay trial costs seconds.
        rows = [relay_once(sharer, sharer_tok, cache, int(sharer_ids[head]), receiver, receiver_tok, bridge, k)
                for _ in range(trials)]
        row = _median(rows)
        row["speedup_c2c"] = row["total"] / out["c2c"]["total"]
        out["relay"][str(k)] = row
    return out
