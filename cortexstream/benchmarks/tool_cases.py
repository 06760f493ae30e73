"""The prompts and tools of `bench tools`, how one answer is scored, and how a case set is asked of a server.

Each prompt clearly needs one of six tools. A case counts when the response holds a call (`message.tool_calls`,
OpenAI format) to the right function whose arguments parse as JSON and validate against that tool's parameter
schema; no call, the wrong function, arguments that fail, an HTTP error and the finish reasons are counted too, and
so is a text answer that is the right call written as bare JSON that the server did not read as a call
("untagged_call": no client sees a call). Half the cases offer only the tool they need, half offer all six.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from cortexstream.benchmarks.structured_schemas import CURRENCY, DATE, CLOCK, choice, obj, pattern, real, text, whole

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


__all__ = ["TOOLS", "TOOL_CASES", "TOOL_CHOICES", "ToolCase", "renders_tools", "score"]
