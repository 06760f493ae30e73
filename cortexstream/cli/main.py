"""`cortexstream` console script: argument parsing, the Linux CPU re-exec (backend/tuning.py) and one-line errors."""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from typing import Callable

from cortexstream.backend import enable_linux_cpu_tuning
from cortexstream.cli.distributed import add_rank_args
from cortexstream.cli.kv_storage import add_kv_storage_args
from cortexstream.cli.training import add_train_parsers


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="GGUF file, model directory or hub repo id (default: smollm2-135m)")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="weight dtype")
    parser.add_argument(
        "--keep-quantized", action="store_true", help="keep quantised weights (default: dequantise on CPU)"
    )


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", "-m", type=int, default=256)
    parser.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--context-overflow", choices=["warn", "error"], default="warn",
                        help="a prompt longer than the model's context: warn and generate anyway, or refuse")


def _add_kv_policy_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-policy", default=None,
        help="KV eviction policy, e.g. 'h2o:budget=0.2', 'h2o:budget=512,sinks=4,recent=64,keep_prefix=40', "
             "'streaming:window=1020' (budgets: tokens, or a fraction of prompt + max tokens)",
    )


def _add_speculative_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--speculative", default=None, metavar="SPEC",
        help="speculative decoding: 'ngram:k=4,n=3' drafts up to k tokens by prompt lookup (the continuation of "
             "the latest earlier match of the last n tokens) and verifies them in one pass; greedy output is "
             "unchanged. 'off' (default) decodes one token per pass",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cortexstream", description="MLX-native LLM inference engine")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="backend, BLAS, default model")
    info.add_argument("--model", default=None,
                      help="also load this model and describe it (with its KV bytes per token for each kv dtype)")

    gen = commands.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("--prompt", "-p", required=True)
    gen.add_argument("--system", default=None, help="system prompt (chat template)")
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    gen.add_argument("--verbose", action="store_true", help="print speed and memory after the text")
    _add_model_args(gen)
    _add_sampling_args(gen)
    _add_kv_policy_arg(gen)
    add_kv_storage_args(gen)
    _add_speculative_arg(gen)
    add_rank_args(gen)

    chat = commands.add_parser("chat", help="plain terminal chat REPL")
    chat.add_argument("--system", default=None)
    _add_model_args(chat)
    _add_sampling_args(chat)
    _add_kv_policy_arg(chat)
    add_kv_storage_args(chat)

    tui = commands.add_parser("tui", help="terminal UI: chat with several conversations and watch the KV arena")
    _add_model_args(tui)
    tui.add_argument("--kv-tokens", type=int, default=8192, help="arena size in tokens")
    tui.add_argument("--block-size", type=int, default=16)
    add_kv_storage_args(tui)
    tui.add_argument("--kv-disk", default=None, metavar="DIR",
                     help="keep prefix-cache KV blocks on disk in DIR too (they survive restarts)")
    tui.add_argument("--kv-disk-size", default="20GiB", metavar="SIZE", help="most bytes kept in DIR (LRU)")
    tui.add_argument("--max-tokens", "-m", type=int, default=512)
    tui.add_argument("--temp", type=float, default=0.0, help="temperature (0 = greedy)")
    tui.add_argument("--repetition-penalty", type=float, default=None)
    tui.add_argument("--system", default="", help="system prompt of new conversations (default: the template's)")
    tui.add_argument("--kv-policy", default="full", help="KV policy of new conversations, e.g. 'h2o:budget=0.2'")
    _add_speculative_arg(tui)
    tui.add_argument("--share-prefix", action="store_true",
                     help="one prefix-cache tenant for all conversations (identical system prompts share blocks)")

    bench = commands.add_parser("bench", help="benchmarks (results as JSON + Markdown)")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    from cortexstream.benchmarks.runner import add_bench_parsers

    add_bench_parsers(kinds)
    add_train_parsers(commands)
    from cortexstream.cli.convert import add_convert_parser
    from cortexstream.cli.serve import add_serve_parser

    add_serve_parser(commands)
    add_convert_parser(commands)
    return parser


def _one_line_warning(message: Warning | str, category: type[Warning], *_args: object, **_kwargs: object) -> None:
    """Warnings (e.g. a prompt longer than the model's context) as one line, like errors."""
    print(f"cortexstream: warning: {message}", file=sys.stderr)


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    from cortexstream.cli import commands

    if name in ("serve", "convert"):
        import importlib

        return getattr(importlib.import_module(f"cortexstream.cli.{name}"), f"run_{name}")
    if name == "train":
        from cortexstream.cli.training import run_train

        return run_train

    return getattr(commands, f"run_{name}")


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if argv is None:  # the command line's own process: the one place besides opt-in scripts that re-executes
        enable_linux_cpu_tuning()
    args = build_parser().parse_args(args_list)
    warnings.showwarning = _one_line_warning
    try:
        if getattr(args, "run", None):  # a sub-command that names its own entry point ("module:function")
            import importlib

            module, function = args.run.split(":")
            return getattr(importlib.import_module(module), function)(args)
        return _command(args.command)(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # one clear line unless --debug; never a traceback by default
        if args.debug:
            traceback.print_exc()
        else:
            from cortexstream.errors import CortexStreamError

            kind = "" if isinstance(exc, CortexStreamError) else f"{type(exc).__name__}: "
            detail = str(exc) or ("out of memory: the request needs more than this machine can allocate"
                                  if isinstance(exc, MemoryError) else "(no message)")
            print(f"cortexstream: error: {kind}{detail}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
