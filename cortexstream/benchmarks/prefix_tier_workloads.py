"""The prompts of `bench prefix-tier`, all cut from one stream of real text (Wikipedia articles,
`evaluation.wiki_corpus`) so that no two documents, tool descriptions or tool outputs share a sentence.

- restart: one document of about `doc_tokens` tokens per round, asked about in one user message;
- agent: `bench serve`-style sessions (`serve_workloads.Session`: each turn resends the conversation so far with
  the replies the server gave). A session's system prompt is an agent preamble plus JSON tool definitions whose
  descriptions are real text (its own, about `system_tokens`); each turn is a tool output of real text and a short
  user request. The arena for CortexStream is sized from the sessions' final prompts, estimated with replies at
  their `max_tokens`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any, Sequence

from cortexstream.benchmarks.prefix_tier_settings import AgentShape
from cortexstream.benchmarks.serve_workloads import Session, Turn, WorkloadSpec
from cortexstream.errors import InvalidArgumentError

# Tokens a ChatML template adds around one message ("<|im_start|>role\n" ... "<|im_end|>\n": 5), rounded up; the
# arena estimate only needs an upper bound.
MESSAGE_OVERHEAD = 6
DOC_QUESTION = "What is this document about? Answer in one sentence."
TOOL_NAMES = ("search_web", "read_file", "run_sql", "fetch_url", "list_directory", "get_calendar", "send_email",
              "query_wiki", "lookup_weather", "translate_text", "summarize_page", "get_stock_price")
TOOL_PARAMETERS = ({"query": "string"}, {"path": "string", "max_bytes": "integer"}, {"url": "string"},
                   {"sql": "string", "limit": "integer"}, {"text": "string", "target_language": "string"})
ASKS = ("What does this tell us? Keep it short.", "Summarize the key facts in two sentences.",
        "Which detail matters most for the task?", "Is anything here surprising?",
        "What should the next tool call be?", "Note the names and dates mentioned.")


class TextSource:
    """Consecutive runs of a token stream as text: each `take` continues where the last one ended."""

    def __init__(self, tokenizer: Any, ids: Sequence[int], origin: str) -> None:
        self.tokenizer = tokenizer
        self.ids = list(ids)
        self.origin = origin  # what the text is, for the results
        self.cursor = 0

    def take(self, num_tokens: int) -> str:
        if self.cursor + num_tokens > len(self.ids):
            raise InvalidArgumentError(f"text: {num_tokens} more tokens wanted at {self.cursor}, the text has "
                                       f"{len(self.ids)} (fewer rounds or a shorter --doc-tokens)")
        text = self.tokenizer.decode(self.ids[self.cursor:self.cursor + num_tokens])
        self.cursor += num_tokens
        return text

    def count(self, text: str) -> int:
        """`text`'s length in tokens."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def wiki_source(tokenizer: Any, num_tokens: int) -> TextSource:
    """The first `num_tokens` tokens (or more) of the Wikipedia text as a `TextSource`."""
    from cortexstream.evaluation.wiki_corpus import wiki_text

    text, origin = wiki_text()
    chars = 8 * num_tokens  # English prose: about 4-5 characters a token; encode only what is needed
    ids = tokenizer.encode(text[:chars], add_special_tokens=False)
    if len(ids) < num_tokens:
        ids = tokenizer.encode(text, add_special_tokens=False)
    return TextSource(tokenizer, ids, origin)


def tokens_needed(rounds: int, doc_tokens: int, shape: AgentShape) -> int:
    """An upper bound on the text one run takes: a document per round, one agent workload (reused each round)."""
    per_session = shape.system_tokens + shape.turns * shape.tool_tokens[1]
    return rounds * doc_tokens + shape.sessions * per_session + 1024


def document_messages(source: TextSource, doc_tokens: int) -> list[dict[str, str]]:
    """The restart part's request: the next `doc_tokens` tokens of text as a document, and a question."""
    return [{"role": "user", "content": f"Read this document.\n\n{source.take(doc_tokens)}\n\n{DOC_QUESTION}"}]


def warmup_messages(index: int) -> list[dict[str, str]]:
    """A short request that shares no prefix block with any document (its own system prompt), so a fresh server's
    one-time start-up costs are not counted in the first timed request. `index` makes each server's different."""
    return [{"role": "system", "content": f"Warm-up request number {index}. Reply briefly."},
            {"role": "user", "content": "Say hello."}]


def system_prompt(source: TextSource, rng: random.Random, index: int, target_tokens: int) -> tuple[str, list[str]]:
    """An agent preamble and JSON tool definitions with real-text descriptions, about `target_tokens` long, and
    the tools' names."""
    header = (f"You are agent {index + 1}, working through a research task with tools. To call a tool, reply with "
              'one JSON object {"tool": NAME, "arguments": {...}}. Available tools:\n')
    tools: list[str] = []
    names: list[str] = []
    order = rng.sample(TOOL_NAMES, len(TOOL_NAMES))
    while True:
        name = order[len(tools) % len(order)] + ("" if len(tools) < len(order) else f"_{len(tools)}")
        params = rng.choice(TOOL_PARAMETERS)
        definition: dict[str, Any] = {
            "name": name, "description": "",
            "parameters": {"type": "object", "properties": {k: {"type": v} for k, v in params.items()},
                           "required": [next(iter(params))]}}
        left = target_tokens - source.count(header + "\n".join([*tools, json.dumps(definition)]))
        if left < 16 and names:
            return header + "\n".join(tools), names
        words = source.take(max(16, min(left, rng.randint(40, 80)))).split()  # one line: no escaped newlines
        while True:  # JSON escapes make a description longer than its text: trim the last one to the target
            definition["description"] = " ".join(words)
            over = source.count(header + "\n".join([*tools, json.dumps(definition)])) - target_tokens
            if over <= 0 or len(words) <= 8:
                break
            words = words[:max(8, len(words) - max(1, over // 2))]
        tools.append(json.dumps(definition))
        names.append(name)


@dataclass(frozen=True)
class AgentWorkload:
    """The sessions and their sizes in tokens: `system_tokens[s]`, `tool_tokens[s][t]`, and `turn_prompt_tokens`
    [s][t], each turn's prompt estimated with every earlier reply at `max_tokens` (an upper bound)."""

    spec: WorkloadSpec
    max_tokens: int
    system_tokens: tuple[int, ...]
    tool_tokens: tuple[tuple[int, ...], ...]
    turn_prompt_tokens: tuple[tuple[int, ...], ...]

    @property
    def final_tokens(self) -> tuple[int, ...]:
        """Each session's KV at its end: its last prompt and reply."""
        return tuple(turns[-1] + self.max_tokens for turns in self.turn_prompt_tokens)

    def kv_tokens(self, fraction: float, block_size: int = 16) -> int:
        """An arena of `fraction` of all sessions' final KV, at least the largest session and some growth room,
        in whole blocks."""
        want = max(math.ceil(fraction * sum(self.final_tokens)), max(self.final_tokens) + 16 * block_size)
        return -(-want // block_size) * block_size


def agent_workload(source: TextSource, shape: AgentShape, seed: int) -> AgentWorkload:
    """`shape.sessions` sessions, all starting at once, each with its own system prompt and tool outputs."""
    rng = random.Random(seed)
    sessions, system_sizes, tool_sizes, prompt_sizes = [], [], [], []
    for index in range(shape.sessions):
        system, names = system_prompt(source, rng, index, shape.system_tokens)
        turns, tools, prompts = [], [], []
        total = source.count(system) + MESSAGE_OVERHEAD
        for _ in range(shape.turns):
            output = source.take(rng.randint(*shape.tool_tokens))
            text = f"Output of {rng.choice(names)}:\n{output}\n\n{rng.choice(ASKS)}"
            turns.append(Turn(text, shape.max_tokens))
            tools.append(source.count(output))
            total += source.count(text) + MESSAGE_OVERHEAD
            prompts.append(total + MESSAGE_OVERHEAD)  # and the assistant's generation prompt
            total += shape.max_tokens + MESSAGE_OVERHEAD  # the reply, resent by the next turn
        sessions.append(Session(0.0, turns, system))
        system_sizes.append(source.count(system))
        tool_sizes.append(tuple(tools))
        prompt_sizes.append(tuple(prompts))
    low, high = shape.tool_tokens
    spec = WorkloadSpec("agent", f"{shape.sessions} concurrent sessions x {shape.turns} turns; each session its own "
                        f"~{shape.system_tokens}-token system prompt with tool definitions; every turn resends the "
                        f"conversation with a {low}-{high}-token tool output (Wikipedia text) and a short user "
                        f"request appended, up to {shape.max_tokens} new tokens, greedy", sessions)
    return AgentWorkload(spec, shape.max_tokens, tuple(system_sizes), tuple(tool_sizes), tuple(prompt_sizes))


__all__ = ["AgentWorkload", "TextSource", "agent_workload", "document_messages", "system_prompt", "tokens_needed",
           "warmup_messages", "wiki_source"]
