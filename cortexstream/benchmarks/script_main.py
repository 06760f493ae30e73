"""The `main(argv)` of every script benchmark (benchmarks/scripts.py lists them): `python -m
cortexstream.benchmarks.<module>` parses the module's own options and runs it, as `cortexstream bench <name>` does."""

from __future__ import annotations

import argparse
from typing import Callable


def run_as_script(doc: str | None, add_arguments: Callable[[argparse.ArgumentParser], None],
                  run_from_args: Callable[[argparse.Namespace], int], argv: list[str] | None) -> None:
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    add_arguments(parser)
    run_from_args(parser.parse_args(argv))
