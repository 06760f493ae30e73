"""Validity of structured output for `bench structured`: requests through an `Engine`, each output judged.

`run_requests` keeps `concurrency` requests in the engine at once (1: one at a time), each with its own prompt,
`response_format` and seed, and returns every completion's text, tokens and finish reason. `validity_cell` runs a
schema set that way and judges each output: it counts only when `json.loads` parses the whole text AND
`jsonschema.validate` accepts it. A completion cut at max_tokens (finish 'length') is a miss and counted as such. For
the unconstrained baseline the count after removing a Markdown code fence (```json ... ```) is given beside it, as
what a lenient client would accept.
"""

from __future__ import annotations

import enum
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Sequence

from cortexstream.benchmarks.structured_schemas import SchemaCase
from cortexstream.benchmarks.structured_settings import Decoding
from cortexstream.engine.finish_reason import FinishReason

TEXT_KEPT = 2000  # characters of each output kept in the results
_FENCE = re.compile(r"^\s*```[a-zA-Z]*\s*\n(.*?)\n?```\s*$", re.DOTALL)


class Verdict(str, enum.Enum):
    VALID = "valid"  # parses and matches the schema
    INVALID = "invalid"  # parses, but the schema refuses it
    UNPARSEABLE = "unparseable"  # not one JSON value


@dataclass(frozen=True)
class Completion:
    text: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason | None


def judge(text: str, schema: dict[str, Any]) -> Verdict:
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return Verdict.UNPARSEABLE
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return Verdict.INVALID
    return Verdict.VALID


def unfenced(text: str) -> str:
    """`text` without a surrounding Markdown code fence (itself when it has none)."""
    match = _FENCE.match(text)
    return match.group(1) if match else text


def run_requests(engine: Any, prompts: Sequence[Any], formats: Sequence[Any], *, max_tokens: int | Sequence[int],
                 temperature: float, seed: int, concurrency: int, bar: Any = None) -> list[Completion]:
    """Every prompt through `engine`, `concurrency` at a time (a new one enters as one ends). Request i gets
    `formats[i]` as its response_format (None: unconstrained), `max_tokens` (or `max_tokens[i]`) and, when
    sampled, seed + i."""
    count = len(prompts)
    limits = [max_tokens] * count if isinstance(max_tokens, int) else list(max_tokens)
    if len(formats) != count or len(limits) != count:
        raise ValueError("run_requests: prompts, formats and max_tokens differ in length")
    texts: list[list[str]] = [[] for _ in range(count)]
    tokens: list[list[int]] = [[] for _ in range(count)]
    reasons: list[FinishReason | None] = [None] * count
    live: dict[str, int] = {}
    queue = list(range(count))[::-1]
    while queue or live:
        while queue and len(live) < concurrency:
            i = queue.pop()
            request = engine.add_request(prompts[i], max_tokens=limits[i], temperature=temperature,
                                         seed=seed + i if temperature > 0 else None, response_format=formats[i])
            live[request] = i
        for out in engine.step():
            i = live.get(out.request_id)
            if i is None:
                continue
            texts[i].append(out.text)
            if out.token is not None:
                tokens[i].append(out.token)
            if out.finish_reason is not None:
                reasons[i] = out.finish_reason
                del live[out.request_id]
                if bar is not None:
                    bar.update(1)
    return [Completion("".join(t), tuple(k), r) for t, k, r in zip(texts, tokens, reasons)]


def validity_cell(engine: Any, model_name: str, cases: Sequence[SchemaCase], prompts: Sequence[list[int]], *,
                  decoding: Decoding, constrained: bool, concurrency: int, max_tokens: int, temperature: float,
                  seed: int, progress: bool = True) -> tuple[dict[str, Any], list[Completion]]:
    """One row of the validity table (and the completions, for the mask timing)."""
    from tqdm import tqdm

    temp = temperature if decoding is Decoding.SAMPLED else 0.0
    label = f"{model_name} {decoding.value} c={concurrency} {'constrained' if constrained else 'unconstrained'}"
    formats = [case.schema if constrained else None for case in cases]
    with tqdm(total=len(cases), desc=label, unit="req", disable=not progress, leave=False) as bar:
        tic = time.perf_counter()
        outs = run_requests(engine, prompts, formats, max_tokens=max_tokens, temperature=temp, seed=seed,
                            concurrency=concurrency, bar=bar)
        seconds = time.perf_counter() - tic
    rows = []
    for case, out in zip(cases, outs):
        verdict = judge(out.text, case.schema)
        rows.append({"schema": case.name, "verdict": verdict.value, "finish_reason": str(out.finish_reason),
                     "tokens": len(out.tokens), "text": out.text[:TEXT_KEPT],
                     "unfenced_verdict": judge(unfenced(out.text), case.schema).value})
    reasons = [r["finish_reason"] for r in rows]
    valid = sum(r["verdict"] == Verdict.VALID for r in rows)
    generated = sum(r["tokens"] for r in rows)
    row = {"model": model_name, "decoding": decoding.value, "temperature": temp, "concurrency": concurrency,
           "constrained": constrained, "schemas": len(cases), "valid": valid, "valid_fraction": valid / len(rows),
           "parsed": sum(r["verdict"] != Verdict.UNPARSEABLE for r in rows),
           "valid_unfenced": sum(r["unfenced_verdict"] == Verdict.VALID for r in rows),
           "length_finishes": reasons.count(FinishReason.LENGTH.value),
           "finish_reasons": {reason: reasons.count(reason) for reason in sorted(set(reasons))},
           "tokens": generated, "seconds": round(seconds, 3),
           "outputs": rows}
    return row, outs


__all__ = ["Completion", "Verdict", "judge", "run_requests", "unfenced", "validity_cell"]
