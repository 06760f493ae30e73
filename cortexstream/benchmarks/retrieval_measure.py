"""One cell of `bench retrieval`: every trial of a (task, placement, context) under one policy.

A trial is a conversation on one prompt cache (`engine.policy_prompt_cache`, a private arena):
- same_prompt: the document and the first question are one prompt; the policy is told where it ends
  (`expect_prompt_end`) before it is fed, so a query-aware policy compresses once the question is in;
- later_turn: the document alone is one prompt, told and fed (compressed at its end), then the question comes as a
  new prompt on the compressed cache, its end told before it is fed: the policy never saw it when it compressed.
A policy that reconstructs (KVzip) repeats each prompt (and the answer tokens before it) once the prompt is fed,
then compresses: in later_turn the document is compressed before the question exists.
Further questions (multiquery) follow the previous answer in the same conversation, each a new prompt. Prompts go
in chunks of `chunk` tokens, the policy acting after each chunk and each answer token; answers are greedy, at most
`ANSWER_TOKENS`, scored by exact match of their first number.

Shared prefix. The document's first `shared` tokens depend on no key, so consecutive trials whose prefixes extend
one another feed them once, on a base cache forked per trial (`fork_cache`: KV and policy state). The base takes
whole chunks only, so every trial is fed in the same chunks as from scratch, and the base is told the same first
prompt end as the trial (or the prefix ends before any query of the prompt's observation window), so a fork
evicts and votes exactly as a cache fed from the start would: sharing changes the cost, not the answers.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import mlx.core as mx

from cortexstream.evaluation.answering import feed_chunks, greedy_tokens
from cortexstream.benchmarks.retrieval_prompts import Trial
from cortexstream.benchmarks.retrieval_settings import Placement
from cortexstream.engine.policy_prompt_cache import attach_policy, fork_cache, policy_state_of
from cortexstream.engine.reconstruction_pass import reconstruct
from cortexstream.engine.reconstruction_prompt import reconstruction_prompt
from cortexstream.kv.prompt_cache import make_prompt_cache
from cortexstream.policies import KVPolicy, parse_policy

ANSWER_TOKENS = 10


def budget_context(context: int, questions: int) -> int:
    """What a budget fraction is a fraction of: the document and questions plus every answer's tokens."""
    return context + questions * ANSWER_TOKENS


def matches(answer: str, code: str) -> bool:
    found = re.search(r"\d+", answer)
    return bool(found and found.group(0) == code)


def physical_tokens(cache: list[Any]) -> int:
    return int(cache[0].sequence.num_tokens)


def run_trial(model: Any, tokenizer: Any, cache: list[Any], trial: Trial, placement: Placement, fed: int,
              context: int, chunk: int) -> dict[str, Any]:
    """The conversation of one trial on `cache`, which holds the document's first `fed` tokens."""
    state = policy_state_of(cache)
    position = fed
    # KVzip: after each prompt the model repeats what it has not repeated yet, then the cache is compressed
    repeat = reconstruction_prompt(tokenizer) if state is not None and state.reconstruction is not None else None
    unrepeated = list(trial.document[:fed])

    def prompt(ids: Sequence[int], logits: bool) -> mx.array | None:
        nonlocal position
        position += len(ids)
        if state is not None:
            state.expect_prompt_end(position)  # before feeding: nothing of this prompt is evicted blind
        out = feed_chunks(model, cache, list(ids), chunk, context, logits=logits)
        if repeat is not None:
            reconstruct(model, cache, unrepeated + list(ids), repeat, context)
            unrepeated.clear()
        return out

    pending: list[int] = list(trial.document[fed:])
    if placement is Placement.LATER_TURN:
        prompt(pending, logits=False)  # the document alone, compressed at its end
        pending = []
    answers, physical = [], []
    for question, code in zip(trial.questions, trial.answers):
        logits = prompt(pending + list(question), logits=True)
        physical.append(physical_tokens(cache))
        tokens = greedy_tokens(model, tokenizer, cache, logits, context, len(code), ANSWER_TOKENS)
        position += len(tokens) - 1
        unrepeated.extend(tokens[:-1])
        pending = tokens[-1:]  # the answer's last token opens the next prompt
        answers.append(tokenizer.decode(tokens).strip())
    right = [matches(a, c) for a, c in zip(answers, trial.answers)]
    return {"depth": round(trial.depth, 3), "codes": list(trial.answers), "answers": answers, "right": right,
            "correct": all(right), "physical_tokens": physical, "prompt_tokens": trial.tokens,
            "facts": [{"name": f.name, "code": f.code, "depth": round(f.depth, 3)} for f in trial.facts]}


class PrefixBase:
    """The shared-prefix cache of consecutive trials (see the module docstring)."""

    def __init__(self, model: Any, policy: KVPolicy | None, placement: Placement, context: int, chunk: int,
                 share: bool) -> None:
        self.model, self.policy, self.placement = model, policy, placement
        self.context, self.chunk, self.share = context, chunk, share
        window = policy.observation_window if policy is not None else None
        self.window = int(window) if window is not None else 0
        self.cache: list[Any] | None = None
        self.fed: tuple[int, ...] = ()
        self.end = 0

    def new_cache(self, end: int) -> list[Any]:
        cache = make_prompt_cache(self.model, max_tokens=self.context + self.chunk)
        state = attach_policy(cache, self.policy, self.model)
        if state is not None:
            state.expect_prompt_end(end)
        return cache

    def fork_for(self, trial: Trial) -> tuple[list[Any], int]:
        """A cache holding the longest whole-chunk prefix of `trial`'s shared tokens it can share, and its length."""
        end = trial.first_prompt_end(self.placement)
        usable = (trial.shared // self.chunk) * self.chunk if self.share else 0
        same_votes = end == self.end or usable + self.window <= min(end, self.end)
        if self.cache is None or not same_votes or trial.document[: len(self.fed)] != self.fed \
                or usable < len(self.fed):
            self.cache, self.fed, self.end = self.new_cache(end), (), end  # told this trial's very end
        if usable > len(self.fed):
            feed_chunks(self.model, self.cache, list(trial.document[len(self.fed):usable]), self.chunk,
                        self.context)
            self.fed = tuple(trial.document[:usable])
        if not self.fed:
            return self.new_cache(end), 0
        return fork_cache(self.cache), len(self.fed)


def run_cell(model: Any, tokenizer: Any, trials: Sequence[Trial], placement: Placement, spec: str,
             context: int, chunk: int, share_prefix: bool = True) -> dict[str, Any]:
    """Every trial of one cell under the policy `spec`; `context` is what budget fractions resolve against."""
    parsed = parse_policy(spec)
    policy = parsed if parsed.evicts else None
    base = PrefixBase(model, policy, placement, context, chunk, share_prefix)
    results = []
    for trial in trials:
        cache, fed = base.fork_for(trial)
        results.append(run_trial(model, tokenizer, cache, trial, placement, fed, context, chunk))
    correct = sum(r["correct"] for r in results)
    asked = len(trials[0].questions) if trials else 0
    per_question = [sum(r["right"][i] for r in results) for i in range(asked)]
    return {"family": parsed.name, "evicts": bool(parsed.evicts), "trials": len(results), "correct": correct, "accuracy": correct / max(len(results), 1),
            "question_correct": per_question,
            "question_accuracy": [c / max(len(results), 1) for c in per_question],
            "budget_tokens": policy.budget_tokens(context) if policy is not None else context,
            "physical_tokens": sum(r["physical_tokens"][0] for r in results) / max(len(results), 1),
            "shared_prefix": share_prefix, "results": results}


__all__ = ["ANSWER_TOKENS", "PrefixBase", "budget_context", "matches", "run_cell", "run_trial"]
