"""What users run is installed; what justified past decisions is not. `cortexstream bench` lists the user-facing
benchmarks (one runner: `cortexstream.benchmarks.runner`), each also `python -m cortexstream.benchmarks.<module>`;
the diagnostics and the asset fetcher live in the checkout's `bench/` (`python -m bench.<module>`), and training
code imports neither."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from bench import DIAGNOSTICS
from cortexstream.benchmarks.runner import BENCHMARKS
from cortexstream.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_bench_help_lists_exactly_the_user_facing_benchmarks(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", "--help"])
    text = capsys.readouterr().out
    listed = text.split("{", 1)[1].split("}", 1)[0].split(",")
    assert stop.value.code == 0 and listed == list(BENCHMARKS)
    assert not set(listed) & ({name.replace("_", "-") for name in DIAGNOSTICS} | {"single", "kernels"})


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_each_benchmark_runs_through_the_one_runner_and_as_a_script(name, tmp_path, capsys):
    args = build_parser().parse_args(["bench", name, "--out", str(tmp_path)])
    assert args.run == "cortexstream.benchmarks.runner:run_benchmark" and args.benchmark == name
    module = importlib.import_module(BENCHMARKS[name][0])
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code == 0 and "--out" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:
        main(["bench", name, "--help"])
    assert stop.value.code == 0 and "--out" in capsys.readouterr().out


def _bench_modules() -> set[str]:
    found = {p.stem for p in (ROOT / "bench").glob("*.py") if p.stem not in ("__init__", "__main__")}
    return found | {p.parent.name for p in (ROOT / "bench").glob("*/__init__.py")}


def test_bench_lists_every_diagnostic_and_none_is_left_in_the_package():
    assert _bench_modules() == set(DIAGNOSTICS)
    installed = {p.stem for p in (ROOT / "cortexstream" / "benchmarks").rglob("*.py")}
    installed |= {p.name for p in (ROOT / "cortexstream" / "benchmarks").iterdir() if p.is_dir()}
    assert not installed & set(DIAGNOSTICS)


@pytest.mark.parametrize("name", sorted(DIAGNOSTICS))
def test_each_diagnostic_runs_from_the_checkout(name, capsys):
    module = importlib.import_module(f"bench.{name}")
    if name == "arena_attention":
        module = importlib.import_module("bench.arena_attention.cli")
    with pytest.raises(SystemExit) as stop:
        module.main(["--help"])
    assert stop.value.code == 0 and f"python -m bench.{name}" in capsys.readouterr().out


def test_training_imports_no_benchmark_code():
    offenders = []
    for path in (ROOT / "cortexstream" / "training").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            offenders += [f"{path.relative_to(ROOT)}: {n}" for n in names
                          if n.startswith(("cortexstream.benchmarks", "bench.")) or n == "bench"]
    assert not offenders


def test_bench_serve_without_httpx_names_the_extra():
    # A fresh interpreter where `import httpx` fails: the CLI still parses, and bench serve says what to install.
    code = ("import sys; sys.modules['httpx'] = None\n"
            "from cortexstream.cli.main import main\n"
            "raise SystemExit(main(['bench', 'serve', '--quick', '--out', sys.argv[1]]))")
    done = subprocess.run([sys.executable, "-c", code, str(ROOT / "bench" / "results")], capture_output=True,
                          text=True, timeout=120, env={"CORTEXSTREAM_NO_OPENBLAS": "1", "PATH": "/usr/bin:/bin"})
    assert done.returncode == 1, done.stderr
    assert done.stderr.strip() == ("cortexstream: error: bench serve needs httpx (its HTTP clients), which is not "
                                   "installed: pip install 'cortexstream[bench]'")


def test_reports_are_written_without_matplotlib(tmp_path, monkeypatch, capsys):
    from cortexstream.benchmarks.common import write_report
    from cortexstream.benchmarks.frontier_report import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    write_report(str(tmp_path), "frontier", {"perplexity": [{"context": 64}]}, "# md\n", plot)
    assert (tmp_path / "frontier.json").exists() and (tmp_path / "frontier.md").read_text() == "# md\n"
    assert not (tmp_path / "frontier.png").exists()
    assert "pip install 'cortexstream[bench]'" in capsys.readouterr().err


def test_decode_floor_keeps_every_request_running_through_a_public_tokenizer():
    from bench.decode_floor import NoEosTokenizer

    class Tok:
        eos_token_ids = {2}
        vocab_size = 10

        def decode(self, ids: list[int]) -> str:
            return "-".join(map(str, ids))

    wrapped = NoEosTokenizer(Tok())
    assert all(eos < 0 for eos in wrapped.eos_token_ids) and wrapped.eos_token_id < 0
    assert wrapped.decode([1, 2]) == "1-2" and wrapped.vocab_size == 10
    assert "_eos_ids" not in (ROOT / "bench" / "decode_floor.py").read_text(encoding="utf-8")
