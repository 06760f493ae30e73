"""What one `bench speculative` run measures: models, task families, decoding modes, concurrency levels, the
prompt-lookup settings beside plain decoding, output length and rounds; checked before anything loads (each error
names the command-line option), and the `--quick` sizes."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from enum import Enum

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
    """Each prompt-lookup setting in its canonical form; plain decoding is always measured, draft models are not
    built in the engine yet."""
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
            raise InvalidArgumentError(f"--speculative: {value!r}: draft models are not implemented in the engine "
                                       "yet; give ngram settings (e.g. ngram:k=4,n=3)")
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The sizes as options (defaults: `SpeculativeSettings`), and the run options."""
    d = SpeculativeSettings()
    parser.add_argument("--models", default=",".join(d.models),
                        help="comma-separated models: smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b (verified "
                             "benchmark assets, skipped with a note when absent), or a GGUF file / model directory")
    parser.add_argument("--tasks", default=",".join(t.value for t in d.tasks),
                        help=f"comma-separated among {', '.join(t.value for t in Task)}")
    parser.add_argument("--modes", default=",".join(m.value for m in d.modes),
                        help="comma-separated among greedy, sampled (temperature --temperature, no seed: a "
                             "seeded request decodes plainly)")
    parser.add_argument("--concurrency", default=",".join(map(str, d.concurrency)),
                        help=f"comma-separated requests per call, each in 1..{MAX_INPUTS} (1: stream_generate, "
                             "more: batch_generate)")
    parser.add_argument("--speculative", default=";".join(d.speculative),
                        help="semicolon-separated prompt-lookup settings measured beside plain decoding, e.g. "
                             "'ngram:k=4,n=3;ngram:k=8,n=3'")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="new tokens per request (at most)")
    parser.add_argument("--rounds", type=int, default=d.rounds, help="rounds per cell, the systems' order "
                        "rotating each round; medians are reported")
    parser.add_argument("--temperature", type=float, default=d.temperature, help="temperature of the sampled mode")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: edit and chat, concurrency 1 and 2, 32 tokens, 1 round "
                             "(speculative_quick.*)")
    parser.add_argument("--max-minutes", type=float, default=None,
                        help="start no new cell after this many minutes (skipped cells are listed as missing)")
    parser.add_argument("--resume", action="store_true", help="keep cells already in the JSON, run the rest")
    parser.add_argument("--out", default="bench/results", help="output folder")


def from_args(args: argparse.Namespace) -> SpeculativeSettings:
    """The settings the options ask for (`--quick`: its smoke-run sizes, the models, modes and settings given)."""
    from cortexstream.cli.number_lists import int_list, name_list

    if args.max_minutes is not None and not args.max_minutes > 0:
        raise InvalidArgumentError(f"--max-minutes: {args.max_minutes!r} must be > 0")
    settings = SpeculativeSettings(
        models=name_list(args.models), tasks=name_list(args.tasks), modes=name_list(args.modes),
        concurrency=int_list(args.concurrency, "--concurrency"),
        speculative=tuple(s.strip() for s in args.speculative.split(";") if s.strip()),
        max_tokens=args.max_tokens, rounds=args.rounds, temperature=args.temperature)
    return settings.quick() if args.quick else settings


__all__ = ["DEFAULT_SPECULATIVE", "Mode", "SpeculativeSettings", "add_arguments", "from_args",
           "speculative_forms"]
