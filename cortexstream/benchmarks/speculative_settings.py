"""What one `bench speculative` run measures: models, task families, decoding modes, concurrency levels, the
prompt-lookup settings beside plain decoding, output length and rounds; checked before anything loads (each error
names the command-line option), and the `--quick` sizes. The options themselves are `speculative.add_arguments`';
a `--pair` run (a target and its draft model) takes the same sizes with its own defaults
(`speculative_pair_settings`)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from enum import Enum
from typing import Any

from cortexstream.benchmarks.speculative_tasks import MAX_INPUTS, Task
from cortexstream.errors import InvalidArgumentError

DEFAULT_SPECULATIVE = ("ngram:k=4,n=3",)


class Mode(str, Enum):
    GREEDY = "greedy"    # temperature 0: prompt lookup must give plain decoding's text, token for token
    SAMPLED = "sampled"  # temperature `SpeculativeSettings.temperature`, no seed (a seeded request decodes plainly)


@dataclass(frozen=True)
class SpeculativeSettings:
    """`speculative`: the prompt-lookup settings measured beside plain decoding (canonical string forms);
    `concurrency`: requests per call (1: `stream_generate`, more: `batch_generate` of that many different prompts
    of the task family)."""

    models: tuple[str, ...] = ("smollm2-135m",)
    tasks: tuple[Task, ...] = tuple(Task)
    modes: tuple[Mode, ...] = tuple(Mode)
    concurrency: tuple[int, ...] = (1, 8)
    speculative: tuple[str, ...] = DEFAULT_SPECULATIVE
    max_tokens: int = 128
    rounds: int = 3
    temperature: float = 0.7

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", _members(self.tasks, Task, "--tasks"))
        object.__setattr__(self, "modes", _members(self.modes, Mode, "--modes"))
        if not self.models or any(not isinstance(m, str) or not m.strip() for m in self.models):
            raise InvalidArgumentError(f"--models: {list(self.models)} must be model names or paths")
        if len(set(self.models)) != len(self.models):
            raise InvalidArgumentError(f"--models: {list(self.models)} names one twice")
        if (not self.concurrency or len(set(self.concurrency)) != len(self.concurrency)
                or any(isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= MAX_INPUTS
                       for c in self.concurrency)):
            raise InvalidArgumentError(f"--concurrency: {list(self.concurrency)} must be different integers in "
                                       f"1..{MAX_INPUTS} (each task family has {MAX_INPUTS} different inputs)")
        object.__setattr__(self, "speculative", speculative_forms(self.speculative))
        for option in ("max_tokens", "rounds"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"--{option.replace('_', '-')}: {value!r} must be an integer >= 1")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t <= 2:
            raise InvalidArgumentError(f"--temperature: {t!r} must be in (0, 2]")

    def quick(self) -> "SpeculativeSettings":
        """A smoke run of about a minute: edit and chat, concurrency 1 and 2, 32 tokens, one round."""
        return replace(self, tasks=(Task.EDIT, Task.CHAT), concurrency=(1, 2), max_tokens=32, rounds=1)


def speculative_forms(values: tuple[str, ...]) -> tuple[str, ...]:
    """Each prompt-lookup setting in its canonical form; plain decoding is always measured, and a draft model is
    measured by `--pair TARGET:DRAFT` (its own run, since it needs two models)."""
    from cortexstream.engine.speculative_config import SpeculativeMethod, parse_speculative

    forms: list[str] = []
    for value in values:
        try:
            config = parse_speculative(value)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"--speculative: {exc}") from None
        if config is None:
            raise InvalidArgumentError(f"--speculative: {value!r} turns speculation off; plain decoding is "
                                       "always measured, give ngram settings only")
        if config.method is not SpeculativeMethod.NGRAM:
            raise InvalidArgumentError(f"--speculative: {value!r}: --speculative takes prompt-lookup settings "
                                       "(e.g. ngram:k=4,n=3); measure a draft model with --pair TARGET:DRAFT")
        if config.text in forms:
            raise InvalidArgumentError(f"--speculative: {config.text!r} is given twice")
        forms.append(config.text)
    if not forms:
        raise InvalidArgumentError("--speculative: give at least one ngram setting (e.g. ngram:k=4,n=3)")
    return tuple(forms)


def _members(values: tuple, kind: type[Enum], option: str) -> tuple:
    members = []
    for value in values:
        try:
            members.append(kind(value))
        except ValueError:
            raise InvalidArgumentError(f"{option}: {getattr(value, 'value', value)!r} is not among "
                                       f"{', '.join(m.value for m in kind)}") from None
    if not members:
        raise InvalidArgumentError(f"{option}: give some of {', '.join(m.value for m in kind)}")
    if len(set(members)) != len(members):
        raise InvalidArgumentError(f"{option}: {[m.value for m in members]} names one twice")
    return tuple(members)


def given_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """The size options given on the command line, as settings fields (the ones left out take the defaults)."""
    from cortexstream.cli.number_lists import int_list, name_list

    if args.max_minutes is not None and not args.max_minutes > 0:
        raise InvalidArgumentError(f"--max-minutes: {args.max_minutes!r} must be > 0")
    given: dict[str, Any] = {}
    for name in ("tasks", "modes"):
        if getattr(args, name) is not None:
            given[name] = name_list(getattr(args, name))
    if args.concurrency is not None:
        given["concurrency"] = int_list(args.concurrency, "--concurrency")
    for name in ("max_tokens", "rounds", "temperature"):
        if getattr(args, name) is not None:
            given[name] = getattr(args, name)
    return given


def from_args(args: argparse.Namespace) -> SpeculativeSettings:
    """The settings the options ask for (`--quick`: its smoke-run sizes, the models, modes and settings given).
    Not for `--pair` runs (`speculative_pair_settings.pair_from_args`)."""
    from cortexstream.cli.number_lists import name_list

    if args.draft_k is not None:
        raise InvalidArgumentError("--draft-k: only with --pair TARGET:DRAFT (prompt lookup takes k in "
                                   "--speculative, e.g. ngram:k=4,n=3)")
    given = given_sizes(args)
    if args.models is not None:
        given["models"] = name_list(args.models)
    if args.speculative is not None:
        given["speculative"] = tuple(s.strip() for s in args.speculative.split(";") if s.strip())
    settings = SpeculativeSettings(**given)
    return settings.quick() if args.quick else settings


__all__ = ["DEFAULT_SPECULATIVE", "Mode", "SpeculativeSettings", "from_args", "given_sizes", "speculative_forms"]
