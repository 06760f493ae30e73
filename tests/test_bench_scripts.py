"""The measurement benchmarks live in cortexstream/benchmarks/ and `cortexstream bench` runs them: each is a
sub-command with its module's own options, and nothing under bench/ is code any more (bench/ holds results)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from cortexstream.benchmarks.scripts import SCRIPTS
from cortexstream.cli.main import build_parser

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_script_benchmark_is_a_bench_subcommand_with_its_own_options(name, tmp_path):
    args = build_parser().parse_args(["bench", name, "--out", str(tmp_path)])
    assert args.run == "cortexstream.benchmarks.scripts:run_script" and args.script == name
    assert str(args.out) == str(tmp_path)
    module = importlib.import_module(SCRIPTS[name][0])
    assert callable(module.run_from_args) and callable(module.main)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_python_m_and_the_cli_share_the_help(name, capsys):
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(SCRIPTS[name][0]).main(["--help"])
    assert stop.value.code == 0 and "--out" in capsys.readouterr().out


def test_bench_holds_results_and_no_code():
    assert not [p for p in BENCH.rglob("*.py") if "__pycache__" not in p.parts]
