"""What enforcing a grammar costs, for `bench structured`: decode speed with and without masks, compile times and
the host time of one mask.

Mask cost: one engine whose requests are all constrained and one whose requests are all free run the same prompts at
batch `batch` in the same process, the two taking turns in an order that alternates every round. tokens/s = tokens
generated / wall seconds of the whole engine run (`mx.synchronize()` before the clock stops). Both engines must
decode the same number of tokens per request, or the ratio would measure how long the batch stays full rather than
the mask: a constrained request ends when its JSON is complete, an unconstrained greedy one may run to max_tokens.
So a calibration run of the constrained engine gives each request's length, that length is the request's max_tokens
in both engines, and the free engine's tokenizer has no end-of-sequence token (`common.NoEosTokenizer`), so its
requests end there too; the calibration run and a first run of the free engine are untimed warm-ups.

Compile: a fresh `GrammarCompiler`, `warm()` timed once (llguidance's view of the vocabulary), then
`constraint(GrammarSpec.json_schema(s))` timed per schema. Host mask: for each schema a fresh constraint is fed a
completion the engine produced under it, timing `allowed(vocab)` + `consume(token)` per token (`allowed` alone for
the end-of-sequence token that closes it).
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

from cortexstream.benchmarks.common import NoEosTokenizer, percentile, release_engines
from cortexstream.benchmarks.structured_measure import Completion, run_requests
from cortexstream.models.eos import eos_ids


def logits_width(model: Any, fallback: int) -> int:
    """Entries of the model's next-token logits (the vocabulary, with any padded rows): a mask's length."""
    return int(getattr(getattr(model, "args", None), "vocab_size", None) or fallback)


def mask_cost(model: Any, tokenizer: Any, model_name: str, prompts: Sequence[list[int]],
              schemas: Sequence[dict[str, Any]], *, batch: int, max_tokens: int, rounds: int,
              progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """One row: tokens/s of each round, constrained and unconstrained, their medians and ratio."""
    import mlx.core as mx
    from tqdm import tqdm

    from cortexstream.engine.engine import Engine

    kv_tokens = batch * (max(len(p) for p in prompts) + max_tokens + 32)
    engines = {True: Engine(model, tokenizer, kv_tokens=kv_tokens, max_num_seqs=batch),
               False: Engine(model, NoEosTokenizer(tokenizer), kv_tokens=kv_tokens, max_num_seqs=batch)}
    formats = {True: list(schemas), False: [None] * len(schemas)}
    tps: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[int]] = {True: [], False: []}
    orders = []
    try:
        with tqdm(total=2 + 2 * rounds, desc=f"{model_name} mask cost", unit="run", disable=not progress,
                  leave=False) as bar:
            calibration = run_requests(engines[True], prompts, formats[True], max_tokens=max_tokens,
                                       temperature=0.0, seed=0, concurrency=batch)
            lengths = [len(c.tokens) for c in calibration]
            bar.update(1)
            run_requests(engines[False], prompts, formats[False], max_tokens=lengths, temperature=0.0, seed=0,
                         concurrency=batch)
            bar.update(1)
            for r in range(rounds):
                order = (True, False) if r % 2 == 0 else (False, True)
                orders.append(["constrained" if c else "unconstrained" for c in order])
                for constrained in order:
                    mx.synchronize()
                    tic = time.perf_counter()
                    outs = run_requests(engines[constrained], prompts, formats[constrained], max_tokens=lengths,
                                        temperature=0.0, seed=0, concurrency=batch)
                    mx.synchronize()
                    seconds = time.perf_counter() - tic
                    count = sum(len(o.tokens) for o in outs)
                    tokens[constrained].append(count)
                    tps[constrained].append(count / seconds)
                    bar.update(1)
    finally:
        release_engines(engines)
    on, off = statistics.median(tps[True]), statistics.median(tps[False])
    log(f"{model_name} mask cost: constrained {on:.1f} tok/s, unconstrained {off:.1f} tok/s (ratio {on / off:.3f})")
    return {"model": model_name, "batch": batch, "requests": len(prompts), "rounds": rounds,
            "max_tokens": max_tokens, "request_lengths": lengths, "orders": orders,
            "constrained_tps": tps[True], "unconstrained_tps": tps[False],
            "constrained_tokens": tokens[True], "unconstrained_tokens": tokens[False],
            "constrained_tps_median": on, "unconstrained_tps_median": off, "ratio": on / off}


def compile_and_mask(model: Any, tokenizer: Any, model_name: str, names: Sequence[str],
                     schemas: Sequence[dict[str, Any]], samples: Sequence[Completion],
                     progress: bool = True) -> tuple[dict[str, Any], dict[str, Any]]:
    """(compile row, host-mask row) of one tokenizer over the schema set; `samples[i]`: an output under schema i."""
    from tqdm import tqdm

    from cortexstream.grammar.compiler import GrammarCompiler
    from cortexstream.grammar.spec import GrammarSpec

    eos = eos_ids(tokenizer)
    compiler = GrammarCompiler(tokenizer, eos)
    tic = time.perf_counter()
    compiler.warm()
    warm_seconds = time.perf_counter() - tic
    width = logits_width(model, compiler.vocab_size)
    compile_ms, per_schema, mask_us = [], [], []
    for name, schema, sample in tqdm(list(zip(names, schemas, samples)), desc=f"{model_name} compile + mask",
                                     unit="schema", disable=not progress, leave=False):
        spec = GrammarSpec.json_schema(schema)
        tic = time.perf_counter()
        compiler.constraint(spec)
        compile_ms.append((time.perf_counter() - tic) * 1e3)
        per_schema.append({"schema": name, "compile_ms": compile_ms[-1]})
        constraint = compiler.constraint(spec)  # a fresh one: the timed one above is dropped
        for token in sample.tokens:
            tic = time.perf_counter()
            constraint.allowed(width)
            if token in eos:
                mask_us.append((time.perf_counter() - tic) * 1e6)
                break
            constraint.consume(token)
            mask_us.append((time.perf_counter() - tic) * 1e6)
    compile_row = {"model": model_name, "warm_seconds": warm_seconds, "schemas": len(compile_ms),
                   "compile_ms_p50": percentile(compile_ms, 50), "compile_ms_p99": percentile(compile_ms, 99),
                   "compile_ms_max": max(compile_ms), "per_schema": per_schema}
    mask_row = {"model": model_name, "mask_width": width, "tokens": len(mask_us),
                "mask_us_p50": percentile(mask_us, 50), "mask_us_p99": percentile(mask_us, 99),
                "mask_us_mean": statistics.fmean(mask_us) if mask_us else float("nan")}
    return compile_row, mask_row


__all__ = ["compile_and_mask", "logits_width", "mask_cost"]
