"""`bench throughput` end to end at its smallest on the tiny random model: JSON, Markdown and heat map structure."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace

import pytest

from cortexstream.benchmarks import throughput
from cortexstream.benchmarks.throughput_prompts import build_prompts


def test_prompt_kinds(tiny):
    _, tokenizer = tiny
    equal = build_prompts(tokenizer, "equal", 4, 40)
    assert [len(p) for p in equal.prompts] == [40] * 4 and len({tuple(p) for p in equal.prompts}) == 4
    ragged = build_prompts(tokenizer, "ragged", 4, 40, seed=3)
    assert all(10 <= len(p) <= 40 for p in ragged.prompts)
    assert ragged.prompts == build_prompts(tokenizer, "ragged", 4, 40, seed=3).prompts  # seeded
    shared = build_prompts(tokenizer, "shared", 4, 40)
    assert shared.shared_prefix_tokens == 30 and all(len(p) == 40 for p in shared.prompts)
    assert len({tuple(p[:30]) for p in shared.prompts}) == 1 and len({tuple(p[30:]) for p in shared.prompts}) == 4


def test_quick_and_flag_parsing():
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    quick = throughput.settings_from_args(parser.parse_args(["--quick"]))
    cells = len(quick.concurrency) * len(quick.prompt_tokens) * len(quick.kinds)
    assert cells == 4 and quick.rounds == 3 and quick.quick
    full = throughput.settings_from_args(parser.parse_args([]))
    assert len(full.concurrency) * len(full.prompt_tokens) * len(full.kinds) == 18 and full.max_tokens == 64
    with pytest.raises(ValueError, match="--kinds"):
        throughput.settings_from_args(parser.parse_args(["--kinds", "equal,odd"]))


def test_smallest_run_writes_json_md_png(tiny, tmp_path):
    model, tokenizer = tiny
    settings = throughput.Settings(concurrency=(2,), prompt_tokens=(16,), max_tokens=3, rounds=2,
                                   itl_streams=2, itl_stream_prompt_tokens=16, admit_tokens=32,
                                   single_prompt_tokens=(8,))
    throughput.run(None, str(tmp_path), settings, model=model, tokenizer=tokenizer, progress=False)
    data = json.loads((tmp_path / "throughput.json").read_text())
    assert [(c["kind"], c["concurrency"], c["prompt_tokens"]) for c in data["matrix"]] == [
        ("equal", 2, 16), ("ragged", 2, 16), ("shared", 2, 16)]
    for cell in data["matrix"]:
        for system in ("cortexstream", "mlx_lm"):
            assert len(cell[system]["wall_s"]) == 2 and cell[system]["peak_memory_gb"] > 0
        assert cell["ratio_median"] > 0 and cell["outputs"] == 2 and 0 <= cell["identical_outputs"] <= 2
        assert cell["ratio_target"] == 1.0 and isinstance(cell["meets_memory_target"], bool)
        assert cell["cortexstream"]["ttft_p99_s"] >= cell["cortexstream"]["ttft_p50_s"] > 0
    itl = data["itl"]
    assert itl["window"]["count"] > 0 and itl["steady"]["count"] > 0 and itl["window_p99_over_steady_median"] > 0
    assert [r["prompt_tokens"] for r in data["single"]] == [8] and data["skipped"] == []
    assert "/" not in data["model"]["source"]  # a name, never a local path
    md = (tmp_path / "throughput.md").read_text()
    for heading in ("## Targets", "## Matrix", "### Latency and diagnostics", "## Inter-token latency",
                    "## Single stream", "Columns."):
        assert heading in md
    assert data["heatmap"] == "throughput.png" and (tmp_path / "throughput.png").stat().st_size > 0


def test_max_minutes_lists_skipped_cells(tiny, tmp_path):
    model, tokenizer = tiny
    settings = throughput.Settings(concurrency=(1,), prompt_tokens=(8,), kinds=("equal",), max_tokens=2,
                                   rounds=1, parts=("matrix",), max_minutes=0.0)
    throughput.run(None, str(tmp_path), settings, model=model, tokenizer=tokenizer, progress=False)
    data = json.loads((tmp_path / "throughput.json").read_text())
    assert data["matrix"] == [] and data["skipped"] == ["equal c=1 prompt=8"]
    assert "Not measured" in (tmp_path / "throughput.md").read_text()


def test_profile_splits_both_calls_into_phases(tiny):
    from bench.throughput_profile import markdown, profile_cell

    model, tokenizer = tiny
    cell = profile_cell(model, tokenizer, "ragged", 3, 16, max_tokens=4, rounds=1)
    ours, ref = cell["ours"], cell["mlx_lm"]
    prompts = build_prompts(tokenizer, "ragged", 3, 16).prompts
    # Every prompt token is computed once (no shared prefix here), in steps that report them.
    assert ours["prefill_tokens"] == sum(len(p) for p in prompts) and ours["prefill_steps"] >= 1
    # Three requests of 4 tokens each: the first token comes from a prefill step, the other 3 from decode steps
    # (some may share a step with a prefill); never more decode steps than tokens left to decode.
    assert 1 <= ours["decode_steps"] <= 3 * 3 and ours["decode_step_median_ms"] > 0
    assert ours["construction_s"] > 0 and ours["prefill_s"] > 0 and ours["decode_s"] > 0
    assert ours["wall_s"] >= ours["construction_s"] + ours["prefill_s"] + ours["decode_s"]
    assert ref["prompt_s"] > 0 and ref["generation_s"] > 0 and ref["wall_s"] >= ref["prompt_s"]
    assert cell["ceiling_at_decode_parity"] >= 1.0 and cell["ratio_at_decode_parity"] > 0
    payload = {"model": {"source": "tiny"}, "machine": {"platform": "p", "cpu": "c", "cpu_count": 2, "mlx": "m",
                                                        "blas": "b"},
               "rounds": 1, "cells_arg": "ragged:3:16", "cells": [cell], "elapsed_minutes": 0.1}
    assert "| ragged c=3 16 |" in markdown(payload)


def test_profile_cells_and_name_are_checked():
    from bench.throughput_profile import _cells
    from cortexstream.errors import InvalidArgumentError

    assert _cells("ragged:8:128, shared:32:1024") == [("ragged", 8, 128), ("shared", 32, 1024)]
    for bad in ("", "ragged:8", "odd:8:128", "ragged:0:128", "ragged:8:2", "ragged:x:128"):
        with pytest.raises(InvalidArgumentError, match="--cells"):
            _cells(bad)
    p = argparse.ArgumentParser()
    throughput.add_arguments(p)
    with pytest.raises(InvalidArgumentError, match="--name"):
        throughput.run_from_args(p.parse_args(["--name", "../x", "--parts", "single"]))


# Partial reports and --resume, on the tiny model with the measurement replaced by a fake (fast, deterministic).

class _Killed(Exception):
    """Stands in for the timeout that kills a long run mid-cell."""


def _fake_cell(kind, concurrency, prompt_tokens, max_tokens, rounds, run_id):
    side = {"wall_median_s": 1.0, "peak_memory_gb": 0.1, "peak_rss_gb": 0.2, "decode_tps": 10.0}
    return {"kind": kind, "concurrency": concurrency, "prompt_tokens": prompt_tokens, "max_tokens": max_tokens,
            "rounds": rounds, "prompts": {"min": prompt_tokens, "max": prompt_tokens},
            "cortexstream": {**side, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2}, "mlx_lm": {**side, "prompt_time_s": 0.3},
            "ratio_median": 1.1, "ratio_best": 1.2, "ratio_paired_median": 1.1, "outputs": concurrency,
            "identical_outputs": concurrency, "first_mismatches": [], "ratio_target": 1.0,
            "meets_ratio_target": True, "meets_memory_target": True, "run": run_id}


@pytest.fixture
def fake_matrix(monkeypatch, tmp_path):
    """`measure(run_id, stop_after=None)` runs a 6-cell matrix into tmp_path with fake cells; returns the cells this
    call measured. Before each cell it checks that the JSON on disk holds every cell finished before it."""
    from cortexstream.benchmarks import throughput_matrix

    monkeypatch.setattr(throughput_matrix, "warm_up", lambda *args: None)
    settings = throughput.Settings(concurrency=(1, 2), prompt_tokens=(8,), max_tokens=2, rounds=2,
                                   parts=("matrix",))

    def measure(run_id, stop_after=None, resume=False, **changes):
        measured = []
        path = tmp_path / "throughput.json"

        def cell(model, tokenizer, kind, c, n, max_tokens, rounds, seed=0):
            if stop_after is not None and len(measured) == stop_after:
                raise _Killed
            if measured:  # the cells of this run so far are on disk already
                assert json.loads(path.read_text())["matrix"][-1]["run"] == run_id
            measured.append((kind, c, n))
            return _fake_cell(kind, c, n, max_tokens, rounds, run_id)

        monkeypatch.setattr(throughput_matrix, "measure_cell", cell)
        model, tokenizer = changes.pop("tiny")
        throughput.run(None, str(tmp_path), replace(settings, **changes), model=model, tokenizer=tokenizer,
                       progress=False, resume=resume)
        return measured

    return measure


PLANNED = [("equal", 1, 8), ("ragged", 1, 8), ("shared", 1, 8), ("equal", 2, 8), ("ragged", 2, 8), ("shared", 2, 8)]


def _cells(data):
    return [(c["kind"], c["concurrency"], c["prompt_tokens"]) for c in data["matrix"]]


def test_interrupted_run_leaves_a_partial_report_of_the_finished_cells(tiny, tmp_path, fake_matrix):
    with pytest.raises(_Killed):
        fake_matrix("first", stop_after=4, tiny=tiny)
    data = json.loads((tmp_path / "throughput.json").read_text())
    assert data["complete"] is False and data["planned_cells"] == 6 and _cells(data) == PLANNED[:4]
    assert data["settings"]["rounds"] == 2 and data["elapsed_minutes"] >= 0
    md = (tmp_path / "throughput.md").read_text()
    assert "**Partial results: 4 of 6 planned matrix cells done**" in md and "| shared | 1 | 8 |" in md
    assert data["heatmap"] == "throughput.png" and (tmp_path / "throughput.png").stat().st_size > 0
    assert sorted(os.listdir(tmp_path)) == ["throughput.json", "throughput.md", "throughput.png"]  # no temp files


def test_resume_measures_only_the_missing_cells(tiny, tmp_path, fake_matrix):
    with pytest.raises(_Killed):
        fake_matrix("first", stop_after=4, tiny=tiny)
    assert fake_matrix("second", resume=True, tiny=tiny, max_minutes=60.0) == PLANNED[4:]  # a new budget is fine
    data = json.loads((tmp_path / "throughput.json").read_text())
    assert data["complete"] is True and _cells(data) == PLANNED and data["resumed_cells"] == 4
    assert [c["run"] for c in data["matrix"]] == ["first"] * 4 + ["second"] * 2
    md = (tmp_path / "throughput.md").read_text()
    assert "Partial results" not in md and "4 matrix cells measured by an earlier run" in md
    assert "| shared | 2 | 8 |" in md
    assert fake_matrix("third", resume=True, tiny=tiny) == []  # a complete report: nothing left to measure
    assert fake_matrix("fourth", tiny=tiny) == PLANNED  # without --resume the run starts over
    assert json.loads((tmp_path / "throughput.json").read_text())["resumed_cells"] == 0


def test_resume_refuses_another_configuration(tiny, tmp_path, fake_matrix):
    from cortexstream.errors import InvalidArgumentError

    with pytest.raises(_Killed):
        fake_matrix("first", stop_after=2, tiny=tiny)
    path = tmp_path / "throughput.json"
    before = path.read_text()
    with pytest.raises(InvalidArgumentError, match=rf"{path}: its setting rounds is 2, this run's is 3; --resume"):
        fake_matrix("second", resume=True, tiny=tiny, rounds=3)
    with pytest.raises(InvalidArgumentError, match=r"its setting kinds is \['equal', 'ragged', 'shared'\], this"):
        fake_matrix("second", resume=True, tiny=tiny, kinds=("equal",))
    data = json.loads(before)
    data["model"]["source"] = "another.gguf"
    path.write_text(json.dumps(data))
    with pytest.raises(InvalidArgumentError, match=r"its model field source is 'another.gguf', this run's is"):
        fake_matrix("second", resume=True, tiny=tiny)
    path.write_text(before)
    # From the command line the check comes before the model is loaded (this model does not exist).
    p = argparse.ArgumentParser()
    throughput.add_arguments(p)
    args = p.parse_args(["--resume", "--out", str(tmp_path), "--parts", "matrix", "--concurrency", "1,2",
                         "--prompt-tokens", "8", "--max-tokens", "3", "--rounds", "2", "--model", "/never.gguf"])
    with pytest.raises(InvalidArgumentError, match=rf"{path}: its setting max_tokens is 2, this run's is 3"):
        throughput.run_from_args(args)
    assert path.read_text() == before
