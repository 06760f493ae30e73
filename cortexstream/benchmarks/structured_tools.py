"""Tool calls for `bench structured`: prompts that each clearly need one tool, sent through the real HTTP server
(`cortexstream.server.create_app` under uvicorn on 127.0.0.1, an ephemeral port) with the `openai` SDK.

A case counts when the response holds a call (`message.tool_calls`, OpenAI format) to the right function whose
arguments parse as JSON and validate against that tool's parameter schema; no call, the wrong function, arguments
that fail, and the finish reasons are counted too, and so is a text answer that is the right call written as bare
JSON without the template's call markers ("untagged_call": no parser reads it, so no client sees a call). Half the cases offer only the tool they need, half offer all
six. Run for `tool_choice` "auto" (the text is parsed for calls) and "required" (a grammar makes the completion a
call), greedy, one call per answer (`parallel_tool_calls=false`). Only models whose chat template renders tools can
take part: the server refuses tools for the others.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Sequence

from cortexstream.benchmarks.structured_schemas import CURRENCY, DATE, CLOCK, choice, obj, pattern, real, text, whole

MODEL_NAME = "bench"
TOOL_CHOICES = ("auto", "required")


def _tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS: dict[str, dict[str, Any]] = {t["function"]["name"]: t for t in (
    _tool("get_weather", "Current weather in a city",
          obj({"city": text(40)}, {"unit": choice("celsius", "fahrenheit")})),
    _tool("get_time", "Current local time in a city or time zone", obj({"location": text(40)})),
    _tool("convert_currency", "Convert an amount of money from one currency to another",
          obj({"amount": real(0, 1_000_000_000), "from_currency": CURRENCY, "to_currency": CURRENCY})),
    _tool("web_search", "Search the web", obj({"query": text(100)}, {"max_results": whole(1, 10)})),
    _tool("create_event", "Add an event to the user's calendar",
          obj({"title": text(60), "date": DATE}, {"start": CLOCK, "duration_minutes": whole(5, 480)})),
    _tool("get_stock_price", "Latest price of a stock by its ticker symbol",
          obj({"symbol": pattern(r"^[A-Z]{1,5}$")})),
)}


@dataclass(frozen=True)
class ToolCase:
    prompt: str
    expected: str  # the function the prompt needs
    all_tools: bool  # offer every tool (else only the expected one)

    def __post_init__(self) -> None:
        if self.expected not in TOOLS:
            raise ValueError(f"ToolCase: unknown tool {self.expected!r}")

    def tools(self) -> list[dict[str, Any]]:
        return list(TOOLS.values()) if self.all_tools else [TOOLS[self.expected]]


_PROMPTS = {
    "get_weather": ["What's the weather like in Oslo right now?", "Is it raining in London at the moment?",
                    "How hot is it in Cairo today, in fahrenheit?", "Tell me the current temperature in Sydney.",
                    "Do I need a coat in Toronto right now? Check the weather."],
    "get_time": ["What time is it in Tokyo?", "What's the current local time in New York?",
                 "Tell me the time in Berlin right now.", "Is it morning or evening in Sydney right now? Check "
                 "the local time.", "What is the local time in Mumbai?"],
    "convert_currency": ["Convert 100 US dollars to euros.", "How many Japanese yen is 50 British pounds?",
                         "What is 250 EUR in CHF?", "Convert 1200 Canadian dollars into US dollars.",
                         "How much is 75 euros in Swedish krona?"],
    "web_search": ["Search the web for the latest news about the James Webb telescope.",
                   "Find articles about sourdough bread recipes.", "Look up who won the 2022 World Cup final.",
                   "Search for reviews of the Framework laptop.", "Find the population of Iceland online."],
    "create_event": ["Add a dentist appointment to my calendar on 2025-03-14 at 09:30.",
                     "Schedule a team meeting on 2025-06-02 at 14:00 for 60 minutes.",
                     "Put 'Mom's birthday' in my calendar for 2025-08-21.",
                     "Create a calendar event called Gym on 2025-01-07 at 18:00.",
                     "Book 'Project review' on my calendar for 2025-11-30 at 10:00, 45 minutes long."],
    "get_stock_price": ["What's Apple's stock price (AAPL)?", "How is MSFT trading right now?",
                        "Get me the latest price of Tesla stock, ticker TSLA.", "What does NVDA cost per share?",
                        "Check the current price of Amazon shares (AMZN)."],
}
TOOL_CASES: tuple[ToolCase, ...] = tuple(ToolCase(prompt, name, all_tools=i % 2 == 1)
                                         for name, prompts in _PROMPTS.items() for i, prompt in enumerate(prompts))


def renders_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders tools in a call format the server parses."""
    from cortexstream.server.agent_prepare import ToolSupport

    return ToolSupport.for_tokenizer(tokenizer).family is not None


class LiveServer:
    """`create_app(model, tokenizer)` served by uvicorn on 127.0.0.1 (an ephemeral port) in a daemon thread."""

    def __init__(self, model: Any, tokenizer: Any, kv_tokens: int, max_num_seqs: int) -> None:
        import uvicorn

        from cortexstream.server import ServerConfig, create_app

        app = create_app(model, tokenizer, ServerConfig(model_name=MODEL_NAME, kv_tokens=kv_tokens,
                                                        max_num_seqs=max_num_seqs))
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = ""

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.time() + 60
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("bench structured: the server did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _untagged_call(content: str, expected: str) -> bool:
    """Whether a text answer is the right call written as bare JSON (no call markers, so no parser reads it)."""
    from cortexstream.benchmarks.structured_measure import unfenced

    try:
        value = json.loads(unfenced(content))
    except ValueError:
        return False
    return isinstance(value, dict) and value.get("name") == expected and "arguments" in value


def score(case: ToolCase, message: Any, finish_reason: str) -> dict[str, Any]:
    """What one answer did: the call made (if any) and whether it is the right, schema-valid call."""
    import jsonschema

    calls = list(message.tool_calls or [])
    row = {"prompt": case.prompt, "expected": case.expected, "all_tools": case.all_tools,
           "finish_reason": finish_reason, "calls": len(calls), "called": None, "arguments": None,
           "outcome": "no_call", "content": (message.content or "")[:500]}
    if not calls:
        if _untagged_call(row["content"], case.expected):
            row["outcome"] = "untagged_call"
        return row
    call = calls[0]
    row.update(called=call.function.name, arguments=call.function.arguments[:500])
    if call.function.name != case.expected:
        row["outcome"] = "wrong_function"
        return row
    try:
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[case.expected]["function"]["parameters"])
    except (ValueError, jsonschema.ValidationError):
        row["outcome"] = "invalid_arguments"
        return row
    row["outcome"] = "correct" if len(calls) == 1 else "extra_calls"
    return row


def tool_rows(model: Any, tokenizer: Any, model_name: str, cases: Sequence[ToolCase], *, max_tokens: int,
              workers: int, progress: bool = True) -> list[dict[str, Any]]:
    """One row per tool_choice: the fraction of `cases` answered with the right, schema-valid call."""
    import openai
    from tqdm import tqdm

    rows = []
    with LiveServer(model, tokenizer, kv_tokens=workers * (2048 + max_tokens), max_num_seqs=workers) as live:
        client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=600)
        for tool_choice in TOOL_CHOICES:
            def ask(case: ToolCase, tool_choice: str = tool_choice) -> dict[str, Any]:
                out = client.chat.completions.create(
                    model=MODEL_NAME, messages=[{"role": "user", "content": case.prompt}], tools=case.tools(),
                    tool_choice=tool_choice, parallel_tool_calls=False, temperature=0.0, max_tokens=max_tokens)
                return score(case, out.choices[0].message, out.choices[0].finish_reason)

            tic = time.perf_counter()
            with ThreadPoolExecutor(workers) as pool:
                answers = list(tqdm(pool.map(ask, cases), total=len(cases), unit="req", leave=False,
                                    desc=f"{model_name} tools {tool_choice}", disable=not progress))
            outcomes = [a["outcome"] for a in answers]
            reasons = [a["finish_reason"] for a in answers]
            correct = outcomes.count("correct")
            rows.append({"model": model_name, "tool_choice": tool_choice, "cases": len(cases),
                         "correct": correct, "correct_fraction": correct / len(cases),
                         "outcomes": {o: outcomes.count(o) for o in sorted(set(outcomes))},
                         "finish_reasons": {r: reasons.count(r) for r in sorted(set(reasons))},
                         "seconds": round(time.perf_counter() - tic, 2), "answers": answers})
    return rows


__all__ = ["TOOLS", "TOOL_CASES", "TOOL_CHOICES", "LiveServer", "ToolCase", "renders_tools", "score", "tool_rows"]
