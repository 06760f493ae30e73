"""`bench retrieval` on the tiny random model: the prompts hold their facts where asked and are as long as asked,
options are refused before anything loads (naming the flag), a whole run writes its report with ratios and targets
from the stored cells, a later-turn question is fed only after the document was compressed, and the shared prefix
changes the cost of a cell but not its answers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from cortexstream.benchmarks import retrieval_measure
from cortexstream.benchmarks.common import real_text
from cortexstream.benchmarks.passkey import passkey_prompt
from cortexstream.benchmarks.retrieval import command_line, run
from cortexstream.benchmarks.retrieval_measure import run_cell
from cortexstream.benchmarks.retrieval_prompts import Fact, build_trials, cell_rng, vault_trial
from cortexstream.benchmarks.retrieval_report import QUERY_AWARE, Status, add_ratios, markdown, targets
from cortexstream.benchmarks.retrieval_settings import Placement, RetrievalSettings, Task
from cortexstream.cli.main import main
from cortexstream.engine.policy_runtime import PolicyState
from cortexstream.errors import InvalidArgumentError
from cortexstream.evaluation.needle import needle_prompt, needle_question


@pytest.fixture(scope="module")
def heap(tiny):
    return list(tiny[1].encode(real_text(20_000)))[:3000]


def _find(ids, part) -> list[int]:
    ids, part = list(ids), list(part)
    return [i for i in range(len(ids) - len(part) + 1) if ids[i:i + len(part)] == part]


def test_passkey_and_needle_trials_are_the_existing_prompts_split_at_the_question(tiny, heap):
    tokenizer = tiny[1]
    rng = cell_rng(0, Task.PASSKEY, Placement.LATER_TURN, 400)
    for trial in build_trials(Task.PASSKEY, tokenizer, None, 400, 3, rng):
        ids, needle_at = passkey_prompt(tokenizer, 400, trial.depth, trial.answers[0])
        assert list(trial.document) + list(trial.questions[0]) == ids and trial.shared == needle_at
        assert trial.tokens == 400 and trial.answers[0].isdigit() and len(trial.answers[0]) == 5
        assert _find(trial.document, tokenizer.encode(f" The pass key is {trial.answers[0]}."))
    fact = Fact("Judge Moreau", "123456", 0.37)
    trial = vault_trial(tokenizer, heap, 500, [fact], [0])
    ids, needle_at, _ = needle_prompt(tokenizer, heap, 500, 0.37, "Judge Moreau", "123456")
    assert list(trial.document) + list(trial.questions[0]) == ids and trial.shared == needle_at
    assert trial.first_prompt_end(Placement.SAME_PROMPT) == 500
    assert trial.first_prompt_end(Placement.LATER_TURN) == 500 - len(trial.questions[0])


def test_multikey_and_multiquery_place_every_fact_and_ask_as_said(tiny, heap):
    tokenizer = tiny[1]
    depths = np.linspace(0.1, 0.9, 4)
    for task, asked in ((Task.MULTIKEY, 1), (Task.MULTIQUERY, 2)):
        trials = build_trials(task, tokenizer, heap, 600, 4, cell_rng(3, task, Placement.SAME_PROMPT, 600))
        for trial, depth in zip(trials, depths):
            assert trial.tokens == 600 and trial.depth == pytest.approx(depth)
            assert len(trial.facts) == (3 if task is Task.MULTIKEY else 2) and len(trial.questions) == asked
            assert len({f.name for f in trial.facts}) == len({f.code for f in trial.facts}) == len(trial.facts)
            starts = []
            for f in trial.facts:
                found = _find(trial.document, tokenizer.encode(f" The vault code for {f.name} is {f.code}. "))
                assert len(found) == 1
                starts.append(found[0])
            assert trial.shared == min(starts)
            order = sorted(range(len(trial.facts)), key=lambda i: trial.facts[i].depth)
            assert sorted(starts) == [starts[i] for i in order]  # deeper facts lie later
            for question, code, fact in zip(trial.questions, trial.answers, trial.facts):
                assert list(question) == list(tokenizer.encode(needle_question(fact.name))) and code == fact.code
        if task is Task.MULTIQUERY:  # the second fact 40% of the 10-90% range away, wrapped inside it
            assert [round(t.facts[1].depth, 3) for t in trials] == [0.42, 0.687, 0.153, 0.42]


def test_a_context_too_short_for_the_facts_names_the_flag(tiny, heap):
    with pytest.raises(InvalidArgumentError, match="--contexts: 200 tokens leave"):
        build_trials(Task.MULTIKEY, tiny[1], heap, 200, 2, cell_rng(0, Task.MULTIKEY, Placement.SAME_PROMPT, 200))


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "passkey,nope"], "--tasks: 'nope' is not among passkey, needle, multikey, multiquery"),
    (["--tasks", "needle,needle"], "--tasks: ['needle', 'needle'] names one twice"),
    (["--placements", "first_turn"], "--placements: 'first_turn' is not among same_prompt, later_turn"),
    (["--policies", "h2o:budget={b};bogus"], "--policies: kv_policy: unknown policy 'bogus'"),
    (["--policies", "full;full"], "--policies: 'full' is given twice"),
    (["--budgets", "0.2,2"], "--budgets: '0.2,2' must be fractions in (0, 1]"),
    (["--contexts", "128"], "--contexts: '128' must be integers >= 256"),
    (["--trials", "0"], "--trials: 0 must be an integer >= 1"),
    (["--chunk", "0"], "--chunk: 0 must be an integer >= 1"),
    (["--seed", "-1"], "--seed: -1 must be an integer >= 0"),
    (["--max-minutes", "0"], "--max-minutes: 0.0 must be > 0"),
])
def test_bad_options_fail_before_loading(tmp_path, capsys, argv, message):
    code = main(["bench", "retrieval", *argv, "--model", str(tmp_path / "never-loaded.gguf"), "--out",
                 str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and message in err and "never-loaded" not in err


def test_policy_strings_expand_per_budget_and_the_full_cache_once():
    s = RetrievalSettings(policies=("full", "snapkv:budget={b},window=8", "h2o:budget=0.3"), budgets=(0.1, 0.5))
    assert [(c.spec, c.budget) for c in s.policy_cells()] == [
        ("full", None), ("snapkv:budget=0.1,window=8", 0.1), ("snapkv:budget=0.5,window=8", 0.5),
        ("h2o:budget=0.3", 0.3)]
    quick = s.quick()
    assert quick.contexts == (512,) and quick.trials == 3 and quick.budgets == (0.2,)
    assert quick.tasks == (Task.PASSKEY, Task.NEEDLE) and quick.placements == tuple(Placement)
    assert command_line(quick, True) == "cortexstream bench retrieval --quick --policies " \
        "'full;snapkv:budget={b},window=8;h2o:budget=0.3'"  # --quick sets the budgets


def _settings(*argv: str) -> RetrievalSettings:
    import argparse

    from cortexstream.benchmarks.retrieval import add_arguments
    from cortexstream.benchmarks.retrieval_settings import from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_args(parser.parse_args(list(argv)))


def test_the_default_policies_include_a_query_agnostic_one_for_the_later_turn():
    """kvzip scores the context alone, so the later-turn target (best query-agnostic policy) can judge it."""
    from cortexstream.policies import parse_policy

    cells = {c.spec: c for c in RetrievalSettings(budgets=(0.33,)).policy_cells()}
    assert list(cells) == ["full", "streaming:budget=0.33", "h2o:budget=0.33", "snapkv:budget=0.33",
                           "kvzip:budget=0.33", "expected:budget=0.33"]
    kvzip = parse_policy("kvzip:budget=0.33")
    assert kvzip.evicts and kvzip.name not in QUERY_AWARE


def test_quick_keeps_the_tasks_and_placements_given_and_its_own_otherwise():
    quick = _settings("--quick")
    assert quick.tasks == (Task.PASSKEY, Task.NEEDLE) and quick.placements == tuple(Placement)
    assert len(quick.cells()) == 2 * 2 * len(quick.policy_cells()) and quick.contexts == (512,)
    later = _settings("--quick", "--placements", "later_turn")
    assert later.tasks == (Task.PASSKEY, Task.NEEDLE) and later.contexts == (512,) and later.trials == 3
    assert {placement for _, placement, _, _ in later.cells()} == {Placement.LATER_TURN}
    assert len(later.cells()) == len(quick.cells()) // 2
    multikey = _settings("--quick", "--tasks", "multikey,passkey")
    assert [(t, pl) for t, pl, _, p in multikey.cells() if p.spec == "full"] == [
        (Task.MULTIKEY, Placement.SAME_PROMPT), (Task.MULTIKEY, Placement.LATER_TURN),
        (Task.PASSKEY, Placement.SAME_PROMPT), (Task.PASSKEY, Placement.LATER_TURN)]
    assert command_line(later, True) == "cortexstream bench retrieval --quick --placements later_turn"
    assert _settings().tasks == tuple(Task) and _settings().placements == tuple(Placement)
    with pytest.raises(InvalidArgumentError, match="--placements: 'nowhere' is not among"):
        _settings("--quick", "--placements", "nowhere")  # checked, no longer dropped by --quick


def test_a_whole_tiny_run_writes_cells_ratios_and_targets(tiny, heap, tmp_path):
    settings = RetrievalSettings(tasks=("passkey", "multiquery"), policies=("full", "h2o:budget={b}",
                                 "snapkv:budget={b},window=8"), budgets=(0.2, 0.33), contexts=(400,), trials=2,
                                 chunk=32)
    data = run(settings, "tiny", str(tmp_path), loaded=tiny, heap=heap, progress=False, log=lambda _: None)
    written = json.loads((tmp_path / "retrieval.json").read_text())
    cells = written["cells"]
    assert written["missing"] == [] and len(cells) == 2 * 2 * 5
    assert {(c["task"], c["placement"]) for c in cells} == {(t, p) for t in ("passkey", "multiquery")
                                                           for p in ("same_prompt", "later_turn")}
    for c in cells:
        full = next(f for f in cells if f["policy"] == "full" and f["task"] == c["task"]
                    and f["placement"] == c["placement"])
        assert c["ratio_to_full"] == (c["accuracy"] / full["accuracy"] if full["accuracy"] else None)
        assert c["accuracy"] == c["correct"] / c["trials"] and len(c["results"]) == 2
        questions = 2 if c["task"] == "multiquery" else 1
        assert len(c["question_accuracy"]) == questions and all(len(r["answers"]) == questions
                                                                for r in c["results"])
        context = 400 + 10 * questions  # budgets are fractions of the context plus the answers' tokens
        expected = context if c["family"] == "full" else c["budget"] * context
        assert abs(c["budget_tokens"] - expected) <= 1
        assert c["kv_bytes"] == c["budget_tokens"] * written["settings"]["bytes_per_token"]
    same = [c for c in cells if c["task"] == "passkey" and c["policy"] != "full"]
    keys = {tuple(r["codes"][0] for r in c["results"]) for c in same}
    assert len(keys) == 2  # one set of trials per (task, placement, context), shared by its policies
    text = (tmp_path / "retrieval.md").read_text()
    assert "## Targets" in text and "## passkey — later_turn" in text and "bench quality" in text
    assert [t["status"] for t in written["targets"]] == [t["status"] for t in targets(written)]
    assert (tmp_path / "retrieval.png").stat().st_size > 0
    again = run(settings, "tiny", str(tmp_path), resume=True, loaded=tiny, heap=heap, progress=False,
                log=lambda _: None)
    assert again["cells"] == data["cells"] and len(again["runs"]) == 2  # resumed: nothing measured twice


def _cell(task, placement, policy, correct, budget=None, family=None, trials=10):
    family = family or policy.split(":")[0]
    return {"task": task, "placement": placement, "context": 512, "policy": policy, "template": policy,
            "budget": budget, "family": family, "evicts": family != "full", "trials": trials, "correct": correct,
            "accuracy": correct / trials, "question_accuracy": [correct / trials], "budget_tokens": 100,
            "kv_bytes": 1000, "results": [], "seconds": 1.0}


def test_targets_are_judged_from_the_stored_numbers_only():
    rows = [_cell("passkey", "same_prompt", "full", 10), _cell("passkey", "same_prompt", "snapkv:budget=0.2", 9, 0.2),
            _cell("passkey", "same_prompt", "h2o:budget=0.2", 10, 0.2),
            _cell("needle", "same_prompt", "full", 8), _cell("needle", "same_prompt", "snapkv:budget=0.2", 8, 0.2),
            _cell("passkey", "later_turn", "full", 10), _cell("passkey", "later_turn", "snapkv:budget=0.33", 10, 0.33),
            _cell("passkey", "later_turn", "expected:budget=0.33", 7, 0.33),
            _cell("needle", "later_turn", "full", 0), _cell("needle", "later_turn", "h2o:budget=0.33", 0, 0.33)]
    data = {"settings": {"contexts": [512]}, "cells": rows}
    add_ratios(rows)
    assert rows[1]["ratio_to_full"] == pytest.approx(0.9) and rows[9]["ratio_to_full"] is None
    same, later = targets(data)
    assert same["status"] == Status.MET.value  # snapkv 0.9 and 1.0 (h2o's 1.0 is not query-aware)
    assert "passkey 512: snapkv:budget=0.2 9/10 vs full 10/10 = 0.90" in same["details"]
    assert later["status"] == Status.MISSED.value  # expected 0.7 (snapkv's 1.0 does not count); needle: no ratio
    assert later["details"][1] == "needle 512: the full cache answered 0/10: no ratio"
    rows[7]["correct"], rows[7]["accuracy"] = 8, 0.8
    assert targets(data)[1]["status"] == Status.NOT_MEASURED.value
    del rows[4]
    assert targets(data)[0]["details"][1] == "needle 512: not measured (no such policy cell)"


def _recorder(monkeypatch) -> list[tuple]:
    events: list[tuple] = []
    expect, after = PolicyState.expect_prompt_end, PolicyState.after_forward

    def record_expect(self, logical_end):
        events.append(("expect", int(logical_end)))
        return expect(self, logical_end)

    def record_after(self, seq, context):
        removed = after(self, seq, context)
        events.append(("pass", seq.logical_length, seq.num_tokens))
        return removed

    monkeypatch.setattr(PolicyState, "expect_prompt_end", record_expect)
    monkeypatch.setattr(PolicyState, "after_forward", record_after)
    return events


def test_a_later_turn_question_is_fed_after_the_document_was_compressed(tiny, heap, monkeypatch):
    model, tokenizer = tiny
    trial = build_trials(Task.NEEDLE, tokenizer, heap, 400, 1, cell_rng(0, Task.NEEDLE, Placement.LATER_TURN,
                                                                     400))[0]
    doc, question = len(trial.document), len(trial.questions[0])
    events = _recorder(monkeypatch)
    run_cell(model, tokenizer, [trial], Placement.LATER_TURN, "snapkv:budget=0.2,window=8", 410, 32,
             share_prefix=False)
    asks = [i for i, e in enumerate(events) if e[0] == "expect"]
    assert {events[i][1] for i in asks} == {doc, doc + question}
    second = next(i for i in asks if events[i][1] == doc + question)
    assert all(events[i][1] == doc for i in asks if i < second)
    before = [e for e in events[:second] if e[0] == "pass"]
    assert before[-1][1] == doc and before[-1][2] == 82  # the document alone, compressed to 20% of 410
    assert all(e[2] == e[1] for e in before[:-1])  # nothing evicted before the document was complete
    after = [e for e in events[second:] if e[0] == "pass"]
    assert after[0][1] > doc and after[0][1] <= doc + question  # the question comes after, on that cache
    events.clear()
    run_cell(model, tokenizer, [trial], Placement.SAME_PROMPT, "snapkv:budget=0.2,window=8", 410, 32,
             share_prefix=False)
    passes = [e for e in events if e[0] == "pass"]
    assert events[0] == ("expect", doc + question)  # told before anything is fed
    assert all(e[2] == e[1] for e in passes if e[1] < doc + question)
    assert any(e[1] == doc + question and e[2] == 82 for e in passes)  # compressed once the question was in


@pytest.mark.parametrize("placement", list(Placement))
@pytest.mark.parametrize("spec", ["full", "h2o:budget=0.3", "snapkv:budget=0.3,window=8", "expected:budget=0.3"])
def test_the_shared_prefix_changes_the_cost_not_the_answers(sharp, heap, monkeypatch, placement, spec):
    model, tokenizer = sharp
    trials = build_trials(Task.MULTIQUERY, tokenizer, heap, 400, 3, cell_rng(1, Task.MULTIQUERY, placement, 400))
    fed = []
    original = retrieval_measure.feed_chunks

    def counting(model, cache, ids, *args, **kwargs):
        fed.append(len(ids))
        return original(model, cache, ids, *args, **kwargs)

    monkeypatch.setattr(retrieval_measure, "feed_chunks", counting)
    shared = run_cell(model, tokenizer, trials, placement, spec, 420, 16, share_prefix=True)
    cost = sum(fed)
    fed.clear()
    alone = run_cell(model, tokenizer, trials, placement, spec, 420, 16, share_prefix=False)
    assert shared["results"] == alone["results"] and cost < sum(fed)
