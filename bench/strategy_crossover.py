"""Where the batch strategies cross over on this CPU: `strided` vs `blocks` vs mlx-lm's KVCache, batch 8, by keys.

Run: ``LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 python -m bench.strategy_crossover``
(about 2 min; ``--steps`` / ``--contexts`` to change the sweep). Writes bench/results/strategy_crossover.json and
.md. One attention layer of a decode step (SmolLM2 shapes: 9 query / 3 KV heads, head_dim 64, float32, block 16),
timed exactly as experiment 1 of bench_arena_attention.py: the engine's DecodeBatch + SDPA hook with the strategy
forced, contiguous tables, variants interleaved with the order rotated every round. It is the evidence behind
`STRIDED_MAX_KEYS` and `BLOCKS_MAX_KEYS` in cortexstream/engine/batch_attention.py, which pick `strided` up to
the first and beyond the second and `blocks` in between.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench.arena_attention.cases import ArenaDecodeBatch, MlxLm, make_sequences
from bench.arena_attention.common import SEED, interleave, make_inputs, versus
from bench.arena_attention.meta import machine_line, machine_meta, steps_sentence
from rich.progress import Progress

from cortexstream.benchmarks.common import write_results
from cortexstream.engine import batch_attention
from cortexstream.benchmarks.runner import run_as_script

CONTEXTS = (256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288)
STRATEGIES = ("strided", "blocks")
BATCH = 8


def measure(ctx: int, warmup: int, steps: int, rng: np.random.Generator) -> dict:
    inp = make_inputs(ctx, BATCH)
    variants = [MlxLm(inp)]
    for strategy in STRATEGIES:
        arena, seqs = make_sequences(inp, ctx + warmup + steps + 2, "contiguous", rng)
        variants.append(ArenaDecodeBatch(strategy, inp, arena, seqs, strategy))
    interleave(variants, warmup, steps, lambda: None)
    base = variants[0]
    row = {"ctx": ctx, "mlx_lm_ms": statistics.median(base.times) * 1e3}
    for v in variants[1:]:
        assert v.strategy == v.key, f"{v.key} was not run ({v.strategy})"
        row.update({f"{v.key}_{name}": value for name, value in versus(v, base).items()})
    row["engine_choice"] = batch_attention.choose_strategy(None, mx.float32, strided=True, num_keys=ctx + 1)
    return row


def to_markdown(data: dict) -> str:
    meta = data["meta"]
    lines = [
        "# Batch strategy crossover (batch 8, contiguous tables)", "",
        f"{machine_line(meta, 'python -m bench.strategy_crossover')} {steps_sentence(meta)} "
        "Ratio = median / mlx-lm `KVCache` median; paired = median of same-round ratios. "
        "Engine choice = what `choose_strategy` picks at that length on CPU.", "",
        *[f"**Note:** {note}\n" for note in data.get("notes", [])],
        "| keys | mlx-lm ms | strided ms | strided ratio (paired) | blocks ms | blocks ratio (paired) "
        "| engine choice |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['ctx']} | {r['mlx_lm_ms']:.2f} | {r['strided_ms']:.2f} | {r['strided_ratio']:.3f} "
            f"({r['strided_paired']:.3f}) | {r['blocks_ms']:.2f} | {r['blocks_ratio']:.3f} ({r['blocks_paired']:.3f}) "
            f"| {r['engine_choice']} |")
    worse = [r for r in data["rows"] if r[f"{r['engine_choice']}_ratio"] > min(r["strided_ratio"], r["blocks_ratio"])
             + 0.03]
    lines += ["", "Lengths where the engine's choice is more than 3 % slower than the other strategy: "
              + (", ".join(str(r["ctx"]) for r in worse) if worse else "none") + "."]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")], default=list(CONTEXTS))
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--note", action="append", default=[], help="a note for the report (repeatable)")
    parser.add_argument("--from-json", type=Path, help="do not measure: rewrite the report from this JSON")


def run_from_args(args: argparse.Namespace) -> int:
    args.quick = False
    if args.from_json:
        write(json.loads(args.from_json.read_text()), args)
        return 0
    mx.random.seed(SEED)
    rng = np.random.default_rng(SEED)
    t0 = time.perf_counter()
    data = {"meta": machine_meta(args, args.warmup, args.steps), "rows": []}
    with Progress() as progress:
        task = progress.add_task("strategy crossover", total=len(args.contexts))
        for ctx in args.contexts:
            data["rows"].append(measure(ctx, args.warmup, args.steps, rng))
            progress.advance(task)
    data["meta"]["elapsed_s"] = time.perf_counter() - t0
    write(data, args)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m bench.strategy_crossover")


def write(data: dict, args: argparse.Namespace) -> None:
    if args.note:
        data["notes"] = list(args.note)
    markdown = to_markdown(data)
    write_results(str(args.out), "strategy_crossover", data, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
