"""Where the wall time of a `batch_generate` call goes, ours and mlx-lm's (issue #17: "where a target is missed,
show with a profile where the time goes and what would close it").

For each cell (kind, concurrency, prompt tokens) both public calls run `rounds` times in alternating order, as in
the matrix. CortexStream's call is split by wrapping `Engine.__init__` and `Engine.step` for the duration of the
call (a diagnostic: the wrapper only reads the clock and the engine's public counters):

* construction: building the private engine (arena included);
* prefill steps: steps that computed prompt tokens (their count, tokens and seconds);
* decode steps: steps that computed none (count, seconds, median step);
* other: the rest of the call (tokenizing, detokenizing, building the result).

mlx-lm's call is split by its own `stats`: `prompt_time` (its prefill), `generation_time` and the rest.

Two bounds turn the profile into what would close the gap: *ratio at decode parity* is mlx-lm's wall over
(mlx-lm's wall - mlx-lm's prompt time + our prefill + our construction and other time), the ratio we would get
if our decode phase took exactly as long as mlx-lm's; *ceiling at decode parity* is mlx-lm's wall over its wall
without its prompt time, the ratio even a free prefill could not beat while decode runs at mlx-lm's speed. A
target above the ceiling needs a faster decode step than mlx-lm's, not better prefill.
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager
from typing import Any, Iterator

DEFAULT_CELLS = "ragged:8:128,shared:8:128,ragged:32:128"


@contextmanager
def _recording(log: dict[str, Any]) -> Iterator[None]:
    from cortexstream.engine.engine import Engine

    init, step = Engine.__init__, Engine.step

    def timed_init(self: Engine, *args: Any, **kwargs: Any) -> None:
        start = time.perf_counter()
        init(self, *args, **kwargs)
        log["construction_s"] += time.perf_counter() - start

    def timed_step(self: Engine) -> Any:
        before = self.num_prompt_tokens_computed
        start = time.perf_counter()
        outputs = step(self)
        seconds = time.perf_counter() - start
        log["steps"].append((seconds, self.num_prompt_tokens_computed - before))
        return outputs

    Engine.__init__, Engine.step = timed_init, timed_step  # type: ignore[method-assign]
    try:
        yield
    finally:
        Engine.__init__, Engine.step = init, step  # type: ignore[method-assign]


def _ours(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    import cortexstream
    from cortexstream.benchmarks.throughput_measure import measure_call

    log: dict[str, Any] = {"construction_s": 0.0, "steps": []}
    with _recording(log):
        m = measure_call(lambda: cortexstream.batch_generate(model, tokenizer, prompts, max_tokens=max_tokens))
    prefill = [(s, n) for s, n in log["steps"] if n > 0]
    decode = [s for s, n in log["steps"] if n == 0]
    prefill_s, decode_s = sum(s for s, _ in prefill), sum(decode)
    return {
        "wall_s": m.wall_s,
        "construction_s": log["construction_s"],
        "prefill_steps": len(prefill),
        "prefill_tokens": sum(n for _, n in prefill),
        "prefill_s": prefill_s,
        "decode_steps": len(decode),
        "decode_s": decode_s,
        "decode_step_median_ms": statistics.median(decode) * 1e3 if decode else None,
        "other_s": m.wall_s - log["construction_s"] - prefill_s - decode_s,
    }


def _reference(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    import mlx_lm

    from cortexstream.benchmarks.throughput_measure import measure_call

    m = measure_call(lambda: mlx_lm.batch_generate(model, tokenizer, prompts, max_tokens=max_tokens))
    stats = m.result.stats
    return {
        "wall_s": m.wall_s,
        "prompt_tokens": stats.prompt_tokens,
        "prompt_s": stats.prompt_time,
        "generation_tokens": stats.generation_tokens,
        "generation_s": stats.generation_time,
        "decode_step_mean_ms": stats.generation_time / max_tokens * 1e3,
        "other_s": m.wall_s - stats.prompt_time - stats.generation_time,
    }


def _median_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise median over rounds (each field on its own: a profile, not one consistent round)."""
    return {key: (statistics.median(r[key] for r in records) if records[0][key] is not None else None)
            for key in records[0]}


def profile_cell(model: Any, tokenizer: Any, kind: str, concurrency: int, prompt_tokens: int, max_tokens: int,
                 rounds: int) -> dict[str, Any]:
    from cortexstream.benchmarks.throughput_matrix import ratio_target
    from cortexstream.benchmarks.throughput_prompts import build_prompts

    prompts = build_prompts(tokenizer, kind, concurrency, prompt_tokens).prompts
    ours, reference = [], []
    for r in range(rounds):
        if r % 2 == 0:
            ours.append(_ours(model, tokenizer, prompts, max_tokens))
            reference.append(_reference(model, tokenizer, prompts, max_tokens))
        else:
            reference.append(_reference(model, tokenizer, prompts, max_tokens))
            ours.append(_ours(model, tokenizer, prompts, max_tokens))
    us, ref = _median_record(ours), _median_record(reference)
    ref_decode = ref["wall_s"] - ref["prompt_s"]
    at_parity = ref["wall_s"] / (ref_decode + us["prefill_s"] + us["construction_s"] + us["other_s"])
    return {
        "kind": kind, "concurrency": concurrency, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
        "rounds": rounds, "ours": us, "mlx_lm": ref,
        "ratio_median": ref["wall_s"] / us["wall_s"],
        "ratio_at_decode_parity": at_parity,
        "ceiling_at_decode_parity": ref["wall_s"] / ref_decode,
        "decode_phase_ratio": ref_decode / (us["decode_s"] or float("nan")),
        "ratio_target": ratio_target(kind, concurrency),
    }


def markdown(payload: dict[str, Any]) -> str:
    from cortexstream.benchmarks.machine import machine_sentence

    lines = [
        "# Where the time goes: `batch_generate` vs `mlx_lm.batch_generate` (issue #17 profile)",
        "",
        f"Model: {payload['model'].get('source')} ({payload['model'].get('weights', 'weights as loaded')}). Machine: {machine_sentence(payload['machine'])}. "
        f"Medians of {payload['rounds']} alternating rounds per cell, field by field. "
        f"Command: `python -m bench.throughput_profile --cells {payload['cells_arg']}`. Took "
        f"{payload['elapsed_minutes']:.1f} minutes.",
        "",
        "| cell | ours wall (s) | construction | prefill (steps, tokens, s) | decode (steps, s, median ms) | other |"
        " mlx-lm wall (s) | mlx-lm prompt (tokens, s) | mlx-lm decode (s, mean ms/step) | ratio | at decode parity |"
        " ceiling at decode parity | target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in payload["cells"]:
        us, ref = c["ours"], c["mlx_lm"]
        lines.append(
            f"| {c['kind']} c={c['concurrency']} {c['prompt_tokens']} | {us['wall_s']:.2f} | {us['construction_s']:.2f} | "
            f"{us['prefill_steps']:.0f}, {us['prefill_tokens']:.0f}, {us['prefill_s']:.2f} | "
            f"{us['decode_steps']:.0f}, {us['decode_s']:.2f}, {us['decode_step_median_ms']:.1f} | {us['other_s']:.2f} | "
            f"{ref['wall_s']:.2f} | {ref['prompt_tokens']:.0f}, {ref['prompt_s']:.2f} | "
            f"{ref['generation_s']:.2f}, {ref['decode_step_mean_ms']:.1f} | {c['ratio_median']:.2f}x | "
            f"{c['ratio_at_decode_parity']:.2f}x | {c['ceiling_at_decode_parity']:.2f}x | {c['ratio_target']:.2f}x |")
    lines += ["", "Columns: see the module docstring of `bench/throughput_profile.py`. "
              "*ratio*: mlx-lm wall / ours (medians). *at decode parity*: the ratio if our decode phase took as long "
              "as mlx-lm's, everything else as measured. *ceiling at decode parity*: mlx-lm's wall over its wall "
              "without its prompt time; a target above it cannot be met by prefill, only by a decode step faster than "
              "mlx-lm's (bench/results/decode_floor.md measures how much of that step attention is).", ""]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cells", default=DEFAULT_CELLS, help="comma-separated kind:concurrency:prompt_tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per cell")
    p.add_argument("--model", default=None, help="GGUF file, model directory or hub repo id (default: smollm2-135m)")
    p.add_argument("--out", default="bench/results", help="output folder")


def _cells(text: str) -> list[tuple[str, int, int]]:
    from cortexstream.benchmarks.throughput_prompts import KINDS
    from cortexstream.errors import InvalidArgumentError

    cells = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in KINDS or not parts[1].isdigit() or not parts[2].isdigit() \
                or int(parts[1]) < 1 or int(parts[2]) < 4:
            raise InvalidArgumentError(f"--cells: '{item}' must be kind:concurrency:prompt_tokens with kind one of "
                                       f"{','.join(KINDS)}, concurrency >= 1 and prompt_tokens >= 4")
        cells.append((parts[0], int(parts[1]), int(parts[2])))
    if not cells:
        raise InvalidArgumentError("--cells: give at least one kind:concurrency:prompt_tokens")
    return cells


def run_from_args(a: argparse.Namespace) -> int:
    from cortexstream.backend import ensure_buffer_cache
    from cortexstream.benchmarks.common import write_results
    from cortexstream.benchmarks.machine import machine
    from cortexstream.benchmarks.throughput import model_description
    from cortexstream.benchmarks.throughput_matrix import warm_up
    from cortexstream.benchmarks.throughput_prompts import text_windows
    from cortexstream.errors import InvalidArgumentError
    from cortexstream.models.loader import load

    cells = _cells(a.cells)
    if a.rounds < 1 or a.max_tokens < 1:
        raise InvalidArgumentError(f"--rounds {a.rounds} / --max-tokens {a.max_tokens}: both must be >= 1")
    model, tokenizer = load(a.model)
    ensure_buffer_cache()
    started = time.perf_counter()
    warm_up(model, tokenizer, text_windows(tokenizer, 2, 32))
    results = [profile_cell(model, tokenizer, kind, c, n, a.max_tokens, a.rounds) for kind, c, n in cells]
    payload = {"benchmark": "throughput_profile", "machine": machine(),
               "model": model_description(model, a.model), "cells_arg": a.cells, "rounds": a.rounds,
               "cells": results, "elapsed_minutes": (time.perf_counter() - started) / 60}
    text = markdown(payload)
    write_results(a.out, "throughput_profile", payload, text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.throughput_profile",
                                description=__doc__.split("\n")[0])
    add_arguments(p)
    return run_from_args(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
