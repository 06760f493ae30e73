"""What one `bench retrieval` run measures: tasks, placements, policies at each budget, contexts and trials, checked
before anything loads (each error names the command-line option that sets the field), and the `--quick` sizes."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from enum import Enum

from cortexstream.errors import InvalidArgumentError

BUDGET_FIELD = "{b}"  # in a policy string: replaced by each budget fraction
DEFAULT_POLICIES = ("full", "streaming:budget={b}", "h2o:budget={b}", "snapkv:budget={b}", "kvzip:budget={b}",
                    "expected:budget={b}")


class Task(str, Enum):
    PASSKEY = "passkey"        # a 5-digit key in repeated filler
    NEEDLE = "needle"          # a 6-digit vault code for a name in Wikipedia text
    MULTIKEY = "multikey"      # three codes for three names, one of them asked
    MULTIQUERY = "multiquery"  # two codes for two names, both asked one after the other

    @property
    def questions(self) -> int:
        return 2 if self is Task.MULTIQUERY else 1


class Placement(str, Enum):
    SAME_PROMPT = "same_prompt"  # document + question in one prompt: compressed after the question is in
    LATER_TURN = "later_turn"    # the document compressed alone; the question arrives in the next turn


QUICK_TASKS = (Task.PASSKEY, Task.NEEDLE)  # --quick's tasks unless --tasks is given


@dataclass(frozen=True)
class PolicyCell:
    """One policy string of a run: `spec` as parsed, `template` as given, `budget` the fraction it was given
    (None for the full cache or a string without a fraction)."""

    template: str
    spec: str
    budget: float | None


@dataclass(frozen=True)
class RetrievalSettings:
    """`policies`: policy strings where `{b}` stands for each of `budgets` (a string without it runs once, e.g.
    the full cache); `contexts`: tokens of the document and all questions; `trials` per cell, depths 10% → 90%."""

    tasks: tuple[Task, ...] = tuple(Task)
    placements: tuple[Placement, ...] = tuple(Placement)
    policies: tuple[str, ...] = DEFAULT_POLICIES
    budgets: tuple[float, ...] = (0.1, 0.2, 0.33, 0.5)
    contexts: tuple[int, ...] = (2048, 4096)
    trials: int = 20
    chunk: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "tasks", _members(self.tasks, Task, "--tasks"))
        object.__setattr__(self, "placements", _members(self.placements, Placement, "--placements"))
        if not self.budgets or any(isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b)
                                   or not 0 < b <= 1 for b in self.budgets):
            raise InvalidArgumentError(f"--budgets: {list(self.budgets)} must be fractions in (0, 1]")
        if not self.contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 256 for c in self.contexts):
            raise InvalidArgumentError(f"--contexts: {list(self.contexts)} must be integers >= 256")
        for option in ("trials", "chunk"):
            value = getattr(self, option)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgumentError(f"--{option}: {value!r} must be an integer >= 1")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise InvalidArgumentError(f"--seed: {self.seed!r} must be an integer >= 0")
        if not self.policies:
            raise InvalidArgumentError("--policies: no policy given")
        self.policy_cells()  # every string parses; none twice

    def policy_cells(self) -> list[PolicyCell]:
        """Every policy string of the run, `{b}` replaced by each budget (in the order given, budget by budget)."""
        from cortexstream.policies import parse_policy

        cells: list[PolicyCell] = []
        for template in self.policies:
            budgets = self.budgets if BUDGET_FIELD in template else (None,)
            for budget in budgets:
                spec = template if budget is None else template.replace(BUDGET_FIELD, f"{budget:g}")
                try:
                    policy = parse_policy(spec)
                except InvalidArgumentError as exc:
                    raise InvalidArgumentError(f"--policies: {exc}") from None
                given = getattr(policy, "budget", None)
                if budget is None and isinstance(given, float):
                    budget = given  # a fixed fraction ("h2o:budget=0.2") still belongs to its budget
                if any(c.spec == spec for c in cells):
                    raise InvalidArgumentError(f"--policies: {spec!r} is given twice")
                cells.append(PolicyCell(template, spec, budget))
        return cells

    def cells(self) -> list[tuple[Task, Placement, int, PolicyCell]]:
        """Every cell the run measures, in the order it measures them: task, placement, context, policy."""
        policy_cells = self.policy_cells()
        return [(task, placement, context, p) for task in self.tasks for placement in self.placements
                for context in self.contexts for p in policy_cells]

    def quick(self) -> "RetrievalSettings":
        """A smoke run of a few minutes: passkey and needle, both placements, 512 tokens, 3 trials, budget 20%."""
        return replace(self, tasks=QUICK_TASKS, placements=tuple(Placement), budgets=(0.2,), contexts=(512,),
                       trials=3)


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
    """The sizes as options (defaults: `RetrievalSettings`). --tasks and --placements default to None, so that
    `--quick` can tell them given (kept) from not given (its own)."""
    d = RetrievalSettings()
    parser.add_argument("--tasks", default=None,
                        help=f"comma-separated among {', '.join(t.value for t in Task)} (default: all; with --quick: "
                             f"{','.join(t.value for t in QUICK_TASKS)})")
    parser.add_argument("--placements", default=None,
                        help=f"comma-separated among {', '.join(p.value for p in Placement)} (default: all)")
    parser.add_argument("--policies", default=";".join(d.policies),
                        help="semicolon-separated policy strings; {b} is replaced by each budget (a string "
                             "without it runs once)")
    parser.add_argument("--budgets", default=",".join(f"{b:g}" for b in d.budgets),
                        help="budget fractions of the context + answer tokens")
    parser.add_argument("--contexts", default=",".join(map(str, d.contexts)),
                        help="tokens of the document and its questions")
    parser.add_argument("--trials", type=int, default=d.trials, help="trials per cell (depths 10%% → 90%%)")
    parser.add_argument("--chunk", type=int, default=d.chunk, help="prompt tokens per pass (the policy acts "
                        "after each)")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the keys, codes and names")


def from_args(args: argparse.Namespace) -> RetrievalSettings:
    """The settings the options ask for (`--quick`: its smoke-run sizes, but the --tasks and --placements given)."""
    from cortexstream.benchmarks.common import policy_specs
    from cortexstream.cli.number_lists import fraction_list, int_list, name_list

    given = {name: name_list(text) for name, text in (("tasks", args.tasks), ("placements", args.placements))
             if text is not None}
    settings = RetrievalSettings(
        policies=policy_specs(args.policies), budgets=fraction_list(args.budgets, "--budgets"),
        contexts=int_list(args.contexts, "--contexts", 256), trials=args.trials, chunk=args.chunk, seed=args.seed,
        **given)
    return replace(settings.quick(), **given) if args.quick else settings


__all__ = ["BUDGET_FIELD", "DEFAULT_POLICIES", "QUICK_TASKS", "Placement", "PolicyCell", "RetrievalSettings",
           "Task", "add_arguments", "from_args"]
