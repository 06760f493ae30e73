"""`bench tools` over HTTP: a case set asked of one running server with the `openai` SDK, each answer scored.

Any OpenAI-compatible server: CortexStream, mlx_lm.server or a peer. An HTTP error is an outcome of its own
(`http_<status>`, with the server's message kept), a request with no answer (timeout, closed connection) is
`no_answer`: neither stops the run, since what a server does with a request it cannot serve is what is measured.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from cortexstream.benchmarks.structured_measure import Verdict, judge, unfenced
from cortexstream.benchmarks.structured_schemas import SchemaCase
from cortexstream.benchmarks.tool_cases import ToolCase, score

KEPT = 500  # characters of an answer or an error message kept in the results


def client_for(url: str, timeout: float) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=timeout)


def _failure(exc: Exception) -> tuple[str, str]:
    """(outcome, message) for a request the server did not answer with a completion."""
    import openai

    if isinstance(exc, openai.APIStatusError):
        return f"http_{exc.status_code}", str(exc)[:KEPT]
    if isinstance(exc, openai.APIError):
        return "no_answer", f"{type(exc).__name__}: {exc}"[:KEPT]
    raise exc


def _summary(answers: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    outcomes = [a["outcome"] for a in answers]
    reasons = [str(a["finish_reason"]) for a in answers if a["finish_reason"] is not None]
    return {"cases": len(answers), "outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))},
            "finish_reasons": {r: reasons.count(r) for r in sorted(set(reasons))}, "seconds": round(seconds, 2),
            "answers": answers}


def _ask_all(ask: Callable[[Any], dict[str, Any]], cases: Sequence[Any], workers: int, desc: str,
             progress: bool) -> dict[str, Any]:
    from tqdm import tqdm

    tic = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        answers = list(tqdm(pool.map(ask, cases), total=len(cases), unit="req", leave=False, desc=desc,
                            disable=not progress))
    return _summary(answers, time.perf_counter() - tic)


def ask_tools(client: Any, model: str, cases: Sequence[ToolCase], tool_choice: str, *, max_tokens: int,
              workers: int, progress: bool = True, desc: str = "tools") -> dict[str, Any]:
    """Every case with `tool_choice`, greedy, one call per answer (`parallel_tool_calls=false`)."""
    def ask(case: ToolCase) -> dict[str, Any]:
        try:
            out = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": case.prompt}], tools=case.tools(),
                tool_choice=tool_choice, parallel_tool_calls=False, temperature=0.0, max_tokens=max_tokens)
        except Exception as exc:  # noqa: BLE001 - _failure re-raises what is not an API error
            outcome, message = _failure(exc)
            return {"prompt": case.prompt, "expected": case.expected, "all_tools": case.all_tools,
                    "finish_reason": None, "calls": 0, "called": None, "arguments": None, "outcome": outcome,
                    "content": message}
        return score(case, out.choices[0].message, out.choices[0].finish_reason)

    row = _ask_all(ask, cases, workers, desc, progress)
    row["correct"] = row["outcomes"].get("correct", 0)
    return row


def ask_schemas(client: Any, model: str, cases: Sequence[SchemaCase], *, max_tokens: int, workers: int,
                progress: bool = True, desc: str = "json_schema") -> dict[str, Any]:
    """Every case with `response_format` json_schema (strict), greedy; the answer judged against its schema."""
    def ask(case: SchemaCase) -> dict[str, Any]:
        fmt = {"type": "json_schema", "json_schema": {"name": case.name, "schema": case.schema, "strict": True}}
        try:
            out = client.chat.completions.create(model=model, messages=case.messages(), response_format=fmt,
                                                 temperature=0.0, max_tokens=max_tokens)
        except Exception as exc:  # noqa: BLE001 - _failure re-raises what is not an API error
            outcome, message = _failure(exc)
            return {"schema": case.name, "outcome": outcome, "finish_reason": None, "content": message}
        content = out.choices[0].message.content or ""
        verdict = judge(content, case.schema)
        lenient = judge(unfenced(content), case.schema)
        return {"schema": case.name, "outcome": verdict.value, "valid_unfenced": lenient is Verdict.VALID,
                "finish_reason": out.choices[0].finish_reason, "content": content[:KEPT]}

    row = _ask_all(ask, cases, workers, desc, progress)
    row["valid"] = row["outcomes"].get(Verdict.VALID.value, 0)
    return row


__all__ = ["ask_schemas", "ask_tools", "client_for"]
