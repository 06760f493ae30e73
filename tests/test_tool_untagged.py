"""Untagged Hermes/Qwen tool calls: a call to an offered tool written as bare or fenced JSON, without
`<tool_call>` markers (what Qwen2.5-Coder-0.5B writes for most `auto` prompts). The recorded outputs below are
that model's own answers in `bench structured`."""

from __future__ import annotations

import json
from functools import partial

import pytest
from hypothesis import given, settings, strategies as st

from cortexstream.server.tool_calls import HermesToolParser, ToolFamily, parse_complete, parser_for
from tests.test_tool_parsers import chunkings, run

KNOWN = ("get_weather", "get_time", "f")
Known = partial(HermesToolParser, known_tools=KNOWN)

QWEN_FENCED = '```json\n{\n  "name": "get_time",\n  "arguments": {\n    "location": "Tokyo"\n  }\n}\n```'
QWEN_BARE = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'
QWEN_HALLUCINATED = ('```json\n{\n  "name": "get_articles",\n  "arguments": {\n    "category": "sourdough bread"'
                     '\n  }\n}\n```')  # a tool that was not offered: the model's text, not a call


def args(**kwargs):
    return json.dumps(kwargs, ensure_ascii=False)


CALLS = [
    (QWEN_FENCED, "", [("get_time", args(location="Tokyo"))]),
    (QWEN_BARE, "", [("get_weather", args(city="Oslo", unit="celsius"))]),
    ("\n" + QWEN_FENCED + "\n", "", [("get_time", args(location="Tokyo"))]),
    ('```\n{"name": "f", "parameters": {"x": 1}}\n```', "", [("f", args(x=1))]),
    ('[{"name": "f", "arguments": {}}, {"name": "get_time", "arguments": {"location": "Oslo"}}]', "",
     [("f", "{}"), ("get_time", args(location="Oslo"))]),
    # A bare call, then a tagged one, then text after them.
    ('{"name": "f", "arguments": {"a": "}"}}\n<tool_call>{"name": "f", "arguments": {}}</tool_call> done', " done",
     [("f", args(a="}")), ("f", "{}")]),
    # The completion ended before the closing fence: the call is whole, so it is read.
    ('```json\n{"name": "f", "arguments": {}}\n', "", [("f", "{}")]),
    ('```json\n{"name": "f", "arguments": {}}\n``` and more', " and more", [("f", "{}")]),
]


@pytest.mark.parametrize("text,content,calls", CALLS)
def test_untagged_calls_to_offered_tools_are_read_in_any_chunking(text, content, calls):
    for chunks in chunkings(text, seed=3):
        assert run(Known, chunks) == (content, calls), chunks


NOT_CALLS = [
    QWEN_HALLUCINATED,
    "Apple's stock price (AAPL) is $1,447.00.",
    '{"answer": 42}',  # a JSON answer, not a call
    '{"name": "get_weather"}',  # no arguments: an object that happens to have a name
    '{"name": "get_weather", "arguments": [1]}',
    '[{"name": "f", "arguments": {}}, {"name": "nope", "arguments": {}}]',  # not every element is a call
    '```python\nprint({"name": "f", "arguments": {}})\n```',
    '```json\n{"name": "f", "arguments": {}}\nand more\n```',  # text inside the fence after the object
    'Here it is: {"name": "f", "arguments": {}}',  # after text, braces are content
    '```json\n{"name": "f", "arguments": {}',  # unterminated
    "``",
    "```",
]


@pytest.mark.parametrize("text", NOT_CALLS)
def test_what_is_not_an_untagged_call_comes_back_exactly(text):
    for chunks in chunkings(text, seed=4):
        assert run(Known, chunks) == (text, []), chunks


def test_without_known_tools_only_tagged_calls_are_read():
    assert parse_complete(HermesToolParser, QWEN_FENCED) == (QWEN_FENCED, [])
    assert parse_complete(partial(parser_for, ToolFamily.HERMES), QWEN_BARE) == (QWEN_BARE, [])
    content, calls = parse_complete(partial(parser_for, ToolFamily.HERMES, known_tools=["get_weather"]), QWEN_BARE)
    assert content == "" and [c.name for c in calls] == ["get_weather"]


def test_plain_text_streams_at_once_and_a_possible_call_is_held():
    parser = Known()
    assert parser.feed("`") == []  # may open a fence
    assert [d.text for d in parser.feed("x")] == ["`x"]
    parser = Known()
    assert parser.feed('{"name": "f", ') == []
    assert [type(d).__name__ for d in parser.feed('"arguments": {}}')] == ["ToolCallStart", "ToolCallArguments"]


PIECES = ["```", "```json\n", "\n", " ", "{", "}", "[", "]", '"', ":", ",", '"name"', '"arguments"', '"f"',
          '"get_time"', '"x"', "{}", "<tool_call>", "</tool_call>", "text", "`"]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=40), cuts=st.lists(st.integers(0, 200), max_size=8))
def test_any_text_in_any_chunking_parses_as_a_whole_and_loses_nothing(pieces, cuts):
    text = "".join(pieces)
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    whole = run(Known, [text])
    assert run(Known, chunks) == whole
    if not whole[1]:
        assert whole[0] == text


def test_the_server_gives_its_parser_the_offered_tools(tiny):
    """A chat request's tools reach the parser the server makes for its completions (and only with auto)."""
    from cortexstream.server.agent_prepare import ToolSupport, prepare_turn
    from cortexstream.server.chat_translate import chat_to_spec
    from cortexstream.server.protocol import ChatCompletionRequest
    from tests.test_server_agent import TIME, WEATHER, hermes_tokenizer

    _, tokenizer = tiny
    hermes = hermes_tokenizer(tokenizer)
    support = ToolSupport.for_tokenizer(hermes)
    body = {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER, TIME]}
    turn = prepare_turn(chat_to_spec(ChatCompletionRequest(**body)), hermes, support)
    assert turn.tool_names == ("get_weather", "get_time")
    content, calls = parse_complete(partial(support.parser, turn.tool_names), QWEN_BARE)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "unit": "celsius"})]
    none = prepare_turn(chat_to_spec(ChatCompletionRequest(**body, tool_choice="none")), hermes, support)
    assert not none.parse_tools and none.tool_names == ()
