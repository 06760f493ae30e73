"""`bench speculative`: the task families hold their source text and never repeat a prompt, options are refused
before anything loads (naming the flag), the report's medians, ratios and targets come from the stored cells, and
a run writes, resumes and skips an absent model as it says. No timing is asserted: the cells here are made up."""

from __future__ import annotations

import json

import pytest

from cortexstream.benchmarks import speculative
from cortexstream.benchmarks.speculative import command_line, run
from cortexstream.benchmarks.speculative_report import Status, cell_ratios, markdown, spec_summary, target_for
from cortexstream.benchmarks.speculative_settings import Mode, SpeculativeSettings
from cortexstream.benchmarks.speculative_tasks import (
    EDIT_FUNCTIONS, MAX_INPUTS, Task, build_prompts, function_source, passages, sentences,
)
from cortexstream.cli.main import main
from cortexstream.errors import InvalidArgumentError
from cortexstream.training.c2c.sharer_asset import AssetError

SPEC = "ngram:k=4,n=3"


def _article(i: int) -> str:
    """Three paragraphs of eight 15-word sentences, every word distinct (so any 4 words in a row occur once)."""
    def sentence(p: int, s: int) -> str:
        return "The " + " ".join(f"w{i}x{p}y{s}z{j}" for j in range(14)) + "."

    return "\n".join(" ".join(sentence(p, s) for s in range(8)) for p in range(3))


WIKI = "\n\n".join(_article(i) for i in range(2 * MAX_INPUTS + 2))


def _content(prompt) -> str:
    assert len(prompt.messages) == 1 and prompt.messages[0]["role"] == "user"
    return prompt.messages[0]["content"]


@pytest.mark.parametrize("task", list(Task))
def test_each_family_gives_different_prompts_and_grounded_ones_contain_their_source(task):
    prompts = build_prompts(task, MAX_INPUTS, WIKI)
    contents = [_content(p) for p in prompts]
    assert len(prompts) == MAX_INPUTS and len(set(contents)) == MAX_INPUTS
    assert all(p.task is task for p in prompts)
    for p, content in zip(prompts, contents):
        if task.grounded:
            assert p.source and p.source in content
        else:
            assert p.source == "" and len(content.split()) < 40
    assert build_prompts(task, 2, WIKI) == prompts[:2]  # a smaller batch is the start of the larger one


def test_edit_prompts_paste_real_functions_and_ask_for_the_whole_function_back():
    prompts = build_prompts(Task.EDIT, MAX_INPUTS, WIKI)
    for (module, qualname), p in zip(EDIT_FUNCTIONS, prompts):
        source = function_source(module, qualname)
        assert 40 <= len(source.splitlines()) <= 120 and source.lstrip().startswith(("def ", "@"))
        assert p.source == source and p.origin == f"{module}.{qualname}"
        assert "Return the whole function" in _content(p)
    assert "Rename the parameter `entries`" in _content(prompts[0])
    assert "Add a keyword-only parameter `verbose" in _content(prompts[1])


def test_quote_prompts_ask_for_a_middle_sentence_by_a_phrase_found_once():
    summarized = {p.source for p in build_prompts(Task.SUMMARIZE, MAX_INPUTS, WIKI)}
    for p in build_prompts(Task.QUOTE, MAX_INPUTS, WIKI):
        phrase = _content(p).split("contains the words \"", 1)[1].split("\"", 1)[0]
        assert p.expected in sentences(p.source)[1:-1] and phrase in p.expected
        assert p.source.count(phrase) == 1 and p.source not in summarized


def test_too_little_text_or_too_many_inputs_is_said():
    with pytest.raises(ValueError, match="articles of 180\\+ words"):
        passages(_article(0), 2)
    for count in (0, MAX_INPUTS + 1):
        with pytest.raises(ValueError, match="count"):
            build_prompts(Task.CHAT, count, WIKI)


@pytest.mark.parametrize("argv, message", [
    (["--speculative", "draft:model=small.gguf"], "--speculative: 'draft:model=small.gguf': --speculative takes "
                                                  "prompt-lookup settings"),
    (["--speculative", "off"], "--speculative: 'off' turns speculation off"),
    (["--speculative", "ngram:k=99"], "--speculative: speculative: k=99 must be an integer in 1..16"),
    (["--speculative", "ngram:k=4;ngram:k=4,n=3"], "--speculative: 'ngram:k=4,n=3' is given twice"),
    (["--concurrency", "1,9"], "--concurrency: [1, 9] must be different integers in 1..8"),
    (["--tasks", "edit,poem"], "--tasks: 'poem' is not among edit, summarize, quote, chat"),
    (["--modes", "greedy,greedy"], "--modes: ['greedy', 'greedy'] names one twice"),
    (["--max-tokens", "0"], "--max-tokens: 0 must be an integer >= 1"),
    (["--rounds", "0"], "--rounds: 0 must be an integer >= 1"),
    (["--temperature", "0"], "--temperature: 0.0 must be in (0, 2]"),
    (["--max-minutes", "0"], "--max-minutes: 0.0 must be > 0"),
])
def test_bad_options_fail_before_loading(tmp_path, capsys, argv, message):
    assert main(["bench", "speculative", *argv, "--models", str(tmp_path / "never-loaded.gguf"),
                 "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("cortexstream: error: ") and message in err
    assert not list(tmp_path.iterdir())


def test_settings_canonicalise_and_quick_sizes():
    s = SpeculativeSettings(speculative=("ngram", "ngram:k=8, n=3"), tasks=("chat",), modes=("sampled",))
    assert s.speculative == (SPEC, "ngram:k=8,n=3") and s.tasks == (Task.CHAT,) and s.modes == (Mode.SAMPLED,)
    q = SpeculativeSettings().quick()
    assert (q.tasks, q.concurrency, q.max_tokens, q.rounds) == ((Task.EDIT, Task.CHAT), (1, 2), 32, 1)
    with pytest.raises(InvalidArgumentError, match="--models"):
        SpeculativeSettings(models=("a", "a"))
    assert command_line(SpeculativeSettings()) == "cortexstream bench speculative"
    assert command_line(q, quick=True) == "cortexstream bench speculative --quick"
    assert command_line(SpeculativeSettings(speculative=(SPEC, "ngram:k=8,n=3"), rounds=5)) == (
        "cortexstream bench speculative --speculative 'ngram:k=4,n=3;ngram:k=8,n=3' --rounds 5")


def _system(walls, tps, tokens=64, spec=None):
    return {"wall_s": walls, "decode_tps": tps, "generated_tokens": [tokens] * len(walls), "spec": spec}


def _cell(task, c, plain_tps, ngram_tps, mode="greedy", differing=0, spec=None):
    cell = {"model": "m", "task": task, "mode": mode, "concurrency": c, "max_tokens": 64, "rounds": 3,
            "temperature": 0.7, "speculative": [SPEC], "prompt_tokens": [100] * c,
            "systems": {"plain": _system([2.0, 3.0, 2.5], plain_tps),
                        SPEC: _system([1.0, 1.5, 2.0], ngram_tps, spec=spec or [
                            {"verify_steps": 10, "drafted": 40, "accepted": 30},
                            {"verify_steps": 10, "drafted": 40, "accepted": 10}, None]),
                        "mlx_lm": _system([2.0, 2.0, 2.0], [8.0, 10.0, 12.0])}}
    if mode == "greedy":
        cell.update(differing_texts={SPEC: differing}, differing_texts_mlx_lm=1)
    return cell


def _data(cells):
    settings = {"models": ["m"], "tasks": ["edit", "quote", "chat"], "modes": ["greedy", "sampled"],
                "concurrency": [1, 8], "speculative": [SPEC], "max_tokens": 64, "rounds": 3, "temperature": 0.7,
                "command": "cortexstream bench speculative --models m", "text_source": "test text",
                "model_records": {"m": {"source": "m.gguf"}}}
    machine = {"platform": "Linux", "cpu": "test CPU", "cpu_count": 2, "mlx": "0.0", "mlx_lm": "0.0",
               "blas": "none"}
    return {"benchmark": "speculative", "settings": settings, "machine": machine, "cells": cells, "skipped": [
        {"model": "qwen2.5-coder-0.5b", "reason": "no verified copy"}], "missing": [], "runs": []}


def test_ratios_and_targets_come_from_the_medians():
    edit1 = _cell("edit", 1, [10.0, 12.0, 11.0], [20.0, 18.0, 22.0])
    r = cell_ratios(edit1, SPEC)
    assert r["decode_vs_plain"] == pytest.approx(20 / 11) and r["wall_vs_plain"] == pytest.approx(2.5 / 1.5)
    assert r["decode_vs_mlx_lm"] == pytest.approx(20 / 10)
    s = spec_summary(edit1["systems"][SPEC]["spec"])
    assert s["acceptance_rate"] == pytest.approx(40 / 80) and s["accepted_per_verify"] == pytest.approx(2.0)
    assert s["drafted_per_verify"] == pytest.approx(4.0) and s["verify_steps_per_round"] == pytest.approx(10)
    assert spec_summary([None]) == {"acceptance_rate": None, "accepted_per_verify": None,
                                    "drafted_per_verify": None, "verify_steps_per_round": None}
    assert (target_for("edit", 1), target_for("quote", 8), target_for("summarize", 2)) == (1.5, 1.2, 1.2)
    assert target_for("chat", 1) == target_for("chat", 8) == 1.0

    cells = [edit1, _cell("edit", 8, [40.0], [44.0]),  # 1.1x at 8: below 1.2
             _cell("chat", 1, [10.0], [10.0]), _cell("chat", 8, [40.0], [39.0], differing=2),
             _cell("quote", 1, [10.0], [14.9], mode="sampled")]
    from cortexstream.benchmarks.speculative_report import targets

    rows = {(t["mode"], t["task"], t["concurrency"]): t for t in targets(_data(cells))}
    assert len(rows) == 2 * 3 * 2
    assert rows[("greedy", "edit", 1)]["status"] == Status.MET.value
    assert rows[("greedy", "edit", 8)]["status"] == Status.MISSED.value
    assert rows[("greedy", "chat", 1)]["status"] == Status.MET.value  # 1.0x meets >= 1.0x
    assert rows[("greedy", "chat", 8)]["status"] == Status.MISSED.value
    assert rows[("sampled", "quote", 1)]["status"] == Status.MISSED.value  # 1.49x
    assert rows[("greedy", "quote", 1)]["status"] == Status.NOT_MEASURED.value and rows[
        ("greedy", "quote", 1)]["ratio"] is None


def test_markdown_names_model_machine_rerun_targets_and_exactness():
    cells = [_cell("edit", 1, [10.0, 12.0, 11.0], [20.0, 18.0, 22.0]),
             _cell("chat", 8, [40.0], [39.0], differing=2), _cell("quote", 1, [10.0], [14.9], mode="sampled")]
    text = markdown(_data(cells))
    assert "m (m.gguf)" in text and "test CPU" in text and "`cortexstream bench speculative --models m`" in text
    assert "skipped: qwen2.5-coder-0.5b: no verified copy" in text
    assert "| m | greedy | edit | 1 | ngram:k=4,n=3 | 1.82x | >= 1.5x | met |" in text
    assert "| m | greedy | chat | 8 | ngram:k=4,n=3 | 0.97x | >= 1.0x | missed |" in text
    assert "| m | sampled | quote | 1 | ngram:k=4,n=3 | 1.49x | >= 1.5x | missed |" in text
    assert "| m | greedy | quote | 8 | ngram:k=4,n=3 | — | >= 1.2x | not measured |" in text
    edit_row = next(line for line in text.splitlines() if line.startswith("| edit | 1 | ngram"))
    assert "| 1.82x | 1.67x | 2.00x | 50% | 2.00 | yes |" in edit_row
    assert "no (2 of 8 differ)" in text and "n/a (sampled)" in text
    assert "## m, greedy" in text and "## m, sampled" in text


def test_run_writes_resumes_and_skips_an_absent_asset(tmp_path, monkeypatch):
    measured = []

    def fake_cell(model, tokenizer, prompts, max_tokens, mode, temperature, specs, rounds):
        measured.append((len(prompts), mode))
        return {k: v for k, v in _cell("chat", len(prompts), [10.0], [12.0], mode=mode.value).items()
                if k in ("systems", "prompt_tokens", "differing_texts", "differing_texts_mlx_lm")}

    def absent(source):
        raise AssetError(f"{source}: no verified copy")

    monkeypatch.setattr(speculative, "measure_cell", fake_cell)
    monkeypatch.setattr(speculative, "warm_up", lambda *a: None)
    monkeypatch.setattr(speculative, "prompt_tokens", lambda tokenizer, p: [1, 2, 3])
    monkeypatch.setattr(speculative, "load_model", absent)
    s = SpeculativeSettings(models=("m", "qwen2.5-coder-0.5b"), tasks=("chat",), concurrency=(1, 2), rounds=1)
    data = run(s, str(tmp_path), loaded={"m": (object(), object())}, progress=False, log=lambda _: None)
    assert sorted(measured) == [(1, Mode.GREEDY), (1, Mode.SAMPLED), (2, Mode.GREEDY), (2, Mode.SAMPLED)]
    assert data["skipped"] == [{"model": "qwen2.5-coder-0.5b", "reason": "qwen2.5-coder-0.5b: no verified copy"}]
    assert data["missing"] == [] and len(data["targets"]) == 4 * 2
    stored = json.loads((tmp_path / "speculative.json").read_text())
    assert len(stored["cells"]) == 4 and "greedy" in (tmp_path / "speculative.md").read_text()
    measured.clear()
    again = run(s, str(tmp_path), resume=True, loaded={"m": (object(), object())}, progress=False)
    assert measured == [] and len(again["cells"]) == 4  # kept, not measured again
    wider = SpeculativeSettings(models=("m",), tasks=("chat",), concurrency=(1, 2), rounds=2)
    run(wider, str(tmp_path), resume=True, loaded={"m": (object(), object())}, progress=False)
    assert len(measured) == 4  # other settings: measured afresh, and only those cells are reported
