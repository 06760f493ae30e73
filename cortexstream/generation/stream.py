"""Single-request generation in the mlx-lm style: `stream_generate` and `generate`."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, replace
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn

from cortexstream.engine.policy_prompt_cache import policy_state_of
from cortexstream.engine.prompt import prompt_to_tokens
from cortexstream.engine.sampling import SamplingParams, sampling_from_kwargs
from cortexstream.engine.text_stream import TextStream
from cortexstream.errors import InvalidArgumentError


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
    **sampling_kwargs: Any,
) -> Iterator[GenerationResponse]:
    """Yield a `GenerationResponse` per generated token; the last one carries `finish_reason`
    ("stop" for eos or a stop string, "length" for max_tokens).

    Runs through the engine (a private one sized for this request unless `engine` is given). With an explicit
    `prompt_cache` (mlx-lm style, e.g. to continue a conversation) or a custom `sampler` callable, the request
    runs directly on that cache instead.

    `kv_policy` (a `cortexstream.policies` object or a string such as 'h2o:budget=0.2') bounds the physical KV.
    With a `prompt_cache` the policy travels with the cache (it is upgraded in place), so calling again with the
    same cache and only the next turn's tokens continues on the evicted cache without recomputing it.
    """
    if sampling is None:
        sampling = sampling_from_kwargs(max_tokens, **sampling_kwargs)
    if not isinstance(prefill_step_size, int) or prefill_step_size < 1:
        raise InvalidArgumentError(f"prefill_step_size: {prefill_step_size!r} must be an integer >= 1")
    tokens = prompt_to_tokens(tokenizer, prompt)
    if sampling.seed is not None:
        mx.random.seed(sampling.seed)
    if prompt_cache is not None or sampler is not None:
        yield from _direct_generate(model, tokenizer, tokens, sampling, sampler, prompt_cache, prefill_step_size,
                                    kv_policy)
        return
    yield from _engine_generate(model, tokenizer, tokens, sampling, kv_policy, engine, prefill_step_size,
                                context_overflow)


def _engine_generate(
    model: nn.Module, tokenizer: Any, tokens: list[int], sampling: SamplingParams, kv_policy: Any, engine: Any,
    prefill_step_size: int, context_overflow: str,
) -> Iterator[GenerationResponse]:
    from cortexstream.engine.engine import Engine
    from cortexstream.engine.sizing import fit_to_context, private_arena_tokens

    sampling = replace(sampling, max_tokens=fit_to_context(model, len(tokens), sampling.max_tokens,
                                                           context_overflow))
    if engine is None:
        from cortexstream.policies.parsing import parse_policy

        kv_policy = parse_policy(kv_policy)
        job = [(len(tokens), sampling.max_tokens, kv_policy)]
        engine = Engine(model, tokenizer, max_num_seqs=1, prefill_step_size=prefill_step_size,
                        prefix_caching=False, kv_tokens=private_arena_tokens(
                            model, job, block_size=16, prefill_step_size=prefill_step_size))
    if sampling.max_tokens == 0:
        return
    start = time.perf_counter()
    request_id = engine.add_request(tokens, sampling, kv_policy=kv_policy)
    first_token_at = None
    try:
        while True:
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                if output.finish_reason == "rejected":
                    raise InvalidArgumentError(f"request rejected: {output.error}")
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


def _direct_generate(
    model: nn.Module, tokenizer: Any, tokens: list[int], sampling: SamplingParams, sampler: Any,
    prompt_cache: list[Any] | None, prefill_step_size: int, kv_policy: Any = None,
) -> Iterator[GenerationResponse]:
    if prompt_cache is None:
        from cortexstream.kv.prompt_cache import make_prompt_cache

        prompt_cache = make_prompt_cache(model, max_tokens=len(tokens) + sampling.max_tokens)
    else:
        from cortexstream.kv.prompt_cache_check import check_cache_for_model

        check_cache_for_model(prompt_cache, model)  # a short or foreign cache would run silently wrong
    evict = None
    if kv_policy is not None or policy_state_of(prompt_cache) is not None:
        from cortexstream.engine.policy_prompt_cache import apply_policy, attach_policy

        if attach_policy(prompt_cache, kv_policy, model) is not None:
            # Fraction budgets resolve against everything this turn can reach (see policies.base).
            context = prompt_cache[0].offset + len(tokens) + sampling.max_tokens
            evict = functools.partial(apply_policy, prompt_cache, context)
    sampler = sampler or sampling.make_sampler()
    processors = sampling.make_logits_processors()
    eos_ids = set(getattr(tokenizer, "eos_token_ids", None) or [tokenizer.eos_token_id])
    text = TextStream(tokenizer, sampling.stop)
    history = mx.array(tokens, mx.uint32)

    def step(inputs: mx.array) -> tuple[mx.array, mx.array]:
        nonlocal history
        logits = model(inputs[None], cache=prompt_cache)[:, -1, :]
        if processors:
            for processor in processors:
                logits = processor(history, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        token = sampler(logprobs)
        if processors:
            history = mx.concatenate([history, token])
        if evict is not None:  # evict between forward passes, once this one is computed
            mx.eval(token, logprobs)
            evict()
        return token, logprobs.squeeze(0)

    start = time.perf_counter()
    prompt = mx.array(tokens, mx.uint32)
    # Prefill all but the last token in chunks; only the KV is needed, so the logits are never evaluated.
    while prompt.size > 1:
        chunk = min(prefill_step_size, prompt.size - 1)
        model(prompt[:chunk][None], cache=prompt_cache)
        if evict is not None:
            evict()
        else:
            mx.eval([c.state for c in prompt_cache])
        prompt = prompt[chunk:]
    if sampling.max_tokens == 0:
        return
    token, logprobs = step(prompt)
    mx.async_eval(token, logprobs)
    prompt_tps = 0.0
    generated = 0
    decode_start = start
    while True:
        has_next = generated + 1 < sampling.max_tokens
        if has_next:
            next_token, next_logprobs = step(token)
            mx.async_eval(next_token, next_logprobs)
        if generated == 0:
            mx.eval(token)
            decode_start = time.perf_counter()
            prompt_tps = len(tokens) / max(decode_start - start, 1e-9)
        generated += 1
        token_id = int(token.item())
        finish = None
        if token_id in eos_ids:
            segment, finish = text.finish(), "stop"
        else:
            segment = text.add_token(token_id)
            if text.stopped:
                finish = "stop"
            elif not has_next:
                segment, finish = segment + text.finish(), "length"
        elapsed = time.perf_counter() - decode_start
        yield GenerationResponse(
            text=segment,
            token=token_id,
            logprobs=logprobs,
            prompt_tokens=len(tokens),
            prompt_tps=prompt_tps,
            generation_tokens=generated,
            generation_tps=(generated - 1) / elapsed if generated > 1 and elapsed > 0 else 0.0,
            peak_memory=_peak_gb(),
            finish_reason=finish,
        )
        if finish is not None:
            return
        token, logprobs = next_token, next_logprobs


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
