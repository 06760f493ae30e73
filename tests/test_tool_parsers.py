"""Tool-call parsers (Hermes/Qwen, Llama 3, Mistral) on model-style outputs, streamed in every way, and the
registry that picks them from a chat template."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from hypothesis import given, settings, strategies as st

from cortexstream.server.tool_calls import (HermesToolParser, Llama3ToolParser, MistralToolParser, ToolFamily,
                                            ToolParserRegistry, default_registry, detect_family,
                                            mistral_call_id, parse_complete, parser_for)
from cortexstream.server.tool_types import TextDelta, ToolCallArguments, ToolCallStart

PARSERS = (HermesToolParser, Llama3ToolParser, MistralToolParser)


def counting_ids():
    counter = itertools.count()
    return lambda: f"id{next(counter)}"


def run(parser_cls, chunks):
    """Feed `chunks` one by one; the deltas, checked for consistency, and the parser's (text, calls)."""
    parser = parser_cls(id_factory=counting_ids())
    deltas = [d for chunk in chunks for d in parser.feed(chunk)] + parser.finish()
    text = "".join(d.text for d in deltas if isinstance(d, TextDelta))
    starts = [d for d in deltas if isinstance(d, ToolCallStart)]
    assert [s.index for s in starts] == list(range(len(parser.calls)))
    for start, call in zip(starts, parser.calls):
        assert (start.id, start.name) == (call.id, call.name)
        fragments = [d.fragment for d in deltas if isinstance(d, ToolCallArguments) and d.index == start.index]
        assert "".join(fragments) == call.arguments
        assert deltas.index(start) < min(i for i, d in enumerate(deltas)
                                         if isinstance(d, ToolCallArguments) and d.index == start.index)
    assert text == parser.text
    return text, [(c.name, c.arguments) for c in parser.calls]


def chunkings(text, seed):
    """Char by char, every split into two, and random chunkings."""
    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def args(**kwargs):
    return json.dumps(kwargs, ensure_ascii=False)


SAMPLES = [
    # Qwen 2.5: text, then two calls in a row (the second's arguments a JSON string), Unicode kept.
    (HermesToolParser,
     'Je vérifie la météo.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"tz\\": \\"Europe/Zurich\\"}"}\n</tool_call>',
     "Je vérifie la météo.\n", [("get_weather", args(city="Zürich", unit="c")), ("get_time", args(tz="Europe/Zurich"))]),
    # A call whose argument contains the closing marker and braces; content after it.
    (HermesToolParser,
     '<tool_call>\n{"name": "write", "arguments": {"text": "a } </tool_call> {b"}}\n</tool_call>\nDone.',
     "\nDone.", [("write", args(text="a } </tool_call> {b"))]),
    # No arguments at all, compact spacing.
    (HermesToolParser, '<tool_call>{"name":"now"}</tool_call>', "", [("now", "{}")]),
    # Llama 3.1 with <|python_tag|>; Llama 3.2 bare, two calls separated by ';' and a newline.
    (Llama3ToolParser, '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "", [("get_weather", args(city="Paris"))]),
    (Llama3ToolParser,
     ' {"name": "search", "parameters": {"q": "mlx"}}; {"name": "get_time", "arguments": {}}\n'
     '{"name": "sum", "parameters": {"xs": [1, 2.5, -3]}}', "",
     [("search", args(q="mlx")), ("get_time", "{}"), ("sum", args(xs=[1, 2.5, -3]))]),
    (Llama3ToolParser, '{"name": "lookup", "parameters": {"id": 7}}\nThe lookup is running.',
     "\nThe lookup is running.", [("lookup", args(id=7))]),
    (Llama3ToolParser, "It is sunny in Paris today.", "It is sunny in Paris today.", []),
    # Mistral v0.3 array form, several calls; the newer name form, with and without [CALL_ID].
    (MistralToolParser,
     '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": '
     '{"tz": "CET"}}]', "", [("get_weather", args(city="Paris")), ("get_time", args(tz="CET"))]),
    (MistralToolParser,
     'Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}',
     "Let me look.", [("get_weather", args(city="Paris")), ("get_time", "{}")]),
    (MistralToolParser, "Bonjour [TOOL_CALLS is not a marker", "Bonjour [TOOL_CALLS is not a marker", []),
]


@pytest.mark.parametrize("parser_cls,text,want_text,want_calls", SAMPLES)
def test_samples_parse_the_same_however_they_are_chunked(parser_cls, text, want_text, want_calls):
    assert run(parser_cls, [text]) == (want_text, want_calls)
    content, calls = parse_complete(parser_cls, text)
    assert content == want_text and [(c.name, c.arguments) for c in calls] == want_calls
    for chunks in chunkings(text, seed=len(text)):
        assert run(parser_cls, chunks) == (want_text, want_calls), chunks


def test_model_written_call_id_is_kept_and_mistral_ids_fit_its_template():
    _, calls = parse_complete(MistralToolParser, "[TOOL_CALLS]f[CALL_ID]a1B2c3D4e[ARGS]{}[TOOL_CALLS]g[ARGS]{}")
    assert calls[0].id == "a1B2c3D4e"
    assert len(calls[1].id) == 9 and calls[1].id.isalnum()
    assert len({mistral_call_id() for _ in range(50)}) == 50


MALFORMED = [
    (HermesToolParser, 'Checking <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'),  # unterminated
    (HermesToolParser, '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'),
    (HermesToolParser, '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>'),  # no name
    (HermesToolParser, '<tool_call>\n{"name": 3, "arguments": {}}\n</tool_call>'),
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>'),
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>'),
    (HermesToolParser, '<tool_call>\nget_weather(city="Paris")\n</tool_call>'),
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": {}} and more\n</tool_call>'),
    (HermesToolParser, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_cal'),
    (Llama3ToolParser, '{"name": "get_weather", "parameters": {"city": "Par'),
    (Llama3ToolParser, '{"name": "get_weather", "parameters": {"city": Paris}}'),
    (Llama3ToolParser, '{"name": "get_weather"}'),  # an object without arguments is an answer in JSON
    (Llama3ToolParser, '{"name": ["x"], "parameters": {}}'),
    (Llama3ToolParser, '<|python_tag|>brave_search.call(query="mlx")'),
    (Llama3ToolParser, '<|python_tag|>'),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}'),
    (MistralToolParser, '[TOOL_CALLS] [{"arguments": {"city": "Paris"}}]'),
    (MistralToolParser, '[TOOL_CALLS] []'),
    (MistralToolParser, '[TOOL_CALLS] [{"name": "f", "arguments": 5}]'),
    (MistralToolParser, '[TOOL_CALLS]get_weather[ARGS]city=Paris'),
    (MistralToolParser, '[TOOL_CALLS]get_weather[ARGS]{"city": }'),
    (MistralToolParser, '[TOOL_CALLS]get weather[ARGS]{}'),
    (MistralToolParser, '[TOOL_CALLS]get_weather'),
    (MistralToolParser, '[TOOL_CALLS]'),
]


@pytest.mark.parametrize("parser_cls,text", MALFORMED)
def test_malformed_calls_come_back_as_their_text(parser_cls, text):
    for chunks in chunkings(text, seed=1):
        assert run(parser_cls, chunks) == (text, []), chunks


def test_a_malformed_call_does_not_hide_the_calls_after_it():
    text = ('<tool_call>\n{"name": "a", "arguments": {"x": 1}\n</tool_call>\n'  # a brace short
            '<tool_call>\n{"name": "b", "arguments": {"y": 2}}\n</tool_call>')
    content, calls = run(HermesToolParser, [text])
    assert content == text[:text.index("</tool_call>") + len("</tool_call>") + 1]
    assert calls == [("b", args(y=2))]


def test_content_streams_at_once_and_only_a_possible_marker_is_held_back():
    hermes = HermesToolParser()
    assert hermes.feed("Hello") == [TextDelta("Hello")]
    assert hermes.feed(" wor<tool") == [TextDelta(" wor")]
    assert hermes.feed("box>") == [TextDelta("<toolbox>")]
    assert hermes.feed("<tool_call>\n") == []
    deltas = hermes.feed('{"name": "f", "arguments": {}}\n</tool_call>')  # the call, before finish()
    assert [type(d) for d in deltas] == [ToolCallStart, ToolCallArguments]
    mistral = MistralToolParser()
    assert mistral.feed("See [TOOL_") == [TextDelta("See ")]
    llama = Llama3ToolParser()
    assert llama.feed("  ") == []  # the message may still turn out to be a call
    assert llama.feed("It is") == [TextDelta("  It is")]
    assert llama.feed(' {"a": 1}') == [TextDelta(' {"a": 1}')]  # past the start, braces are content


def test_whitespace_is_kept_exactly_without_calls_and_dropped_around_them():
    assert parse_complete(HermesToolParser, "\n  answer \n\n")[0] == "\n  answer \n\n"
    assert parse_complete(HermesToolParser, "\n\n")[0] == "\n\n"
    call = '<tool_call>{"name": "f"}</tool_call>'
    assert parse_complete(HermesToolParser, f"\n{call}\n\n{call}\n")[0] == ""


def test_a_parser_is_used_once():
    parser = HermesToolParser()
    parser.finish()
    with pytest.raises(RuntimeError, match="feed"):
        parser.feed("x")
    with pytest.raises(RuntimeError, match="finish"):
        parser.finish()


# --- properties -------------------------------------------------------------------------------------------------
PIECES = ["<tool_call>", "</tool_call>", "<tool_", "</tool", "<|python_tag|>", "<|pyth", "[TOOL_CALLS]", "[TOOL",
          "[ARGS]", "[CALL_ID]", "{", "}", "[", "]", '"', "\\", ":", ",", ";", " ", "\n", '"name"', '"arguments"',
          '"parameters"', '"f"', "f", "{}", "é", "Paris", "1"]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=40), parser_index=st.integers(0, 2),
       cuts=st.lists(st.integers(0, 200), max_size=8))
def test_any_text_in_any_chunking_parses_as_a_whole_and_loses_nothing(pieces, parser_index, cuts):
    parser_cls = PARSERS[parser_index]
    text = "".join(pieces)
    points = sorted({c % (len(text) + 1) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]
    whole = run(parser_cls, [text])
    assert run(parser_cls, chunks) == whole
    if not whole[1]:
        assert whole[0] == text


VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=12),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                    max_size=3), max_leaves=8)
CALLS = st.lists(st.tuples(st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}", fullmatch=True),
                           st.dictionaries(st.text(max_size=8), VALUES, max_size=4)), min_size=1, max_size=3)
PLAIN = st.text(st.characters(blacklist_characters="<[{"), max_size=20)


def render(family, calls, gaps):
    if family is ToolFamily.HERMES:
        blocks = [f'<tool_call>\n{json.dumps({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls]
        return "".join(gap + block for gap, block in zip(gaps, blocks)) + gaps[-1]
    if family is ToolFamily.MISTRAL:
        blocks = [f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a, ensure_ascii=False)}" for n, a in calls]
        return "".join(gap + block for gap, block in zip(gaps, blocks)) + gaps[-1]
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls) + gaps[-1]


@settings(max_examples=200, deadline=None)
@given(calls=CALLS, gaps=st.lists(PLAIN, min_size=4, max_size=4), cut_seed=st.integers(0, 10**6),
       family=st.sampled_from([ToolFamily.HERMES, ToolFamily.LLAMA3, ToolFamily.MISTRAL]))
def test_written_calls_parse_back_exactly(calls, gaps, cut_seed, family):
    gaps = gaps[:len(calls)] + [gaps[-1]]
    text = render(family, calls, gaps)
    if family is ToolFamily.LLAMA3:  # content only after the calls; a trailing ';' separates, like whitespace
        kept = [gaps[-1]] if gaps[-1].strip().strip(";").strip() else []
    else:
        kept = [gap for gap in gaps if gap.strip()]
    want = ("".join(kept), [(n, json.dumps(a, ensure_ascii=False)) for n, a in calls])
    parser_cls = type(parser_for(family))
    assert run(parser_cls, [text]) == want
    chunks = list(chunkings(text, cut_seed))
    assert run(parser_cls, chunks[0]) == want and run(parser_cls, chunks[-1]) == want


# --- registry ---------------------------------------------------------------------------------------------------
QWEN = ('{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}{{- "\\n</tools>\\n\\nFor each '
        'function call, return a json object with function name and arguments within <tool_call></tool_call> '
        'XML tags" }}<|im_start|>')
LLAMA31 = ('{%- if builtin_tools is defined or tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}'
           '<|start_header_id|>{{- "<|python_tag|>" + tool_call.name + ".call(" }}')
LLAMA32 = ('<|start_header_id|>user<|end_header_id|>{{- "Given the following functions, please respond with a JSON '
           'for a function call with its proper arguments" }}{{- \'"parameters": \' }}{%- for tool in tools %}')
MISTRAL3 = '{%- if message.tool_calls %}{{- "[TOOL_CALLS] [" }}{%- for tool_call in message.tool_calls %}'
MISTRAL32 = '{{- "[TOOL_CALLS]" + tool_call.function.name + "[ARGS]" + arguments }}'
CHATML = "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}"


@pytest.mark.parametrize("template,want", [(QWEN, ToolFamily.HERMES), (LLAMA31, ToolFamily.LLAMA3),
                                           (LLAMA32, ToolFamily.LLAMA3), (MISTRAL3, ToolFamily.MISTRAL),
                                           (MISTRAL32, ToolFamily.MISTRAL_ARGS), (CHATML, None)])
def test_the_family_is_read_from_the_chat_template(template, want):
    assert detect_family(template) is want
    assert detect_family(template, "llama") is want  # a template decides; the model type does not override it


def test_without_a_template_the_model_type_decides():
    assert detect_family(None, "qwen2") is ToolFamily.HERMES
    assert detect_family(None, "mixtral") is ToolFamily.MISTRAL
    assert detect_family(None, "llama") is None and detect_family(None) is None
    assert isinstance(parser_for(ToolFamily.MISTRAL_ARGS), MistralToolParser)


def test_a_registered_family_is_detected_first_on_its_own_registry_only():
    class BracketParser(HermesToolParser):
        pass

    registry = ToolParserRegistry()
    registry.register_family("brackets", BracketParser, lambda template, model_type: "<call>" in (template or ""))
    assert registry.detect_family("<call> <tool_call>") == "brackets"
    assert registry.detect_family(QWEN) is ToolFamily.HERMES
    assert isinstance(registry.parser_for("brackets"), BracketParser)
    assert isinstance(registry.parser_for(ToolFamily.LLAMA3), Llama3ToolParser)
    assert registry.families()[0] == "brackets"
    fresh = default_registry()
    assert fresh.detect_family("<call> <tool_call>") is ToolFamily.HERMES
    with pytest.raises(ValueError, match="family: no tool family 'brackets'"):
        fresh.parser_for("brackets")


def test_registering_refuses_clashes_and_non_parsers():
    registry = ToolParserRegistry()
    registry.register_family("mine", HermesToolParser, lambda t, m: False)
    with pytest.raises(ValueError, match="name: a tool family 'mine' is already registered"):
        registry.register_family("mine", HermesToolParser, lambda t, m: False)
    with pytest.raises(ValueError, match="name: 'hermes' is a built-in"):
        registry.register_family("hermes", HermesToolParser, lambda t, m: False)
    with pytest.raises(ValueError, match="detect"):
        registry.register_family("other", HermesToolParser, None)
    registry.register_family("broken", lambda: object(), lambda t, m: False)
    with pytest.raises(TypeError, match="broken"):
        registry.parser_for("broken")
