"""The trials of `bench retrieval`: a document (task text + haystack with the needles in it) and its questions.

- passkey: `passkey.passkey_prompt` (a 5-digit key in repeated filler), its question split off;
- needle / multikey / multiquery: `evaluation.needle`'s vault-code sentences in Wikipedia text (its TASK, NAMES and
  sentence forms, so one fact asked once is exactly `needle_prompt`): one fact; three facts for three names with
  one asked; two facts both asked, the second after the first answer.
Every trial's document and questions together are `context` tokens. A trial's depth (10% → 90% over a cell) places
the fact asked first; multikey's two other facts lie at seeded random depths, multiquery's second fact 40% of the
depth range away (wrapping within 10-90%). Everything before the first needle depends on no key: `shared` tokens.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from cortexstream.benchmarks.passkey import QUESTION as PASSKEY_QUESTION
from cortexstream.benchmarks.passkey import passkey_prompt
from cortexstream.benchmarks.retrieval_settings import Placement, Task
from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.needle import NAMES, needle_question, needle_sentence
from cortexstream.evaluation.needle import TASK as VAULT_TASK

MULTIKEY_FACTS = 3
MULTIQUERY_OFFSET = 0.4  # of the 10-90% depth range, between multiquery's two facts


@dataclass(frozen=True)
class Fact:
    name: str  # "" for a passkey
    code: str
    depth: float


@dataclass(frozen=True)
class Trial:
    """`questions[i]` is answered by `answers[i]`; the first prompt is `document` (+ `questions[0]` when the
    question shares the prompt); `shared`: leading document tokens that depend on no key or name."""

    document: tuple[int, ...]
    questions: tuple[tuple[int, ...], ...]
    answers: tuple[str, ...]
    shared: int
    depth: float
    facts: tuple[Fact, ...]

    @property
    def tokens(self) -> int:
        return len(self.document) + sum(len(q) for q in self.questions)

    def first_prompt_end(self, placement: Placement) -> int:
        return len(self.document) + (len(self.questions[0]) if placement is Placement.SAME_PROMPT else 0)


def passkey_trial(tokenizer: Any, context: int, depth: float, key: str) -> Trial:
    ids, needle_at = passkey_prompt(tokenizer, context, depth, key)
    question = list(tokenizer.encode(PASSKEY_QUESTION))
    if len(ids) != context or needle_at < 1 or ids[-len(question):] != question:
        raise InvalidArgumentError(f"--contexts: {context} tokens leave no room for the passkey prompt's filler")
    return Trial(tuple(ids[: -len(question)]), (tuple(question),), (key,), needle_at, depth,
                 (Fact("", key, depth),))


def vault_trial(tokenizer: Any, heap: Sequence[int], context: int, facts: Sequence[Fact],
                asked: Sequence[int]) -> Trial:
    """Task text, `heap` tokens with each fact's sentence at its depth, and the questions for `facts[i]` for i in
    `asked` (in that order); document + questions = `context` tokens."""
    encode = tokenizer.encode
    task = list(encode(VAULT_TASK))
    needles = [list(encode(needle_sentence(f.name, f.code))) for f in facts]
    questions = [tuple(encode(needle_question(facts[i].name))) for i in asked]
    room = context - len(task) - sum(map(len, needles)) - sum(map(len, questions))
    if room < 16 or room > len(heap):
        raise InvalidArgumentError(f"--contexts: {context} tokens leave {room} heap tokens for {len(facts)} facts "
                                   f"(need 16..{len(heap)})")
    cuts = [int(round(f.depth * room)) for f in facts]
    document, at = list(task), 0
    for cut, needle in sorted(zip(cuts, needles), key=lambda pair: pair[0]):
        document += list(heap[at:cut]) + needle
        at = cut
    document += list(heap[at:room])
    return Trial(tuple(document), tuple(questions), tuple(facts[i].code for i in asked), len(task) + min(cuts),
                 facts[asked[0]].depth, tuple(facts))


def cell_rng(seed: int, task: Task, placement: Placement, context: int) -> np.random.Generator:
    """The one generator of a (task, placement, context): every policy there gets the same trials."""
    return np.random.default_rng([seed, zlib.crc32(task.value.encode()), zlib.crc32(placement.value.encode()),
                                  context])


def codes(rng: np.random.Generator, count: int) -> list[str]:
    return [str(c) for c in rng.choice(900000, count, replace=False) + 100000]


def build_trials(task: Task, tokenizer: Any, heap: Sequence[int] | None, context: int, trials: int,
                 rng: np.random.Generator) -> list[Trial]:
    """`trials` trials of `task`, depths evenly spaced 10% → 90% (one trial: 50%)."""
    depths = [float(d) for d in (np.linspace(0.1, 0.9, trials) if trials > 1 else [0.5])]
    if task is Task.PASSKEY:
        return [passkey_trial(tokenizer, context, d, str(k)) for d, k in zip(depths, rng.integers(10000, 100000,
                                                                                                  trials))]
    if heap is None:
        raise InvalidArgumentError(f"{task.value}: the heap text is needed")
    out = []
    for depth in depths:
        count = {Task.NEEDLE: 1, Task.MULTIKEY: MULTIKEY_FACTS, Task.MULTIQUERY: 2}[task]
        names = [NAMES[int(i)] for i in rng.choice(len(NAMES), count, replace=False)]
        depth_of = [depth]
        if task is Task.MULTIKEY:
            depth_of += [float(d) for d in rng.uniform(0.05, 0.95, count - 1)]
        elif task is Task.MULTIQUERY:
            depth_of.append(0.1 + (depth - 0.1 + MULTIQUERY_OFFSET * 0.8) % 0.8)
        facts = [Fact(n, c, d) for n, c, d in zip(names, codes(rng, count), depth_of)]
        asked = (0, 1) if task is Task.MULTIQUERY else (0,)
        out.append(vault_trial(tokenizer, heap, context, facts, asked))
    return out


__all__ = ["Fact", "Trial", "build_trials", "cell_rng", "passkey_trial", "vault_trial"]
