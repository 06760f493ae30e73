"""Needle in a heap: one rare, high-information fact (a random 6-digit code) hidden in ordinary prose.

Unlike passkey retrieval, whose haystack is one repeated filler paragraph (trivially compressible: every window
of it looks alike), the heap here is real Wikipedia text, so the needle competes with content that is also
informative, and a policy that merges or evicts by similarity gets no free ride. Per trial:

    TASK + heap[:cut] + " The vault code for <name> is <code>. " + heap[cut:] + "\\nWhat is the vault code for
    <name>? The vault code for <name> is"

The heap comes from `wiki_corpus.wiki_text()` tokens [HEAP_START, ...): after the ~20k tokens that
`bench quality` scores perplexity on and before token 65536 where the sidecar's training text starts
(`cortexstream.training.text`), so neither overlaps it. Scored per trial: exact match of the first number in a
greedy answer, and the teacher-forced NLL per token of " <code>" (a graded signal when a small model's greedy
answers are mostly wrong). As in passkey, the heap before the needle is computed once per (context, policy)
and forked per trial (depths ascending); the policy edits the cache after every `chunk` prompt tokens and every
answer token. `physical_tokens` is the cache's physical size when the question has been read.
"""

from __future__ import annotations

import re
import time
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from cortexstream.errors import InvalidArgumentError

HEAP_START = 32768
ANSWER_TOKENS = 10
TASK = "Read the following text carefully. One sentence in it holds a code you will be asked about.\n"
NAMES = ("Dr. Ellington", "Mrs. Okafor", "Captain Varga", "Professor Lindqvist", "Mr. Takahashi",
         "Judge Moreau", "Sister Agnes", "Colonel Brandt", "Ms. Castellanos", "Father Dunleavy")


def needle_sentence(name: str, code: str) -> str:
    return f" The vault code for {name} is {code}. "


def needle_question(name: str) -> str:
    return f"\nWhat is the vault code for {name}? The vault code for {name} is"


def needle_prompt(tokenizer: Any, heap: Sequence[int], total_tokens: int, depth: float, name: str,
                  code: str) -> tuple[list[int], int, list[int]]:
    """(prompt ids of about `total_tokens`, index where the needle starts, ids of the answer " <code>")."""
    encode = tokenizer.encode
    task = list(encode(TASK))
    needle = list(encode(needle_sentence(name, code)))
    question = list(encode(needle_question(name)))
    room = total_tokens - len(task) - len(needle) - len(question)
    if room < 16 or room > len(heap):
        raise InvalidArgumentError(f"needle: context {total_tokens} leaves {room} heap tokens "
                                   f"(need 16..{len(heap)})")
    body = list(heap[:room])
    cut = int(round(depth * room))
    prefix = task + body[:cut]
    return prefix + needle + body[cut:] + question, len(prefix), list(encode(f" {code}"))


def _answer_nll(model: Any, cache: list[Any], logits: mx.array, answer: list[int], context: int) -> float:
    from cortexstream.engine.policy_prompt_cache import apply_policy

    total = 0.0
    for i, token in enumerate(answer):
        total -= float((logits[0] - mx.logsumexp(logits[0]))[token].item())
        if i + 1 < len(answer):
            logits = model(mx.array([[token]], dtype=mx.uint32), cache=cache)[:, -1, :]
            mx.eval(logits)
            apply_policy(cache, context)
    return total / len(answer)


def needle_cell(model: Any, tokenizer: Any, heap: Sequence[int], context: int, policy: str, trials: int,
                chunk: int, seed: int) -> dict[str, Any]:
    """Every trial of one (context, policy) cell."""
    from cortexstream.kv.prompt_cache import make_prompt_cache
    from cortexstream.engine.policy_prompt_cache import attach_policy, fork_cache
    from cortexstream.evaluation.answering import feed_chunks, greedy_tokens

    rng = np.random.default_rng([seed, context])
    depths = np.linspace(0.1, 0.9, trials) if trials > 1 else np.array([0.5])
    codes = [str(c) for c in rng.integers(100000, 1000000, trials)]
    names = [NAMES[int(i)] for i in rng.integers(0, len(NAMES), trials)]
    budget_context = context + ANSWER_TOKENS
    base = make_prompt_cache(model, max_tokens=budget_context + chunk)
    state = attach_policy(base, policy)
    if state is not None:  # a query-aware policy (SnapKV) compresses once the question is in, not before
        state.expect_prompt_end(len(needle_prompt(tokenizer, heap, context, 0.5, names[0], codes[0])[0]))
    fed, results = 0, []
    for depth, code, name in zip(depths, codes, names):
        ids, needle_at, answer_ids = needle_prompt(tokenizer, heap, context, float(depth), name, code)
        feed_chunks(model, base, ids[fed:needle_at], chunk, budget_context)
        fed = needle_at
        trial = fork_cache(base)
        logits = feed_chunks(model, trial, ids[needle_at:], chunk, budget_context, logits=True)
        physical = int(trial[0].sequence.num_tokens)
        nll = _answer_nll(model, fork_cache(trial), logits, answer_ids, budget_context)
        answer = tokenizer.decode(greedy_tokens(model, tokenizer, trial, logits, budget_context, 6, ANSWER_TOKENS))
        found = re.search(r"\d+", answer)
        results.append({"depth": round(float(depth), 3), "code": code, "name": name, "answer": answer.strip(),
                        "correct": bool(found and found.group(0) == code), "answer_nll": round(nll, 4),
                        "physical_tokens": physical, "prompt_tokens": len(ids)})
    correct = sum(r["correct"] for r in results)
    return {"trials": trials, "correct": correct, "accuracy": correct / trials,
            "answer_nll": float(np.mean([r["answer_nll"] for r in results])),
            "physical_tokens": float(np.mean([r["physical_tokens"] for r in results])), "results": results}


def heap_tokens(tokenizer: Any, context: int) -> tuple[list[int], str]:
    """Heap text for contexts up to `context`: wiki_text tokens from HEAP_START (see module docstring)."""
    from cortexstream.evaluation.wiki_corpus import wiki_text

    text, source = wiki_text()
    ids = list(tokenizer.encode(text))
    if len(ids) < HEAP_START + context:
        raise InvalidArgumentError(f"needle: the heap text has {len(ids)} tokens, fewer than "
                                   f"{HEAP_START + context} (start {HEAP_START} + context {context})")
    return ids[HEAP_START:HEAP_START + context], f"{source}, tokens [{HEAP_START}, {HEAP_START + context})"


def run_needle(model: Any, tokenizer: Any, policies: list[str], *, contexts: Sequence[int] = (2048,),
               trials: int = 10, chunk: int = 64, seed: int = 0, heap: Sequence[int] | None = None,
               log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Needle retrieval for each (context, policy string): one dict per cell (accuracy, answer NLL per token,
    mean physical cache size, per-trial results, seconds). `heap`: token ids to use instead of wiki_text."""
    from cortexstream.policies import parse_policy

    if trials < 1 or chunk < 1 or not contexts:
        raise InvalidArgumentError(f"needle: trials {trials} and chunk {chunk} must be >= 1, contexts non-empty")
    for spec in policies:
        parse_policy(spec)  # bad strings fail before any work
    source = "given token ids"
    if heap is None:
        heap, source = heap_tokens(tokenizer, max(contexts))
    rows = []
    for context in contexts:
        for spec in policies:
            tic = time.perf_counter()
            cell = needle_cell(model, tokenizer, heap, int(context), spec, trials, chunk, seed)
            row = {"context": int(context), "policy": spec, "heap": source, "chunk": chunk, **cell,
                   "seconds": round(time.perf_counter() - tic, 1)}
            rows.append(row)
            log(f"needle context={context} {spec}: {cell['correct']}/{trials} correct, answer NLL "
                f"{cell['answer_nll']:.3f}/token, {cell['physical_tokens']:.0f} physical tokens "
                f"({row['seconds']:.0f} s)")
    return rows
