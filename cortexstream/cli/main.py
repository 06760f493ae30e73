"""`cortexstream` console script: argument parsing, the OpenBLAS re-exec and one-line errors."""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Callable

from cortexstream.backend import maybe_reexec_with_openblas


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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cortexstream", description="MLX-native LLM inference engine")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser("info", help="backend, BLAS, default model")
    info.add_argument("--model", default=None, help="also load this model and describe it")

    gen = commands.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("--prompt", "-p", required=True)
    gen.add_argument("--system", default=None, help="system prompt (chat template)")
    gen.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    gen.add_argument("--verbose", action="store_true", help="print speed and memory after the text")
    _add_model_args(gen)
    _add_sampling_args(gen)

    chat = commands.add_parser("chat", help="plain terminal chat REPL")
    chat.add_argument("--system", default=None)
    _add_model_args(chat)
    _add_sampling_args(chat)
    return parser


def _command(name: str) -> Callable[[argparse.Namespace], int]:
    from cortexstream.cli import commands

    return getattr(commands, f"run_{name}")


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    if argv is None:
        maybe_reexec_with_openblas()
    args = build_parser().parse_args(args_list)
    try:
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
            print(f"cortexstream: error: {kind}{exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
