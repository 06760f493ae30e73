"""The one runner of the user-facing benchmarks: `cortexstream bench <name>` and `python -m
cortexstream.benchmarks.<module>` run the same code.

Each benchmark module defines `add_arguments(parser)` (its options, `--out` among them) and `run_from_args(args)
-> int`; `BENCHMARKS` is the only place that names them for the CLI. The output folder is checked before a long
run starts, so results always have somewhere to go. Diagnostics that justified past design decisions are not
here: they live in the checkout's top-level `bench/` (`python -m bench.<name>`) and are not installed.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Callable

# bench command -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "throughput": ("cortexstream.benchmarks.throughput",
                   "whole-call wall time, TTFT, ITL, memory vs mlx-lm (+ heat map)"),
    "quality": ("cortexstream.benchmarks.quality", "perplexity, passkey retrieval and streaming under KV policies"),
    "frontier": ("cortexstream.benchmarks.frontier",
                 "perplexity vs measured KV cache size for every policy family (+ passkey, needle)"),
    "c2c": ("cortexstream.benchmarks.c2c",
            "C2C fusion: held-out quality (same model, cross-model) and handoff latency"),
    "kv-dtype": ("cortexstream.benchmarks.kv_dtype", "quality, memory and speed of int8/int4/float16 KV"),
    "serve": ("cortexstream.benchmarks.serve", "cortexstream serve vs mlx_lm.server over HTTP (3 workloads)"),
    "structured": ("cortexstream.benchmarks.structured", "JSON-schema validity, grammar mask cost and compile time"),
    "tools": ("cortexstream.benchmarks.tool_bench",
              "tool calls and enforced JSON schemas over HTTP, beside mlx_lm.server and the peers"),
    "retrieval": ("cortexstream.benchmarks.retrieval",
                  "passkey / needle / multi-key / multi-query retrieval from a compressed KV cache"),
    "speculative": ("cortexstream.benchmarks.speculative",
                    "prompt lookup (speculative decoding) vs plain decoding and mlx-lm on edit/summary/quote/chat"),
    "prefix-tier": ("cortexstream.benchmarks.prefix_tier",
                    "KV disk tier: TTFT after a restart, agent sessions vs mlx_lm.server (serve --kv-disk)"),
}


def add_bench_parsers(kinds: argparse._SubParsersAction) -> None:
    """One `bench` sub-command per benchmark, with the module's own arguments."""
    for name, (module, help_text) in BENCHMARKS.items():
        parser = kinds.add_parser(name, help=help_text)
        importlib.import_module(module).add_arguments(parser)
        parser.set_defaults(run="cortexstream.benchmarks.runner:run_benchmark", benchmark=name)


def run_benchmark(args: argparse.Namespace) -> int:
    """Entry point of those sub-commands (the CLI calls it through `run`)."""
    return int(run_checked(importlib.import_module(BENCHMARKS[args.benchmark][0]).run_from_args, args))


def run_checked(run_from_args: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """`run_from_args(args)` after checking `args.out` (before a long run, not after it)."""
    from cortexstream.atomic_files import check_output_dir

    check_output_dir(str(args.out))
    return int(run_from_args(args))


def run_as_script(doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
                  run_from_args: Callable[[argparse.Namespace], int], argv: list[str] | None,
                  prog: str | None = None) -> int:
    """The `main(argv)` of a benchmark module run as a script: its own options, the same checks as the CLI."""
    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    if getattr(args, "out", None) is None:
        return int(run_from_args(args))
    return run_checked(run_from_args, args)


__all__ = ["BENCHMARKS", "add_bench_parsers", "run_as_script", "run_benchmark", "run_checked"]
