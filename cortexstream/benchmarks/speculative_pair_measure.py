"""One cell of `bench speculative --pair`: a target model decoded plainly and drafted by a smaller model, in
CortexStream and in mlx-lm, on the same token-id prompts, rounds in rotating order.

Systems:
- `plain`: CortexStream's public call (`stream_generate` for one prompt, `batch_generate` for several) on an engine
  built as the private one would be;
- `draft`: the same call on the same kind of engine given `speculative="draft:model=DRAFT,k=K"` as its default
  (which loads the draft model and its mirrored arena);
- mlx-lm on the same model objects: at concurrency 1 its speculative decoding (`stream_generate(...,
  draft_model=..., num_draft_tokens=K)`, i.e. `speculative_generate_step`); above 1 mlx-lm cannot batch speculation,
  so its `batch_generate` of the target alone (`mlx_lm_batch`).

The CortexStream engines are built before the timed call (untimed, `prepare_s`): building the draft engine loads
the draft model from its file, which is not decoding and which mlx-lm, given model objects, never does. The timed
call is the whole public call on that engine. Decode tokens/s as in `speculative_measure`.
"""

from __future__ import annotations

import functools
import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

from cortexstream.benchmarks.speculative_measure import (
    PLAIN, Outcome, differing, mlx_lm_call, private_engine, public_call, timed_stream,
)
from cortexstream.benchmarks.speculative_settings import Mode
from cortexstream.benchmarks.throughput_measure import measure_call

DRAFT = "draft"
MLX_LM_SPECULATIVE = "mlx_lm_speculative"  # concurrency 1: mlx-lm's speculative decoding on the same pair
MLX_LM_BATCH = "mlx_lm_batch"  # above 1: mlx-lm's batch_generate of the target alone (no batched speculation)


def mlx_lm_system(concurrency: int) -> str:
    """The mlx-lm system a cell of this concurrency compares with."""
    return MLX_LM_SPECULATIVE if concurrency == 1 else MLX_LM_BATCH


def draft_setting(draft_source: str, k: int) -> str:
    """The engine's `speculative=` for this draft model (canonical form; checked)."""
    from cortexstream.engine.speculative_config import SpeculativeConfig, SpeculativeMethod

    return SpeculativeConfig(SpeculativeMethod.DRAFT, k=k, model=draft_source).text


@dataclass(frozen=True)
class PreparedCall:
    """`prepare()` (untimed) builds what `run(prepared)` (timed) needs: an engine, or None."""

    prepare: Callable[[], Any]
    run: Callable[[Any], Outcome]


def engine_system(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, sampling: dict[str, Any],
                  speculative: str | None) -> PreparedCall:
    """CortexStream's public call on an engine built beforehand as the private one would be, `speculative` its
    default; its speculation counters are read before it is closed."""
    def run(engine: Any) -> Outcome:
        try:
            return public_call(model, tokenizer, prompts, max_tokens, sampling, speculative, engine)
        finally:
            engine.close()

    return PreparedCall(functools.partial(private_engine, model, tokenizer, prompts, max_tokens, speculative), run)


def mlx_lm_counters(from_draft: list[bool], k: int, max_tokens: int) -> dict[str, int]:
    """mlx-lm's speculation counters, rebuilt from its stream (every token once, flagged when it was a kept
    draft): each verify pass drafts min(k, tokens left) and yields its kept drafts then the target's token, so a
    pass ends at an unflagged token (or where the stream ends)."""
    passes = drafted = done = 0
    starting = True
    for flag in from_draft:
        if starting:
            passes += 1
            drafted += min(k, max_tokens - done)
        done += 1
        starting = not flag
    return {"verify_steps": passes, "drafted": drafted, "accepted": sum(map(bool, from_draft))}


def mlx_lm_speculative_call(model: Any, draft_model: Any, tokenizer: Any, prompt: list[int], max_tokens: int,
                            k: int, sampler: Any) -> Callable[[], Outcome]:
    """mlx-lm's speculative decoding of one prompt on the same model objects, timed on its stream."""
    import mlx_lm

    def call() -> Outcome:
        flags: list[bool] = []

        def tapped(responses: Any) -> Any:
            for r in responses:
                flags.append(bool(r.from_draft))
                yield r

        text, generated, tps = timed_stream(tapped(mlx_lm.stream_generate(
            model, tokenizer, prompt, max_tokens, draft_model=draft_model, num_draft_tokens=k, sampler=sampler)))
        return Outcome((text,), generated, tps, mlx_lm_counters(flags, k, max_tokens))

    return call


def pair_systems(model: Any, draft_model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int,
                 mode: Mode, temperature: float, setting: str, k: int) -> dict[str, PreparedCall]:
    """Every system of a cell: plain, draft, and mlx-lm (speculative for one prompt, batched target above)."""
    from mlx_lm.sample_utils import make_sampler

    t = temperature if mode is Mode.SAMPLED else 0.0
    sampling, sampler = {"temperature": t}, make_sampler(temp=t)
    if len(prompts) == 1:
        peer = mlx_lm_speculative_call(model, draft_model, tokenizer, prompts[0], max_tokens, k, sampler)
    else:
        peer = mlx_lm_call(model, tokenizer, prompts, max_tokens, sampler)
    return {PLAIN: engine_system(model, tokenizer, prompts, max_tokens, sampling, None),
            DRAFT: engine_system(model, tokenizer, prompts, max_tokens, sampling, setting),
            mlx_lm_system(len(prompts)): PreparedCall(lambda: None, lambda _: peer())}


def alternate_prepared(systems: dict[str, PreparedCall], rounds: int) -> dict[str, list[tuple[Any, float]]]:
    """Every system once per round, round r starting at position r mod n: (the timed call's measurement, the
    untimed preparation's seconds). Memory is released before each preparation."""
    import mlx.core as mx

    names = list(systems)
    runs: dict[str, list[tuple[Any, float]]] = {name: [] for name in names}
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            mx.clear_cache()  # the previous system's engine (and draft model) goes before the next is built
            tic = time.perf_counter()
            prepared = systems[name].prepare()
            prepare_s = time.perf_counter() - tic
            runs[name].append((measure_call(functools.partial(systems[name].run, prepared)), prepare_s))
            del prepared
    return runs


def measure_pair_cell(model: Any, draft_model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int,
                      mode: Mode, temperature: float, setting: str, k: int, rounds: int) -> dict[str, Any]:
    """Every system `rounds` times: per system the per-round wall times, preparation seconds, decode tokens/s,
    generated tokens and speculation counters; greedy: how many texts of the draft system and of mlx-lm differ
    from plain decoding's (worst round)."""
    runs = alternate_prepared(pair_systems(model, draft_model, tokenizer, prompts, max_tokens, mode, temperature,
                                           setting, k), rounds)
    systems = {name: {"wall_s": [round(m.wall_s, 4) for m, _ in ms],
                      "prepare_s": [round(p, 3) for _, p in ms],
                      "decode_tps": [round(m.result.decode_tps, 2) for m, _ in ms],
                      "generated_tokens": [m.result.generated for m, _ in ms],
                      "spec": [m.result.spec for m, _ in ms] if name != PLAIN and name != MLX_LM_BATCH else None}
               for name, ms in runs.items()}
    cell: dict[str, Any] = {"systems": systems, "prompt_tokens": [len(p) for p in prompts],
                            "mlx_lm_system": mlx_lm_system(len(prompts))}
    if mode is Mode.GREEDY:
        plain = [m.result.texts for m, _ in runs[PLAIN]]
        cell["differing_texts"] = {name: max(differing(m.result.texts, ref) for (m, _), ref in zip(runs[name], plain))
                                   for name in runs if name != PLAIN}
    return cell


def warm_up_pair(model: Any, draft_model: Any, tokenizer: Any, prompts: list[list[int]], setting: str, k: int,
                 batched: bool) -> None:
    """Every system once on one prompt (and on two when `batched`), a few tokens each."""
    for group in (prompts[:1], prompts[:2]) if batched else (prompts[:1],):
        alternate_prepared(pair_systems(model, draft_model, tokenizer, group, 8, Mode.GREEDY, 0.0, setting, k), 1)


__all__ = ["DRAFT", "MLX_LM_BATCH", "MLX_LM_SPECULATIVE", "PreparedCall", "alternate_prepared", "draft_setting",
           "engine_system", "measure_pair_cell", "mlx_lm_counters", "mlx_lm_speculative_call", "mlx_lm_system",
           "pair_systems", "warm_up_pair"]
