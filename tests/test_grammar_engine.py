"""Grammar-constrained output in the engine: every completion matches its JSON schema, under batching with free
requests, pipelined decode, preemption (the grammar replays), forked n > 1 completions and the prefix cache."""

from __future__ import annotations

import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

from cortexstream.engine.engine import Engine
from cortexstream.engine.sampling import SamplingParams, sampling_from_kwargs
from cortexstream.errors import InvalidArgumentError
from cortexstream.grammar import GrammarKind, GrammarSpec, grammar_for
from test_engine import random_prompts

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "score": {"type": "number", "minimum": -1, "maximum": 1},
        "nick": {"type": "string", "maxLength": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CHOICE = {"type": "object", "properties": {"ok": {"type": "boolean"}, "level": {"enum": ["low", "high", 3]}},
          "required": ["ok", "level"], "additionalProperties": False}
LIST = {"type": "array", "items": {"type": "integer", "minimum": 5, "maximum": 9}, "minItems": 1, "maxItems": 4}


def run(engine, requests):
    """requests: list of (prompt, kwargs) -> (texts, finish reasons, token lists) in order."""
    ids = [engine.add_request(p, **kw) for p, kw in requests]
    texts, reasons, tokens = {i: "" for i in ids}, {}, {i: [] for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            texts[out.request_id] += out.text
            if out.token is not None:
                tokens[out.request_id].append(out.token)
            reasons[out.request_id] = out.finish_reason or reasons.get(out.request_id)
    return [texts[i] for i in ids], [reasons[i] for i in ids], [tokens[i] for i in ids]


def engine_for(tiny, **kwargs):
    model, tokenizer = tiny
    return Engine(model, tokenizer, **{"kv_tokens": 4096, "block_size": 4, "prefill_tokens_while_decoding": 16,
                                       **kwargs})


def assert_valid(texts, reasons, schema):
    for text, reason in zip(texts, reasons):
        assert reason == "stop", (reason, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.parametrize("pipeline", [False, True])
def test_constrained_outputs_match_their_schemas_beside_free_requests(tiny, pipeline):
    prompts = random_prompts(9, seed=3, low=3, high=30)
    schemas = [PERSON, CHOICE, LIST]
    requests = []
    for i, prompt in enumerate(prompts):
        kw = {"max_tokens": 120, "temperature": 0.0 if i % 2 else 0.9, "seed": i}
        if i % 3 != 2:
            kw["response_format"] = schemas[i % 3]
        requests.append((prompt, kw))
    texts, reasons, _ = run(engine_for(tiny, pipeline=pipeline), requests)
    for i, (text, reason) in enumerate(zip(texts, reasons)):
        if i % 3 != 2:
            assert_valid([text], [reason], schemas[i % 3])
    free_texts = [t for i, t in enumerate(texts) if i % 3 == 2]
    assert not all(_parses(t) for t in free_texts)  # the tiny random model writes no JSON unless constrained


def _parses(text):
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_a_constrained_request_gets_the_same_tokens_alone_and_batched(tiny):
    prompts = random_prompts(6, seed=8, low=3, high=25)
    target = (prompts[0], {"max_tokens": 60, "response_format": PERSON})
    _, _, alone = run(engine_for(tiny), [target])
    _, _, batched = run(engine_for(tiny), [target] + [(p, {"max_tokens": 40}) for p in prompts[1:]])
    assert batched[0] == alone[0]


def test_preempted_constrained_requests_replay_their_grammar(tiny):
    """A tiny arena preempts by recompute: the re-created request's matcher replays what it had generated."""
    prompts = random_prompts(6, seed=11, low=10, high=30)
    requests = [(p, {"max_tokens": 60, "response_format": CHOICE}) for p in prompts]
    tight = engine_for(tiny, kv_tokens=120)
    texts, reasons, tokens = run(tight, requests)
    assert tight.stats()["preemptions"] > 0
    _, _, roomy_tokens = run(engine_for(tiny), requests)
    assert tokens == roomy_tokens
    assert_valid(texts, reasons, CHOICE)


def test_forked_completions_and_prefix_cache_hits_each_match(tiny):
    model, tokenizer = tiny
    engine = engine_for(tiny)
    prompt = random_prompts(1, seed=21, low=20, high=21)[0]
    sampling = SamplingParams(temperature=1.0, max_tokens=80, seed=5, grammar=GrammarSpec.json_schema(CHOICE))
    ids = [f"fork-{i}" for i in range(4)]
    engine.fork(prompt, sampling, ids)
    texts = {i: "" for i in ids}
    while engine.has_unfinished:
        for out in engine.step():
            texts[out.request_id] += out.text
    for text in texts.values():
        jsonschema.validate(json.loads(text), CHOICE)
    again, reasons, _ = run(engine, [(prompt, {"max_tokens": 80, "response_format": CHOICE})])
    assert engine.stats()["prefix_hit_blocks"] >= 1
    assert_valid(again, reasons, CHOICE)


def test_pydantic_models_json_object_regex_and_lark(tiny):
    class Item(BaseModel):
        label: str = Field(max_length=5)
        count: int = Field(ge=0, le=9)

    engine = engine_for(tiny)
    texts, reasons, tokens = run(engine, [
        ([5, 6, 7], {"max_tokens": 60, "response_format": Item}),
        ([8, 9], {"max_tokens": 60, "response_format": {"type": "json_object"}}),
    ])
    assert reasons[0] == "stop"
    Item.model_validate_json(texts[0])
    # Any JSON object: the random model may write digits until max_tokens; whatever it wrote is a prefix the
    # grammar accepts (a fresh matcher replays every token), and a finished one parses.
    engine.grammars.constraint(GrammarSpec.json_object()).replay(tokens[1])
    assert texts[1].startswith("{") and (reasons[1] == "length" or isinstance(json.loads(texts[1]), dict))
    regex = SamplingParams(max_tokens=20, grammar=GrammarSpec.regex(r"[a-c]{3}-[0-9]{2}"))
    lark = SamplingParams(max_tokens=20, grammar=GrammarSpec.lark('start: "yes" | "no"'))
    out, reasons, _ = run(engine, [([4, 5], {"sampling": regex}), ([6, 7], {"sampling": lark})])
    assert reasons == ["stop", "stop"]
    import re
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", out[0]) and out[1] in ("yes", "no")


@pytest.mark.parametrize("bad, message", [
    ({"type": "strin"}, "Invalid type"),
    ({"type": "string", "pattern": "(?=a)"}, "look-around"),
    ({"type": "string", "format": "not-a-format"}, "Unknown format"),
    ("{not json", "not valid JSON"),
    ([1, 2], "expected a JSON schema"),
    ("[1, 2]", "must be an object"),
])
def test_a_schema_that_cannot_be_enforced_is_refused_before_queueing(tiny, bad, message):
    engine = engine_for(tiny)
    with pytest.raises(InvalidArgumentError, match=f"response_format.*{message}"):
        engine.add_request([5, 6], max_tokens=5, response_format=bad)
    assert not engine.has_unfinished


def test_grammar_for_accepts_openai_forms_and_refuses_other_types():
    assert grammar_for(None) is None and grammar_for({"type": "text"}) is None
    assert grammar_for({"type": "json_object"}).kind is GrammarKind.JSON_OBJECT
    spec = grammar_for({"type": "json_schema", "json_schema": {"name": "x", "schema": CHOICE, "strict": True}})
    assert spec.kind is GrammarKind.JSON_SCHEMA and json.loads(spec.source) == CHOICE
    assert list(json.loads(grammar_for(PERSON).source)["properties"]) == list(PERSON["properties"])  # order kept
    with pytest.raises(InvalidArgumentError, match="response_format.json_schema: has no 'schema'"):
        grammar_for({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(InvalidArgumentError, match="response_format"):
        grammar_for(3.5)
    with pytest.raises(InvalidArgumentError, match="grammar"):
        SamplingParams(grammar={"type": "object"})
    assert sampling_from_kwargs(10, response_format=CHOICE).grammar == GrammarSpec.json_schema(CHOICE)


def test_the_public_calls_take_response_format(tiny):
    import cortexstream

    class Pair(BaseModel):
        key: str = Field(max_length=4)
        value: int = Field(ge=0, le=9)

    model, tokenizer = tiny
    assert Pair.model_json_schema().get("additionalProperties") is None
    assert json.loads(GrammarSpec.json_schema(Pair).source)["additionalProperties"] is False
    one = cortexstream.generate(model, tokenizer, "hello", max_tokens=40, response_format=Pair)
    Pair.model_validate_json(one)
    closed = json.loads(GrammarSpec.json_schema(Pair).source)
    batch = cortexstream.batch_generate(model, tokenizer, ["a b", "c d e", "f"], max_tokens=40,
                                        response_format=closed)
    for text in batch.texts:
        jsonschema.validate(json.loads(text), closed)
    streamed = "".join(r.text for r in cortexstream.stream_generate(model, tokenizer, "zz", max_tokens=40,
                                                                   response_format=CHOICE, temperature=0.8))
    jsonschema.validate(json.loads(streamed), CHOICE)
