"""`bench speculative --pair TARGET:DRAFT`: its options are refused before anything loads (naming the flag) and have
their own small defaults, mlx-lm's speculation counters are rebuilt from its stream's flags, the report's ratios,
targets and exactness come from the stored cells, a run writes, resumes and skips an absent pair, and a cell runs
every system for real on the tiny model drafting itself. No timing is asserted: the report's cells are made up."""

from __future__ import annotations

import json

import pytest

from cortexstream.benchmarks import speculative_pair
from cortexstream.benchmarks.speculative_pair import run_pair
from cortexstream.benchmarks.speculative_pair_measure import (
    DRAFT, MLX_LM_BATCH, MLX_LM_SPECULATIVE, draft_setting, measure_pair_cell, mlx_lm_counters,
)
from cortexstream.benchmarks.speculative_pair_report import pair_markdown, pair_ratios, pair_targets
from cortexstream.benchmarks.speculative_pair_settings import PairSettings, pair_command_line, parse_pair
from cortexstream.benchmarks.speculative_report import Status
from cortexstream.benchmarks.speculative_settings import Mode
from cortexstream.benchmarks.speculative_tasks import Task
from cortexstream.cli.main import main
from cortexstream.errors import InvalidArgumentError
from cortexstream.training.c2c.sharer_asset import AssetError

PAIR = "qwen2.5-coder-1.5b:qwen2.5-coder-0.5b"


@pytest.mark.parametrize("argv, message", [
    (["--pair", "target.gguf"], "--pair: 'target.gguf' must be TARGET:DRAFT"),
    (["--pair", "a:b:c"], "--pair: 'a:b:c' must be TARGET:DRAFT"),
    (["--pair", "m.gguf:m.gguf"], "--pair: 'm.gguf:m.gguf' names the same model as target and draft"),
    (["--pair", "t.gguf:d,1.gguf"], "--pair: draft 'd,1.gguf' contains ','"),
    (["--pair", PAIR, "--draft-k", "0"], "--draft-k: 0 must be an integer in 1..16"),
    (["--pair", PAIR, "--models", "smollm2-135m"], "--models: not with --pair"),
    (["--pair", PAIR, "--speculative", "ngram"], "--speculative: not with --pair"),
    (["--pair", PAIR, "--concurrency", "1,9"], "--concurrency: [1, 9] must be different integers in 1..8"),
    (["--pair", PAIR, "--tasks", "poem"], "--tasks: 'poem' is not among edit, summarize, quote, chat"),
    (["--pair", PAIR, "--max-tokens", "0"], "--max-tokens: 0 must be an integer >= 1"),
    (["--draft-k", "4"], "--draft-k: only with --pair TARGET:DRAFT"),
])
def test_bad_pair_options_fail_before_loading(tmp_path, capsys, argv, message):
    assert main(["bench", "speculative", *argv, "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("cortexstream: error: ") and message in err
    assert not list(tmp_path.iterdir())


def test_pair_settings_are_small_by_default_and_take_the_sizes_given():
    s = PairSettings()
    assert (s.target, s.draft, s.pair) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", PAIR)
    assert (s.tasks, s.modes, s.concurrency, s.max_tokens, s.rounds, s.k) == (
        (Task.EDIT, Task.QUOTE), (Mode.GREEDY,), (1,), 64, 1, 4)
    q = s.quick()
    assert (q.tasks, q.concurrency, q.max_tokens, q.rounds) == ((Task.EDIT,), (1,), 32, 1)
    assert parse_pair(" a.gguf : b.gguf ") == ("a.gguf", "b.gguf")
    with pytest.raises(InvalidArgumentError, match="--modes"):
        PairSettings(modes=("greedy", "greedy"))
    assert pair_command_line(s) == f"cortexstream bench speculative --pair {PAIR}"
    assert pair_command_line(q, quick=True) == f"cortexstream bench speculative --pair {PAIR} --quick"
    wide = PairSettings(concurrency=(1, 4), k=6, rounds=3, modes=("greedy", "sampled"))
    assert pair_command_line(wide) == (f"cortexstream bench speculative --pair {PAIR} --modes greedy,sampled "
                                       "--concurrency 1,4 --draft-k 6 --rounds 3")


def test_pair_options_reach_the_run(tmp_path, monkeypatch):
    seen = {}

    def fake_run(settings, out, **kw):
        seen.update(settings=settings, **kw)
        (tmp_path / "speculative_pair.md").write_text("report\n")

    monkeypatch.setattr(speculative_pair, "run_pair", fake_run)
    monkeypatch.setattr("cortexstream.backend.enable_linux_cpu_tuning", lambda: None)
    assert main(["bench", "speculative", "--pair", "t.gguf:d.gguf", "--concurrency", "1,4", "--draft-k", "3",
                 "--out", str(tmp_path)]) == 0
    s = seen["settings"]
    assert (s.target, s.draft, s.concurrency, s.k, s.tasks, s.max_tokens) == (
        "t.gguf", "d.gguf", (1, 4), 3, (Task.EDIT, Task.QUOTE), 64)
    assert seen["quick"] is False and seen["resume"] is False


@pytest.mark.parametrize("flags, k, max_tokens, expected", [
    ([True] * 4 + [False] + [True] * 4 + [False] + [True] * 4 + [False] + [True], 4, 16, (4, 13, 13)),
    ([True, False, False, True, True, False], 4, 64, (3, 12, 3)),  # 1 kept, 0 kept, 2 kept
    ([False] * 3, 2, 3, (3, 2 + 2 + 1, 0)),  # the last pass drafts only what is left
    ([True, True], 4, 64, (1, 4, 2)),  # ended (eos) inside a pass: that pass still counts
    ([], 4, 8, (0, 0, 0)),
])
def test_mlx_lm_counters_rebuild_passes_from_the_stream(flags, k, max_tokens, expected):
    c = mlx_lm_counters(flags, k, max_tokens)
    assert (c["verify_steps"], c["drafted"], c["accepted"]) == expected


def _system(tps, walls=(2.0,), spec=None, prepare=(5.0,)):
    return {"wall_s": list(walls), "prepare_s": list(prepare), "decode_tps": list(tps),
            "generated_tokens": [64] * len(tps), "spec": spec}


def _cell(task, c, plain, draft, peer, mode="greedy", differing=0):
    reference = MLX_LM_SPECULATIVE if c == 1 else MLX_LM_BATCH
    spec = [{"verify_steps": 16, "drafted": 64, "accepted": 48}]
    cell = {"task": task, "mode": mode, "concurrency": c, "target": "t", "draft": "d", "k": 4, "max_tokens": 64,
            "rounds": 1, "temperature": 0.7, "prompt_tokens": [300] * c, "mlx_lm_system": reference,
            "systems": {"plain": _system(plain, walls=(4.0,), prepare=(0.1,)), DRAFT: _system(draft, spec=spec),
                        reference: _system(peer, prepare=(0.0,), spec=spec if c == 1 else None)}}
    if mode == "greedy":
        cell["differing_texts"] = {DRAFT: differing, reference: 0}
    return cell


def _data(cells, concurrency=(1, 4)):
    settings = {"target": "t", "draft": "d", "k": 4, "tasks": ["edit", "quote"], "modes": ["greedy"],
                "concurrency": list(concurrency), "max_tokens": 64, "rounds": 1, "temperature": 0.7,
                "command": f"cortexstream bench speculative --pair {PAIR}", "text_source": "test text",
                "model_records": {"target": {"source": "t.gguf"}, "draft": {"source": "d.gguf"}}}
    machine = {"platform": "Linux", "cpu": "test CPU", "cpu_count": 2, "mlx": "0.0", "mlx_lm": "0.0",
               "blas": "none"}
    return {"benchmark": "speculative_pair", "settings": settings, "machine": machine, "cells": cells,
            "skipped": [], "missing": [], "runs": []}


def test_pair_ratios_targets_and_markdown_come_from_the_cells():
    edit1 = _cell("edit", 1, plain=[10.0], draft=[14.0], peer=[12.0])
    r = pair_ratios(edit1)
    assert r["decode_vs_plain"] == pytest.approx(1.4) and r["decode_vs_mlx_lm"] == pytest.approx(14 / 12)
    assert r["wall_vs_plain"] == pytest.approx(2.0)
    cells = [edit1, _cell("edit", 4, plain=[30.0], draft=[33.0], peer=[40.0], differing=1),
             _cell("quote", 1, plain=[10.0], draft=[12.0], peer=[13.0])]
    rows = {(t["task"], t["concurrency"]): t for t in pair_targets(_data(cells))}
    assert len(rows) == 4
    assert (rows[("edit", 1)]["vs_mlx_lm_status"], rows[("edit", 1)]["vs_plain_status"]) == ("met", "met")
    assert (rows[("edit", 4)]["vs_mlx_lm_status"], rows[("edit", 4)]["vs_plain_status"]) == ("missed", "missed")
    assert rows[("edit", 4)]["reference"] == MLX_LM_BATCH and rows[("edit", 4)]["differing_texts"] == 1
    assert (rows[("quote", 1)]["vs_mlx_lm_status"], rows[("quote", 1)]["vs_plain_status"]) == ("missed", "missed")
    assert rows[("quote", 4)]["vs_plain_status"] == Status.NOT_MEASURED.value
    assert rows[("quote", 4)]["vs_plain"] is None

    text = pair_markdown(_data(cells))
    assert "t drafted by d" in text and "Target: t (t.gguf); draft: d (d.gguf), up to 4" in text
    assert "test CPU" in text
    assert f"`cortexstream bench speculative --pair {PAIR}`" in text and "1 round(s)" in text
    assert "| greedy | edit | 1 | 1.17x (mlx-lm speculative) | >= 1.0x | met | 1.40x | >= 1.3x | met | yes |" in text
    assert ("| greedy | edit | 4 | 0.82x (mlx-lm batch_generate, target alone (no batched speculation)) | >= 1.0x | "
            "missed | 1.10x | >= 1.3x | missed | no (1 of 4 differ) |") in text
    assert "| greedy | quote | 4 | — (mlx-lm batch_generate" in text and "not measured" in text
    draft_row = next(line for line in text.splitlines() if line.startswith("| edit | 1 | draft |"))
    assert draft_row == "| edit | 1 | draft | 2.00 | 5.0 | 14.0 | 64 | 1.40x | 1.17x | 75% | 3.00 | yes |"
    peer_row = next(line for line in text.splitlines() if line.startswith("| edit | 1 | mlx-lm speculative |"))
    assert "| 75% | 3.00 | yes |" in peer_row
    sampled = _data([_cell("edit", 1, plain=[10.0], draft=[14.0], peer=[12.0], mode="sampled")], (1,))
    sampled["settings"]["modes"] = ["sampled"]
    assert "n/a (sampled)" in pair_markdown(sampled) and "## sampled" in pair_markdown(sampled)


def test_run_pair_writes_resumes_and_skips_an_absent_pair(tmp_path, monkeypatch):
    measured = []

    def fake_cell(model, draft, tokenizer, prompts, max_tokens, mode, temperature, setting, k, rounds):
        measured.append((len(prompts), mode, setting, k))
        cell = _cell("edit", len(prompts), plain=[10.0], draft=[13.0], peer=[12.0], mode=mode.value)
        return {key: cell[key] for key in ("systems", "prompt_tokens", "mlx_lm_system", "differing_texts")
                if key in cell}

    checked = []
    monkeypatch.setattr(speculative_pair, "measure_pair_cell", fake_cell)
    monkeypatch.setattr(speculative_pair, "warm_up_pair", lambda *a, **kw: None)
    monkeypatch.setattr(speculative_pair, "prompt_tokens", lambda tokenizer, p: [1, 2, 3])
    monkeypatch.setattr(speculative_pair, "check_pair", lambda *a: checked.append(a[-1]))
    loaded = {"t.gguf": (object(), object()), "d.gguf": (object(), object())}
    s = PairSettings(target="t.gguf", draft="d.gguf", tasks=("edit", "chat"), concurrency=(1, 2))
    data = run_pair(s, str(tmp_path), loaded=loaded, progress=False, log=lambda _: None)
    assert checked == ["d.gguf"]
    assert sorted(m[0] for m in measured) == [1, 1, 2, 2]
    assert {(m[2], m[3]) for m in measured} == {("draft:model=d.gguf,k=4", 4)}
    assert data["skipped"] == [] and data["missing"] == [] and len(data["targets"]) == 4
    stored = json.loads((tmp_path / "speculative_pair.json").read_text())
    assert len(stored["cells"]) == 4 and stored["settings"]["target"] == "t.gguf"
    assert "## greedy" in (tmp_path / "speculative_pair.md").read_text()
    measured.clear()
    again = run_pair(s, str(tmp_path), resume=True, loaded=loaded, progress=False)
    assert measured == [] and len(again["cells"]) == 4  # kept, not measured again

    def absent(source):
        raise AssetError(f"{source}: no verified copy")

    monkeypatch.setattr(speculative_pair, "model_path", absent)
    gone = run_pair(PairSettings(), str(tmp_path), progress=False, log=lambda _: None)
    assert measured == [] and gone["cells"] == [] and gone["missing"] == []
    assert gone["skipped"] == [{"model": PAIR, "reason": "qwen2.5-coder-0.5b: no verified copy"}]
    assert "skipped: " + PAIR in (tmp_path / "speculative_pair.md").read_text()


@pytest.mark.parametrize("concurrency", [1, 2])
def test_a_cell_runs_every_system_on_the_tiny_model_drafting_itself(tiny, tiny_gguf, concurrency):
    model, tokenizer = tiny
    prompts = [tokenizer.encode("def main():\n    return 42"), tokenizer.encode("The quick brown fox")][:concurrency]
    setting = draft_setting(tiny_gguf, 4)
    cell = measure_pair_cell(model, model, tokenizer, prompts, 12, Mode.GREEDY, 0.7, setting, 4, 1)
    peer = MLX_LM_SPECULATIVE if concurrency == 1 else MLX_LM_BATCH
    assert set(cell["systems"]) == {"plain", DRAFT, peer} and cell["mlx_lm_system"] == peer
    assert cell["differing_texts"][DRAFT] == 0  # greedy drafting gives plain decoding's text
    ours = cell["systems"][DRAFT]["spec"][0]
    assert ours["verify_steps"] > 0 and ours["accepted"] == ours["drafted"] > 0  # the draft is the target
    assert cell["systems"]["plain"]["spec"] is None and all(p >= 0 for p in cell["systems"][DRAFT]["prepare_s"])
    if concurrency == 1:
        theirs, generated = cell["systems"][peer]["spec"][0], cell["systems"][peer]["generated_tokens"][0]
        assert 0 < theirs["accepted"] <= theirs["drafted"]
        assert generated - theirs["accepted"] in (theirs["verify_steps"], theirs["verify_steps"] - 1)
    else:
        assert cell["systems"][peer]["spec"] is None
