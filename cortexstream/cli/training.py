"""`cortexstream train <kind>`: one CLI module per trainable component, `cortexstream/training/<package>/cli.py`.

Each module defines `add_parser(subparsers) -> None` (its own arguments) and `run(args) -> int`. Modules are
found by name, so adding a trainer touches no shared file. Trainers run the shared training loop (its flags);
profilers measure something of a model once, with no loop (a head profile for `kvzip_heads`).
"""

from __future__ import annotations

import argparse
import importlib

# command name -> its package under cortexstream/training/
TRAINERS = {"compressor": "compression", "merger": "merger", "sidecar": "sidecar", "c2c": "c2c"}
PROFILERS = {"head-profile": "head_profile"}


def _module_name(kind: str) -> str:
    package = TRAINERS.get(kind) or PROFILERS[kind]
    return f"cortexstream.training.{package}.cli"


def _module(kind: str):  # noqa: ANN202 - a module object
    return importlib.import_module(_module_name(kind))


def add_train_parsers(commands: argparse._SubParsersAction) -> None:
    train = commands.add_parser("train", help="train learned KV components: " + ", ".join([*TRAINERS, *PROFILERS]))
    kinds = train.add_subparsers(dest="train_kind", required=True)
    for kind in [*TRAINERS, *PROFILERS]:
        try:
            module = _module(kind)
        except ModuleNotFoundError as exc:
            if exc.name != _module_name(kind):
                raise
            continue
        module.add_parser(kinds)


def run_train(args: argparse.Namespace) -> int:
    if getattr(args, "out", None):
        from cortexstream.atomic_files import check_output_dir

        check_output_dir(args.out)  # a run directory that cannot be written fails now, not at the first checkpoint
    return int(_module(args.train_kind).run(args))
