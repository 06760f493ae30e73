"""Single-request generation in the mlx-lm style: `stream_generate` and `generate`."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn

from cortexstream.engine.finish_reason import FinishReason
from cortexstream.engine.prompt import prompt_to_tokens
from cortexstream.engine.sampling import SamplingParams, sampling_from_kwargs
from cortexstream.errors import GenerationError, InvalidArgumentError


@dataclass
class GenerationResponse:
    """One streamed step, with the same fields as mlx-lm's `GenerationResponse`."""

    text: str
    token: int
    logprobs: mx.array
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None


def _peak_gb() -> float:
    return mx.get_peak_memory() / 1e9


def stream_generate(
    model: nn.Module,
    tokenizer: Any,
    prompt: Any,
    max_tokens: int = 256,
    *,
    sampling: SamplingParams | None = None,
    sampler: Any = None,
    prompt_cache: list[Any] | None = None,
    prefill_step_size: int = 512,
    kv_policy: Any = None,
    engine: Any = None,
    context_overflow: str = "warn",
    kv_dtype: str | None = None,
    kv_group_size: int | None = None,
    speculative: Any = None,
    **sampling_kwargs: Any,
) -> Iterator[GenerationResponse]:
    """Yield a `GenerationResponse` per generated token; the last one carries `finish_reason`
    ("stop" for eos or a stop string, "length" for max_tokens).

    Runs through the engine (a private one sized for this request unless `engine` is given), always: an explicit
    `prompt_cache` (mlx-lm style, e.g. to continue a conversation) binds the request to that cache instead of
    arena blocks, and a custom `sampler` callable replaces the sampling parameters' own; stop strings, logits
    processors and policies work the same either way.

    `kv_policy` (a `cortexstream.policies` object or a string such as 'h2o:budget=0.2') bounds the physical KV.
    With a `prompt_cache` the policy travels with the cache (it is upgraded in place), so calling again with the
    same cache and only the next turn's tokens continues on the evicted cache without recomputing it.

    `kv_dtype` ("float16", "int8", "int4", "k=int8,v=int4", ...; `kv_group_size` 32 or 64) is how the private
    engine's arena stores K/V; with an `engine` or a `prompt_cache` it must match what they store (or be left out).

    `speculative`: "ngram:k=4,n=3" drafts tokens by prompt lookup and verifies them in one pass (greedy output is
    unchanged; see docs/speculative.md); "draft:model=SRC,k=4" drafts with a smaller model (loaded with the private
    engine, on every call: for many calls build an `Engine` with it as its default and pass `engine=`); None: the
    engine's default (off for a private engine).
    """
    from cortexstream.engine.speculative_config import parse_speculative

    parse_speculative(speculative)  # a bad setting fails before any work ("off" stays "off" for the engine)
    if sampling is None:
        sampling = sampling_from_kwargs(max_tokens, **sampling_kwargs)
    if not isinstance(prefill_step_size, int) or prefill_step_size < 1:
        raise InvalidArgumentError(f"prefill_step_size: {prefill_step_size!r} must be an integer >= 1")
    tokens = prompt_to_tokens(tokenizer, prompt)
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    storage = (kv_dtype, kv_group_size)
    yield from _engine_generate(model, tokenizer, tokens, sampling, kv_policy, engine, prefill_step_size,
                                context_overflow, prompt_cache, sampler, storage, speculative)


def _engine_generate(
    model: nn.Module, tokenizer: Any, tokens: list[int], sampling: SamplingParams, kv_policy: Any, engine: Any,
    prefill_step_size: int, context_overflow: str, prompt_cache: list[Any] | None, sampler: Any,
    storage: tuple[str | None, int | None], speculative: Any = None,
) -> Iterator[GenerationResponse]:
    from cortexstream.kv.arena_config import check_arena_storage

    from cortexstream.engine.engine import Engine
    from cortexstream.engine.sizing import fit_to_context, private_arena

    sampling = replace(sampling, max_tokens=fit_to_context(model, len(tokens), sampling.max_tokens,
                                                           context_overflow))
    owned = engine is None
    if engine is not None:
        check_arena_storage(engine.arena, model, *storage)
    elif prompt_cache is not None and prompt_cache and hasattr(prompt_cache[0], "sequence"):
        check_arena_storage(prompt_cache[0].sequence.arena, model, *storage)
    if engine is None:
        from cortexstream.policies.parsing import parse_policy

        kv_policy = parse_policy(kv_policy)
        job = [(len(tokens), sampling.max_tokens, kv_policy)]
        # A request on the caller's prompt cache keeps its KV there: its engine needs no arena to speak of.
        arena = None if prompt_cache is not None else private_arena(
            model, job, block_size=16, prefill_step_size=prefill_step_size, kv_dtype=storage[0],
            kv_group_size=storage[1])
        # Its default speculation is the request's: a draft model is loaded with the engine (ngram needs nothing).
        engine = Engine(model, tokenizer, max_num_seqs=1, prefill_step_size=prefill_step_size,
                        prefix_caching=False, kv_tokens=16 if arena is None else None, arena=arena,
                        speculative=speculative)
    if sampling.max_tokens == 0:
        if owned:
            engine.close()
        return
    start = time.perf_counter()
    request_id = engine.add_request(tokens, sampling, kv_policy=kv_policy, prompt_cache=prompt_cache,
                                    sampler=sampler, speculative=speculative)
    first_token_at = None
    try:
        while True:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                if output.finish_reason == FinishReason.REJECTED:
                    raise InvalidArgumentError(f"request rejected: {output.error}")
                if output.finish_reason == FinishReason.ERROR:
                    raise GenerationError(f"generation failed: {output.error}")
                now = time.perf_counter()
                if first_token_at is None:
                    first_token_at = now
                generated = output.generation_tokens
                elapsed = now - first_token_at
                yield GenerationResponse(
                    text=output.text,
                    token=output.token,
                    logprobs=output.logprobs,
                    prompt_tokens=len(tokens),
                    prompt_tps=len(tokens) / max(first_token_at - start, 1e-9),
                    generation_tokens=generated,
                    generation_tps=(generated - 1) / elapsed if generated > 1 and elapsed > 0 else 0.0,
                    peak_memory=_peak_gb(),
                    finish_reason=output.finish_reason,
                )
                if output.finished:
                    return
    finally:
        engine.abort(request_id)  # no-op once finished; frees the blocks if the caller stopped early
        if owned:
            engine.close()  # what its backend holds goes back now, even when the caller stopped mid-stream


def generate(
    model: nn.Module, tokenizer: Any, prompt: Any, max_tokens: int = 256, *, verbose: bool = False, **kwargs: Any
) -> str:
    """Generate a completion and return its text (eos and stop strings excluded)."""
    pieces: list[str] = []
    last: GenerationResponse | None = None
    for response in stream_generate(model, tokenizer, prompt, max_tokens, **kwargs):
        pieces.append(response.text)
        if verbose:
            print(response.text, end="", flush=True)
        last = response
    if verbose and last is not None:
        print()
        print("=" * 10)
        print(f"Prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {last.generation_tokens} tokens, {last.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {last.peak_memory:.3f} GB")
    return "".join(pieces)
