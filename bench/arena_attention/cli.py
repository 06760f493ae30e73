"""KV-arena attention benchmark: one decode step of one attention layer, arena vs mlx-lm's KVCache.

Command line: run every experiment, then write arena_attention.json and arena_attention.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from cortexstream.benchmarks.common import write_results

from .attention import experiment_attention, experiment_pitfall, experiment_python_overhead
from .common import BIG_CACHE, OPENBLAS, SEED
from .layout import experiment_buffer_per_layer, experiment_layout, experiment_write_in_place
from .meta import machine_meta, openblas_loaded
from .report import conclusions, to_markdown
from cortexstream.benchmarks.runner import run_as_script


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer steps (a smoke run, noisier numbers)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="output folder")
    parser.add_argument("--previous", type=Path, help="arena_attention.json of an earlier run: its experiment-1 "
                        "ratios are reported next to this run's (the machine is shared; one run is not enough)")
    parser.add_argument("--from-json", type=Path, help="do not measure: rewrite the report from this JSON")
    parser.add_argument("--note", action="append", default=[], help="a note for the report (repeatable)")


def run_from_args(args: argparse.Namespace) -> int:
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        write(data, args)
        return 0
    if not openblas_loaded():
        print(f"hint: run with LD_PRELOAD={OPENBLAS} for OpenBLAS matmuls (recorded in the JSON)", file=sys.stderr)
    warmup, steps = (2, 10) if args.quick else (5, 30)
    mx.random.seed(SEED)
    rng = np.random.default_rng(SEED)
    t_start = time.perf_counter()
    columns = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns) as progress:
        data: dict[str, Any] = {"meta": machine_meta(args, warmup, steps)}
        data["attention"] = experiment_attention(warmup, steps, progress, rng, None)
        data["attention_big_cache"] = experiment_attention(warmup, steps, progress, rng, BIG_CACHE)
        data["layout"] = experiment_layout(warmup, steps, progress)
        data["buffer_per_layer"] = experiment_buffer_per_layer(1, 1 if args.quick else 3, progress)
        data["write_in_place"] = experiment_write_in_place(warmup, steps, progress)
        data["per_sequence_pitfall"] = experiment_pitfall(warmup, steps, progress, rng)
        data["python_overhead"] = experiment_python_overhead(progress, rng, 50 if args.quick else 200)
    data["meta"]["elapsed_s"] = time.perf_counter() - t_start
    write(data, args)
    for r in data["attention"]:
        print(f"ctx={r['ctx']:>5} B={r['batch']} {r['label']:<46} {r['median_ms']:8.3f} ms  "
              f"x{r['ratio_vs_mlx_lm']:.2f}")
    print("\n".join(data["conclusions"]))
    print(f"wrote {args.out / 'arena_attention.json'} and arena_attention.md ({data['meta']['elapsed_s']:.0f} s run)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_as_script(__doc__, add_arguments, run_from_args, argv, "python -m bench.arena_attention")


def write(data: dict[str, Any], args: argparse.Namespace) -> None:
    """Attach the earlier run (if given), regenerate the conclusions, write the JSON and the Markdown."""
    if args.note:
        data["notes"] = list(args.note)
    if args.previous:
        previous = json.loads(args.previous.read_text())
        data["previous_run"] = {key: previous[key] for key in ("meta", "attention", "attention_big_cache")}
    data["conclusions"] = conclusions(data)
    write_results(str(args.out), "arena_attention", data, to_markdown(data))
