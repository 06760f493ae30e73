"""`cortexstream bench <name>` for the measurement benchmarks that also run as `python -m
cortexstream.benchmarks.<module>`: the allocator, the arena attention, block size, strategy crossover and the
decode floor. Each module defines `add_arguments(parser)` and `run_from_args(args) -> int`; this table is the
only place that names them for the CLI, so `cortexstream bench` and `python -m` run the same code.
"""

from __future__ import annotations

import argparse
import importlib

# bench command -> (module, one-line help)
SCRIPTS: dict[str, tuple[str, str]] = {
    "allocator": ("cortexstream.benchmarks.allocator", "block allocator: indexed free runs vs naive scans"),
    "arena-attention": ("cortexstream.benchmarks.arena_attention.cli",
                        "decode attention straight from the KV arena vs mlx-lm's KVCache (six experiments)"),
    "block-size": ("cortexstream.benchmarks.block_size", "batched decode attention at block sizes 16-128"),
    "strategy-crossover": ("cortexstream.benchmarks.strategy_crossover",
                           "strided vs blocks vs mlx-lm batched attention from 256 to 12288 keys"),
    "throughput-profile": ("cortexstream.benchmarks.throughput_profile",
                           "where a batch_generate call's wall time goes, ours and mlx-lm's, per matrix cell"),
    "small-gemm": ("cortexstream.benchmarks.small_gemm",
                   "the CPU small-batch matmul kernel vs MLX's BLAS matmul on a decode step's Linear layers"),
    "decode-floor": ("cortexstream.benchmarks.decode_floor",
                     "how much of a batched decode step any engine running mlx-lm's model code can change"),
}


def add_script_parsers(kinds: argparse._SubParsersAction) -> None:
    """One `bench` sub-command per script benchmark, with the module's own arguments."""
    for name, (module, help_text) in SCRIPTS.items():
        parser = kinds.add_parser(name, help=help_text)
        importlib.import_module(module).add_arguments(parser)
        parser.set_defaults(run="cortexstream.benchmarks.scripts:run_script", script=name)


def run_script(args: argparse.Namespace) -> int:
    """Entry point of those sub-commands (the CLI calls it through `run`)."""
    from cortexstream.atomic_files import check_output_dir

    check_output_dir(str(args.out))  # before a long run, not after it: results must have somewhere to go
    return int(importlib.import_module(SCRIPTS[args.script][0]).run_from_args(args))


__all__ = ["SCRIPTS", "add_script_parsers", "run_script"]
