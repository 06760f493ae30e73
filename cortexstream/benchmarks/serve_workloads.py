"""The serving benchmark's workloads: seeded, built from token counts with the model's own tokenizer.

A workload is a list of `Session`s. A session is one user: it starts at `start` seconds and sends its turns one
after another, each turn resending the whole conversation so far (system prompt, earlier user turns and the
replies that server actually gave).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

# Plain English words; prompts are random runs of them cut to an exact token count.
_WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education river mountain garden music light"
).split()


@dataclass(frozen=True)
class Turn:
    user_text: str
    max_tokens: int


@dataclass
class Session:
    start: float  # seconds after the workload starts
    turns: list[Turn]
    system: str | None = None


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    description: str
    sessions: list[Session] = field(default_factory=list)


class PromptMaker:
    """Random word text of an exact token length under `tokenizer` (a Hugging Face tokenizer)."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)

    def text(self, num_tokens: int) -> str:
        words = " ".join(self.rng.choice(_WORDS) for _ in range(num_tokens + 8))
        ids = self.tokenizer.encode(words, add_special_tokens=False)[:num_tokens]
        return self.tokenizer.decode(ids)


def shared_system_chat(tokenizer: Any, seed: int, users: int = 32, system_tokens: int = 500,
                       user_tokens: tuple[int, int] = (30, 300), new_tokens: tuple[int, int] = (64, 256),
                       rate: float = 8.0) -> WorkloadSpec:
    """Workload 1: one shared system prompt, one turn per user, Poisson arrivals at `rate` requests/s."""
    maker = PromptMaker(tokenizer, seed)
    system = maker.text(system_tokens)
    clock, sessions = 0.0, []
    for _ in range(users):
        sessions.append(Session(clock, [Turn(maker.text(maker.rng.randint(*user_tokens)),
                                             maker.rng.randint(*new_tokens))], system))
        clock += maker.rng.expovariate(rate)
    return WorkloadSpec("shared_system_chat",
                        f"{users} users, shared {system_tokens}-token system prompt, user turns {user_tokens[0]}-"
                        f"{user_tokens[1]} tokens, {new_tokens[0]}-{new_tokens[1]} new tokens, Poisson arrivals at "
                        f"{rate}/s", sessions)


def multi_turn(tokenizer: Any, seed: int, users: int = 8, turns: int = 4, user_tokens: tuple[int, int] = (30, 120),
               new_tokens: tuple[int, int] = (64, 128)) -> WorkloadSpec:
    """Workload 2: users holding conversations; every turn resends the whole conversation."""
    maker = PromptMaker(tokenizer, seed)
    sessions = [Session(0.0, [Turn(maker.text(maker.rng.randint(*user_tokens)), maker.rng.randint(*new_tokens))
                              for _ in range(turns)]) for _ in range(users)]
    return WorkloadSpec("multi_turn", f"{users} users x {turns} turns, each turn resends the conversation "
                        f"(user turns {user_tokens[0]}-{user_tokens[1]} tokens, {new_tokens[0]}-{new_tokens[1]} "
                        "new tokens)", sessions)


def unrelated(tokenizer: Any, seed: int, prompts: int = 16, prompt_tokens: tuple[int, int] = (200, 400),
              new_tokens: int = 128) -> WorkloadSpec:
    """Workload 3: unrelated random prompts (nothing shared), all at once."""
    maker = PromptMaker(tokenizer, seed)
    sessions = [Session(0.0, [Turn(maker.text(maker.rng.randint(*prompt_tokens)), new_tokens)])
                for _ in range(prompts)]
    return WorkloadSpec("unrelated", f"{prompts} unrelated prompts of {prompt_tokens[0]}-{prompt_tokens[1]} tokens "
                        f"at once, {new_tokens} new tokens", sessions)


MEMORY_BOUND = "memory_bound"


def memory_bound(tokenizer: Any, seed: int, sessions: int = 32, history_tokens: int = 1500, turns: int = 4,
                 user_tokens: tuple[int, int] = (20, 60), new_tokens: tuple[int, int] = (64, 128)) -> WorkloadSpec:
    """Workload 4: long conversations, all at once, so the KV arena rather than the batch limit decides how many
    run together. Each session opens with its own `history_tokens`-token system text (standing for a system
    prompt plus earlier history: nothing is shared between sessions, so no prefix cache can stretch the
    budget), then `turns` user turns, each resending the conversation so far."""
    for name, value in (("sessions", sessions), ("history_tokens", history_tokens), ("turns", turns)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {value!r} must be an integer >= 1")
    for name, (low, high) in (("user_tokens", user_tokens), ("new_tokens", new_tokens)):
        if not 1 <= low <= high:
            raise ValueError(f"{name}: {(low, high)!r} must be (low, high) with 1 <= low <= high")
    maker = PromptMaker(tokenizer, seed)
    out = []
    for _ in range(sessions):
        history = maker.text(history_tokens)
        out.append(Session(0.0, [Turn(maker.text(maker.rng.randint(*user_tokens)), maker.rng.randint(*new_tokens))
                                 for _ in range(turns)], history))
    return WorkloadSpec(MEMORY_BOUND, f"{sessions} conversations at once, each its own {history_tokens}-token "
                        f"system+history text, {turns} turns (user turns {user_tokens[0]}-{user_tokens[1]} tokens, "
                        f"{new_tokens[0]}-{new_tokens[1]} new tokens), every turn resending the conversation",
                        out)


def memory_bound_workload(tokenizer: Any, seed: int, quick: bool, sessions: int | None,
                          history_tokens: int) -> WorkloadSpec:
    """The memory-bound workload as `bench serve` runs it; `quick`: short conversations (a smoke run)."""
    if quick:
        return memory_bound(tokenizer, seed + 3, sessions or 3, history_tokens=60, turns=2, user_tokens=(10, 20),
                            new_tokens=(16, 32))
    return memory_bound(tokenizer, seed + 3, sessions or 32, history_tokens=history_tokens)


WORKLOAD_NAMES = ("shared_system_chat", "multi_turn", "unrelated", MEMORY_BOUND)


def build_workloads(tokenizer: Any, seed: int, quick: bool, rate: float) -> list[WorkloadSpec]:
    if quick:  # a smoke run: seconds, not a measurement
        return [
            shared_system_chat(tokenizer, seed, users=3, system_tokens=60, user_tokens=(10, 20),
                               new_tokens=(4, 8), rate=rate),
            multi_turn(tokenizer, seed + 1, users=2, turns=2, user_tokens=(10, 20), new_tokens=(4, 8)),
            unrelated(tokenizer, seed + 2, prompts=3, prompt_tokens=(20, 40), new_tokens=8),
        ]
    return [shared_system_chat(tokenizer, seed, rate=rate), multi_turn(tokenizer, seed + 1),
            unrelated(tokenizer, seed + 2)]
