"""`bench tools`: the case set, scoring, asking a live server (the tiny model with a Hermes template, where the
grammar under "required" is what makes calls well-formed), the options, and a whole run of the benchmark on
`cortexstream serve` as a subprocess (the tiny model's template renders no tools, so its tool requests are 400s,
recorded as the server's answer)."""

from __future__ import annotations

import json
import shlex
from types import SimpleNamespace

import jsonschema
import pytest

from cortexstream.benchmarks.serve_processes import Launch, Peer, command
from cortexstream.benchmarks.structured_schemas import SCHEMA_CASES
from cortexstream.benchmarks.tool_bench import ToolBenchSettings, command_line, from_args, run
from cortexstream.benchmarks.tool_bench_ask import ask_schemas, ask_tools
from cortexstream.benchmarks.tool_cases import TOOL_CASES, TOOLS, ToolCase, renders_tools, score
from cortexstream.errors import InvalidArgumentError
from cortexstream.grammar.spec import GrammarSpec
from server_harness import LiveServer
from test_bench_structured import _unbounded


def test_tool_cases_need_each_tool_and_their_schemas_are_bounded():
    assert len(TOOL_CASES) >= 30
    assert {c.expected for c in TOOL_CASES} == set(TOOLS)
    assert {c.all_tools for c in TOOL_CASES} == {True, False}
    for name, tool in TOOLS.items():
        GrammarSpec.json_schema(tool["function"]["parameters"]).check()
        assert _unbounded(tool["function"]["parameters"], name) == []


def _message(content="", calls=()):
    return SimpleNamespace(content=content, tool_calls=[SimpleNamespace(function=SimpleNamespace(
        name=name, arguments=arguments)) for name, arguments in calls])


def test_score_tells_the_outcomes_apart():
    case = ToolCase("weather in Oslo?", "get_weather", all_tools=True)
    good = '{"city": "Oslo", "unit": "celsius"}'
    assert score(case, _message(calls=[("get_weather", good)]), "tool_calls")["outcome"] == "correct"
    assert score(case, _message(calls=[("get_time", '{"location": "Oslo"}')]), "tool_calls")["outcome"] == \
        "wrong_function"
    assert score(case, _message(calls=[("get_weather", '{"city": "Oslo", "unit": "kelvin"}')]),
                 "tool_calls")["outcome"] == "invalid_arguments"
    assert score(case, _message(calls=[("get_weather", good)] * 2), "tool_calls")["outcome"] == "extra_calls"
    bare = '```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```'
    assert score(case, _message(bare), "stop")["outcome"] == "untagged_call"
    assert score(case, _message("It is sunny."), "stop")["outcome"] == "no_call"


@pytest.fixture(scope="module")
def hermes_server(tiny):
    from test_server_agent import hermes_tokenizer

    model, tokenizer = tiny
    hermes = hermes_tokenizer(tokenizer)
    assert renders_tools(hermes) and not renders_tools(tokenizer)
    with LiveServer(model, hermes, kv_tokens=8192, max_num_seqs=4) as live:
        yield live


def test_ask_tools_over_http(hermes_server):
    cases = TOOL_CASES[:4]
    client = hermes_server.client()
    rows = [ask_tools(client, "tiny", cases, choice, max_tokens=96, workers=4, progress=False)
            for choice in ("auto", "required")]
    for row in rows:
        answers = row["answers"]
        assert [a["prompt"] for a in answers] == [c.prompt for c in cases]
        assert sum(row["outcomes"].values()) == len(cases) == sum(row["finish_reasons"].values())
        assert row["correct"] == sum(a["outcome"] == "correct" for a in answers)
        for a in answers:
            if a["outcome"] == "correct":
                jsonschema.validate(json.loads(a["arguments"]), TOOLS[a["expected"]]["function"]["parameters"])
    required = rows[1]["answers"]
    # the grammar makes every completion under "required" that is not cut short a call
    assert all(a["calls"] == 1 for a in required if a["finish_reason"] != "length")
    assert any(a["finish_reason"] == "tool_calls" for a in required)


def test_ask_schemas_and_errors_are_outcomes(hermes_server):
    client = hermes_server.client()
    row = ask_schemas(client, "tiny", SCHEMA_CASES[:3], max_tokens=64, workers=2, progress=False)
    assert row["cases"] == 3 and row["valid"] == row["outcomes"].get("valid", 0)
    assert all(a["outcome"] == "valid" for a in row["answers"] if a["finish_reason"] == "stop")
    wrong_model = ask_tools(client, "no-such-model", TOOL_CASES[:2], "auto", max_tokens=8, workers=2,
                            progress=False)
    assert wrong_model["outcomes"] == {"http_404": 2} and wrong_model["correct"] == 0
    assert "no-such-model" in wrong_model["answers"][0]["content"]


@pytest.mark.parametrize("kwargs, flag", [
    ({"systems": ("vllm",)}, "--systems"), ({"systems": ()}, "--systems"), ({"workers": 0}, "--workers"),
    ({"schemas": len(SCHEMA_CASES) + 1}, "--schemas"), ({"model_dir": "/nonexistent"}, "--model-dir"),
    ({"timeout": 0}, "--timeout")])
def test_bad_options_are_refused_naming_the_flag(kwargs, flag):
    with pytest.raises(InvalidArgumentError, match=flag):
        ToolBenchSettings(**kwargs)


def test_the_cli_registers_the_command_and_peers_start_with_the_tool_parser(tmp_path):
    from cortexstream.cli.main import build_parser

    args = build_parser().parse_args(["bench", "tools", "--systems", "cortexstream", "--schemas", "0",
                                      "--workers", "2", "--out", "somewhere"])
    settings = from_args(args)
    assert settings.systems == ("cortexstream",) and settings.schemas == 0 and args.out == "somewhere"
    assert from_args(build_parser().parse_args(shlex.split(command_line(settings))[1:])) == settings
    python = "/venv/bin/python"
    cmd = command(Launch(Peer.VLLM_MLX.value, None, 4, python=python, tool_parser="hermes"), "DIR", 1234)
    assert cmd[-3:] == ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with pytest.raises(ValueError, match="tool_parser"):
        Launch("mlx_lm", None, 4, tool_parser="hermes")


def test_a_whole_run_on_a_subprocess_server(tiny_gguf, tmp_path):
    """The tiny model renders no tools: every tool request is the server's 400, recorded as such; its json_schema
    answers are enforced."""
    settings = ToolBenchSettings(model=tiny_gguf, systems=("cortexstream",), workers=2, max_tokens=16, schemas=2,
                                 schema_max_tokens=48, kv_tokens=2048, timeout=120)
    data = run(settings, str(tmp_path), progress=False, log=lambda _: None)
    stored = json.loads((tmp_path / "tools.json").read_text())
    assert stored == json.loads(json.dumps(data))
    assert [(r["system"], r["tool_choice"]) for r in stored["tools"]] == [("cortexstream auto", "auto"),
                                                                          ("cortexstream auto", "required")]
    for row in stored["tools"]:
        assert row["outcomes"] == {"http_400": len(TOOL_CASES)}
        assert "renders no tools" in row["answers"][0]["content"]
    (schemas,) = stored["schemas"]
    assert schemas["cases"] == 2 and sum(schemas["outcomes"].values()) == 2
    assert all(a["outcome"] == "valid" for a in schemas["answers"] if a["finish_reason"] == "stop")
    (server,) = stored["servers"]
    assert server["started"] and server["peak_rss_bytes"] > 0
    md = (tmp_path / "tools.md").read_text()
    for heading in ("## Tool calls", "## `response_format` json_schema", "## Errors the servers answered with",
                    "## Servers"):
        assert heading in md
    assert f"| cortexstream auto | auto | 0/{len(TOOL_CASES)} (0%) | http_400 {len(TOOL_CASES)} |" in md


def test_peer_variants_are_parsed_labelled_and_need_their_peer(tmp_path):
    from cortexstream.benchmarks.tool_bench import parse_variants

    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.write_text("")
    variants = parse_variants(["rapid-mlx:RAPID_MLX_CONSTRAIN_TOOLS=0"])
    assert variants == ((Peer.RAPID_MLX, "RAPID_MLX_CONSTRAIN_TOOLS", "0"),)
    settings = ToolBenchSettings(systems=(), peers={Peer.RAPID_MLX: str(python)}, variants=variants)
    labels = [launch.label for launch in settings.launches()]
    assert labels == ["rapid_mlx", "rapid_mlx RAPID_MLX_CONSTRAIN_TOOLS=0"]
    assert all(launch.fresh_home and launch.tool_parser == "hermes" for launch in settings.launches())
    with pytest.raises(InvalidArgumentError, match="--peer-variant"):
        ToolBenchSettings(variants=variants)
    for bad in ("rapid_mlx", "rapid_mlx:=1", "nope:A=1"):
        with pytest.raises(InvalidArgumentError, match="--peer-variant"):
            parse_variants([bad])
