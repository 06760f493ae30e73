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
