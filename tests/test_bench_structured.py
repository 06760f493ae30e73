"""`cortexstream bench structured` on the tiny model: the schema set, the options, and a small real run whose every
number is checked against the outputs it stored.

The tiny model has random weights: unconstrained it writes noise, so the baseline must come out invalid while the
constrained runs, whose grammar forces the JSON, come out valid whenever they end on their own ("stop").
"""

from __future__ import annotations

import json
import shlex
import statistics

import pytest

from cortexstream.benchmarks.structured import run
from cortexstream.benchmarks.structured_measure import Verdict, judge, unfenced
from cortexstream.benchmarks.structured_schemas import SCHEMA_CASES, schema_cases
from cortexstream.benchmarks.structured_settings import StructuredSettings, command_line, from_args
from cortexstream.errors import InvalidArgumentError
from cortexstream.grammar.spec import GrammarSpec

SCHEMAS = {case.name: case.schema for case in SCHEMA_CASES}
SMALL = 5  # schemas in the tiny run


# --- the schema set -------------------------------------------------------------------------------------------
def _unbounded(schema: dict, path: str) -> list[str]:
    """Places where a completion following `schema` could go on for ever (an open string, array, number...)."""
    if "anyOf" in schema:
        return [p for i, s in enumerate(schema["anyOf"]) for p in _unbounded(s, f"{path}.anyOf[{i}]")]
    if "enum" in schema:
        return []
    kind = schema.get("type")
    if kind == "string":
        return [] if "maxLength" in schema or "pattern" in schema else [path]
    if kind in ("integer", "number"):
        return [] if "minimum" in schema and "maximum" in schema else [path]
    if kind == "array":
        return ([] if "maxItems" in schema else [path]) + _unbounded(schema["items"], f"{path}[]")
    if kind == "object":
        out = [] if schema.get("additionalProperties") is False else [f"{path} (open object)"]
        return out + [p for k, s in schema["properties"].items() for p in _unbounded(s, f"{path}.{k}")]
    return [] if kind == "boolean" else [f"{path} (unknown {kind})"]


def _keywords(schema) -> set[str]:
    found = set()
    if isinstance(schema, dict):
        found |= set(schema)
        if schema.get("type") in ("boolean", "number"):
            found.add(schema["type"])
        if schema.get("type") == "object" and set(schema["properties"]) != set(schema["required"]):
            found.add("optional field")
        for value in schema.values():
            found |= _keywords(value)
    elif isinstance(schema, list):
        for value in schema:
            found |= _keywords(value)
    return found


def test_the_schema_set_covers_the_keywords_compiles_and_always_ends():
    assert len(SCHEMA_CASES) >= 50 and len(SCHEMAS) == len(SCHEMA_CASES)
    keywords = set().union(*(_keywords(s) for s in SCHEMAS.values()))
    assert {"anyOf", "enum", "pattern", "maxLength", "minItems", "maxItems", "minimum", "maximum", "boolean",
            "number", "optional field"} <= keywords
    nested = [n for n, s in SCHEMAS.items() if any(p.get("type") == "object" for p in s["properties"].values())]
    assert len(nested) >= 5
    for case in SCHEMA_CASES:
        GrammarSpec.json_schema(case.schema).check()  # llguidance can enforce it
        assert _unbounded(case.schema, case.name) == []
        missing = [k for k in case.schema["properties"] if k not in case.prompt]
        assert not missing, f"{case.name}: the prompt does not name {missing}"
        assert case.messages()[-1]["role"] == "user"
    assert [c.name for c in schema_cases(3)] == [c.name for c in SCHEMA_CASES[:3]]


# --- options --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, flag", [
    ("schemas", 0, "--schemas"), ("schemas", len(SCHEMA_CASES) + 1, "--schemas"), ("rounds", 0, "--rounds"),
    ("batch", 1, "--batch"), ("max_tokens", 0, "--max-tokens"), ("temperature", 0.0, "--temperature"),
    ("models", (), "--model")])
def test_bad_options_are_refused_naming_the_flag(field, value, flag):
    with pytest.raises(InvalidArgumentError, match=flag):
        StructuredSettings(**{field: value})


def test_the_cli_registers_the_command_and_its_command_line_round_trips():
    from cortexstream.cli.main import build_parser

    words = ["bench", "structured", "--model", "a.gguf", "--model", "b", "--rounds", "2", "--schemas", "7",
             "--out-dir", "somewhere"]
    args = build_parser().parse_args(words)
    settings = from_args(args)
    assert args.out == "somewhere" and settings.models == ("a.gguf", "b") and settings.schemas == 7
    again = from_args(build_parser().parse_args(shlex.split(command_line(settings))[1:]))
    assert again == settings


def test_judge_and_fences():
    schema = SCHEMAS["person"]
    assert judge('{"name": "Ada", "age": 36}', schema) is Verdict.VALID
    assert judge('{"name": "Ada", "age": 360}', schema) is Verdict.INVALID
    assert judge('```json\n{"name": "Ada", "age": 36}\n```', schema) is Verdict.UNPARSEABLE
    assert judge(unfenced('```json\n{"name": "Ada", "age": 36}\n```'), schema) is Verdict.VALID
    assert unfenced("no fence") == "no fence"


# --- a real run on the tiny model -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("structured")
    model, tokenizer = tiny
    data = run(StructuredSettings(schemas=SMALL, max_tokens=40, rounds=1), str(out),
               loaded=[("tiny", model, tokenizer)], progress=False, log=lambda _: None)
    stored = json.loads((out / "structured.json").read_text())
    return data, stored, (out / "structured.md").read_text()


def test_the_json_holds_every_part_as_written(results):
    data, stored, _ = results
    assert stored["benchmark"] == "structured" and stored == json.loads(json.dumps(data))
    cells = {(r["decoding"], r["concurrency"], r["constrained"]) for r in stored["validity"]}
    assert cells == {("greedy", 1, True), ("greedy", 8, True), ("sampled", 1, True), ("sampled", 8, True),
                     ("greedy", 8, False)}
    assert stored["settings"]["schema_names"] == [c.name for c in SCHEMA_CASES[:SMALL]]
    assert [t["status"] for t in stored["targets"]] in (["met"], ["missed"])
    assert "cpu" in stored["machine"] and "tools" not in stored


def test_validity_numbers_are_those_of_the_stored_outputs(results):
    _, stored, _ = results
    for row in stored["validity"]:
        outs = row["outputs"]
        assert [o["schema"] for o in outs] == stored["settings"]["schema_names"]
        verdicts = [judge(o["text"], SCHEMAS[o["schema"]]).value for o in outs]
        assert verdicts == [o["verdict"] for o in outs]
        assert row["valid"] == verdicts.count("valid") and row["valid_fraction"] == row["valid"] / len(outs)
        assert row["length_finishes"] == sum(o["finish_reason"] == "length" for o in outs)
        assert sum(row["finish_reasons"].values()) == len(outs) and row["tokens"] == sum(o["tokens"] for o in outs)
        if row["constrained"]:  # the grammar makes every completion that ends by itself valid
            assert all(o["verdict"] == "valid" for o in outs if o["finish_reason"] == "stop")
    baseline = next(r for r in stored["validity"] if not r["constrained"])
    assert baseline["valid"] == 0 and all(o["verdict"] != "valid" for o in baseline["outputs"])
    greedy = next(r for r in stored["validity"] if r["constrained"] and r["concurrency"] == 8
                  and r["decoding"] == "greedy")
    assert greedy["valid"] > baseline["valid"]


def test_mask_cost_compile_and_mask_rows(results):
    _, stored, _ = results
    (cost,), (compiled,), (mask,) = stored["mask_cost"], stored["compile"], stored["host_mask"]
    assert len(cost["constrained_tps"]) == len(cost["unconstrained_tps"]) == 1 and cost["requests"] == SMALL
    assert cost["constrained_tokens"] == cost["unconstrained_tokens"] == [sum(cost["request_lengths"])]
    assert cost["ratio"] == pytest.approx(statistics.median(cost["constrained_tps"])
                                          / statistics.median(cost["unconstrained_tps"]))
    assert compiled["schemas"] == SMALL and compiled["warm_seconds"] > 0
    assert 0 < compiled["compile_ms_p50"] <= compiled["compile_ms_p99"] <= compiled["compile_ms_max"]
    greedy = next(r for r in stored["validity"] if r["constrained"] and r["concurrency"] == 8
                  and r["decoding"] == "greedy")
    assert mask["tokens"] == greedy["tokens"] and 0 < mask["mask_us_p50"] <= mask["mask_us_p99"]


def test_the_markdown_report(results):
    _, stored, md = results
    assert f"Command: `{stored['settings']['command']}`" in md
    assert stored["settings"]["command"].startswith("cortexstream bench structured") and "--schemas 5" in md
    for heading in ("## Targets", "## Validity", "## Mask cost", "## Grammar compile and host mask time",
                    ):
        assert heading in md
    assert "| tiny | greedy | 8 | no | 0/5 (0%) |" in md
    assert "cortexstream bench tools" in md and "Machine: " in md
