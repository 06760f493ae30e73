"""What one `bench prefix-tier` run measures: which parts, how many rounds, the document and agent workload sizes,
checked before anything is converted or started (each error names the command-line option that sets the field),
and the `--quick` sizes."""

from __future__ import annotations

import argparse
import math
import shlex
from dataclasses import dataclass, field
from enum import Enum

from cortexstream.cli.number_lists import name_list
from cortexstream.errors import InvalidArgumentError


class Part(str, Enum):
    RESTART = "restart"  # TTFT of a repeated document: cold, warm in RAM, after a restart from the disk tier
    AGENT = "agent"      # concurrent agent sessions, arena too small for all of them, against mlx_lm.server


class AgentSystem(str, Enum):
    """The servers of the agent part, run one after another."""

    CORTEXSTREAM_DISK = "cortexstream_disk"  # cortexstream serve --kv-disk DIR (a fresh DIR per run)
    CORTEXSTREAM_RAM = "cortexstream_ram"    # cortexstream serve, prefix cache in RAM only (the reference)
    MLX_LM = "mlx_lm"                        # mlx_lm.server with its default LRU prompt cache

    @property
    def label(self) -> str:
        return {AgentSystem.CORTEXSTREAM_DISK: "cortexstream --kv-disk", AgentSystem.CORTEXSTREAM_RAM:
                "cortexstream (RAM only)", AgentSystem.MLX_LM: "mlx_lm.server"}[self]


def _positive_int(value: object, option: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{option}: {value!r} must be an integer >= {minimum}")


@dataclass(frozen=True)
class AgentShape:
    """The agent workload: `sessions` concurrent sessions of `turns` turns. Each session has its own system prompt
    with tool definitions (about `system_tokens`); every turn appends a tool output of `tool_tokens` (low, high)
    tokens of real text and a short user message, and asks for up to `max_tokens` new tokens. CortexStream's arena
    holds `arena_fraction` of the sessions' final total (at least the largest session)."""

    sessions: int = 8
    turns: int = 10
    system_tokens: int = 600
    tool_tokens: tuple[int, int] = (150, 250)
    max_tokens: int = 48
    arena_fraction: float = 1 / 3

    def __post_init__(self) -> None:
        _positive_int(self.sessions, "--sessions")
        _positive_int(self.turns, "--turns")
        _positive_int(self.system_tokens, "system_tokens", 64)
        _positive_int(self.max_tokens, "max_tokens")
        low, high = self.tool_tokens
        if isinstance(low, bool) or not isinstance(low, int) or not isinstance(high, int) or not 16 <= low <= high:
            raise InvalidArgumentError(f"tool_tokens: {self.tool_tokens!r} must be (low, high) with 16 <= low <= high")
        if not isinstance(self.arena_fraction, float) or not math.isfinite(self.arena_fraction) or \
                not 0 < self.arena_fraction <= 1:
            raise InvalidArgumentError(f"arena_fraction: {self.arena_fraction!r} must be a fraction in (0, 1]")


FULL_ROUNDS, QUICK_ROUNDS = 3, 1
FULL_DOC_TOKENS, QUICK_DOC_TOKENS = 4096, 1024
# A smoke run: shorter prompts and replies too, so that it takes about a minute on two cores.
QUICK_AGENT = AgentShape(sessions=2, turns=3, system_tokens=300, tool_tokens=(60, 100), max_tokens=16)


@dataclass(frozen=True)
class PrefixTierSettings:
    """`doc_tokens`: the restart part's document (one per round, each round a fresh disk directory); `rounds`:
    how often each part is measured (medians reported; the agent part alternates the order of its servers)."""

    parts: tuple[Part, ...] = tuple(Part)
    rounds: int = FULL_ROUNDS
    doc_tokens: int = FULL_DOC_TOKENS
    agent: AgentShape = field(default_factory=AgentShape)
    answer_tokens: int = 8  # the restart part's max_tokens: TTFT is what it times
    seed: int = 0
    timeout: float = 1800.0
    quick: bool = False

    def __post_init__(self) -> None:
        parts = tuple(self.parts)
        if not parts or len(set(parts)) != len(parts):
            raise InvalidArgumentError(f"--parts: {[str(p) for p in parts]} must name each part at most once, "
                                       "at least one")
        try:
            object.__setattr__(self, "parts", tuple(Part(p) for p in parts))
        except ValueError:
            bad = [p for p in parts if p not in {m.value for m in Part}]
            raise InvalidArgumentError(f"--parts: {bad} are not among {', '.join(p.value for p in Part)}") from None
        _positive_int(self.rounds, "--rounds")
        _positive_int(self.doc_tokens, "--doc-tokens", 64)
        _positive_int(self.answer_tokens, "answer_tokens")
        _positive_int(self.seed, "--seed", 0)
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or \
                not math.isfinite(self.timeout) or self.timeout <= 0:
            raise InvalidArgumentError(f"--timeout: {self.timeout!r} must be seconds > 0")

    @property
    def name(self) -> str:
        """The results' file stem."""
        return "prefix_tier_quick" if self.quick else "prefix_tier"

    def command(self, model: str | None) -> str:
        """The command that measures these settings (options that differ from the defaults, or --quick's)."""
        default = from_values(quick=self.quick)
        words = ["cortexstream", "bench", "prefix-tier"] + (["--quick"] if self.quick else [])
        if self.parts != default.parts:
            words += ["--parts", ",".join(p.value for p in self.parts)]
        for option in ("rounds", "doc_tokens", "seed", "timeout"):
            value = getattr(self, option)
            if value != getattr(default, option):
                words += [f"--{option.replace('_', '-')}", str(value) if isinstance(value, int) else f"{value:g}"]
        return shlex.join(words + (["--model", model] if model else []))


def from_values(*, quick: bool, parts: str | None = None, rounds: int | None = None, doc_tokens: int | None = None,
                seed: int = 0, timeout: float = 1800.0) -> PrefixTierSettings:
    """Settings from option values; None takes the full run's default or, with `quick`, the quick one."""
    return PrefixTierSettings(
        parts=name_list(parts) if parts is not None else tuple(Part),
        rounds=rounds if rounds is not None else (QUICK_ROUNDS if quick else FULL_ROUNDS),
        doc_tokens=doc_tokens if doc_tokens is not None else (QUICK_DOC_TOKENS if quick else FULL_DOC_TOKENS),
        agent=QUICK_AGENT if quick else AgentShape(), seed=seed, timeout=timeout, quick=quick)


def from_args(args: argparse.Namespace) -> PrefixTierSettings:
    return from_values(quick=args.quick, parts=args.parts, rounds=args.rounds, doc_tokens=args.doc_tokens,
                       seed=args.seed, timeout=args.timeout)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=None, help=f"comma-separated, from {', '.join(p.value for p in Part)} "
                        "(default: both)")
    parser.add_argument("--rounds", type=int, default=None,
                        help=f"rounds of each part, medians reported (default {FULL_ROUNDS}; --quick {QUICK_ROUNDS})")
    parser.add_argument("--doc-tokens", type=int, default=None,
                        help=f"the restart part's document length in tokens (default {FULL_DOC_TOKENS}; --quick "
                        f"{QUICK_DOC_TOKENS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0,
                        help="seconds per request of the restart part and per server run of the agent part")
    parser.add_argument("--quick", action="store_true",
                        help=f"smoke run: {QUICK_ROUNDS} round, a {QUICK_DOC_TOKENS}-token document, "
                        f"{QUICK_AGENT.sessions} sessions x {QUICK_AGENT.turns} turns with shorter prompts "
                        "(prefix_tier_quick.*)")


__all__ = ["AgentShape", "AgentSystem", "Part", "PrefixTierSettings", "add_arguments", "from_args", "from_values"]
