"""What one `bench speculative --pair TARGET:DRAFT` run measures: the target and its draft model (verified asset
names or loadable sources), task families, decoding modes, concurrency levels, tokens drafted per verify pass,
output length and rounds; checked before anything loads, each error naming its option.

The defaults are small on purpose: the pair's target (Qwen2.5-Coder-1.5B, a K-quant GGUF dequantised to float32)
decodes slowly on a small CPU, so a default run is two input-grounded tasks, greedy, one request, 64 tokens, one
round; concurrency above 1 (where mlx-lm has no batched speculation) only when asked.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass, replace

from cortexstream.benchmarks.speculative_settings import Mode, SpeculativeSettings, given_sizes
from cortexstream.benchmarks.speculative_tasks import Task
from cortexstream.engine.speculative_config import DEFAULT_K, K_RANGE
from cortexstream.errors import InvalidArgumentError

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"
DEFAULT_PAIR = f"{DEFAULT_TARGET}:{DEFAULT_DRAFT}"


def parse_pair(text: str) -> tuple[str, str]:
    """`TARGET:DRAFT` as (target, draft): two different model names or paths, neither containing ':' or ','
    (',' would end the draft's path in its `draft:model=...` setting)."""
    parts = [p.strip() for p in str(text).split(":")]
    if len(parts) != 2 or not all(parts):
        raise InvalidArgumentError(f"--pair: {text!r} must be TARGET:DRAFT, two model names or paths without ':' "
                                   f"(e.g. {DEFAULT_PAIR})")
    if parts[0] == parts[1]:
        raise InvalidArgumentError(f"--pair: {text!r} names the same model as target and draft")
    if "," in parts[1]:
        raise InvalidArgumentError(f"--pair: draft {parts[1]!r} contains ',', which ends the model in a "
                                   "draft:model=... setting")
    return parts[0], parts[1]


@dataclass(frozen=True)
class PairSettings:
    """`target` decoded plainly and with `draft` drafting up to `k` tokens per verify pass (CortexStream:
    `speculative="draft:model=DRAFT,k=K"`, adaptive; mlx-lm: `num_draft_tokens=K` at concurrency 1)."""

    target: str = DEFAULT_TARGET
    draft: str = DEFAULT_DRAFT
    tasks: tuple[Task, ...] = (Task.EDIT, Task.QUOTE)
    modes: tuple[Mode, ...] = (Mode.GREEDY,)
    concurrency: tuple[int, ...] = (1,)
    k: int = DEFAULT_K
    max_tokens: int = 64
    rounds: int = 1
    temperature: float = 0.7

    def __post_init__(self) -> None:
        parse_pair(f"{self.target}:{self.draft}")
        # The sizes are checked (and tasks / modes canonicalised) exactly as a prompt-lookup run's.
        checked = SpeculativeSettings(models=(self.target,), tasks=self.tasks, modes=self.modes,
                                      concurrency=self.concurrency, max_tokens=self.max_tokens, rounds=self.rounds,
                                      temperature=self.temperature)
        object.__setattr__(self, "tasks", checked.tasks)
        object.__setattr__(self, "modes", checked.modes)
        k = self.k
        if isinstance(k, bool) or not isinstance(k, int) or not K_RANGE[0] <= k <= K_RANGE[1]:
            raise InvalidArgumentError(f"--draft-k: {k!r} must be an integer in {K_RANGE[0]}..{K_RANGE[1]}")

    @property
    def pair(self) -> str:
        return f"{self.target}:{self.draft}"

    def quick(self) -> "PairSettings":
        """A smoke run: edit, one request, 32 tokens, one round (loading the pair takes most of it)."""
        return replace(self, tasks=(Task.EDIT,), concurrency=(1,), max_tokens=32, rounds=1)


def pair_from_args(args: argparse.Namespace) -> PairSettings:
    """The settings of a `--pair` run: the sizes given, the rest `PairSettings`' defaults (`--quick`: its
    smoke-run sizes). --models and --speculative belong to prompt-lookup runs and are refused."""
    for option, value in (("--models", args.models), ("--speculative", args.speculative)):
        if value is not None:
            raise InvalidArgumentError(f"{option}: not with --pair (the pair names the models, and measures the "
                                       "draft model, not prompt lookup); run them separately")
    target, draft = parse_pair(args.pair)
    given = given_sizes(args)
    if args.draft_k is not None:
        given["k"] = args.draft_k
    settings = PairSettings(target=target, draft=draft, **given)
    return settings.quick() if args.quick else settings


def pair_command_line(s: PairSettings, quick: bool = False) -> str:
    """The command that measures `s` (--pair, then the options that differ from the defaults or --quick's)."""
    d, words = PairSettings(), ["cortexstream", "bench", "speculative", "--pair", s.pair]
    if quick:
        d, words = d.quick(), words + ["--quick"]
    for option, name, text in (
            ("--tasks", "tasks", ",".join(t.value for t in s.tasks)),
            ("--modes", "modes", ",".join(m.value for m in s.modes)),
            ("--concurrency", "concurrency", ",".join(map(str, s.concurrency))), ("--draft-k", "k", str(s.k)),
            ("--max-tokens", "max_tokens", str(s.max_tokens)), ("--rounds", "rounds", str(s.rounds)),
            ("--temperature", "temperature", f"{s.temperature:g}")):
        if getattr(s, name) != getattr(d, name):
            words += [option, text]
    return shlex.join(words)


__all__ = ["DEFAULT_DRAFT", "DEFAULT_PAIR", "DEFAULT_TARGET", "PairSettings", "pair_command_line", "pair_from_args",
           "parse_pair"]
