"""What one `bench structured` run measures, checked before anything loads (each error names its option), and the
command line that reproduces it (written into the report, with models named without local paths)."""

from __future__ import annotations

import argparse
import enum
import shlex
from dataclasses import dataclass

from cortexstream.errors import InvalidArgumentError


class Decoding(str, enum.Enum):
    GREEDY = "greedy"
    SAMPLED = "sampled"  # at `temperature`, every request seeded


@dataclass(frozen=True)
class StructuredSettings:
    """`models`: sources for `cortexstream.load` (None: the default SmolLM2). `schemas`: how many of the schema set
    (None: all). `batch`: requests in the engine at once in the concurrent validity runs and the mask-cost runs."""

    models: tuple[str | None, ...] = (None,)
    rounds: int = 3
    max_tokens: int = 256
    schemas: int | None = None
    batch: int = 8
    temperature: float = 0.7
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.models:
            raise InvalidArgumentError("--model: give at least one model")
        for name in ("rounds", "max_tokens", "batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"--{name.replace('_', '-')}: {value!r} must be an integer >= 1")
        if self.batch < 2:
            raise InvalidArgumentError(f"--batch: {self.batch} must be >= 2 (batch 1 is the one-at-a-time run)")
        if self.schemas is not None:
            from cortexstream.benchmarks.structured_schemas import schema_cases

            schema_cases(self.schemas)  # the range check, naming --schemas
        if not 0 < self.temperature <= 2:
            raise InvalidArgumentError(f"--temperature: {self.temperature!r} must be in (0, 2]")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise InvalidArgumentError(f"--seed: {self.seed!r} must be an integer")

    @property
    def concurrencies(self) -> tuple[int, int]:
        return (1, self.batch)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = StructuredSettings()
    parser.add_argument("--model", action="append", default=None, metavar="PATH",
                        help="model to measure (repeatable; default: smollm2-135m; 'qwen2.5-coder-0.5b': the "
                             "benchmark asset)")
    parser.add_argument("--rounds", type=int, default=d.rounds,
                        help="mask-cost rounds (constrained and unconstrained alternate which goes first)")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max_tokens of every request")
    parser.add_argument("--schemas", type=int, default=None, metavar="N",
                        help="only the N simplest schemas (a quick run; default: all)")
    parser.add_argument("--batch", type=int, default=d.batch, help="requests in the engine at once")
    parser.add_argument("--temperature", type=float, default=d.temperature, help="temperature of the sampled runs")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of request i in the sampled runs: seed + i")
    parser.add_argument("--out-dir", "--out", dest="out", default="bench/results", metavar="DIR",
                        help="output folder")


def from_args(args: argparse.Namespace) -> StructuredSettings:
    return StructuredSettings(models=tuple(args.model) if args.model else (None,), rounds=args.rounds,
                              max_tokens=args.max_tokens, schemas=args.schemas, batch=args.batch,
                              temperature=args.temperature, seed=args.seed)


def command_line(s: StructuredSettings) -> str:
    """The command that measures `s` (models by their neutral name: no local folders in a result file)."""
    from cortexstream.benchmarks.machine import neutral_source

    d, words = StructuredSettings(), ["cortexstream", "bench", "structured"]
    for model in s.models:
        if model is not None:
            words += ["--model", neutral_source(model)]
    for name in ("rounds", "max_tokens", "schemas", "batch", "temperature", "seed"):
        if getattr(s, name) != getattr(d, name):
            words += [f"--{name.replace('_', '-')}", str(getattr(s, name))]
    return shlex.join(words)


__all__ = ["Decoding", "StructuredSettings", "add_arguments", "command_line", "from_args"]
