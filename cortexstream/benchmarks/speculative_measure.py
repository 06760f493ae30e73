"""One cell of `bench speculative`: the same token-id prompts through every system, whole public calls, rounds in
rotating order (`throughput_measure.alternate`: cache emptied and garbage collected before each call).

Systems: CortexStream plain (the public call as a user makes it, its private engine built inside), CortexStream
with each prompt-lookup setting (the same call given an engine built inside the timed call exactly as the private
one would be, so its `stats()` can be read: verify passes, drafted and accepted tokens), and mlx-lm on the same
model object (`mlx_lm.stream_generate` for one request, `mlx_lm.batch_generate` for more).

Decode tokens/s: for one request, the tokens after the first over the time after the first token, timed on the
stream; for a batch, the call's own stats (CortexStream: tokens after each request's first over the time from the
first first token; mlx-lm: its `generation_tps`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from cortexstream.benchmarks.speculative_settings import Mode
from cortexstream.benchmarks.throughput_measure import alternate

PLAIN = "plain"
MLX_LM = "mlx_lm"
PREFILL_STEP = 512  # the public calls' default prefill_step_size
BLOCK_SIZE = 16  # the public calls' private arenas' block size


@dataclass(frozen=True)
class Outcome:
    """What one call produced: texts in prompt order, generated tokens over all requests, decode tokens/s, and the
    engine's speculation counters (None for plain decoding and mlx-lm)."""

    texts: tuple[str, ...]
    generated: int
    decode_tps: float
    spec: dict[str, int] | None = None


def private_engine(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int,
                   speculative: str | None = None) -> Any:
    """The engine `stream_generate` (one prompt) or `batch_generate` (several) would build for this job, with
    `speculative` as its default (a draft setting loads the draft model here)."""
    from cortexstream.engine.engine import Engine
    from cortexstream.engine.sizing import fit_to_context, private_arena
    from cortexstream.policies.parsing import parse_policy

    jobs = [(len(p), fit_to_context(model, len(p), max_tokens), parse_policy(None)) for p in prompts]
    arena = private_arena(model, jobs, block_size=BLOCK_SIZE, prefill_step_size=PREFILL_STEP)
    if len(prompts) == 1:
        return Engine(model, tokenizer, max_num_seqs=1, prefill_step_size=PREFILL_STEP, prefix_caching=False,
                      arena=arena, speculative=speculative)
    return Engine(model, tokenizer, arena=arena, max_num_seqs=len(prompts), prefill_step_size=PREFILL_STEP,
                  prefill_tokens_while_decoding=None, speculative=speculative)


def timed_stream(responses: Iterable[Any]) -> tuple[str, int, float]:
    """(text, generated tokens, decode tokens/s) of one streamed request: tokens after the first over the time
    from the first response to the last."""
    pieces, first, last, generated = [], None, None, 0
    for r in responses:
        last = time.perf_counter()
        first = first if first is not None else last
        pieces.append(r.text)
        generated = r.generation_tokens
    elapsed = (last - first) if first is not None else 0.0
    return "".join(pieces), generated, (generated - 1) / elapsed if generated > 1 and elapsed > 0 else 0.0


def spec_counters(engine: Any) -> dict[str, int]:
    stats = engine.stats()
    return {"verify_steps": int(stats["spec_verify_steps"]), "drafted": int(stats["spec_drafted_tokens"]),
            "accepted": int(stats["spec_accepted_tokens"])}


def cortex_call(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, sampling: dict[str, Any],
                speculative: str | None) -> Callable[[], Outcome]:
    """The public call: `stream_generate` for one prompt, `batch_generate` for several; with `speculative`, on an
    engine built inside the call (as the private one) whose counters are read before it is closed."""
    def call() -> Outcome:
        engine = None if speculative is None else private_engine(model, tokenizer, prompts, max_tokens)
        try:
            return public_call(model, tokenizer, prompts, max_tokens, sampling, speculative, engine)
        finally:
            if engine is not None:
                engine.close()

    return call


def public_call(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, sampling: dict[str, Any],
                speculative: str | None, engine: Any) -> Outcome:
    """One timed public call (`stream_generate` for one prompt, `batch_generate` for several) on `engine` (None:
    the call's private one); with `speculative`, the engine's speculation counters afterwards."""
    import cortexstream

    if len(prompts) == 1:
        text, generated, tps = timed_stream(cortexstream.stream_generate(
            model, tokenizer, prompts[0], max_tokens, engine=engine, speculative=speculative, **sampling))
        texts = (text,)
    else:
        done = cortexstream.batch_generate(model, tokenizer, prompts, max_tokens, engine=engine,
                                           speculative=speculative, **sampling)
        texts, generated, tps = tuple(done.texts), done.stats.generation_tokens, done.stats.generation_tps
    counters = None if speculative is None or engine is None else spec_counters(engine)
    return Outcome(texts, generated, tps, counters)


def mlx_lm_call(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int,
                sampler: Any) -> Callable[[], Outcome]:
    """mlx-lm on the same model object: `stream_generate` for one prompt, `batch_generate` for several."""
    import mlx_lm

    def call() -> Outcome:
        if len(prompts) == 1:
            text, generated, tps = timed_stream(mlx_lm.stream_generate(model, tokenizer, prompts[0], max_tokens,
                                                                        sampler=sampler))
            return Outcome((text,), generated, tps)
        done = mlx_lm.batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, sampler=sampler)
        return Outcome(tuple(done.texts), int(done.stats.generation_tokens), float(done.stats.generation_tps))

    return call


def system_calls(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, mode: Mode,
                 temperature: float, speculative: tuple[str, ...]) -> dict[str, Callable[[], Outcome]]:
    """Every system's call for these prompts: plain, each prompt-lookup setting, mlx-lm. Sampled calls carry no
    seed (a seeded request decodes plainly, so it would measure nothing)."""
    from mlx_lm.sample_utils import make_sampler

    t = temperature if mode is Mode.SAMPLED else 0.0
    sampling = {"temperature": t}
    calls = {PLAIN: cortex_call(model, tokenizer, prompts, max_tokens, sampling, None)}
    calls.update({s: cortex_call(model, tokenizer, prompts, max_tokens, sampling, s) for s in speculative})
    calls[MLX_LM] = mlx_lm_call(model, tokenizer, prompts, max_tokens, make_sampler(temp=t))
    return calls


def measure_cell(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int, mode: Mode,
                 temperature: float, speculative: tuple[str, ...], rounds: int) -> dict[str, Any]:
    """Every system `rounds` times; per system the per-round wall times, decode tokens/s, generated tokens and
    speculation counters, and (greedy) whether each prompt-lookup setting gave plain decoding's texts."""
    calls = system_calls(model, tokenizer, prompts, max_tokens, mode, temperature, speculative)
    runs = alternate(calls, rounds)
    systems = {name: {"wall_s": [round(m.wall_s, 4) for m in ms],
                      "decode_tps": [round(m.result.decode_tps, 2) for m in ms],
                      "generated_tokens": [m.result.generated for m in ms],
                      "spec": [m.result.spec for m in ms] if name in speculative else None}
               for name, ms in runs.items()}
    cell: dict[str, Any] = {"systems": systems, "prompt_tokens": [len(p) for p in prompts]}
    if mode is Mode.GREEDY:
        plain = [m.result.texts for m in runs[PLAIN]]
        cell["differing_texts"] = {s: max(differing(a.result.texts, b) for a, b in zip(runs[s], plain))
                                   for s in speculative}
        cell["differing_texts_mlx_lm"] = max(differing(a.result.texts, b) for a, b in zip(runs[MLX_LM], plain))
    return cell


def differing(texts: tuple[str, ...], reference: tuple[str, ...]) -> int:
    return sum(a != b for a, b in zip(texts, reference)) + abs(len(texts) - len(reference))


def warm_up(model: Any, tokenizer: Any, prompts: list[list[int]], speculative: tuple[str, ...]) -> None:
    """Every system once on one prompt and on two, a few tokens each (compilation, first allocations)."""
    for group in (prompts[:1], prompts[:2]):
        for call in system_calls(model, tokenizer, group, 8, Mode.GREEDY, 0.0, speculative).values():
            call()


__all__ = ["MLX_LM", "Outcome", "PLAIN", "cortex_call", "differing", "measure_cell", "mlx_lm_call",
           "private_engine", "spec_counters", "system_calls", "timed_stream", "warm_up"]
