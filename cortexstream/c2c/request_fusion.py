"""Fusing running engine requests: read a request's KV, write fused KV back, keep decoding.

Uses only the engine's public methods (`lookup`, `read_kv`, `write_kv`, `attach_hook`, `step`). Call these between
`engine.step()` calls (for a `ThreadedEngine`, inside `call`), never during one.

Flow: `run_until_prefilled(engine, rid)` -> `extract_cache(src_engine, src_rid)` and `extract_cache(engine, rid)`
-> `fuser.fused_layers(...)` (or `fuse_requests`, which does all of it with the tenant check) -> `fuse_into`
-> `engine.step()` as usual: the fused blocks are ordinary arena blocks, so decode (single or batched) reads them.

What the engine guarantees for fused requests:
- `Engine.write_kv` marks the request's KV as not rebuildable from its tokens: the scheduler never preempts it by
  recompute (it picks another victim, or fails the request with finish_reason "error" and the reason when no other
  is left), and the block manager never registers its blocks in the prefix cache. Shared blocks (prefix cache,
  forked prefixes) are copied on write first, so other requests never see fused KV.
- `fuse_on_prefill(fuser, source, (engine, rid))` gives the paper's semantics through the scheduler: the
  request's hook (`engine.sequence.SequenceHook`) runs between steps once all prompt tokens but the last are
  in the KV, fuses them, and the last prompt token and first sample are then computed on the fused cache. Fusing
  after `run_until_prefilled` instead leaves the first sampled token unfused (it is sampled right after prefill).
- Requests whose KV policy evicted or compressed tokens are refused: their slots no longer map to positions.
"""

from __future__ import annotations

from typing import Any, Sequence

from cortexstream.c2c.fusion import CacheFuser, LayerKV
from cortexstream.c2c.safety import DPConfig, check_tenants
from cortexstream.engine.sequence import SequenceHook, SequenceStatus
from cortexstream.errors import InvalidArgumentError


def find_running(engine: Any, request_id: str) -> Any:
    """The engine's `Sequence` of a running request (InvalidArgumentError if waiting, finished or unknown)."""
    seq = engine.lookup(request_id)
    if seq is None or seq.status is not SequenceStatus.RUNNING:
        raise InvalidArgumentError(f"request '{request_id}' is not running (waiting, finished or unknown)")
    return seq


def run_until_prefilled(engine: Any, request_id: str, max_steps: int = 100_000) -> list[Any]:
    """Step the engine until the request's whole prompt is in the KV; returns every output produced meanwhile
    (other requests' too, so the caller loses nothing)."""
    outputs: list[Any] = []
    for _ in range(max_steps):
        seq = engine.lookup(request_id)
        if seq is not None and seq.num_computed >= len(seq.prompt_ids):
            return outputs
        if not engine.has_unfinished:
            break
        step = engine.step()
        outputs.extend(step)
        if any(o.request_id == request_id and o.finished for o in step):
            raise InvalidArgumentError(f"request '{request_id}' finished before it could be fused")
    raise InvalidArgumentError(f"request '{request_id}' was not prefilled within {max_steps} steps")


def extract_cache(engine: Any, request_id: str, num_tokens: int | None = None) -> list[LayerKV]:
    """Per layer `(K, V)` `[1, H, N, D]` of a running request's first `num_tokens` (default all) KV slots.

    The arrays are evaluated copies, not views of the arena, so later arena writes never alias them (and a held
    view would make MLX copy a whole layer buffer on the next in-place write).
    """
    seq = find_running(engine, request_id)
    if seq.num_physical != seq.num_computed:
        raise InvalidArgumentError(f"request '{request_id}': its KV policy evicted or compressed tokens, so cache "
                                   "slots no longer correspond to token positions")
    return engine.read_kv(request_id, num_tokens)


def fuse_into(engine: Any, request_id: str, layers: Sequence[LayerKV | None], start: int = 0) -> int:
    """Overwrite tokens [start, start + N) of every layer given (None = leave the layer alone) of a running
    request with new K/V `[1, H, N, D]`. Shared blocks are copied first. Returns the number of layers written."""
    seq = find_running(engine, request_id)
    if seq.num_physical != seq.num_computed:
        raise InvalidArgumentError(f"request '{request_id}': KV was evicted/compressed; positions do not match")
    return engine.write_kv(request_id, list(layers), start)


def fuse_requests(
    fuser: CacheFuser,
    source: tuple[Any, str],
    target: tuple[Any, str],
    *,
    layer_mask: Any = None,
    allow_cross_tenant: bool = False,
    num_tokens: int | None = None,
    dp: DPConfig | None = None,
) -> int:
    """Fuse request `source = (engine, id)` (the sharer, any model) into `target = (engine, id)` (the receiver).

    Tenants are the requests' own (`add_request(tenant=...)`), checked before any KV is read. Fuses the first
    `num_tokens` positions (default: the shorter of the two); the two requests must hold token-aligned prompts
    (the same ids, or ids from `alignment.TokenAligner`; checked when both engines share one tokenizer).
    Returns the number of receiver layers changed.
    """
    (src_engine, src_id), (tgt_engine, tgt_id) = source, target
    src_seq, tgt_seq = find_running(src_engine, src_id), find_running(tgt_engine, tgt_id)
    check_tenants(src_seq.tenant, tgt_seq.tenant, allow_cross_tenant)
    n = num_tokens if num_tokens is not None else min(src_seq.num_physical, tgt_seq.num_physical)
    if src_engine.tokenizer is tgt_engine.tokenizer and src_seq.all_ids[:n] != tgt_seq.all_ids[:n]:
        raise InvalidArgumentError(f"requests '{src_id}' and '{tgt_id}' hold different tokens in positions 0..{n}; "
                                   "fusion needs token-aligned sequences")
    src = extract_cache(src_engine, src_id, n)
    tgt = extract_cache(tgt_engine, tgt_id, n)
    fused = fuser.fuse(src, tgt, layer_mask, src_seq.tenant, tgt_seq.tenant, allow_cross_tenant, dp=dp)
    changed = [f if (f[0] is not t[0] or f[1] is not t[1]) else None for f, t in zip(fused, tgt)]
    return fuse_into(tgt_engine, tgt_id, changed, start=0)



def _waiting_or_running(engine: Any, request_id: str) -> Any:
    seq = engine.lookup(request_id)
    if seq is None:
        raise InvalidArgumentError(f"request '{request_id}' is neither waiting nor running")
    return seq


def fuse_on_prefill(
    fuser: CacheFuser,
    source: tuple[Any, str],
    target: tuple[Any, str],
    *,
    layer_mask: Any = None,
    allow_cross_tenant: bool = False,
    dp: DPConfig | None = None,
) -> None:
    """Fuse `source = (engine, id)` into request `target = (engine, id)` when all its prompt tokens but the last
    are computed, so its last prompt token and first sampled token already read the fused cache (the paper's
    recipe). The target must not have started its prompt's last token. At that moment the source request must
    be running with at least as many tokens in its KV; if it is not, or anything else fails, the target request
    finishes with finish_reason "error" and the reason (the engine never drops the failure silently)."""
    tgt_engine, tgt_id = target
    seq = _waiting_or_running(tgt_engine, tgt_id)
    if seq.num_computed >= len(seq.prompt_ids) or seq.output_ids:
        raise InvalidArgumentError(f"request '{tgt_id}' has already computed its whole prompt")
    src_seq = _waiting_or_running(source[0], source[1])
    check_tenants(src_seq.tenant, seq.tenant, allow_cross_tenant)  # fail early; fuse_requests checks again

    def hook(s: Any) -> None:
        n = len(s.prompt_ids) - 1
        if n < 1:
            return  # a one-token prompt has nothing to fuse
        fuse_requests(fuser, source, target, layer_mask=layer_mask, allow_cross_tenant=allow_cross_tenant,
                      num_tokens=n, dp=dp)

    tgt_engine.attach_hook(tgt_id, SequenceHook.before_last_prompt_token(seq, hook, "c2c fusion"))
