"""`cortexstream train <kind>`: one module per trainable component, `cortexstream/cli/train_<kind>.py`.

Each module defines `add_parser(subparsers) -> None` (its own arguments) and `run(args) -> int`. Modules are
found by name, so adding a trainer touches no shared file.
"""

from __future__ import annotations

import argparse
import importlib

TRAINERS = ("compressor", "sidecar", "c2c")


def _module(kind: str):  # noqa: ANN202 - a module object
    return importlib.import_module(f"cortexstream.cli.train_{kind}")


def add_train_parsers(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser("train", help="train learned KV components: " + ", ".join(TRAINERS))
    kinds = train.add_subparsers(dest="train_kind", required=True)
    for kind in TRAINERS:
        try:
            module = _module(kind)
        except ModuleNotFoundError as exc:
            if exc.name != f"cortexstream.cli.train_{kind}":
                raise
            continue
        module.add_parser(kinds)


def run_train(args: argparse.Namespace) -> int:
    return int(_module(args.train_kind).run(args))
