"""`batch_generate`: many prompts through the continuous-batching engine, mlx_lm.batch_generate style."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from cortexstream.errors import InvalidArgumentError
from cortexstream.engine.sampling import sampling_from_kwargs


@dataclass
class BatchStats:
    prompt_tokens: int = 0
    prompt_tps: float = 0.0
    prompt_time: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    generation_time: float = 0.0
    peak_memory: float = 0.0  # GB
    ttft: list[float] = field(default_factory=list)  # per request, seconds


@dataclass
class BatchResponse:
    texts: list[str]
    stats: BatchStats
    token_ids: list[list[int]] | None = None
    finish_reasons: list[str] | None = None
    errors: list[str | None] | None = None


def batch_generate(
    model: nn.Module,
    tokenizer: Any,
    prompts: Sequence[Any],
    max_tokens: int | Sequence[int] = 128,
    *,
    verbose: bool = False,
    return_token_ids: bool = False,
    kv_policy: Any = None,
    engine: Any = None,
    kv_tokens: int | None = None,
    max_num_seqs: int | None = None,
    prefill_step_size: int = 512,
    context_overflow: str = "warn",
    kv_dtype: str | None = None,
    kv_group_size: int | None = None,
    speculative: Any = None,
    ranks: Any = None,
    **sampling_kwargs: Any,
) -> BatchResponse:
    """Generate for every prompt concurrently; texts come back in prompt order.

    `kv_policy`: one policy (object or string) for every prompt, or a list with one per prompt (None: full cache).
    `speculative`: "ngram:k=4,n=3" for every prompt (prompt lookup, verified in the batched decode pass),
    "draft:model=SRC,k=4" (a draft model, loaded with the private engine; an `engine` must have been built with
    it), or None.
    `kv_dtype` / `kv_group_size`: how the private engine's arena stores K/V (as in `stream_generate`; with an
    `engine` they must match its arena or be left out).
    `ranks`: rank 0's `DistributedSession` (under mlx.launch or mpirun): the engine this call builds runs on every
    rank for the call, then is detached; the other ranks call `ranks.follow()`. An `engine` of the caller's is
    attached by the caller (`ranks.attach(engine)`) instead. Either way, a KV policy the ranks cannot share is
    refused before any request starts.
    Each request's max_tokens is cut to the model's context; a prompt longer than the context is warned about
    (`context_overflow="warn"`) or refused (`"error"`).

    Stats: `prompt_*` covers the time until the last request got its first token, `generation_*` the decode
    tokens after that point. A request that cannot fit is reported in `errors` with its reason, never dropped.
    """
    from cortexstream.engine.engine import Engine
    from cortexstream.engine.prompt import prompt_to_tokens
    from cortexstream.engine.sizing import fit_to_context, private_arena
    from cortexstream.policies.parsing import parse_policy

    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise InvalidArgumentError(f"prompts: expected a list of prompts, got {type(prompts).__name__} "
                                   "(wrap a single prompt in a list)")
    if not prompts:
        raise InvalidArgumentError("prompts: empty list")
    from cortexstream.engine.speculative_config import parse_speculative
    from cortexstream.generation.ranks import attach_private, check_rank_policies, check_ranks, release

    if ranks is not None:
        check_ranks(ranks, engine)

    parse_speculative(speculative)  # a bad setting fails before any work ("off" stays "off" for the engine)
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(limits) != len(prompts):
        raise InvalidArgumentError(f"max_tokens: {len(limits)} values for {len(prompts)} prompts")
    samplings = [sampling_from_kwargs(limit, **sampling_kwargs) for limit in limits]
    policies = list(kv_policy) if isinstance(kv_policy, (list, tuple)) else [kv_policy] * len(prompts)
    if len(policies) != len(prompts):
        raise InvalidArgumentError(f"kv_policy: {len(policies)} policies for {len(prompts)} prompts")
    prompt_ids = []
    for i, prompt in enumerate(prompts):
        try:
            prompt_ids.append(prompt_to_tokens(tokenizer, prompt))
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"prompts[{i}]: {exc}") from None
    samplings = [replace(s, max_tokens=fit_to_context(model, len(t), s.max_tokens, context_overflow))
                 for t, s in zip(prompt_ids, samplings)]
    check_rank_policies(engine, ranks, policies)
    owned = engine is None
    if engine is not None:
        from cortexstream.kv.arena_config import check_arena_storage

        check_arena_storage(engine.arena, model, kv_dtype, kv_group_size)
    if engine is None:
        # A private engine costs what this job needs: an arena for every request's prompt + max_tokens at once
        # (within the memory available), filled prompt-first: nothing waits for a stream to stay smooth.
        jobs = [(len(t), s.max_tokens, parse_policy(k)) for t, s, k in zip(prompt_ids, samplings, policies)]
        engine = Engine(
            model, tokenizer,
            kv_tokens=kv_tokens,
            kv_dtype=kv_dtype if kv_tokens else None,
            kv_group_size=kv_group_size if kv_tokens else None,
            arena=None if kv_tokens else private_arena(model, jobs, block_size=16,
                                                       prefill_step_size=prefill_step_size, kv_dtype=kv_dtype,
                                                       kv_group_size=kv_group_size),
            max_num_seqs=max_num_seqs or len(prompts),
            prefill_step_size=prefill_step_size,
            prefill_tokens_while_decoding=None,
            speculative=speculative,  # a draft model is loaded with the engine
        )
        if ranks is not None:
            attach_private(ranks, engine)
    mx.reset_peak_memory()
    start = time.perf_counter()
    ids = [engine.add_request(t, s, kv_policy=k, speculative=speculative)
           for t, s, k in zip(prompt_ids, samplings, policies)]
    index = {rid: i for i, rid in enumerate(ids)}
    texts = [""] * len(ids)
    tokens: list[list[int]] = [[] for _ in ids]
    reasons: list[str] = [""] * len(ids)
    errors: list[str | None] = [None] * len(ids)
    first_token = [0.0] * len(ids)
    prompt_tokens = 0
    failed = True
    try:
        while engine.has_unfinished:
            for out in engine.step():
                i = index.get(out.request_id)
                if i is None:
                    continue
                if out.token is not None:
                    if not tokens[i]:
                        first_token[i] = time.perf_counter()
                        prompt_tokens += out.prompt_tokens
                    tokens[i].append(out.token)
                    texts[i] += out.text
                if out.finished:
                    reasons[i], errors[i] = out.finish_reason, out.error
                    if verbose:
                        done = sum(1 for r in reasons if r)
                        print(f"[batch_generate] finished {done}/{len(ids)}", end="\r")
        failed = False
    finally:
        if owned:  # what its backend holds goes back now (and the ranks free its arena), even when a step raised
            release(engine, ranks, failed)
    end = time.perf_counter()
    started = [t for t in first_token if t > 0]
    prefill_done = max(started) if started else end
    decode_tokens = sum(max(0, len(t) - 1) for t in tokens)
    stats = BatchStats(
        prompt_tokens=prompt_tokens,
        prompt_time=prefill_done - start,
        prompt_tps=prompt_tokens / max(prefill_done - start, 1e-9),
        generation_tokens=sum(len(t) for t in tokens),
        generation_time=end - prefill_done,
        generation_tps=decode_tokens / max(end - min(started, default=end), 1e-9),
        peak_memory=mx.get_peak_memory() / 1e9,
        ttft=[t - start for t in first_token if t > 0],
    )
    if verbose:
        print(f"\n[batch_generate] Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec")
        print(f"[batch_generate] Generation: {stats.generation_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec")
        print(f"[batch_generate] Peak memory: {stats.peak_memory:.3f} GB")
    return BatchResponse(texts, stats, tokens if return_token_ids else None, reasons, errors)
